"""The import rules of docs/architecture.md, checked over the source with `ast`.

1. No import circles between modules of `gateway/`, `channels/` and `bench/`, counting
   every import: at the top, inside functions, and under `if TYPE_CHECKING:`.
2. Layers import only downward: a module imports modules of its own layer or of layers
   below it (`LAYERS`, top first). Inside the state layer no package imports another that
   imports it back.
3. The storage mode is chosen in one place: only the storage seam opens a store's file or
   PostgreSQL backend (`BACKENDS`); other code asks the `Storage` it was given. A
   PostgreSQL backend may also be imported by another module of the shared mode (the
   replica router, a PostgreSQL store built on the journal's connections). Benchmarks,
   like tests, measure the backends themselves.
4. Only the seam reads `storage.url`.
5. The core names no platform: no module of `gateway/` imports a platform's package
   (`channels/<platform>/`), and the daemon, `gateway doctor`, the configuration, the admin
   page (its templates too), the metrics and the failpoints hold no identifier or string
   naming one (docstrings and comments may use one as an example; an identifier from a
   module of Python's own of the same name, `import signal`, is Python's). A platform is
   known to them only through its `gateway.registry.ChannelSpec`.
6. Nothing shipped (`gateway/`, `channels/`) imports the project's tests: the conformance
   kit (`gateway.testing`) ships in the package and runs outside this repository.
7. The example channel package (examples/channel-example) imports from the gateway only
   the channel SDK (`CHANNEL_SDK`): what a third party's package may rely on.

A rule broken on purpose is listed in `ALLOWED` with its reason; an entry that no longer
matches any import fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "channels", "bench")

#: Top first. A module belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("benchmarks", ("bench",)),
    # The channel conformance kit drives the gateway from outside (a `gateway run`
    # process): it imports only the pure vocabularies below, never the daemon.
    ("conformance kit", ("gateway.testing",)),
    ("edges", ("gateway.cli", "gateway.doctor", "gateway.daemon")),
    ("storage seam", ("gateway.storage",)),
    ("channels", ("channels",)),
    ("http", ("gateway.http",)),
    ("runtime", ("gateway.agent", "gateway.dispatch")),
    (
        "state",
        (
            "gateway.sessions",
            "gateway.memory",
            "gateway.journal",
            "gateway.access",
            "gateway.schedules",
            "gateway.usage",
            "gateway.people",
            "gateway.cache",
            "gateway.media",
        ),
    ),
    ("models", ("gateway.llm",)),
    (
        "support",
        (
            "gateway.config",
            # PostgreSQL's pools, migrations and fencing, a channel store's backends, what
            # import and export share: what the state packages build on.
            "gateway.plumbing",
            "gateway.telemetry",
            "gateway.gcpolicy",
            # Pure vocabularies and parsers that live beside the code they serve and that
            # configuration validates with: they import nothing above this layer.
            "gateway.dispatch.queue_modes",
            "gateway.schedules.schedule",
            "gateway.http.throttle",
            # Who may talk to the bot, as a channel's settings say it (`ChannelSpec.access`).
            "gateway.access.rules",
            # What a chat platform declares and where the declarations are found: the
            # configuration reads each channel's section through it.
            "gateway.registry",
        ),
    ),
    (
        "base",
        (
            "gateway",
            "gateway.messages",
            "gateway.channel",
            "gateway.fsutil",
            "gateway.failpoints",
            "gateway.lazy",
            "gateway.logs",
            "gateway.redaction",
            # What a session key may be (a key never escapes the sessions folder) is part
            # of what a message is.
            "gateway.sessions.keys",
            "gateway.sessions.errors",
        ),
    ),
)

#: The modules that open one mode's stores: a file backend or a PostgreSQL one. Only the
#: seam imports them from outside their package.
BACKENDS = {
    "gateway.sessions.store": "files",
    "gateway.sessions.pg_store": "postgresql",
    "gateway.memory.store": "files",
    "gateway.memory.pg_store": "postgresql",
    "gateway.journal.store": "files",
    "gateway.journal.cursors": "files",
    "gateway.journal.pg_store": "postgresql",
    "gateway.journal.pg_cursors": "postgresql",
    "gateway.journal.pg_relay": "postgresql",
    "gateway.access.store": "files",
    "gateway.access.pg_store": "postgresql",
    "gateway.schedules.store": "files",
    "gateway.schedules.pg_store": "postgresql",
    "gateway.usage.store": "files",
    "gateway.usage.pg_store": "postgresql",
    "gateway.people.store": "files",
    "gateway.people.pg_store": "postgresql",
    "gateway.dispatch.router": "postgresql",
}
SEAM = ("gateway.storage.seam", "gateway.storage.files", "gateway.storage.shared")

#: (importer, imported) pairs that break a rule on purpose, with the reason.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    imported: str
    line: int


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


_TREES: dict[Path, ast.Module] = {}


def parsed(path: Path) -> ast.Module:
    tree = _TREES.get(path)
    if tree is None:
        tree = _TREES[path] = ast.parse(path.read_text(encoding="utf-8"))
    return tree


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in parsed(path).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(known: dict[str, Path]) -> Iterator[Import]:
    """Every import between known modules (a name imported from a package that is one of
    its submodules counts as that submodule)."""
    seen: set[tuple[str, str, int]] = set()
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(parsed(path)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                names = [f"{source}.{alias.name}" for alias in node.names] or [source]
                if not all(n in known for n in names):
                    names.append(source)
            for name in names:
                target = _resolve(name, known)
                key = (module, target or module, node.lineno)
                if target is not None and target != module and key not in seen:
                    seen.add(key)
                    yield Import(module, target, node.lineno)


def layer_of(module: str) -> int:
    best, found = -1, len(LAYERS)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    return found


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


KNOWN = modules()
IMPORTS = [i for i in imports(KNOWN) if (i.importer, i.imported) not in ALLOWED]


def describe(found: list[Import]) -> str:
    return "\n".join(
        f"  {i.importer} -> {i.imported} ({KNOWN[i.importer].relative_to(ROOT)}:{i.line})"
        for i in found
    )


def test_the_rules_see_the_whole_source() -> None:
    # The walk found the packages, their layers cover every module, and imports resolve.
    assert len(KNOWN) > 150
    assert {"gateway.daemon", "gateway.storage.seam", "channels.telegram.channel"} <= set(KNOWN)
    unplaced = sorted(m for m in KNOWN if layer_of(m) == len(LAYERS))
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"
    assert any(i.imported == "gateway.storage.seam" for i in IMPORTS)


def test_no_module_imports_another_that_imports_it_back() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for found in IMPORTS:
        graph[found.importer].add(found.imported)
    assert cycles(graph) == []


def test_layers_import_only_downward() -> None:
    upward = [i for i in IMPORTS if layer_of(i.imported) < layer_of(i.importer)]
    assert not upward, "imports of a higher layer:\n" + describe(upward)


def test_no_state_package_imports_one_that_imports_it_back() -> None:
    state = dict(LAYERS)["state"]
    graph: dict[str, set[str]] = defaultdict(set)
    for found in IMPORTS:
        a, b = package_of(found.importer), package_of(found.imported)
        if a != b and a in state and b in state:
            graph[a].add(b)
    assert cycles(graph) == []


def test_only_the_storage_seam_opens_a_backend() -> None:
    def allowed(found: Import) -> bool:
        backend = found.imported
        if package_of(found.importer) == package_of(backend):
            return True  # a package uses its own backends
        if found.importer in SEAM or found.importer == "gateway.storage.transfer":
            return True
        if found.importer.startswith("bench."):
            return True  # a benchmark measures a backend itself
        # The shared mode's modules build on each other (the journal's connections).
        return BACKENDS[backend] == "postgresql" and BACKENDS.get(found.importer) == "postgresql"

    outside = [i for i in IMPORTS if i.imported in BACKENDS and not allowed(i)]
    assert not outside, "backends opened outside the storage seam:\n" + describe(outside)


def test_only_the_storage_seam_reads_the_storage_url() -> None:
    readers = []
    for module, path in KNOWN.items():
        if module.startswith(("gateway.storage", "gateway.config")):
            continue
        for node in ast.walk(parsed(path)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "url"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "storage"
            ):
                readers.append(f"{module}:{node.lineno}")
    assert readers == []


def test_nothing_shipped_imports_the_tests() -> None:
    found = []
    for module, path in KNOWN.items():
        if module.startswith("bench"):
            continue  # benchmarks are not shipped either
        for node in ast.walk(parsed(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [
                f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "tests"
            ]
    assert found == []


#: What a channel package outside this project may import from the gateway: its
#: declaration and settings, the Channel protocol and messages, and the conformance kit
#: (docs/channel-sdk.md).
CHANNEL_SDK = (
    "gateway.registry",
    "gateway.channel",
    "gateway.messages",
    "gateway.config",
    "gateway.config.access",
    "gateway.config.section",
    "gateway.testing",
)
EXAMPLE = ROOT / "examples" / "channel-example"


def test_the_example_channel_uses_only_the_channel_sdk() -> None:
    files = sorted(EXAMPLE.rglob("*.py"))
    assert any(path.name == "channel.py" for path in files)
    found = []
    for path in files:
        for node in ast.walk(parsed(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.split(".")[0] not in ("gateway", "channels", "tests"):
                    continue
                if name in CHANNEL_SDK or name.startswith("gateway.testing."):
                    continue
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert found == [], "the example reaches past the channel SDK:\n" + "\n".join(found)


def test_every_allowed_exception_still_matches_an_import() -> None:
    everything = {(i.importer, i.imported) for i in imports(KNOWN)}
    stale = [pair for pair in ALLOWED if pair not in everything]
    assert stale == []


def test_the_map_names_only_files_and_modules_that_exist() -> None:
    # docs/architecture.md is kept true: every path and dotted module name it shows exists.
    import re

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for path in set(re.findall(r"\b((?:gateway|channels|tests|docs)/[\w/.-]*\w)", text)):
        if "<" not in path and not (ROOT / path).exists():
            missing.append(path)
    for name in set(re.findall(r"`((?:gateway|channels)(?:\.\w+)+)", text)):
        if (ROOT / name).is_file():
            continue  # a file at the top, such as gateway.toml
        module = _resolve(name, KNOWN)
        if module is None:
            missing.append(name)
        elif module != name:
            # The rest names something the module defines (a class, a function, a constant).
            first = name[len(module) + 1 :].split(".")[0]
            if first not in top_level_names(KNOWN[module]):
                missing.append(name)
    assert sorted(missing) == []
    for layer, _prefixes in LAYERS:
        assert f"| {layer} |" in text, f"the map's layer table lacks {layer}"


#: The modules that learn every platform from its spec, never by name.
PLATFORM_FREE = (
    "gateway.daemon",
    "gateway.doctor",
    "gateway.config",
    "gateway.http.admin",
    "gateway.http.metrics",
    "gateway.failpoints",
    "gateway.registry",
)


def platforms() -> list[str]:
    """The platform packages under channels/ (each a folder with an __init__.py)."""
    return sorted(p.parent.name for p in (ROOT / "channels").glob("*/__init__.py"))


def test_no_core_module_imports_a_platform_package() -> None:
    packages = tuple(f"channels.{name}" for name in platforms())
    assert "channels.telegram" in packages
    found = [
        i
        for i in IMPORTS
        if i.importer.startswith("gateway.")
        and (i.imported in packages or i.imported.startswith(tuple(p + "." for p in packages)))
    ]
    assert not found, "the core imports a platform's package:\n" + describe(found)


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the string nodes that are docstrings (a module's, a class's, a
    function's first statement)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _words_of(tree: ast.Module) -> Iterator[tuple[int, str, bool]]:
    """(line, text, is an identifier) of every identifier and non-docstring string of
    `tree`."""
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node.lineno, node.value, False
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id, True
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr, True
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield node.lineno, node.name, True
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg, True
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.name, True


#: Platform names that are ordinary words too: in the core's identifiers and prose
#: they are the word (a log line, `missing_line`), so only what can name nothing but the
#: platform counts for them: the name as a whole string, a session key's prefix
#: (`line:`), its section (`channels.line`), its variables (`__LINE__`), or the brand
#: as written (`LINE`).
ORDINARY_WORDS = frozenset({"line"})


def _naming(names: list[str]) -> Callable[[str, bool], bool]:
    """Whether a text names one of `names` (`is_identifier`: it is a name in the code,
    not a string)."""
    import re

    plain = [n for n in names if n not in ORDINARY_WORDS]
    anywhere = (
        re.compile(r"(?<![a-z])(" + "|".join(plain) + r")(?![a-z])", re.IGNORECASE)
        if plain
        else None
    )
    words = sorted(ORDINARY_WORDS & set(names))
    spelled = (
        re.compile(
            "|".join(
                rf"^{w}$|(?<![a-z]){w}:(?!\s)|channels\.{w}(?![a-z])|__{w.upper()}__|\b{w.upper()}\b"
                for w in words
            )
        )
        if words
        else None
    )

    def names_one(text: str, is_identifier: bool) -> bool:
        if anywhere is not None and anywhere.search(text):
            return True
        return spelled is not None and not is_identifier and bool(spelled.search(text))

    return names_one


def _python_modules_named(tree: ast.Module, names: list[str]) -> set[str]:
    """The platform names that are also modules of Python's standard library the module
    imports (`import signal`): there the identifiers with that word (`signal.SIGTERM`,
    `open_signal_receiver`) mean Python's, not the platform. Strings still count."""
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    return {n for n in names if n in imported and n in sys.stdlib_module_names}


def test_a_python_module_named_like_a_platform_is_not_the_platform() -> None:
    """`import signal` (Python's) in the daemon is not the Signal channel; a string
    naming the platform still is, and so is the word in a module without that import."""
    tree = ast.parse("import signal\nsignal.SIGTERM\nkind = 'signal'\n")
    assert _python_modules_named(tree, ["signal", "telegram"]) == {"signal"}
    words = [(text, is_identifier) for _, text, is_identifier in _words_of(tree)]
    assert ("signal", False) in words and ("SIGTERM", True) in words
    assert _python_modules_named(ast.parse("x = 1"), ["signal"]) == set()


def test_the_core_names_no_platform() -> None:
    names = platforms()
    names_one = _naming(names)
    found = []
    for module, path in KNOWN.items():
        if not any(module == m or module.startswith(m + ".") for m in PLATFORM_FREE):
            continue
        tree = parsed(path)
        # `import signal` (Python's): there the identifiers with that word are Python's.
        python_words = _python_modules_named(tree, names)
        in_code = _naming([n for n in names if n not in python_words])
        for line, text, is_identifier in _words_of(tree):
            if (in_code if is_identifier else names_one)(text, is_identifier):
                found.append(f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}")
    for template in sorted((ROOT / "gateway" / "http" / "admin").rglob("*")):
        if template.suffix in (".html", ".js", ".css"):
            for number, text in enumerate(template.read_text(encoding="utf-8").splitlines(), 1):
                if names_one(text, False):
                    found.append(f"{template.relative_to(ROOT)}:{number}: {text.strip()[:80]!r}")
    assert found == [], "platforms named in the core:\n" + "\n".join(found)


def test_an_ordinary_word_names_a_platform_only_as_its_name() -> None:
    names_one = _naming(["line", "telegram"])
    for text in (
        "line",
        "line:U4af49",
        "channels.line",
        "GATEWAY_CHANNELS__LINE__TOKEN",
        "LINE bot",
    ):
        assert names_one(text, False), text
    for text in ("one line each", "missing_line", "line: {text}", "timeline"):
        assert not names_one(text, False), text
    assert not names_one("line", True)  # a variable called line is the word
    assert names_one("telegram_chat", True)
