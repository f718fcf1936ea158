"""The PostgreSQL the shared-backend tests use (GATEWAY_TEST_PG_URL, default the local one,
database `test`): each test gets its own schema, dropped afterwards. A test skips when no
server answers, except under CI=true, where that fails: CI must not go green by silently
testing only the file stores."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import quote

import pytest

PG_URL = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _unreachable_reason() -> str | None:
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install -e '.[dev]')"
    try:
        psycopg.connect(PG_URL, connect_timeout=2).close()
    except psycopg.Error as exc:
        return f"PostgreSQL not reachable at {PG_URL} ({type(exc).__name__}: {exc})"
    return None


def require_pg() -> None:
    reason = _unreachable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires PostgreSQL (scripts/ensure-services.sh)")
    pytest.skip(reason)


def schema_url(schema: str) -> str:
    """`PG_URL` with every connection's search_path set to ``schema``."""
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options={quote(f'-csearch_path={schema}')}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL whose connections see an empty schema of their own (migrations not applied)."""
    require_pg()
    import psycopg

    schema = "gwtest_" + uuid.uuid4().hex[:12]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema_url(schema)
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def migrated_pg_url(pg_url: str) -> str:
    """`pg_url` with this build's migrations applied."""
    from gateway.plumbing.postgres import connect, migrate

    with connect(pg_url) as conn:
        migrate(conn)
    return pg_url


@pytest.fixture
def pg_pools(migrated_pg_url: str) -> Iterator[Callable[[], Any]]:
    """Opens connection pools on `migrated_pg_url`, one per simulated process or replica
    (a `psycopg_pool.ConnectionPool` each); all closed after the test."""
    from gateway.plumbing.postgres import sync_pool

    pools: list[Any] = []

    def open_pool() -> Any:
        pool = sync_pool(migrated_pg_url, max_size=4)
        pool.open(wait=True)
        pools.append(pool)
        return pool

    yield open_pool
    for pool in pools:
        pool.close()
