"""How far each mailbox was read (channels.email.state), in both storage modes: the
workspace file and PostgreSQL shared by replicas."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from channels.email.state import FileMailboxState, MailboxMark, PostgresMailboxState

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_file_keeps_a_mark_per_mailbox(tmp_path: Path) -> None:
    state = FileMailboxState(tmp_path / "email-state.json")
    assert await state.load("a@x/INBOX") is None
    await state.save("a@x/INBOX", MailboxMark(5, 10))
    await state.save("b@x/INBOX", MailboxMark(7, 3))
    again = FileMailboxState(tmp_path / "email-state.json")
    assert await again.load("a@x/INBOX") == MailboxMark(5, 10)
    assert await again.load("b@x/INBOX") == MailboxMark(7, 3)
    assert (tmp_path / "email-state.json").stat().st_mode & 0o777 == 0o600


async def test_an_unreadable_file_starts_over_and_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "email-state.json"
    path.write_text("{not json")
    state = FileMailboxState(path)
    assert await state.load("a@x/INBOX") is None  # read as at a first start
    await state.save("a@x/INBOX", MailboxMark(5, 1))
    assert await state.load("a@x/INBOX") == MailboxMark(5, 1)


async def test_postgres_shares_the_mark_and_never_moves_it_back(migrated_pg_url: str) -> None:
    import psycopg

    @contextlib.asynccontextmanager
    async def connection() -> AsyncIterator[Any]:
        conn = await psycopg.AsyncConnection.connect(migrated_pg_url, autocommit=True)
        async with conn:
            yield conn

    one, other = PostgresMailboxState(connection), PostgresMailboxState(connection)
    assert await one.load("a@x/INBOX") is None
    await one.save("a@x/INBOX", MailboxMark(5, 10))
    assert await other.load("a@x/INBOX") == MailboxMark(5, 10)
    # A replica paused past its role wakes up and saves an older mark: refused.
    await other.save("a@x/INBOX", MailboxMark(5, 7))
    assert await one.load("a@x/INBOX") == MailboxMark(5, 10)
    # A renumbered folder starts a new count.
    await other.save("a@x/INBOX", MailboxMark(6, 2))
    assert await one.load("a@x/INBOX") == MailboxMark(6, 2)
