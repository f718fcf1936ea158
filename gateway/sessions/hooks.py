"""Session hooks: extensions observe tree navigation and compaction, and may veto forks
and compactions before they happen. The events they get are `gateway.sessions.manager`'s
(`TreeEvent`, `CompactEvent`, `BeforeForkEvent`, `BeforeCompactEvent`), which carry the
`Session` they happen to."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, get_args

from gateway.logs import logger

HookEvent = Literal[
    "session_before_fork", "session_tree", "session_before_compact", "session_compact"
]
HOOK_EVENTS: frozenset[str] = frozenset(get_args(HookEvent))
BEFORE_EVENTS: frozenset[str] = frozenset({"session_before_fork", "session_before_compact"})

Hook = Callable[[Any], object]


class CancelOperation(Exception):
    """Raise from a ``before`` hook to cancel the operation (same as returning False)."""


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
