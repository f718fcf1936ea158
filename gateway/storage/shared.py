"""The shared mode of the storage seam: every store in PostgreSQL (`storage.url`), shared by
the replicas of one deployment.

Two kinds of connections serve it: the process's worker-thread pool
(`gateway.plumbing.postgres.SharedStorage`: opened once per URL per process, the schema
checked or migrated first, closed at exit) for the stores' blocking calls, and the
journal's event-loop pool (`gateway.journal.pg_store.PostgresDedupeStore`), which a turn's
session appends and usage rows ride on, and through which the replica router, the
platform roles, the relay and the heartbeat's runs go. The workspace folder still holds
per-process files (the SQLite cache), but none of the state.
"""

from __future__ import annotations

import atexit
import functools
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from gateway.access.protocol import PairingBackend
    from gateway.config import PartialSettings, Settings
    from gateway.dispatch.lanes import Lanes, ReplicaRouter
    from gateway.journal.pg_store import PostgresDedupeStore
    from gateway.journal.protocol import DedupeStore, Lead, Relay
    from gateway.memory.protocol import ConsolidationGuard, MemoryBackend
    from gateway.people.protocol import PeopleStore
    from gateway.plumbing.backends import Backends, Leader
    from gateway.plumbing.postgres import SharedStorage
    from gateway.schedules.protocol import JobStore
    from gateway.schedules.runs import RunState
    from gateway.sessions.listing import SessionListing
    from gateway.sessions.manager import SessionManager
    from gateway.usage.protocol import UsageLedger

_T = TypeVar("_T")

_connections: dict[str, SharedStorage] = {}


def shared_connections(url: str, *, pool_size: int, migrate_mode: str) -> SharedStorage:
    """The process's connections to `url` (opened, and the schema migrated or checked, on
    first use; closed at exit)."""
    storage = _connections.get(url)
    if storage is None:
        from gateway.plumbing.postgres import SharedStorage

        storage = SharedStorage(url, pool_size=pool_size, migrate_mode=migrate_mode)
        storage.open()
        _connections[url] = storage
        atexit.register(storage.close)
    return storage


def connections_open(url: str) -> bool:
    """Are this process's connections to `url` open already?"""
    return url in _connections


class PostgresStorage:
    """Every store in PostgreSQL (see the module)."""

    kind = "postgresql"
    title = "PostgreSQL"
    one_writer = False

    def __init__(self, settings: Settings | PartialSettings) -> None:
        assert settings.storage.url
        self.settings = settings
        self.url = settings.storage.url
        self._journal: PostgresDedupeStore | None = None

    @property
    def db(self) -> SharedStorage:
        section = self.settings.storage
        return shared_connections(
            self.url, pool_size=section.pool_size, migrate_mode=section.migrate
        )

    def describe(self) -> str:
        from gateway.redaction import redact_url

        return f"shared, {redact_url(self.url)}"

    def where(self) -> str:
        from gateway.redaction import redact_url

        return redact_url(self.url)

    def connected(self) -> bool:
        return connections_open(self.url)

    def check(self) -> str:
        from gateway.plumbing.postgres import StorageError, connect, schema_status
        from gateway.redaction import redact_url

        where = redact_url(self.url)
        with connect(self.url) as conn:
            status = schema_status(conn)
        if status.unknown:
            raise StorageError(
                f"the database at {where} has schema versions {list(status.unknown)} that "
                "this gateway does not know (a newer version migrated it); upgrade this gateway"
            )
        if status.pending and self.settings.storage.migrate != "auto":
            raise StorageError(
                f"the database at {where} lacks {len(status.pending)} schema migrations and "
                "storage.migrate is 'never'; run `gateway db migrate` first"
            )
        pending = f", {len(status.pending)} migrations to apply at start" if status.pending else ""
        return f"state in PostgreSQL at {where} (schema version {status.current}{pending})"

    def connect(self) -> None:
        self.db  # noqa: B018 (opening is the point)

    def sessions(self, *, spare_files: int = 0) -> SessionManager:
        from gateway.sessions.manager import SessionManager
        from gateway.sessions.pg_store import PostgresSessions
        from gateway.storage.workspace import prepare_workspace

        settings = self.settings
        prepare_workspace(settings)  # per-process files (the SQLite cache) live there
        return SessionManager.shared(
            PostgresSessions(self.db.sync),
            max_cache_size=settings.sessions.max_cache_size,
            max_cache_bytes=settings.sessions.max_cache_mb * 1024 * 1024,
        )

    def session_listing(self) -> SessionListing:
        return self.sessions()

    def memory(self) -> MemoryBackend:
        from gateway.memory.pg_store import PostgresMemoryStore

        return PostgresMemoryStore(
            self.db.sync,
            mode=self.settings.memory.scope,
            people=self.people(),
            dense=self.settings.memory.dense_recall,
        )

    def consolidation_guard(self) -> ConsolidationGuard | None:
        from gateway.journal.pg_store import new_replica_id
        from gateway.memory.pg_store import PostgresConsolidationGuard

        # Replicas share sessions: one consolidates a session at a time, never a span twice.
        return PostgresConsolidationGuard(self.db.sync, new_replica_id())

    def pairing(self) -> PairingBackend:
        from gateway.access.pg_store import PostgresPairingStore
        from gateway.redaction import redact_url

        db = self.db
        return PostgresPairingStore(db.sync, where=redact_url(db.url))

    def usage_ledger(self) -> UsageLedger:
        from gateway.usage.pg_store import PostgresUsageLedger

        return PostgresUsageLedger(self.db.sync)

    def jobs(self) -> JobStore:
        from gateway.schedules.pg_store import PostgresJobStore

        return PostgresJobStore(self.db.sync)

    def people(self) -> PeopleStore:
        from gateway.people.pg_store import PostgresPeopleStore

        return PostgresPeopleStore(self.db.sync)

    def journal(
        self, *, ttl: float, sessions: SessionManager, usage: UsageLedger | None
    ) -> DedupeStore:
        from gateway.journal.pg_store import PostgresDedupeStore
        from gateway.usage.pg_store import PostgresUsageLedger

        # Shared with the other replicas: one claim per platform message wins.
        journal = PostgresDedupeStore(self.url, ttl=ttl, pool_size=self.settings.storage.pool_size)
        # A turn's appends and usage row go over the journal's event-loop pool, not
        # a worker thread each (see `gateway.sessions.pg_store`).
        sessions.use_loop_connections(journal.connection)
        if isinstance(usage, PostgresUsageLedger):
            usage.aconnect = journal.connection
        self._journal = journal
        return journal

    @property
    def _opened_journal(self) -> PostgresDedupeStore:
        if self._journal is None:
            raise RuntimeError("the journal is opened first (Storage.journal)")
        return self._journal

    def router(self, lanes: Lanes) -> ReplicaRouter | None:
        from gateway.dispatch.router import SessionRouter

        lease_ttl = self.settings.storage.lease_ttl_seconds
        return SessionRouter(self._opened_journal, lanes, lease_ttl=lease_ttl)

    def lead(self, role: str) -> Lead:
        from gateway.journal.pg_cursors import lead_as

        return lead_as(self.url, role)

    def leader(self, role: str) -> Leader | None:
        from gateway.journal.pg_cursors import run_as_leader

        return functools.partial(run_as_leader, self.url, role)

    def relay(self, role: str) -> Relay | None:
        from gateway.journal.pg_relay import PostgresRelay

        return PostgresRelay(self._opened_journal, role)

    def heartbeat_runs(self) -> RunState:
        from gateway.schedules.pg_store import SharedRunState

        # One run per due time, all replicas.
        return SharedRunState(self._opened_journal)

    def open(self, backends: Backends[_T]) -> _T:
        return backends.postgresql(self.db)
