"""Every library the product imports is one pyproject.toml names (a dependency or an
extra's): an import that works here only because another package pulled it in breaks on
a user's machine the day that package changes (httpx2, `openai`'s transport, was one)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"gateway", "channels"}


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs.extend(extra)
    names = set()
    for spec in specs:
        match = re.match(r"[A-Za-z0-9._-]+", spec)
        assert match, spec
        names.add(_normal(match.group(0)))
    return names


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported() -> dict[str, str]:
    """Top-level module -> the first file importing it, over the product's code."""
    found: dict[str, str] = {}
    for package in OURS:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.partition(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared() -> None:
    declared = _declared()
    owners = packages_distributions()
    undeclared = {}
    for module, where in _imported().items():
        if module in OURS or module in sys.stdlib_module_names or module == "__future__":
            continue
        distributions = {_normal(d) for d in owners.get(module, [])}
        if not distributions:
            continue  # not installed here: an optional library only some extra brings
        if not distributions & declared:
            undeclared[module] = (sorted(distributions), where)
    assert undeclared == {}, undeclared
