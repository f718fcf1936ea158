"""Sessions as the agent sees them (`Session`) and their owner (`SessionManager`).

A `Session` is the handle of one session key: it appends entries through its store and
answers questions from the in-memory tree. The manager hands out at most one live
`Session` per key, caches hot ones (LRU), lists, resets, forks and deletes them.
Everything here is blocking I/O guarded by threading locks: call it from a worker
thread (``anyio.to_thread.run_sync``) when on the event loop. The exceptions are made
for the loop: `SessionManager.aget_or_create` and `Session.aadd_message` do the work on
the loop when it cannot block (a cached or small session, an append to an open file)
and hop to a worker thread otherwise.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from gateway.fsutil import probe_writable
from gateway.llm import LLMMessage
from gateway.logs import logger
from gateway.sessions.commitlog import CommitLog, recover_commit_logs
from gateway.sessions.context import SessionContext, choose_cut
from gateway.sessions.entries import (
    BranchEntry,
    CompactionEntry,
    CustomInfoEntry,
    CustomMessageEntry,
    Entry,
    LabelEntry,
    LeafEntry,
    MessageEntry,
    ModelChangeEntry,
    ParentSessionRef,
    SessionHeader,
    SessionInfoEntry,
    ThinkingLevelChangeEntry,
)
from gateway.sessions.errors import (
    EntryNotFoundError,
    SessionError,
    SessionExistsError,
)
from gateway.sessions.hooks import HookRegistry
from gateway.sessions.index import INDEX_DIR
from gateway.sessions.keys import SUFFIX, encode_key, session_path
from gateway.sessions.listing import (
    ArchivedSessionInfo,
    SessionInfo,
    list_archived_files,
    list_session_files,
    most_recent_first,
)
from gateway.sessions.outputs import FileToolOutputs, MemoryToolOutputs, ToolOutputStore
from gateway.sessions.spares import SPARES_DIR, SparePool
from gateway.sessions.store import (
    DIR_MODE,
    FILE_MODE,
    STORE_OPEN_FLAGS,
    AsyncGroupCommitter,
    EntryFactory,
    FileSessionStore,
    FsyncPolicy,
    GroupCommitter,
    LoadReport,
    MemorySessionStore,
    SessionStore,
    check_fsync_policy,
    checkpoint_files,
    new_header,
)
from gateway.sessions.tree import SessionTree, TreeNode

if TYPE_CHECKING:
    from gateway.sessions.pg_store import AsyncConnect, PostgresSessions


def _require(tree: SessionTree, entry_id: str) -> None:
    if not tree.is_usable(entry_id):
        raise EntryNotFoundError(f"this session has no entry {entry_id!r}")


def _message_factory(msg: LLMMessage, meta: Mapping[str, Any] | None) -> EntryFactory[MessageEntry]:
    meta_dict = dict(meta) if meta is not None else None
    return lambda tree, eid, ts: MessageEntry(
        id=eid, parent_id=tree.leaf_id, timestamp=ts, message=msg, meta=meta_dict
    )


@dataclass(frozen=True, slots=True)
class BeforeForkEvent:
    """A fork is about to happen (`session_before_fork`; a hook may veto it)."""

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


class Session:
    """One conversation: an append-only tree of entries and the context it yields.

    The object is the handle of its key: `SessionManager.reset` and `delete` turn it
    into the key's new session in place, and a reset done by another process is picked
    up at the next append or refresh. Every method is thread-safe. Made by
    `SessionManager`, not directly.
    """

    def __init__(self, store: SessionStore, hooks: HookRegistry) -> None:
        self._store = store
        self._hooks = hooks

    def __repr__(self) -> str:
        return f"<Session key={self.key!r} id={self.session_id} entries={len(self._store.tree)}>"

    # -- identity ---------------------------------------------------------------------

    @property
    def key(self) -> str:
        return self._store.key

    @property
    def session_id(self) -> str:
        return self._store.header.id

    @property
    def header(self) -> SessionHeader:
        return self._store.header

    @property
    def path(self) -> Path | None:
        """The file of this session (None for in-memory sessions); it exists once the
        first entry was appended."""
        return self._store.path

    @property
    def load_report(self) -> LoadReport:
        with self._store.lock:
            return self._store.report

    @property
    def created_at(self) -> float:
        return self._store.header.timestamp

    @property
    def updated_at(self) -> float:
        with self._store.lock:
            last = self._store.tree.last_entry()
            return last.timestamp if last is not None else self._store.header.timestamp

    @property
    def name(self) -> str | None:
        with self._store.lock:
            return self._store.tree.name

    def custom_info(self, custom_type: str) -> Any:
        """The data of the session's latest `custom_info` entry of `custom_type` (None:
        there is none). One dict read, without the store's lock: safe on the event loop
        while a worker thread appends."""
        return self._store.tree.custom_info(custom_type)

    # -- the tree ---------------------------------------------------------------------

    @property
    def leaf_id(self) -> str | None:
        with self._store.lock:
            return self._store.tree.leaf_id

    @property
    def entries(self) -> list[Entry]:
        """Every entry in file order (the header excluded; see `header`)."""
        with self._store.lock:
            return self._store.tree.entries()

    @property
    def labels(self) -> dict[str, str]:
        with self._store.lock:
            return dict(self._store.tree.labels)

    def get_entry(self, entry_id: str) -> Entry | None:
        with self._store.lock:
            return self._store.tree.get_entry(entry_id)

    def children(self, entry_id: str | None) -> list[Entry]:
        with self._store.lock:
            return self._store.tree.children(entry_id)

    def get_branch(self, from_id: str | None = None) -> list[Entry]:
        """Entries from the root to ``from_id`` (default: the current leaf)."""
        with self._store.lock:
            if from_id is not None:
                _require(self._store.tree, from_id)
            return self._store.tree.get_branch(from_id)

    def branch_nowait(self) -> list[Entry] | None:
        """`get_branch` of the leaf without waiting (for the event loop): None when a
        worker thread holds the store."""
        lock = self._store.lock
        if not lock.acquire(blocking=False):
            return None
        try:
            return self._store.tree.get_branch(None)
        finally:
            lock.release()

    def get_tree(self) -> list[TreeNode]:
        with self._store.lock:
            return self._store.tree.get_tree()

    def export_jsonl(self) -> str:
        """The session as stored, in the JSONL format (the same from every store)."""
        return self._store.export_jsonl()

    def refresh(self) -> None:
        """Pick up entries other processes appended (one ``stat`` if there are none)."""
        self._store.refresh()

    def flush(self) -> None:
        self._store.flush()

    # -- context ----------------------------------------------------------------------

    def build_context(self) -> SessionContext:
        with self._store.lock:
            return self._store.tree.build_context()

    context = build_context

    @property
    def messages(self) -> list[LLMMessage]:
        """Messages of the current context: after the latest compaction's cut."""
        return list(self.build_context().messages)

    @property
    def message_count(self) -> int:
        return len(self.build_context().messages)

    @property
    def summary(self) -> str | None:
        """The latest compaction summary on the branch."""
        return self.build_context().summary

    @summary.setter
    def summary(self, value: str | None) -> None:
        # A compaction that keeps every current message and carries the new summary.
        context = self.build_context()
        first = context.entry_ids[0] if context.entry_ids else None
        self.compact(value or "", first)

    def get_recent(self, window: int) -> list[LLMMessage]:
        """The last ``window`` messages of the context (none for ``window <= 0``)."""
        messages = self.build_context().messages
        return list(messages[-window:]) if window > 0 else []

    def get_old_messages(self, window: int) -> list[LLMMessage]:
        """Context messages before the last ``window`` (candidates for a summary)."""
        messages = self.build_context().messages
        if window <= 0:
            return list(messages)
        return list(messages[:-window]) if len(messages) > window else []

    # -- appending --------------------------------------------------------------------

    def add_message(self, msg: LLMMessage, meta: Mapping[str, Any] | None = None) -> MessageEntry:
        """Append a message at the leaf; it is in the file when this returns."""
        return self._store.append(_message_factory(msg, meta))

    async def aadd_message(
        self, msg: LLMMessage, meta: Mapping[str, Any] | None = None, *, defer: bool = False
    ) -> MessageEntry:
        """`add_message` for the event loop: the same promise (in the file, fsynced as
        the policy says, when this returns) without blocking the loop. With ``defer`` it
        is in the file (a killed process does not lose it) and made durable with the
        session's next append or `asettle`, in that append's group-commit round
        (`FileSessionStore.aappend`): the caller settles if it appends nothing more."""
        return await self._store.aappend(_message_factory(msg, meta), defer=defer)

    async def asettle(self) -> None:
        """Make the session's deferred appends durable now (nothing if there are none)."""
        await self._store.asettle()

    def append_model_change(self, model: str) -> ModelChangeEntry:
        return self._store.append(
            lambda tree, eid, ts: ModelChangeEntry(
                id=eid, parent_id=tree.leaf_id, timestamp=ts, model=model
            )
        )

    def append_thinking_level_change(self, thinking_level: str) -> ThinkingLevelChangeEntry:
        return self._store.append(
            lambda tree, eid, ts: ThinkingLevelChangeEntry(
                id=eid, parent_id=tree.leaf_id, timestamp=ts, thinking_level=thinking_level
            )
        )

    def append_custom_info(self, custom_type: str, data: Any) -> CustomInfoEntry:
        return self._store.append(
            lambda tree, eid, ts: CustomInfoEntry(
                id=eid, parent_id=tree.leaf_id, timestamp=ts, custom_type=custom_type, data=data
            )
        )

    def append_custom_message(
        self, custom_type: str, content: str, *, display: bool = True
    ) -> CustomMessageEntry:
        return self._store.append(
            lambda tree, eid, ts: CustomMessageEntry(
                id=eid,
                parent_id=tree.leaf_id,
                timestamp=ts,
                custom_type=custom_type,
                content=content,
                display=display,
            )
        )

    def set_name(self, name: str | None) -> SessionInfoEntry:
        return self._store.append(
            lambda tree, eid, ts: SessionInfoEntry(
                id=eid, parent_id=tree.leaf_id, timestamp=ts, name=name
            )
        )

    def label(self, entry_id: str, label: str | None) -> LabelEntry:
        """Attach ``label`` to an entry (None removes it)."""

        def make(tree: SessionTree, eid: str, ts: float) -> LabelEntry:
            _require(tree, entry_id)
            return LabelEntry(
                id=eid, parent_id=tree.leaf_id, timestamp=ts, target_id=entry_id, label=label
            )

        return self._store.append(make)

    def branch(self, entry_id: str | None) -> LeafEntry:
        """Move the leaf to ``entry_id`` (None: before the first entry); new entries then
        hang off it. Persisted as a ``leaf`` entry, so it survives a restart; nothing is
        removed. Fires ``session_tree``."""
        old: list[str | None] = []

        def make(tree: SessionTree, eid: str, ts: float) -> LeafEntry:
            if entry_id is not None:
                _require(tree, entry_id)
            old[:] = [tree.leaf_id]
            return LeafEntry(id=eid, parent_id=tree.leaf_id, timestamp=ts, target_id=entry_id)

        entry = self._store.append(make)
        self._hooks.emit("session_tree", TreeEvent(self, old[0], entry.target_id, entry))
        return entry

    def branch_with_summary(self, entry_id: str, summary: str) -> BranchEntry:
        """Go back to ``entry_id`` leaving a summary of the abandoned branch, which the
        model sees in place of it. Fires ``session_tree``."""
        old: list[str | None] = []

        def make(tree: SessionTree, eid: str, ts: float) -> BranchEntry:
            _require(tree, entry_id)
            old[:] = [tree.leaf_id]
            return BranchEntry(
                id=eid, parent_id=entry_id, timestamp=ts, from_id=entry_id, summary=summary
            )

        entry = self._store.append(make)
        self._hooks.emit("session_tree", TreeEvent(self, old[0], entry.id, entry))
        return entry

    def compact(
        self,
        summary: str,
        first_kept_entry_id: str | None,
        tokens_before: int | None = None,
        details: dict[str, Any] | None = None,
    ) -> CompactionEntry | None:
        """Record a compaction: from now on the context is ``summary`` plus the messages
        from ``first_kept_entry_id`` on. Nothing is removed from the file. Returns None
        if a ``session_before_compact`` hook cancelled it."""
        event = BeforeCompactEvent(self, summary, first_kept_entry_id, tokens_before)
        if not self._hooks.allow("session_before_compact", event):
            logger.bind(session_key=self.key).info("compaction cancelled by a hook")
            return None

        def make(tree: SessionTree, eid: str, ts: float) -> CompactionEntry:
            if first_kept_entry_id is not None:
                _require(tree, first_kept_entry_id)
            return CompactionEntry(
                id=eid,
                parent_id=tree.leaf_id,
                timestamp=ts,
                summary=summary,
                first_kept_entry_id=first_kept_entry_id,
                tokens_before=tokens_before,
                details=details,
            )

        entry = self._store.append(make)
        self._hooks.emit("session_compact", CompactEvent(self, entry))
        return entry

    def prune_to_window(self, window: int) -> int:
        """Compact so the context keeps about the last ``window`` messages, carrying the
        current summary forward; returns how many messages left the context. Deletes
        nothing, and never separates tool calls from their results (see `choose_cut`)."""
        if window < 0:
            raise ValueError("window must be >= 0")
        context = self.build_context()
        cut = choose_cut(context.messages, window)
        if cut == 0:
            return 0
        first = context.entry_ids[cut] if cut < len(context.entry_ids) else None
        entry = self.compact(context.summary or "", first)
        return 0 if entry is None else cut


class SessionManager:
    """Owns the sessions of one folder: ``<sessions_dir>/<encoded key>.jsonl``.

    Promise: at most one live `Session` object per key. Hot sessions are held by an LRU
    cache of ``max_cache_size``; every live session (cached or still referenced
    elsewhere) is also tracked weakly, so an evicted session that someone still holds is
    handed out again instead of being loaded twice. Eviction never loses an entry:
    entries are on disk when ``append`` returns (the in-memory variant never evicts).
    """

    def __init__(
        self,
        sessions_dir: Path,
        max_cache_size: int = 2000,
        *,
        max_cache_bytes: int = 256 * 1024 * 1024,
        fsync: FsyncPolicy = "batch",
        hooks: HookRegistry | None = None,
        committer: GroupCommitter | None = None,
        spare_files: int = 0,
        io_on_loop: bool = True,
    ) -> None:
        self._dir: Path | None = Path(sessions_dir)
        self._dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._shared: PostgresSessions | None = None
        #: Tool outputs too big for the context, kept beside the sessions.
        self.outputs: ToolOutputStore = FileToolOutputs(self._dir)
        self._setup(max_cache_size, fsync, hooks, committer, max_cache_bytes, io_on_loop)
        # Lines a power cut took from the files of a process that died come back first.
        recover_commit_logs(self._dir)
        self._commit_log: CommitLog | None = (
            CommitLog(self._dir) if self._fsync == "batch" else None
        )
        # Empty files kept ready for new sessions (`gateway.sessions.spares`): for a
        # long-running owner that calls `close`; 0 (the default) keeps none.
        self._spares: SparePool | None = None
        if spare_files > 0:
            self._spares = SparePool(
                self._dir / SPARES_DIR,
                flags=STORE_OPEN_FLAGS,
                mode=FILE_MODE,
                dir_mode=DIR_MODE,
                size=spare_files,
            )

    @classmethod
    def in_memory(cls, *, hooks: HookRegistry | None = None) -> SessionManager:
        """A manager with no disk at all and the same API (tests, throwaway sessions)."""
        manager = cls.__new__(cls)
        manager._dir = None
        manager._shared = None
        manager.outputs = MemoryToolOutputs()
        manager._setup(0, "never", hooks, None, max_bytes=0, io_on_loop=True)
        manager._spares = None
        return manager

    @classmethod
    def shared(
        cls,
        sessions: PostgresSessions,
        max_cache_size: int = 2000,
        *,
        max_cache_bytes: int = 256 * 1024 * 1024,
        hooks: HookRegistry | None = None,
    ) -> SessionManager:
        """A manager whose sessions live in PostgreSQL, shared with other replicas.

        Every call that touches a session's rows blocks on the network, so nothing runs
        on the event loop (`open_nowait` always declines; `aget_or_create` hops)."""
        manager = cls.__new__(cls)
        manager._dir = None
        manager._shared = sessions
        manager.outputs = sessions.outputs()
        manager._setup(
            max_cache_size, "never", hooks, None, max_bytes=max_cache_bytes, io_on_loop=False
        )
        manager._spares = None
        return manager

    @property
    def _in_memory(self) -> bool:
        return self._dir is None and self._shared is None

    def _setup(
        self,
        max_cache_size: int,
        fsync: str,
        hooks: HookRegistry | None,
        committer: GroupCommitter | None,
        max_bytes: int,
        io_on_loop: bool,
    ) -> None:
        if max_cache_size < 0:
            raise ValueError("max_cache_size must be >= 0")
        self._fsync = check_fsync_policy(fsync)
        self._max = max_cache_size
        self.hooks = hooks or HookRegistry()
        self._committer = committer
        self._async_committer = AsyncGroupCommitter()
        self._commit_log = None
        #: False: the `a*`/`*_nowait` methods never touch files on the caller's
        #: thread (every file operation goes to a worker thread).
        self.io_on_loop = io_on_loop
        self._lock = threading.RLock()
        self._lru: OrderedDict[str, Session] = OrderedDict()
        # File bytes of each cached session when last touched, and their sum: the
        # cache is bounded by bytes as well as by count.
        self._lru_bytes: dict[str, int] = {}
        self._bytes = 0
        self._max_bytes = max_bytes  # 0: no byte bound
        self._live: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self._memory: dict[str, Session] = {}  # the in-memory variant keeps everything

    @property
    def sessions_dir(self) -> Path | None:
        return self._dir

    def path_for(self, key: str) -> Path | None:
        """The current file of ``key`` (raises `SessionKeyError` for an unusable key)."""
        encode_key(key)
        return None if self._dir is None else session_path(self._dir, key)

    # -- the cache --------------------------------------------------------------------

    def _new_session(
        self, key: str, header: SessionHeader | None = None, stem: str | None = None
    ) -> Session:
        store: SessionStore
        if self._shared is not None:
            store = self._shared.store(key, header)
        elif self._dir is None:
            store = MemorySessionStore(key, header=header)
        else:
            store = FileSessionStore(
                self._dir / ((stem or encode_key(key)) + SUFFIX),
                key,
                fsync=self._fsync,
                committer=self._committer,
                async_committer=self._async_committer,
                spares=self._spares,
                io_on_loop=self.io_on_loop,
                header=header,
                commit_log=self._commit_log,
                index_dir=self._dir / INDEX_DIR,
            )
        return Session(store, self.hooks)

    def _remember(self, session: Session) -> None:
        key = session.key
        if self._in_memory:
            self._memory[key] = session
            return
        if key not in self._lru:
            self._live[key] = session
            self._lru[key] = session
        else:
            self._lru.move_to_end(key)
        size = session._store.size
        self._bytes += size - self._lru_bytes.get(key, 0)
        self._lru_bytes[key] = size
        while len(self._lru) > self._max or (
            self._max_bytes and self._bytes > self._max_bytes and len(self._lru) > 1
        ):
            # Still in _live while referenced elsewhere.
            old, _ = self._lru.popitem(last=False)
            self._bytes -= self._lru_bytes.pop(old, 0)

    def _lookup(self, key: str) -> Session | None:
        if self._in_memory:
            return self._memory.get(key)
        session = self._lru.get(key) or self._live.get(key)
        if session is not None:
            self._remember(session)
        return session

    def _open(self, key: str, *, create: bool) -> Session | None:
        stem = encode_key(key)
        with self._lock:
            session = self._lookup(key)
            if session is None:
                session = self._new_session(key, stem=stem)
                session._store.load()
                # Remembered even for get(): its load report (e.g. a file moved aside)
                # stays visible to the next get_or_create.
                self._remember(session)
                return session if create or session._store.persisted else None
        session.refresh()
        if not create and not session._store.persisted:
            return None
        return session

    def get_or_create(self, key: str) -> Session:
        """The session of ``key``: cached, loaded from its file, or new (no file until the
        first entry is appended)."""
        session = self._open(key, create=True)
        assert session is not None
        return session

    def open_nowait(self, key: str) -> Session | None:
        """`get_or_create` without blocking: the session when it is cached and current
        or its file is small and free, None when that needs a worker thread (a busy
        lock, a large file, a change by another process to read)."""
        if not self.io_on_loop or not self._lock.acquire(blocking=False):
            encode_key(key)  # an unusable key raises here as on every other path
            return None
        try:
            session = self._lookup(key)  # a key found here was checked when it was opened
            if session is not None:
                store = session._store
                if isinstance(store, FileSessionStore) and not store.is_current_nowait():
                    return None
                return session
            session = self._new_session(key, stem=encode_key(key))
            store = session._store
            if isinstance(store, FileSessionStore) and not store.try_load_nowait():
                return None  # dropped unused: the worker thread loads it afresh
            self._remember(session)
            return session
        finally:
            self._lock.release()

    def cached(self, key: str) -> Session | None:
        """The cached session of ``key`` as it is, without reading its store; None when
        it is not cached or the cache is busy. Only for a caller that knows no other
        process wrote to the session since this one last read it (the shared mode's
        session lease, `gateway.dispatch.router`)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return self._lookup(key)
        finally:
            self._lock.release()

    async def aget_or_create(self, key: str) -> Session:
        """`get_or_create` for the event loop: on the loop when `open_nowait` (files) or
        `_aopen_shared` (PostgreSQL) can, else in a worker thread."""
        session = self.open_nowait(key)
        if session is None and self._shared is not None and self._shared.aconnect is not None:
            session = await self._aopen_shared(key)
        if session is None:
            session = await anyio.to_thread.run_sync(self.get_or_create, key)
        return session

    async def _aopen_shared(self, key: str) -> Session | None:
        """`get_or_create` of the shared mode on the event loop, when one round trip over
        the loop's pool shows the cached session current or a new key without a row
        (`PostgresSessionStore.aload_nowait`); None when entries must be read."""
        stem = encode_key(key)
        if not self._lock.acquire(blocking=False):
            return None
        try:
            session = self._lookup(key)
            fresh = session is None
            if session is None:
                session = self._new_session(key, stem=stem)
        finally:
            self._lock.release()
        aload = getattr(session._store, "aload_nowait", None)
        if aload is None or not await aload():
            return None  # a new one is dropped unused: the worker thread loads afresh
        if fresh:
            if not self._lock.acquire(blocking=False):
                return None
            try:
                if self._lookup(key) is not None:
                    return None  # opened by another meanwhile: the thread path takes it
                self._remember(session)
            finally:
                self._lock.release()
        return session

    def get(self, key: str) -> Session | None:
        """The session of ``key`` if it has saved entries (a file), else None."""
        return self._open(key, create=False)

    def save(self, session: Session) -> None:
        """Entries are appended as they are added; this only forces them to disk under
        ``fsync="never"`` (a no-op otherwise)."""
        session.flush()

    def clear_cache(self) -> None:
        """Drop the cache's references (sessions still held elsewhere stay live)."""
        with self._lock:
            self._lru.clear()
            self._lru_bytes.clear()
            self._bytes = 0

    def close(self) -> None:
        """Close every live session's file (they reopen on next use)."""
        with self._lock:
            sessions = list(self._live.values()) + list(self._memory.values())
        if self._commit_log is not None:
            # First: the files it covers are fsynced many at a time, not one by one.
            self._commit_log.close(checkpoint_files)
        for session in sessions:
            session._store.close()
        if self._spares is not None:
            self._spares.close()

    # -- listing ----------------------------------------------------------------------

    def use_loop_connections(self, aconnect: AsyncConnect) -> None:
        """The shared mode: turns append over the event loop's pool, given by `aconnect`
        (`PostgresSessionStore.aappend`). No effect on files."""
        if self._shared is not None:
            self._shared.aconnect = aconnect

    def probe(self) -> None:
        """Raise what a new session would meet now: the `OSError` of a file that cannot
        be written in the folder, or `StorageError` when PostgreSQL does not answer."""
        if self._shared is not None:
            self._shared.ping()
        elif self._dir is not None:
            probe_writable(self._dir)

    def list_sessions(self) -> list[SessionInfo]:
        """Sessions with a file, most recently active first, from the directory listing
        and ``stat`` alone (files are not opened)."""
        if self._shared is not None:
            infos = [
                SessionInfo(row.key, None, row.updated_at, row.size_bytes)
                for row in self._shared.list_sessions()
            ]
        elif self._dir is None:
            with self._lock:
                sessions = [s for s in self._memory.values() if s._store.persisted]
            infos = [SessionInfo(s.key, None, s.updated_at, 0) for s in sessions]
        else:
            infos = list_session_files(self._dir)
        return most_recent_first(infos)

    def list_archived(self, key: str | None = None) -> list[ArchivedSessionInfo]:
        """The sessions `/new` replaced (of `key`, or of every key), each key's most
        recent first, from directory listings alone."""
        if self._dir is None:
            return []
        return list_archived_files(self._dir, key)

    def open_archived(self, key: str, number: int) -> Session:
        """Archived session `number` of `key` (1 = the most recently archived), to read.

        It is not cached and nothing is appended to it: an archived session stays as
        `/new` left it. Raises SessionError when there is no such archived session."""
        archived = self.list_archived(key)
        if not 1 <= number <= len(archived):
            have = f"it has {len(archived)}" if archived else "it has none"
            raise SessionError(
                f"session {key!r} has no archived session {number}; {have} "
                "(`gateway sessions list --all` shows them)"
            )
        store = FileSessionStore(archived[number - 1].path, key, fsync=self._fsync)
        store.load()
        return Session(store, self.hooks)

    def continue_recent(self) -> Session | None:
        """The most recently active session, or None if there is none."""
        for info in self.list_sessions():
            session = self.get(info.key)
            if session is not None:
                return session
        return None

    # -- lifecycle --------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        """Remove the key's current file and cache entry, and the tool outputs stored
        beside that session; True if a file was removed. A live `Session` of the key
        becomes a new, empty session. Archived sessions and their outputs stay."""
        encode_key(key)
        with self._lock:
            session = self._lookup(key)
            self._lru.pop(key, None)
            self._bytes -= self._lru_bytes.pop(key, 0)
            if session is None:
                session = self._new_session(key)
            session_id = None
            with session._store.lock:
                if self._shared is None:  # PostgreSQL deletes the outputs with the row
                    session._store.load()  # the id of the session stored now
                    session_id = session.session_id if session._store.persisted else None
                removed = session._store.delete()
        outputs = 0
        if session_id is not None:
            outputs = self.outputs.delete_session(key, session_id)
        logger.bind(session_key=key).info(
            "deleted session (file removed: {}, tool outputs: {})", removed, outputs
        )
        return removed

    def reset(self, key: str) -> Session:
        """Start a new session for ``key`` (``/new``). The old file is kept: it moves to
        ``archive/<stem>/<time>-<session id>.jsonl`` and the new header names it as
        ``previous_session``. Returns the key's `Session`, now the new session."""
        session = self.get_or_create(key)
        with self._lock:
            session._store.archive()
        return session

    def fork(
        self, key: str, new_key: str | None = None, entry_id: str | None = None
    ) -> Session | None:
        """Copy the root-to-leaf path (or root-to-``entry_id``) of ``key`` into a new
        session under ``new_key`` (default ``<key>:fork:<id>``) whose header links back
        (``parent_session``). Returns None if a ``session_before_fork`` hook cancelled."""
        source = self.get(key)
        if source is None:
            raise SessionError(f"there is no session {key!r} to fork")
        target_key = new_key if new_key is not None else f"{key}:fork:{os.urandom(4).hex()}"
        encode_key(target_key)
        if not self.hooks.allow(
            "session_before_fork", BeforeForkEvent(source, entry_id, target_key)
        ):
            logger.bind(session_key=key).info("fork cancelled by a hook")
            return None
        with source._store.lock:
            branch = source.get_branch(entry_id)
            ref = ParentSessionRef(
                key=key,
                session_id=source.session_id,
                entry_id=branch[-1].id if branch else None,
            )
        with self._lock:
            if (
                self._lookup(target_key) is not None
                or (self._dir is not None and session_path(self._dir, target_key).exists())
                or (self._shared is not None and self._shared.exists(target_key))
            ):
                raise SessionExistsError(
                    f"session {target_key!r} already exists; pick another key or reset it first"
                )
            session = self._new_session(target_key, new_header(target_key, parent_session=ref))
            session._store.create_with(branch)
            self._remember(session)
        if branch:  # the copied tool results' handles read the same outputs in the fork
            self.outputs.copy_session(key, ref.session_id, target_key, session.session_id)
        logger.bind(session_key=key).info(
            "forked {} entries into session {!r}", len(branch), target_key
        )
        return session
