"""`SqliteFile`: calls on the loop only when they cannot wait, the worker thread
otherwise, and WAL checkpoints kept out of commits."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from gateway import fsutil
from gateway.cache.backend import CacheRecord
from gateway.cache.sqlite_backend import SqliteCacheBackend
from gateway.fsutil import SqliteFile
from gateway.journal.store import FileDedupeStore
from tests.loop_probe import hold_sqlite_write_lock, loop_ticks

pytestmark = pytest.mark.anyio


def file_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def schema(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v TEXT)")


async def test_nowait_runs_here_only_when_it_cannot_wait(tmp_path: Path) -> None:
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    put = lambda conn: conn.execute("INSERT INTO t VALUES ('a', '1')")  # noqa: E731
    assert db.try_transaction_nowait(put) == (False, None)  # not open yet: nothing ran
    await db.run(lambda conn: None)  # opens it
    assert db.try_transaction_nowait(put)[0] is True
    holder = hold_sqlite_write_lock(db.path, 0.3)
    try:
        put_b = lambda conn: conn.execute("INSERT INTO t VALUES ('b', '2')")  # noqa: E731
        assert db.try_transaction_nowait(put_b) == (False, None)  # locked: not here
        await db.transaction(put_b)  # the worker thread waits for the lock
    finally:
        holder.join()
    rows = await db.run(lambda conn: conn.execute("SELECT k, v FROM t ORDER BY k").fetchall())
    assert rows == [("a", "1"), ("b", "2")]
    await db.aclose()


async def test_checkpoints_run_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fsutil, "CHECKPOINT_EVERY", 50)
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    await db.run(lambda conn: None)
    mode = await db.run(lambda conn: conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0])
    assert mode == 0  # commits never checkpoint themselves
    for n in range(120):

        def put(conn: sqlite3.Connection, n: int = n) -> None:
            conn.execute("INSERT INTO t VALUES (?, 'x')", (str(n),))

        ran, _ = db.try_transaction_nowait(put)
        if not ran:  # a checkpoint is running: the worker thread writes instead
            await db.transaction(put)
    assert db.checkpoints >= 1
    await db.aclose()  # waits for a checkpoint still running
    conn = sqlite3.connect(db.path)
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 120
    conn.close()


async def test_a_cache_lookup_waits_for_a_foreign_lock_off_the_loop(tmp_path: Path) -> None:
    """A lookup that must write (an expired entry to drop) while another process holds
    the lock: not on the loop, still answered correctly once the lock is free."""
    backend = SqliteCacheBackend(tmp_path / "cache.sqlite3")
    record = CacheRecord(
        key="k",
        response="answer",
        model="m",
        scope="shared",
        partition="",
        query="q",
        created_at=0.0,
        expires_at=10.0,
    )
    await backend.put(record, now=1.0, max_entries=100)
    assert (await backend.get("k", now=2.0)) is not None
    holder = hold_sqlite_write_lock(backend.path, 0.3)
    try:
        async with loop_ticks() as ticks:
            gone = await backend.get("k", now=20.0)  # expired: the lookup deletes it
    finally:
        holder.join()
    assert gone is None
    assert ticks.count >= 10
    assert (await backend.get("k", now=2.0)) is None  # the delete happened
    await backend.aclose()


async def test_threads_mode_never_runs_on_the_loop(tmp_path: Path) -> None:
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema, io_on_loop=False)
    await db.run(lambda conn: None)  # open
    assert db.try_run_nowait(lambda conn: 1) == (False, None)
    await db.transaction(lambda conn: conn.execute("INSERT INTO t VALUES ('a', '1')"))
    assert await db.run(lambda conn: conn.execute("SELECT v FROM t").fetchone()[0]) == "1"
    await db.aclose()


async def test_a_worker_call_waits_out_an_immediate_locked_answer(tmp_path: Path) -> None:
    """SQLite sometimes answers "locked" at once instead of waiting (two processes
    switching a new file to WAL): a worker call retries until the busy timeout."""
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    other = tmp_path / "other.sqlite3"
    sqlite3.connect(other).close()
    attempts = 0

    def fn(conn: sqlite3.Connection) -> str:
        nonlocal attempts
        attempts += 1
        probe = sqlite3.connect(other, timeout=0, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")  # "locked" at once while the holder holds it
            probe.execute("COMMIT")
        finally:
            probe.close()
        return "done"

    holder = hold_sqlite_write_lock(other, 0.2)
    try:
        assert await db.run(fn) == "done"
    finally:
        holder.join()
    assert attempts > 1
    await db.aclose()


async def test_a_durable_transaction_commits_with_fsync_and_others_do_not(
    tmp_path: Path,
) -> None:
    """`transaction(..., durable=True)` commits with synchronous = FULL (fsynced: it
    survives a power cut); the connection goes back to NORMAL for the others."""
    db = SqliteFile(tmp_path / "d.sqlite", what="test", init=schema)
    rows = iter(range(100))

    def level(conn: sqlite3.Connection) -> int:
        conn.execute("INSERT INTO t VALUES (?, 'v')", (str(next(rows)),))
        return int(conn.execute("PRAGMA synchronous").fetchone()[0])

    assert await db.transaction(level, durable=True) == 2  # FULL
    assert await db.transaction(level) == 1  # NORMAL
    ran, plain = db.try_transaction_nowait(level)
    assert ran and plain == 1
    await db.aclose()


async def test_the_journal_is_fsynced_when_durable_and_answers_are_not(tmp_path: Path) -> None:
    """A durable journal (the daemon's default) fsyncs what a platform is told we
    have before `journal` returns; answered marks ride plain commits. Observed with
    SQLite's statement trace on the store's connection."""
    from gateway.journal.store import FileDedupeStore
    from gateway.messages import InboundMessage

    store = FileDedupeStore(tmp_path / "j.sqlite", durable=True)
    statements: list[str] = []
    msg = InboundMessage(channel="t", chat_id="1", text="hi", message_id="1")
    await store.journal("k", msg)  # opens the connection
    conn = store._db._conn  # the store's own connection: trace what it runs
    assert conn is not None
    conn.set_trace_callback(statements.append)
    await store.journal("k2", msg)
    await store.mark_done("k2")
    await store.aclose()
    full = [i for i, s in enumerate(statements) if s == "PRAGMA synchronous = FULL"]
    inserts = [i for i, s in enumerate(statements) if s.startswith("INSERT OR REPLACE INTO inbox")]
    answered = [
        i for i, s in enumerate(statements) if s.startswith("INSERT OR REPLACE INTO answered")
    ]
    assert len(full) == 1 and full[0] < inserts[0]  # the journal commit ran under FULL
    assert answered and answered[0] > full[0]
    resets = [i for i, s in enumerate(statements) if s == "PRAGMA synchronous = NORMAL"]
    assert resets and resets[0] < answered[0]  # the answer's commit did not


def _modes(path: Path) -> dict[str, str]:
    return {
        name: oct(stat.S_IMODE(Path(f"{path}{suffix}").stat().st_mode))
        for name, suffix in (("db", ""), ("wal", "-wal"), ("shm", "-shm"))
    }


def _loose_files(*paths: Path) -> None:
    for path in paths:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").touch()
            os.chmod(f"{path}{suffix}", 0o644)


@pytest.mark.parametrize("leftover", [False, True], ids=["new", "loose-leftover"])
async def test_wal_and_shm_files_are_0600_while_open(tmp_path: Path, leftover: bool) -> None:
    """The cache file and dedupe.sqlite, with the WAL and shared-memory files SQLite
    makes next to them, are private however the process's umask is set."""
    cache_path, dedupe_path = tmp_path / "cache.sqlite", tmp_path / "dedupe.sqlite"
    if leftover:  # files an older gateway left readable by others
        _loose_files(cache_path, dedupe_path)
    old_umask = os.umask(0o022)
    try:
        cache = SqliteCacheBackend(cache_path)
        dedupe = FileDedupeStore(dedupe_path)
        now = 1_800_000_000.0
        record = CacheRecord("k", "answer", "m", "shared", "p", "q", now, now + 60)
        await cache.put(record, now=now, max_entries=10)
        await dedupe.seen_or_add("telegram:1:m1")
        await dedupe.mark_done("telegram:1:m1")
        await dedupe.count()  # waits for the batched write
        private = {"db": "0o600", "wal": "0o600", "shm": "0o600"}
        assert (_modes(cache_path), _modes(dedupe_path)) == (private, private)
        await cache.aclose()
        await dedupe.aclose()
    finally:
        os.umask(old_umask)


async def test_every_write_counts_towards_the_checkpoint_however_it_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Autocommitted writes (`run`, `try_run_nowait`), not only `transaction`s, bring
    the checkpoint: the cache wrote only so, and its WAL grew without bound. Reads do
    not count."""
    monkeypatch.setattr(fsutil, "CHECKPOINT_EVERY", 10)
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    await db.run(lambda conn: None)

    def settled() -> None:  # no write while a checkpoint runs (that brings the next one)
        if db._checkpointer is not None:
            db._checkpointer.join()

    for n in range(25):
        await db.run(lambda conn, n=n: conn.execute("INSERT INTO t VALUES (?, 'x')", (str(n),)))
        await db.run(lambda conn: conn.execute("SELECT count(*) FROM t").fetchone())
        settled()
    assert db.checkpoints == 2
    await db.aclose()
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    await db.run(lambda conn: None)
    for n in range(25, 35):
        ran, _ = db.try_run_nowait(
            lambda conn, n=n: conn.execute("INSERT INTO t VALUES (?, 'x')", (str(n),))
        )
        assert ran
        settled()
    assert db.checkpoints == 1
    await db.aclose()


async def test_a_commit_during_a_checkpoint_brings_the_next_one_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite starts the WAL over only at a write that finds all of it copied. A commit
    that came while the checkpoint ran left some of it uncopied: waiting a thousand
    commits for the next checkpoint, which a steady stream of writes (the cache's puts
    a few ms apart) again overlaps, grew the WAL for ever (past 175 MB measured). The
    next checkpoint comes `CHECKPOINT_CHASE_EVERY` commits later, and once one ends
    with nothing written meanwhile, the next write starts the WAL over."""
    import threading

    monkeypatch.setattr(fsutil, "CHECKPOINT_EVERY", 20)
    monkeypatch.setattr(fsutil, "WAL_SIZE_LIMIT", 32 * 1024)
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    release = threading.Event()
    real = SqliteFile._checkpoint

    def slow_checkpoint(self: SqliteFile) -> None:
        release.wait(10)  # a checkpoint that takes a while
        real(self)

    monkeypatch.setattr(SqliteFile, "_checkpoint", slow_checkpoint)
    rows = iter(range(10_000))

    async def write() -> None:
        n = next(rows)
        await db.transaction(
            lambda conn: conn.execute("INSERT INTO t VALUES (?, ?)", (str(n), "x" * 2000))
        )

    for _ in range(20):
        await write()
    assert db.checkpoints == 1 and db._checkpointer is not None
    await write()  # comes while the checkpoint runs
    release.set()
    db._checkpointer.join()
    assert file_size(Path(f"{db.path}-wal")) > 32 * 1024  # not started over
    writes = 0
    while db.checkpoints < 2 and writes < 100:
        await write()
        writes += 1
    assert db.checkpoints == 2 and writes <= fsutil.CHECKPOINT_CHASE_EVERY  # soon
    db._checkpointer.join()  # nothing written meanwhile: it copied all of it
    await write()  # SQLite starts the WAL over, cut back to the limit
    assert file_size(Path(f"{db.path}-wal")) <= 32 * 1024
    for _ in range(fsutil.CHECKPOINT_CHASE_EVERY):
        await write()
    assert db.checkpoints == 2  # caught up: back to one every `CHECKPOINT_EVERY`
    await db.aclose()


async def test_a_bloated_wal_is_cut_back_once_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A WAL left large (by a version that never checkpointed) shrinks to the limit
    when SQLite next starts it over."""
    monkeypatch.setattr(fsutil, "WAL_SIZE_LIMIT", 64 * 1024)
    monkeypatch.setattr(fsutil, "CHECKPOINT_EVERY", 10**9)  # none while it grows
    db = SqliteFile(tmp_path / "x.sqlite3", what="test", init=schema)
    for n in range(300):
        await db.transaction(
            lambda conn, n=n: conn.execute("INSERT INTO t VALUES (?, ?)", (str(n), "x" * 2000))
        )
    wal = Path(f"{db.path}-wal")
    assert file_size(wal) > 1_000_000
    monkeypatch.setattr(fsutil, "CHECKPOINT_EVERY", 1)
    await db.transaction(lambda conn: conn.execute("INSERT INTO t VALUES ('c', 'x')"))
    assert db._checkpointer is not None
    db._checkpointer.join()
    await db.transaction(lambda conn: conn.execute("INSERT INTO t VALUES ('d', 'x')"))
    assert file_size(wal) <= 64 * 1024
    await db.aclose()


async def test_a_put_with_much_to_evict_leaves_the_loop_and_evicts_it_all(tmp_path: Path) -> None:
    """A put runs on the loop when its work is small; one that must evict many entries
    (the limit was lowered) is rolled back there and done whole by the worker."""

    def record(n: int) -> CacheRecord:
        return CacheRecord(
            key=f"k{n}",
            response="answer",
            model="m",
            scope="shared",
            partition="p",
            query=f"q{n}",
            created_at=0.0,
            expires_at=1e12,
        )

    backend = SqliteCacheBackend(tmp_path / "cache.sqlite3")
    for n in range(40):
        assert await backend.put(record(n), now=float(n), max_entries=1000) == 0
    assert await backend.put(record(40), now=40.0, max_entries=38) == 3  # on the loop
    assert await backend.put(record(41), now=41.0, max_entries=5) == 34  # the worker
    assert (await backend.counts(now=42.0)).entries == 5
    assert await backend.get("k41", now=42.0) is not None  # the newest stays
    assert await backend.get("k0", now=42.0) is None  # the least recently used went
    await backend.aclose()
