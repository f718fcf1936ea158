"""What a store of a channel's own hands the storage seam: how to open it in each mode
(`Backends`); and the shape of a loop that only the replica holding a role may run
(`Leader`). Both seam implementations and the channels import this, not the seam."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from gateway.config import PartialSettings, Settings
    from gateway.plumbing.postgres import SharedStorage

_T = TypeVar("_T")

#: Runs an intake loop once this process may (`Storage.leader`).
Leader = Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Backends(Generic[_T]):
    """A store of a channel's own, in both modes: how to open it from the settings (the
    workspace's files) and from the shared mode's connections. `Storage.open` calls the
    one of its mode."""

    files: Callable[[Settings | PartialSettings], _T]
    postgresql: Callable[[SharedStorage], _T]
