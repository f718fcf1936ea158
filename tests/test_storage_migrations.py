"""Numbered PostgreSQL migrations: applied once, in order, under a lock; a newer schema is
refused; an unreachable server is one clear error."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from gateway.plumbing.postgres import (
    StorageError,
    StorageUnavailable,
    check_url,
    connect,
    migrate,
    migrations,
    schema_status,
)
from gateway.redaction import redact_url


def test_shipped_migrations_are_numbered_from_one_without_gaps() -> None:
    versions = [m.version for m in migrations()]
    assert versions == list(range(1, len(versions) + 1))
    assert all(m.sql.strip() for m in migrations())


def test_a_fresh_database_gets_every_migration_then_none(pg_url: str) -> None:
    with connect(pg_url) as conn:
        before = schema_status(conn)
        assert before.applied == () and len(before.pending) == len(migrations())
        applied = migrate(conn)
        assert [m.version for m in applied] == [m.version for m in migrations()]
        assert migrate(conn) == []
        after = schema_status(conn)
        assert after.pending == () and after.current == migrations()[-1].version
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT table_name FROM information_schema.tables "
                "WHERE table_schema = current_schema()"
            )
        }
    assert {"gw_sessions", "gw_session_entries", "gw_inbound", "gw_replicas"} <= tables


def test_three_replicas_starting_at_once_apply_each_migration_once(pg_url: str) -> None:
    results: list[Any] = []
    barrier = threading.Barrier(3)

    def start() -> None:
        with connect(pg_url) as conn:
            barrier.wait()
            results.append([m.version for m in migrate(conn)])

    threads = [threading.Thread(target=start) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Exactly one starter applied the whole list; the others found nothing pending.
    assert sorted(map(len, results)) == [0, 0, len(migrations())]
    with connect(pg_url) as conn:
        rows = conn.execute("SELECT version FROM gw_schema_migrations").fetchall()
    assert sorted(v for (v,) in rows) == [m.version for m in migrations()]


def test_a_schema_newer_than_this_build_is_refused(pg_url: str) -> None:
    with connect(pg_url) as conn:
        migrate(conn)
        conn.execute("INSERT INTO gw_schema_migrations VALUES (9999, 'from_the_future', 0)")
        conn.commit()
        with pytest.raises(StorageError, match=r"\[9999\].*upgrade this gateway"):
            migrate(conn)


def test_an_unreachable_server_is_one_line_without_the_password() -> None:
    url = "postgresql://gw:hunter2@127.0.0.1:1/gw"
    with pytest.raises(StorageUnavailable) as err:
        connect(url, connect_timeout=1)
    text = str(err.value)
    assert "\n" not in text and "hunter2" not in text and "127.0.0.1:1" in text


def test_urls_are_checked_and_redacted() -> None:
    assert redact_url("postgresql://u:pw@h:5/d") == "postgresql://u:***@h:5/d"
    assert redact_url("postgresql://u@h/d") == "postgresql://u@h/d"
    with pytest.raises(StorageError, match="only postgresql://"):
        check_url("mysql://u:pw@h/d")
    with pytest.raises(StorageError) as err:
        check_url("sqlite:///x?password=pw")
    assert "only postgresql://" in str(err.value)
