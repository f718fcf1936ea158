"""PostgreSQL for the shared mode: connection pools, numbered schema migrations applied
under a lock, and the errors an operator sees when the database is not there.

Migrations are the files ``migrations/NNNN_name.sql`` shipped inside the package, applied
in order, each in its own transaction together with its row in ``gw_schema_migrations``;
a session-level advisory lock makes concurrent starters (three replicas and a migration
Job) apply each migration exactly once. A database that already holds a *newer* schema
than this build knows is refused: running old code against it could lose data.

psycopg 3 (with psycopg_pool) is the driver: it is the maintained successor of psycopg2,
speaks both sync and async with one API, and its pool checks connections and reconnects.

Pooled connections are in autocommit mode: a single statement is its own transaction (one
round trip, where an implicit ``BEGIN`` and ``COMMIT`` made three), and code that needs
several statements to commit together says so with ``conn.transaction()``. A connection
is checked before it is handed out only when it sat idle for `CHECK_AFTER_IDLE` seconds
(as HikariCP's ``aliveBypassWindowMs``): a busy pool pays no check round trip per
checkout, and an idle connection, which a server restart may have broken, is still
checked and replaced.
"""

from __future__ import annotations

import re
import time
import weakref
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

from gateway.logs import logger
from gateway.redaction import redact_url

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import AsyncConnectionPool, ConnectionPool

#: First key of the advisory lock that serializes migrations ("gwmg" in ASCII); the
#: second is the schema's hash, so gateways in different schemas do not wait for each other.
MIGRATION_LOCK = 0x67776D67
_MIGRATION_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class StorageError(Exception):
    """The shared storage cannot be used; the message says what to do (one line)."""


class StorageUnavailable(StorageError):
    """PostgreSQL did not answer (down, unreachable, refusing connections)."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    applied: tuple[tuple[int, str, float], ...]  # (version, name, applied at)
    pending: tuple[Migration, ...]
    #: Versions in the database this build does not know (a newer gateway migrated it).
    unknown: tuple[int, ...]

    @property
    def current(self) -> int:
        return max((v for v, _, _ in self.applied), default=0)


def require_driver() -> None:
    """Fail clearly when the PostgreSQL extra is not installed."""
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        raise StorageError(
            "storage.url names PostgreSQL but its driver is not installed; "
            "run: pip install 'chat-gateway[postgres]'"
        ) from None


def check_url(url: str) -> str:
    """``url`` if it names PostgreSQL, else a `StorageError` saying what is expected."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("postgresql", "postgres"):
        raise StorageError(
            f"storage.url {redact_url(url)!r}: only postgresql://user@host:port/db is "
            "supported (leave it unset to keep everything in workspace files)"
        )
    return url


def migrations() -> list[Migration]:
    """The migrations this build ships, in version order."""
    found = []
    folder = resources.files("gateway.plumbing") / "migrations"
    for item in folder.iterdir():
        m = _MIGRATION_NAME.match(item.name)
        if m is None:
            continue
        found.append(Migration(int(m[1]), m[2], item.read_text(encoding="utf-8")))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if len(set(versions)) != len(versions):
        raise StorageError(f"two migrations share a version number: {versions}")
    return found


_BOOKKEEPING = """
CREATE TABLE IF NOT EXISTS gw_schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at double precision NOT NULL
)
"""


def _applied(conn: psycopg.Connection[Any]) -> list[tuple[int, str, float]]:
    exists = conn.execute("SELECT to_regclass('gw_schema_migrations') IS NOT NULL").fetchone()
    if not exists or not exists[0]:
        return []
    rows = conn.execute(
        "SELECT version, name, applied_at FROM gw_schema_migrations ORDER BY version"
    ).fetchall()
    return [(int(v), str(n), float(t)) for v, n, t in rows]


def schema_status(conn: psycopg.Connection[Any]) -> SchemaStatus:
    applied = _applied(conn)
    conn.commit()
    known = {mig.version for mig in migrations()}
    done = {v for v, _, _ in applied}
    return SchemaStatus(
        applied=tuple(applied),
        pending=tuple(mig for mig in migrations() if mig.version not in done),
        unknown=tuple(sorted(done - known)),
    )


def migrate(conn: psycopg.Connection[Any]) -> list[Migration]:
    """Apply the pending migrations (under the advisory lock); return those applied here.

    Raises `StorageError` when the database holds a schema newer than this build.
    """
    conn.execute("SELECT pg_advisory_lock(%s::int4, hashtext(current_schema()))", (MIGRATION_LOCK,))
    conn.commit()
    try:
        conn.execute(_BOOKKEEPING)
        conn.commit()
        status = schema_status(conn)
        if status.unknown:
            raise StorageError(
                f"the database has schema versions {list(status.unknown)} that this gateway "
                "does not know (a newer version migrated it); upgrade this gateway"
            )
        for mig in status.pending:
            with conn.transaction():
                conn.execute(mig.sql.encode())
                conn.execute(
                    "INSERT INTO gw_schema_migrations (version, name, applied_at) "
                    "VALUES (%s, %s, %s)",
                    (mig.version, mig.name, time.time()),
                )
            logger.info("storage: applied migration {:04d}_{}", mig.version, mig.name)
        return list(status.pending)
    finally:
        conn.rollback()  # whatever failed above must not keep the unlock from running
        conn.execute(
            "SELECT pg_advisory_unlock(%s::int4, hashtext(current_schema()))", (MIGRATION_LOCK,)
        )
        conn.commit()


def _describe(exc: BaseException, url: str) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"PostgreSQL at {redact_url(url)} is not reachable ({text})"


def connect(url: str, *, connect_timeout: float = 5.0) -> psycopg.Connection[Any]:
    """One plain connection (CLI commands, migrations)."""
    require_driver()
    import psycopg

    check_url(url)
    try:
        return psycopg.connect(url, connect_timeout=max(1, int(connect_timeout)))
    except psycopg.OperationalError as exc:
        raise StorageUnavailable(_describe(exc, url)) from None


#: Seconds a pooled connection may sit idle and still be handed out unchecked.
CHECK_AFTER_IDLE = 1.0

_returned_at: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _needs_check(conn: Any) -> bool:
    return time.monotonic() - _returned_at.get(conn, float("-inf")) >= CHECK_AFTER_IDLE


def _check_idle(conn: psycopg.Connection[Any]) -> None:
    if _needs_check(conn):
        conn.execute("")


async def _acheck_idle(conn: psycopg.AsyncConnection[Any]) -> None:
    if _needs_check(conn):
        await conn.execute("")


def _note_returned(conn: psycopg.Connection[Any]) -> None:
    _returned_at[conn] = time.monotonic()


async def _anote_returned(conn: psycopg.AsyncConnection[Any]) -> None:
    _returned_at[conn] = time.monotonic()


#: Seconds PostgreSQL lets a transaction of ours sit idle (the client between two of its
#: statements) before it ends it: a replica frozen inside a transaction (the locking
#: session append, a memory write) would otherwise hold its row locks, the lease's
#: share lock among them (`gateway.plumbing.fence`), and keep the other replicas from
#: taking its sessions over for as long as it stays frozen. No transaction of ours
#: waits on the client anywhere near this long.
IDLE_IN_TRANSACTION = 10


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}s'")


async def _aconfigure(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION}s'")


def sync_pool(url: str, *, min_size: int = 1, max_size: int = 8) -> ConnectionPool:
    """A pool for code that runs in worker threads (the session stores)."""
    require_driver()
    from psycopg_pool import ConnectionPool

    check_url(url)
    return ConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        open=False,
        timeout=10.0,
        name="gateway-sync",
        kwargs={"autocommit": True},
        configure=_configure,
        check=_check_idle,
        reset=_note_returned,
    )


def async_pool(url: str, *, min_size: int = 1, max_size: int = 8) -> AsyncConnectionPool:
    """A pool for code on the event loop (the inbound journal)."""
    require_driver()
    from psycopg_pool import AsyncConnectionPool

    check_url(url)
    return AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        open=False,
        # The journal's wait: past it the platform is told to send again (a 5xx), which
        # beats holding its request until its own timeout.
        timeout=3.0,
        name="gateway-async",
        kwargs={"autocommit": True},
        configure=_aconfigure,
        check=_acheck_idle,
        reset=_anote_returned,
    )


class SharedStorage:
    """The shared mode's connections in one process: the schema checked (or migrated)
    once, a pool for worker threads, and one for the event loop when asked for."""

    def __init__(self, url: str, *, pool_size: int = 8, migrate_mode: str = "auto") -> None:
        self.url = check_url(url)
        self.pool_size = pool_size
        self.migrate_mode = migrate_mode
        self._sync: ConnectionPool | None = None

    def open(self) -> None:
        """Connect, apply or check migrations, open the pool. Raises `StorageUnavailable`
        when the server does not answer, `StorageError` when the schema is not ready."""
        with connect(self.url) as conn:
            if self.migrate_mode == "auto":
                migrate(conn)
            else:
                status = schema_status(conn)
                if status.pending:
                    raise StorageError(
                        f"the database lacks {len(status.pending)} schema migrations and "
                        "storage.migrate is 'never'; run `gateway db migrate` first"
                    )
        pool = sync_pool(self.url, max_size=self.pool_size)
        try:
            pool.open(wait=True, timeout=10.0)
        except Exception as exc:
            pool.close()
            raise StorageUnavailable(_describe(exc, self.url)) from None
        self._sync = pool

    @property
    def sync(self) -> ConnectionPool:
        if self._sync is None:
            raise StorageError("shared storage used before it was opened")
        return self._sync

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
