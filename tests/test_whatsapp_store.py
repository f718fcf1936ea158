"""The WhatsApp store keeps its promises in both modes (a SQLite file in the workspace,
and PostgreSQL shared by replicas): windows and statuses only move forward, a status
that comes first is kept for its message, a held reply is templated once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from channels.whatsapp.store import (
    STORE_FILE,
    FileWhatsAppStore,
    HeldReply,
    PostgresWhatsAppStore,
    SentMessage,
    WhatsAppStore,
)

pytestmark = pytest.mark.anyio

CHAT = "106540352242922:4915112345678"
KEY = f"whatsapp:{CHAT}"


@pytest.fixture(params=["file", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], WhatsAppStore]]:
    """Opens stores on one place, as several processes (or replicas) would."""
    if request.param == "file":
        yield lambda: FileWhatsAppStore(tmp_path / STORE_FILE)
        return
    pools = request.getfixturevalue("pg_pools")
    yield lambda: PostgresWhatsAppStore(pools())


def sent(wamid: str, part: int = 0, body: str = "hello") -> SentMessage:
    return SentMessage(wamid, CHAT, KEY, "text", body, "reply-1", part, 1000.0)


async def test_the_window_only_moves_forward(stores: Callable[[], WhatsAppStore]) -> None:
    one, other = stores(), stores()
    assert await one.last_inbound(CHAT) is None
    await one.note_inbound(CHAT, "wamid.B", 2000.0)
    await other.note_inbound(CHAT, "wamid.A", 1000.0)  # an old message, redelivered late
    found = await one.last_inbound(CHAT)
    assert found is not None and (found.at, found.message_id) == (2000.0, "wamid.B")
    await other.note_inbound(CHAT, "wamid.C", 3000.0)
    found = await one.last_inbound(CHAT)
    assert found is not None and found.message_id == "wamid.C"
    await one.aclose()
    await other.aclose()


async def test_statuses_move_forward_once_whoever_gets_them(
    stores: Callable[[], WhatsAppStore],
) -> None:
    one, other = stores(), stores()
    row = await one.record_sent(sent("wamid.1"))
    assert row.status == "accepted" and row.body == "hello"
    changed = await other.update_status("wamid.1", "sent", None, "")
    assert changed is not None and changed.status == "sent" and changed.session_key == KEY
    assert await one.update_status("wamid.1", "sent", None, "") is None  # Meta sent it again
    assert (await one.update_status("wamid.1", "read", None, "")) is not None
    assert await other.update_status("wamid.1", "delivered", None, "") is None  # out of order
    assert await other.update_status("wamid.1", "failed", 131026, "x") is None  # read stays
    assert await other.update_status("wamid.1", "deleted", None, "") is None  # not tracked
    found = await one.sent("wamid.1")
    assert found is not None and found.status == "read" and found.error_code is None

    # Both replicas get the same callback at once: exactly one of them changes it.
    await one.record_sent(sent("wamid.2"))
    results: list[object] = []

    async def update(store: WhatsAppStore) -> None:
        results.append(await store.update_status("wamid.2", "failed", 131047, "window"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(update, one)
        tg.start_soon(update, other)
    assert sum(r is not None for r in results) == 1


async def test_a_status_that_comes_first_is_returned_when_its_message_is_recorded(
    stores: Callable[[], WhatsAppStore],
) -> None:
    store = stores()
    early = await store.update_status("wamid.3", "failed", 131047, "131047 Re-engagement")
    assert early is not None and not early.recorded
    row = await store.record_sent(sent("wamid.3", body="the text"))
    assert row.status == "failed" and row.error_code == 131047 and row.body == "the text"
    assert row.recorded


async def test_held_replies_are_listed_and_templated_once(
    stores: Callable[[], WhatsAppStore],
) -> None:
    one, other = stores(), stores()
    for part in (0, 1):
        await one.hold(HeldReply("r1", part, CHAT, KEY, f"part {part}", "window", 1000.0 + part))
    await one.hold(HeldReply("r1", 0, CHAT, KEY, "again", "window", 5000.0))  # kept once
    assert [h.text for h in await other.held()] == ["part 1", "part 0"]
    assert await other.held_count() == 2
    assert await one.claim_template("r1") and not await other.claim_template("r1")
    assert await one.held() == []
    # A part held after the template went is not held again: the template covered it.
    await other.hold(HeldReply("r1", 2, CHAT, KEY, "part 2", "131047 later", 3000.0))
    assert await one.held_count() == 0
    # A template that failed puts the reply back, with why.
    await one.hold(HeldReply("r2", 0, CHAT, KEY, "other", "window", 4000.0))
    assert await one.claim_template("r2")
    await one.release_template("r2", "template x: 132001")
    [back] = await other.held()
    assert back.reply_id == "r2" and back.reason == "window; template x: 132001"
