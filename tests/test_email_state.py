"""How far each mailbox was read (channels.email.state): a mark per mailbox, kept as a
channel cursor (gateway.journal.cursors; the shared mode's store is exercised by the failover
kill test, tests/test_email_kill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from channels.email.state import MailboxMark, MailboxMarks
from gateway.journal.cursors import CURSOR_FILE, FileCursorStore

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_mark_per_mailbox_beside_other_channels_cursors(tmp_path: Path) -> None:
    store = FileCursorStore(tmp_path / CURSOR_FILE)
    await store.save("matrix:@bot:example.org", "s72594_4483_1934")
    marks = MailboxMarks(store)
    assert await marks.load("a@x/INBOX") is None
    await marks.save("a@x/INBOX", MailboxMark(5, 10))
    await marks.save("b@x/INBOX", MailboxMark(7, 3))
    again = MailboxMarks(FileCursorStore(tmp_path / CURSOR_FILE))
    assert await again.load("a@x/INBOX") == MailboxMark(5, 10)
    assert await again.load("b@x/INBOX") == MailboxMark(7, 3)
    assert await store.load("email:a@x/INBOX") == "5:10"
    assert await store.load("matrix:@bot:example.org") == "s72594_4483_1934"


def test_a_mark_this_build_cannot_read_is_no_mark() -> None:
    """The channel then reads the folder as at a first start: unseen mail only, and the
    journal drops what it has answered."""
    assert MailboxMark.decode("5:10") == MailboxMark(5, 10)
    for value in (None, "", "5", "5:", "x:1", "5:-1", "5:10:2"):
        assert MailboxMark.decode(value) is None, value
