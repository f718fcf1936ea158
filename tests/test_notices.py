"""The notice cooldown the channel adapters share (channels/notices.py)."""

from __future__ import annotations

from channels.notices import NoticeCooldown


def test_one_notice_per_conversation_per_cooldown() -> None:
    notices = NoticeCooldown()
    assert notices.allow("chat:1", 60.0)
    assert not notices.allow("chat:1", 60.0)
    assert notices.allow("chat:2", 60.0)
    assert notices.allow("chat:1", 0.0)  # the cooldown is over


def test_past_its_bound_it_forgets_and_lets_a_notice_through() -> None:
    notices = NoticeCooldown(remember=2)
    for chat in ("a", "b", "c"):
        assert notices.allow(chat, 60.0)
    assert notices.allow("d", 60.0)  # over the bound: everything forgotten
    assert notices.allow("a", 60.0)
