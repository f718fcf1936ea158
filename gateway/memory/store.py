"""MemoryStore: the MemoryManager of a session key, by scope mode, with open managers cached.

Invariant: while a manager for a scope is alive in this process, the store hands out
that same object for the scope (never a second manager on the same files). At most
`max_open` managers are held strongly (LRU); an evicted one is flushed and freed once
nobody uses it, and a scope asked for again afterwards is reopened from its files.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from gateway.memory.manager import MemoryManager, utc_now
from gateway.memory.messages import FileMessageSource
from gateway.memory.scopes import (
    MEMORY_DIRNAME,
    ScopeMode,
    scope_dir,
    scope_dirname,
    scope_for_session,
)
from gateway.people.protocol import PeopleStore, person_scope


def session_keys(sessions_dir: Path) -> set[str]:
    """Every session key with a current or an archived session file in `sessions_dir`."""
    from gateway.sessions.listing import list_archived_files, list_session_files

    try:
        keys = {info.key for info in list_session_files(sessions_dir)}
    except FileNotFoundError:
        return set()
    return keys | {info.key for info in list_archived_files(sessions_dir)}


class MemoryStore:
    """Memory managers of one workspace, one per scope."""

    def __init__(
        self,
        workspace_path: Path,
        *,
        mode: ScopeMode = "per_session",
        max_open: int = 128,
        history_max_bytes: int = 512_000,
        fsync_appends: bool = False,
        knowledge_flush_every: int = 32,
        clock: Callable[[], datetime] = utc_now,
        people: PeopleStore | None = None,
        sessions_dir: Path | None = None,
        dense: bool = False,
    ) -> None:
        """`sessions_dir`: where the sessions are, so that each scope's past messages are
        searchable (`MemoryManager.search_messages`); None leaves them out. `dense`: fuse
        the sentence model into message search when its extra is installed (the daemon
        passes `memory.dense_recall`; off by default, as a library's search stays
        deterministic while a background pass embeds)."""
        scope_for_session("probe:key", mode)  # reject an unknown mode now, not per call
        self.people = people
        self.workspace_path = Path(workspace_path)
        self._memory_root = str(self.workspace_path / MEMORY_DIRNAME)
        self.mode: ScopeMode = mode
        self.sessions_dir = Path(sessions_dir) if sessions_dir is not None else None
        self.max_open = max(1, max_open)
        self._options = {
            "history_max_bytes": history_max_bytes,
            "fsync_appends": fsync_appends,
            "knowledge_flush_every": knowledge_flush_every,
        }
        self._dense = dense
        self._clock = clock
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, MemoryManager] = OrderedDict()
        self._alive: weakref.WeakValueDictionary[str, MemoryManager] = weakref.WeakValueDictionary()

    def scope_for(self, session_key: str) -> str:
        """The scope `session_key` uses in this store's mode."""
        if self.mode == "person" and self.people is not None:
            return person_scope(self.people, session_key)
        return scope_for_session(session_key, self.mode)

    def exists(self, session_key: str) -> bool:
        """Has `session_key`'s scope any memory yet? A stat, nothing is created."""
        scope = self.scope_for(session_key)
        with self._lock:
            if scope in self._alive:
                return True
        # Called on the event loop every turn: plain strings, not pathlib, and one stat.
        return os.path.isdir(os.path.join(self._memory_root, scope_dirname(scope)))

    def for_session(self, session_key: str) -> MemoryManager:
        """The manager holding `session_key`'s memory (opened on first use)."""
        return self.for_scope(self.scope_for(session_key))

    def for_scope(self, scope: str) -> MemoryManager:
        """The manager of a scope by name (e.g. `WORKSPACE_SCOPE`)."""
        evicted: list[MemoryManager] = []
        with self._lock:
            manager = self._alive.get(scope)
            if manager is None:
                manager = MemoryManager(
                    self.workspace_path,
                    scope,
                    history_max_bytes=int(self._options["history_max_bytes"]),
                    fsync_appends=bool(self._options["fsync_appends"]),
                    knowledge_flush_every=int(self._options["knowledge_flush_every"]),
                    clock=self._clock,
                    messages=self._message_source(scope),
                    dense=self._dense,
                )
                self._alive[scope] = manager
            self._recent[scope] = manager
            self._recent.move_to_end(scope)
            while len(self._recent) > self.max_open:
                evicted.append(self._recent.popitem(last=False)[1])
        for old in evicted:
            old.flush()
        return manager

    def _message_source(self, scope: str) -> FileMessageSource | None:
        if self.sessions_dir is None:
            return None
        sessions_dir = self.sessions_dir

        def keys() -> list[str]:
            if self.mode == "per_session":
                return [scope]  # the conversation's own key (archived sessions included)
            return [k for k in session_keys(sessions_dir) if self._scope_or_none(k) == scope]

        return FileMessageSource(sessions_dir, scope_dir(self.workspace_path, scope), keys)

    def _scope_or_none(self, session_key: str) -> str | None:
        try:
            return self.scope_for(session_key)
        except ValueError:
            return None

    def open_scopes(self) -> list[str]:
        """Scopes with a live manager."""
        with self._lock:
            return list(self._alive.keys())

    def flush(self) -> None:
        """Persist pending knowledge changes of every live manager."""
        with self._lock:
            managers = list(self._alive.values())
        for manager in managers:
            manager.flush()

    def close(self) -> None:
        """Close every live manager (saving what a flush does not: the message indexes)
        and drop the cache; managers still in use stay valid."""
        with self._lock:
            managers = list(self._alive.values())
        for manager in managers:
            manager.close()
        with self._lock:
            self._recent.clear()
