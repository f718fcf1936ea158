"""Lazy re-exports for a package's `__init__` (PEP 562): each name is imported from its
module on first use, so importing one light submodule of the package (or the package for
one name) does not load its heavy modules too."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, which re-exports the names of each
    of `modules` (submodule name -> names), importing a submodule when one of its names
    is first asked for. A package keeps the same names under `if TYPE_CHECKING:`."""
    owner = {name: module for module, names in modules.items() for name in names}
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        module = owner.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # found without this function next time
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *owner})

    return __getattr__, __dir__
