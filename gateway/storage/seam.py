"""The storage seam: every store of one mode, the mode chosen once, at start.

`open_storage(settings)` is the one place that reads `storage.url` to pick a mode: files
in the workspace (`gateway.storage.files.FileStorage`, the default) or PostgreSQL shared
by replicas (`gateway.storage.shared.PostgresStorage`). Everything else asks the
`Storage` it was given for the store it needs and never learns which mode is on, as
SQLAlchemy's dialects are picked once from a URL and httpx's transports once per client.

The promises each store keeps are its own package's (`gateway.sessions`,
`gateway.memory`, `gateway.journal`, `gateway.access`, `gateway.schedules`,
`gateway.usage`, `gateway.people`); both modes keep the same ones, which the conformance
tests check store by store. A channel with state of its own (WhatsApp's windows and held
replies) hands the seam both of its backends (`Backends`), and the seam opens the one of
its mode.

Light to import: the backends are imported when first opened, so a one-shot command
such as `gateway sessions list` loads only what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

from gateway.plumbing.backends import Backends, Leader

_T = TypeVar("_T")

if TYPE_CHECKING:
    from gateway.access.protocol import PairingBackend
    from gateway.config import PartialSettings, Settings
    from gateway.dispatch.lanes import Lanes, ReplicaRouter
    from gateway.journal.protocol import DedupeStore, Lead, Relay
    from gateway.memory.protocol import ConsolidationGuard, MemoryBackend
    from gateway.people.protocol import PeopleStore
    from gateway.schedules.protocol import JobStore
    from gateway.schedules.runs import RunState
    from gateway.sessions.listing import SessionListing
    from gateway.sessions.manager import SessionManager
    from gateway.usage.protocol import UsageLedger


class Storage(Protocol):
    """Every store of one mode. Each call opens a store (blocking I/O: call it before the
    event loop runs, or from a worker thread); the shared mode's connections are opened
    once per process and closed at exit."""

    settings: Settings | PartialSettings
    #: The mode, for machines (/readyz while waiting): "files" or "postgresql".
    kind: str
    #: The mode, for people (log lines): "workspace files" or "PostgreSQL".
    title: str

    @property
    def one_writer(self) -> bool:
        """Are the workspace's files the state, so that one process at a time may write
        them (the workspace lock guards them)? False when a database shared by replicas
        is the state (it guards itself)."""
        ...

    def describe(self) -> str:
        """Where the state lives, for people: "workspace files", "shared, <url>"."""
        ...

    def where(self) -> str:
        """Where the sessions are written, for an error message: a folder or a URL."""
        ...

    def connected(self) -> bool:
        """Is everything the stores need open (always, for files)?"""
        ...

    def check(self) -> str:
        """Can the stores be opened? One line saying so, without changing anything (no
        folder made, no migration applied): for `gateway doctor`. Raises
        `StorageUnavailable` when the database does not answer, `StorageError` saying what
        to do when it cannot be used."""
        ...

    def connect(self) -> None:
        """Open what the mode needs before the first store (and migrate the schema):
        raises `StorageUnavailable` when the database does not answer, `StorageError`
        when it cannot be used. Nothing to do for files."""
        ...

    def sessions(self, *, spare_files: int = 0) -> SessionManager:
        """The sessions, once the workspace's folders are made and writable
        (`WorkspaceError` otherwise); a long-running gateway passes `spare_files` (see
        `gateway.sessions.spares`), one-shot commands do not."""
        ...

    def session_listing(self) -> SessionListing:
        """The sessions as `sessions()`' manager lists them, for a command that only lists
        them (the files mode reads the folder without the session machinery). Close it
        after use."""
        ...

    def memory(self) -> MemoryBackend:
        """Long-term memory (facts, history, knowledge, every message searchable)."""
        ...

    def consolidation_guard(self) -> ConsolidationGuard | None:
        """What keeps replicas from consolidating one session at once (None: one
        process, whose consolidator serializes itself)."""
        ...

    def pairing(self) -> PairingBackend:
        """Approved senders and pending pairing codes."""
        ...

    def usage_ledger(self) -> UsageLedger:
        """Token usage totals (a budget holds across replicas in the shared mode)."""
        ...

    def jobs(self) -> JobStore:
        """Reminders and scheduled tasks set from chat."""
        ...

    def people(self) -> PeopleStore:
        """Who is who across channels."""
        ...

    def journal(
        self, *, ttl: float, sessions: SessionManager, usage: UsageLedger | None
    ) -> DedupeStore:
        """The inbound journal and outbox of the gateway that runs `sessions` and counts
        into `usage` (the shared mode lets a turn's appends and usage rows ride on the
        journal's connections). Opened once per gateway; the leases, roles and relays
        below go through it."""
        ...

    def router(self, lanes: Lanes) -> ReplicaRouter | None:
        """The replica router that feeds `lanes` the sessions this replica holds, or
        None when one process runs every session."""
        ...

    def lead(self, role: str) -> Lead:
        """Who reads a platform's stream and keeps its read position: this process, its
        cursor in the workspace; or the one replica holding `role`."""
        ...

    def leader(self, role: str) -> Leader | None:
        """Runs a loop only on the replica holding `role`; None: this process runs it."""
        ...

    def relay(self, role: str) -> Relay | None:
        """Requests to the replica holding `role` (None: this process holds it)."""
        ...

    def heartbeat_runs(self) -> RunState:
        """The heartbeat jobs' last runs."""
        ...

    def open(self, backends: Backends[_T]) -> _T:
        """A channel's own store, of this mode."""
        ...


def open_storage(settings: Settings | PartialSettings) -> Storage:
    """The storage of the mode `settings` asks for: PostgreSQL when `storage.url` is set,
    else the workspace's files. The only place the mode is chosen."""
    if settings.storage.url:
        from gateway.storage.shared import PostgresStorage

        return PostgresStorage(settings)
    from gateway.storage.files import FileStorage

    return FileStorage(settings)
