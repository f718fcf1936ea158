"""Session hooks: extensions observe tree navigation and compaction, and may veto forks
and compactions before they happen."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from gateway.logs import logger

if TYPE_CHECKING:
    from gateway.sessions.entries import BranchEntry, CompactionEntry, LeafEntry
    from gateway.sessions.manager import Session

HookEvent = Literal[
    "session_before_fork", "session_tree", "session_before_compact", "session_compact"
]
HOOK_EVENTS: frozenset[str] = frozenset(get_args(HookEvent))
BEFORE_EVENTS: frozenset[str] = frozenset({"session_before_fork", "session_before_compact"})

Hook = Callable[[Any], object]


class CancelOperation(Exception):
    """Raise from a ``before`` hook to cancel the operation (same as returning False)."""


@dataclass(frozen=True, slots=True)
class BeforeForkEvent:
    session: Session
    entry_id: str | None
    new_key: str


@dataclass(frozen=True, slots=True)
class TreeEvent:
    """The leaf moved: `Session.branch` (a leaf entry) or `branch_with_summary`."""

    session: Session
    old_leaf_id: str | None
    new_leaf_id: str | None
    entry: LeafEntry | BranchEntry


@dataclass(frozen=True, slots=True)
class BeforeCompactEvent:
    session: Session
    summary: str
    first_kept_entry_id: str | None
    tokens_before: int | None


@dataclass(frozen=True, slots=True)
class CompactEvent:
    session: Session
    entry: CompactionEntry


class HookRegistry:
    """Callbacks per event. ``before`` hooks run first and in order; one that returns
    False or raises `CancelOperation` cancels the operation and later hooks don't run.
    Any other exception from a ``before`` hook propagates (the operation does not
    happen); an exception from an after-the-fact hook is logged and swallowed, since
    the entry is already on disk.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hooks: dict[str, list[Hook]] = {name: [] for name in HOOK_EVENTS}

    def register(self, event: HookEvent, fn: Hook) -> Callable[[], None]:
        """Add ``fn`` for ``event``; returns a function that removes it again."""
        if event not in HOOK_EVENTS:
            raise ValueError(
                f"unknown session hook event {event!r}; known: {', '.join(sorted(HOOK_EVENTS))}"
            )
        with self._lock:
            self._hooks[event].append(fn)

        def unregister() -> None:
            with self._lock:
                if fn in self._hooks[event]:
                    self._hooks[event].remove(fn)

        return unregister

    def _snapshot(self, event: str) -> list[Hook]:
        with self._lock:
            return list(self._hooks[event])

    def allow(self, event: HookEvent, payload: object) -> bool:
        """Run the ``before`` hooks of ``event``; False if one of them cancelled."""
        if event not in BEFORE_EVENTS:
            raise ValueError(f"{event!r} is not a cancellable 'before' event")
        for fn in self._snapshot(event):
            try:
                if fn(payload) is False:
                    return False
            except CancelOperation:
                return False
        return True

    def emit(self, event: HookEvent, payload: object) -> None:
        """Run the hooks of an after-the-fact event; their errors are logged only."""
        for fn in self._snapshot(event):
            try:
                fn(payload)
            except Exception as exc:
                logger.opt(exception=exc).error("session hook {} for {} failed", fn, event)
