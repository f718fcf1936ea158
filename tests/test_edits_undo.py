"""Edits and /undo as branches of the session tree: the agent with real sessions on disk
and the real openai client against the fake server; the session stores' side in both
stores (files, PostgreSQL); and the whole daemon with the fake Telegram and Slack."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.agent.rewind import (
    NOTHING_TO_UNDO_TEXT,
    OLD_EDIT_TEXT,
    branch_for_edit,
    plan_edit,
    undo_last_exchange,
)
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import META_EDIT_OF, InboundMessage
from gateway.sessions import LeafEntry, SessionManager
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram
from tests.llm_messages import assistant, user
from tests.test_session_store_conformance import OpenManager, open_manager  # noqa: F401
from tests.test_slack_daemon import event, fake_slack, posts, slack_gateway  # noqa: F401
from tests.test_telegram_e2e import fake_tg, gateway, wait_sent  # noqa: F401

pytestmark = pytest.mark.anyio

KEY = "telegram:42"


def said(text: str, number: int) -> InboundMessage:
    return InboundMessage(channel="telegram", chat_id="42", text=text, message_id=f"42:{number}")


def edit(text: str, number: int, version: int = 1) -> InboundMessage:
    return InboundMessage(
        channel="telegram",
        chat_id="42",
        text=text,
        message_id=f"42:{number}:edit:{version}",
        metadata={META_EDIT_OF: f"42:{number}"},
    )


def stored(settings: Settings, key: str = KEY) -> list[dict[str, Any]]:
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def texts_sent(fake: FakeOpenAI) -> list[str]:
    return [str(m["content"]) for m in fake.chat_requests[-1].messages[1:]]


async def test_an_edit_of_the_latest_message_reruns_the_turn_as_a_new_branch(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(said("I live in Paris", 1))
        await gw.agent.handle(said("whats 2+3", 2))
        reply = await gw.agent.handle(edit("what's 2+2", 2))
        assert reply.text == "echo: what's 2+2" and not reply.is_error
        # The model saw the edited text in place of the old one, not after it.
        assert texts_sent(fake_openai) == ["I live in Paris", "echo: I live in Paris", "what's 2+2"]
        # Edited again: the new branch's message answers to the same platform message.
        await gw.agent.handle(edit("what's 2+2?", 2, version=2))
        assert texts_sent(fake_openai)[-1] == "what's 2+2?"
        follow = await gw.agent.handle(said("thanks", 3))
        assert not follow.is_error
        assert texts_sent(fake_openai) == [
            "I live in Paris",
            "echo: I live in Paris",
            "what's 2+2?",
            "echo: what's 2+2?",
            "thanks",
        ]
    finally:
        await gw.aclose()
    lines = stored(settings)
    # Nothing was removed: both old branches are still in the file, and two `leaf`
    # entries record the moves.
    contents = [e["message"]["content"] for e in lines if e["type"] == "message"]
    assert "whats 2+3" in contents and "echo: whats 2+3" in contents
    assert "what's 2+2" in contents and "echo: what's 2+2" in contents
    assert [e["type"] for e in lines].count("leaf") == 2
    first_user = next(
        e for e in lines if e["type"] == "message" and e["message"]["content"] == "I live in Paris"
    )
    reply_to_it = next(e for e in lines if e.get("parent_id") == first_user["id"])
    # Every version of message 2 hangs off the answer to message 1.
    versions = [e for e in lines if e["type"] == "message" and e["parent_id"] == reply_to_it["id"]]
    assert [v["message"]["content"] for v in versions] == ["whats 2+3", "what's 2+2", "what's 2+2?"]
    assert [v["meta"].get("post_id", v["meta"]["message_id"]) for v in versions] == ["42:2"] * 3


async def test_an_edit_of_an_older_message_gets_a_short_answer_and_changes_nothing(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(said("first", 1))
        await gw.agent.handle(said("second", 2))
        calls = len(fake_openai.chat_requests)
        reply = await gw.agent.handle(edit("first, changed", 1))
        unknown = await gw.agent.handle(edit("never seen", 99))
        assert reply.text == OLD_EDIT_TEXT == unknown.text
        assert len(fake_openai.chat_requests) == calls  # the model was not asked
        session = gw.agent.sessions.get_or_create(KEY)
        assert [m.content for m in session.messages] == [
            "first",
            "echo: first",
            "second",
            "echo: second",
        ]
    finally:
        await gw.aclose()
    assert not any(e["type"] == "leaf" for e in stored(settings))


async def test_undo_moves_the_leaf_back_one_exchange_and_keeps_it_on_disk(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(said("keep me", 1))
        await gw.agent.handle(said("a mistake", 2))
        undone = await gw.agent.handle(said("/undo", 3))
        assert not undone.is_error and '"a mistake"' in undone.text
        await gw.agent.handle(said("what now", 4))
        assert texts_sent(fake_openai) == ["keep me", "echo: keep me", "what now"]
        await gw.agent.handle(said("/undo", 5))
        await gw.agent.handle(said("/undo", 6))
        empty = await gw.agent.handle(said("/undo", 7))
        assert empty.is_error and empty.text == NOTHING_TO_UNDO_TEXT
        assert gw.agent.sessions.get_or_create(KEY).messages == []
    finally:
        await gw.aclose()
    lines = stored(settings)
    assert [e["type"] for e in lines].count("leaf") == 3
    contents = [e["message"]["content"] for e in lines if e["type"] == "message"]
    assert contents == [
        "keep me",
        "echo: keep me",
        "a mistake",
        "echo: a mistake",
        "what now",
        "echo: what now",
    ]


async def test_undo_of_a_message_that_got_no_answer_does_not_claim_one(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The model failed, so the message has no answer: /undo takes back the message and
    says only that (it must not say "and my answer")."""
    gw = Gateway.build(make_settings(fake_openai))
    try:
        answered = await gw.agent.handle(said("first", 1))
        assert not answered.is_error
        fake_openai.add_error(500)
        failed = await gw.agent.handle(said("lost one", 2))
        assert failed.is_error
        undone = await gw.agent.handle(said("/undo", 3))
        assert '"lost one"' in undone.text and "no answer" in undone.text
        assert "my answer" not in undone.text
        again = await gw.agent.handle(said("/undo", 4))
        assert '"first"' in again.text and "and my answer" in again.text
    finally:
        await gw.aclose()


# --------------------------------------------------------------------------- stores


def _exchange(manager: SessionManager, number: int, text: str) -> None:
    session = manager.get_or_create(KEY)
    session.add_message(user(text), {"message_id": f"42:{number}"})
    session.add_message(assistant(f"echo: {text}"))


def test_edit_and_undo_branches_survive_a_reload_in_every_store(
    open_manager: OpenManager,  # noqa: F811
) -> None:
    first = open_manager()
    _exchange(first, 1, "one")
    _exchange(first, 2, "two")
    session = first.get_or_create(KEY)
    plan = branch_for_edit(session, "42:2")
    assert plan.rerun and plan.branched_from == session.leaf_id
    session.add_message(user("two, edited"), {"message_id": "42:2:edit:1", "post_id": "42:2"})
    session.add_message(assistant("echo: two, edited"))
    assert not branch_for_edit(session, "42:1").rerun  # not the latest: no move
    again = open_manager().get(KEY)
    assert again is not None and again.leaf_id == session.leaf_id
    assert [m.content for m in again.messages] == [
        "one",
        "echo: one",
        "two, edited",
        "echo: two, edited",
    ]
    assert sum(isinstance(e, LeafEntry) for e in again.entries) == 1
    undone = undo_last_exchange(again)
    assert undone is not None and undone.message.content == "two, edited"
    third = open_manager().get(KEY)
    assert third is not None
    assert [m.content for m in third.messages] == ["one", "echo: one"]
    # Every message ever written is still there.
    assert len([e for e in third.entries if e.type == "message"]) == 6


def test_an_edit_interrupted_after_its_leaf_entry_goes_on_without_moving_again(
    open_manager: OpenManager,  # noqa: F811
) -> None:
    manager = open_manager()
    _exchange(manager, 1, "one")
    session = manager.get_or_create(KEY)
    assert branch_for_edit(session, "42:1").rerun
    # A crash here: the leaf moved, the edited message was never appended.
    reopened = open_manager().get(KEY)
    assert reopened is not None and reopened.leaf_id is None
    plan = plan_edit(reopened.get_branch(), reopened.entries, reopened.leaf_id, "42:1")
    assert plan.rerun and plan.branched_from is None
    branch_for_edit(reopened, "42:1")
    assert sum(isinstance(e, LeafEntry) for e in reopened.entries) == 1


# --------------------------------------------------------------------------- daemon


async def test_telegram_edit_reruns_and_an_old_edit_is_told_through_the_daemon(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,  # noqa: F811
    make_settings: Callable[..., Settings],
) -> None:
    chat = 4242
    async with gateway(make_settings, fake_openai, fake_tg):
        first = fake_tg.push_update(fake_tg.user_message(chat, "helo"))
        await wait_sent(fake_tg, chat, 1)
        second = fake_tg.push_update(fake_tg.user_message(chat, "whats 2+3"))
        await wait_sent(fake_tg, chat, 2)
        fake_tg.push_update(fake_tg.edited_message(second, "what's 2+2"))
        await wait_sent(fake_tg, chat, 3)
        fake_tg.push_update(fake_tg.edited_message(first, "hello"))
        await wait_sent(fake_tg, chat, 4)
        fake_tg.push_update(fake_tg.user_message(chat, "/undo"))
        await wait_sent(fake_tg, chat, 5)
    replies = [m["text"] for m in fake_tg.sent_messages(chat)]
    assert replies[:4] == ["echo: helo", "echo: whats 2+3", "echo: what's 2+2", OLD_EDIT_TEXT]
    assert replies[4].startswith('Undone: your message "what\'s 2+2"')
    assert [m["content"] for m in fake_openai.chat_requests[-1].messages[1:]] == [
        "helo",
        "echo: helo",
        "what's 2+2",
    ]


async def test_slack_dm_edit_reruns_and_an_unfurl_does_not(
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
    fake_slack: FakeSlack,  # noqa: F811
) -> None:
    alice = "U0ALICE001"
    async with slack_gateway(make_settings, fake_openai, fake_slack):
        original = fake_slack.dm_message(alice, "see https://example.org about 2+3")
        await event(fake_slack, original)
        await posts(fake_slack, 1)
        # Slack adds the link preview with a message_changed of the same text.
        await event(fake_slack, fake_slack.message_changed(original, original["event"]["text"]))
        await event(
            fake_slack, fake_slack.message_changed(original, "see https://example.org about 2+2")
        )
        [_, rerun] = await posts(fake_slack, 2)
    assert rerun.params["text"] == "echo: see https://example.org about 2+2"
    assert len(fake_openai.chat_requests) == 2
    assert [m["content"] for m in fake_openai.chat_requests[-1].messages[1:]] == [
        "see https://example.org about 2+2"
    ]
