"""The agent's half of the delivery promise: a message is stored once, whatever replays.

The user's session entry carries the platform message id; a message the dispatcher
replays after a crash (`META_REPLAYED`) is looked up in the session: found with its
reply, the reply is given again without asking the model; found without one, the turn
goes on without storing the message again; not found, it runs as new. Real sessions on
disk, the real openai client and the fake OpenAI server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.agent.turns import META_STEERED, EarlierTurn, find_turn
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.llm.types import LLMMessage, ToolCall
from gateway.messages import MERGED_IDS_KEY, META_REPLAYED, InboundMessage
from gateway.sessions.entries import MessageEntry
from tests.fakes.openai_server import FakeOpenAI

pytestmark = pytest.mark.anyio

KEY = "telegram:42"


def inbound(text: str, message_id: str, *, replayed: bool = False) -> InboundMessage:
    metadata: dict[str, Any] = {META_REPLAYED: True} if replayed else {}
    return InboundMessage(
        channel="telegram",
        chat_id="42",
        sender_id="42",
        text=text,
        message_id=message_id,
        metadata=metadata,
    )


def stored(settings: Settings) -> list[dict[str, Any]]:
    from gateway.sessions.keys import encode_key

    path = settings.sessions_dir / f"{encode_key(KEY)}.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in lines if e["type"] == "message"]


def entry(role: str, content: str, meta: dict[str, Any] | None = None, **kw: Any) -> MessageEntry:
    return MessageEntry(
        id=f"e{content}",
        parent_id=None,
        timestamp=0.0,
        message=LLMMessage(role, content, **kw),
        meta=meta,
    )


# --------------------------------------------------------------------------- find_turn


def test_find_turn_reads_the_branch() -> None:
    call = ToolCall(id="c1", function_name="current_time")
    branch = [
        entry("user", "a", {"message_id": "42:1"}),
        entry("assistant", "", tool_calls=[call]),
        entry("tool", "noon", tool_call_id="c1", name="current_time"),
        entry("assistant", "it is noon"),
        entry("user", "b", {"message_id": "42:2", MERGED_IDS_KEY: ["42:2", "42:3"]}),
        entry("assistant", "", tool_calls=[call]),
    ]
    assert find_turn(branch, "42:1") == EarlierTurn(
        reply="it is noon", is_latest=True, reply_entry="eit is noon", turn_entry="ea"
    )
    assert find_turn(branch, "42:3") == EarlierTurn(reply=None, is_latest=True, turn_entry="eb")
    assert find_turn(branch, "42:9") is None
    interrupted = [branch[0], entry("user", "c", {"message_id": "42:4"})]
    assert find_turn(interrupted, "42:1") == EarlierTurn(
        reply=None, is_latest=False, turn_entry="ea"
    )
    assert find_turn([entry("user", "x")], "42:1") is None  # no meta: not that message


def test_find_turn_counts_a_message_that_joined_a_turn_as_part_of_it() -> None:
    """A message steered into a running turn neither ends that turn nor starts another:
    the turn's lead and the joined message both find the turn's one reply, and a turn
    cut short after the joined message was stored can still go on, from its lead (the
    turn's first user entry, for both)."""
    call = ToolCall(id="c1", function_name="current_time")
    steered = {"message_id": "42:2", META_STEERED: True}
    branch = [
        entry("user", "a", {"message_id": "42:1"}),
        entry("assistant", "", tool_calls=[call]),
        entry("tool", "noon", tool_call_id="c1", name="current_time"),
        entry("user", "b", steered),
        entry("assistant", "both answered"),
    ]
    answered = EarlierTurn(
        reply="both answered", is_latest=True, reply_entry="eboth answered", turn_entry="ea"
    )
    assert find_turn(branch, "42:1") == answered
    assert find_turn(branch, "42:2") == answered
    cut = branch[:4]  # the crash came after the joined message was stored
    assert find_turn(cut, "42:1") == EarlierTurn(reply=None, is_latest=True, turn_entry="ea")
    assert find_turn(cut, "42:2") == EarlierTurn(reply=None, is_latest=True, turn_entry="ea")
    # A later message of its own (not steered) still ends the earlier turn.
    later = [*cut[:3], entry("user", "c", {"message_id": "42:3"})]
    assert find_turn(later, "42:1") == EarlierTurn(reply=None, is_latest=False, turn_entry="ea")


# --------------------------------------------------------------------------- the agent


async def test_the_user_entry_carries_the_platform_message_id(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("hello", "42:7"))
    finally:
        await gw.aclose()
    user, _assistant = stored(settings)
    assert user["meta"] == {"message_id": "42:7"}


async def test_a_replayed_message_whose_reply_is_stored_is_not_run_again(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("hello", "42:7"))
        before = len(fake_openai.chat_requests)
        again = await gw.agent.handle(inbound("hello", "42:7", replayed=True))
    finally:
        await gw.aclose()
    assert again.text == "echo: hello" and not again.is_error
    assert len(fake_openai.chat_requests) == before  # the model was not asked again
    assert [m["message"]["content"] for m in stored(settings)] == ["hello", "echo: hello"]


async def test_a_replayed_turn_that_never_finished_goes_on_without_a_second_entry(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The crash came after the user's entry (and a tool round) was written: the turn
    goes on from there; the user's message is in the session once."""
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        session = await gw.sessions.aget_or_create(KEY)
        session.add_message(LLMMessage("user", "what time is it?"), {"message_id": "42:8"})
        fake_openai.add_tool_call("current_time")
        fake_openai.add_reply("it is noon")
        reply = await gw.agent.handle(inbound("what time is it?", "42:8", replayed=True))
    finally:
        await gw.aclose()
    assert reply.text == "it is noon"
    roles = [(m["message"]["role"], m["message"].get("content")) for m in stored(settings)]
    assert [r for r, _ in roles].count("user") == 1
    assert roles[0] == ("user", "what time is it?") and roles[-1] == ("assistant", "it is noon")
    # The model saw the user's message once.
    sent = fake_openai.chat_requests[0].messages
    assert [m["content"] for m in sent if m["role"] == "user"] == ["what time is it?"]


async def test_a_replayed_message_the_session_lacks_runs_as_new(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("first time", "42:9", replayed=True))
    finally:
        await gw.aclose()
    assert reply.text == "echo: first time"
    assert [m["message"]["content"] for m in stored(settings)] == ["first time", "echo: first time"]
