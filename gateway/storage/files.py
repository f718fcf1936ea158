"""The files mode of the storage seam: every store in the workspace folder, one gateway
writing it at a time (the workspace lock, `gateway.storage.workspace`).

What lives where (the names are the stores' own constants):

| state | where |
|---|---|
| sessions | `sessions/` (JSONL trees, archives, tool outputs) |
| memory | `memory/<scope>/` (MEMORY.md, HISTORY.md, knowledge.json, indexes) |
| journal and outbox | `dedupe.sqlite` |
| platform cursors | `channel-cursors.json` and `channel-state/` |
| pairing | `pairing.json` |
| usage | `usage.sqlite` |
| scheduled jobs | `schedules.json` |
| heartbeat runs | `heartbeat-state.json` |
| people | `people.json` |
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gateway.access.protocol import PairingBackend
    from gateway.config import PartialSettings, Settings
    from gateway.dispatch.lanes import Lanes, ReplicaRouter
    from gateway.journal.protocol import DedupeStore, Lead, Relay
    from gateway.memory.protocol import ConsolidationGuard, MemoryBackend
    from gateway.people.protocol import PeopleStore
    from gateway.plumbing.backends import Backends, Leader
    from gateway.schedules.protocol import JobStore
    from gateway.schedules.runs import RunState
    from gateway.sessions.listing import SessionListing
    from gateway.sessions.manager import SessionManager
    from gateway.usage.protocol import UsageLedger

_T = TypeVar("_T")

#: The journal and outbox, in the workspace folder.
JOURNAL_FILE = "dedupe.sqlite"


def pairing_path(settings: Settings | PartialSettings) -> Path:
    """The workspace's pairing file."""
    from gateway.access.store import PAIRING_FILE

    return settings.workspace_path / PAIRING_FILE


class FileStorage:
    """Every store in the workspace's files (see the module)."""

    kind = "files"
    title = "workspace files"
    one_writer = True

    def __init__(self, settings: Settings | PartialSettings) -> None:
        self.settings = settings

    def describe(self) -> str:
        return "workspace files"

    def where(self) -> str:
        return str(self.settings.sessions_dir)

    def connected(self) -> bool:
        return True

    def check(self) -> str:
        # The workspace check makes and checks the folders; nothing more to ask here.
        return f"state in workspace files under {self.settings.workspace_path}"

    def connect(self) -> None:
        return None

    def sessions(self, *, spare_files: int = 0) -> SessionManager:
        from gateway.sessions.manager import SessionManager
        from gateway.storage.workspace import prepare_workspace

        settings = self.settings
        prepare_workspace(settings)
        return SessionManager(
            settings.sessions_dir,
            max_cache_size=settings.sessions.max_cache_size,
            max_cache_bytes=settings.sessions.max_cache_mb * 1024 * 1024,
            fsync=settings.sessions.fsync,
            spare_files=spare_files,
            io_on_loop=settings.io_on_loop,
        )

    def session_listing(self) -> SessionListing:
        from gateway.sessions.listing import FileSessionListing
        from gateway.storage.workspace import prepare_workspace

        prepare_workspace(self.settings)
        return FileSessionListing(self.settings.sessions_dir)

    def memory(self) -> MemoryBackend:
        from gateway.memory.store import MemoryStore

        settings = self.settings
        return MemoryStore(
            settings.workspace_path,
            mode=settings.memory.scope,
            history_max_bytes=settings.memory.history_max_bytes,
            people=self.people(),
            sessions_dir=settings.sessions_dir,
            dense=settings.memory.dense_recall,
        )

    def consolidation_guard(self) -> ConsolidationGuard | None:
        return None

    def pairing(self) -> PairingBackend:
        from gateway.access.store import PairingStore

        return PairingStore(pairing_path(self.settings))

    def usage_ledger(self) -> UsageLedger:
        from gateway.usage.store import USAGE_FILE, SqliteUsageLedger

        return SqliteUsageLedger(self.settings.workspace_path / USAGE_FILE)

    def jobs(self) -> JobStore:
        from gateway.schedules.store import JOBS_FILE, FileJobStore

        return FileJobStore(self.settings.workspace_path / JOBS_FILE)

    def people(self) -> PeopleStore:
        from gateway.people.store import PEOPLE_FILE, FilePeopleStore

        return FilePeopleStore(self.settings.workspace_path / PEOPLE_FILE)

    def journal(
        self, *, ttl: float, sessions: SessionManager, usage: UsageLedger | None
    ) -> DedupeStore:
        from gateway.journal.store import FileDedupeStore

        settings = self.settings
        return FileDedupeStore(
            settings.workspace_path / JOURNAL_FILE,
            ttl=ttl,
            io_on_loop=settings.io_on_loop,
            # Power-cut safe like the sessions: what a platform was told we have is
            # fsynced before it is told.
            durable=settings.sessions.fsync != "never",
        )

    def router(self, lanes: Lanes) -> ReplicaRouter | None:
        return None

    def lead(self, role: str) -> Lead:
        from gateway.journal.cursors import CURSOR_FILE, FileCursorStore, run_with

        return run_with(FileCursorStore(self.settings.workspace_path / CURSOR_FILE))

    def leader(self, role: str) -> Leader | None:
        return None

    def relay(self, role: str) -> Relay | None:
        return None

    def heartbeat_runs(self) -> RunState:
        from gateway.schedules.runs import STATE_FILE, HeartbeatState

        return HeartbeatState(self.settings.workspace_path / STATE_FILE)

    def open(self, backends: Backends[_T]) -> _T:
        return backends.files(self.settings)
