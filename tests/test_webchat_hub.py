"""The pages open in one process (channels/webchat/hub.py): no wake-up is lost, news is
bounded, a late reader gets the drafts in progress and who is typing."""

from __future__ import annotations

import anyio
import pytest

from channels.webchat.hub import MAX_NEWS, Hub

pytestmark = pytest.mark.anyio


async def test_a_wake_after_the_reader_took_its_event_is_seen() -> None:
    hub = Hub()
    reader = hub.subscribe("ann")
    changed = reader.take_changed()
    hub.wake("ann")
    with anyio.fail_after(1):
        await changed.wait()
    hub.wake("bob")  # nobody reads Bob's log here: nothing happens
    assert not reader.take_changed().is_set()
    hub.unsubscribe(reader)
    assert len(hub) == 0


async def test_news_is_bounded_and_a_late_reader_catches_up() -> None:
    hub = Hub()
    early = hub.subscribe("ann")
    for n in range(MAX_NEWS + 10):
        hub.notice("ann", "m1", f"notice {n}")
    for n in range(5):
        hub.draft("ann", "m1", f"<p>draft {n}</p>")
    hub.typing("ann", "m1", True)
    items = early.take_news()
    assert len(items) == MAX_NEWS + 1  # the newest notices, then one draft: the latest
    assert items[-1] == {"type": "draft", "reply_to": "m1", "html": "<p>draft 4</p>"}
    late = hub.subscribe("ann")
    news = late.take_news()
    assert {"type": "typing", "message_id": "m1", "on": True} in news
    assert {"type": "draft", "reply_to": "m1", "html": "<p>draft 4</p>"} in news
    hub.draft_done("ann", "m1")
    hub.typing("ann", "m1", False)
    assert [i["type"] for i in hub.subscribe("ann").take_news()] == []
