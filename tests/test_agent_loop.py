"""The agent loop end to end in-process: real sessions on disk, the real openai client,
the fake OpenAI server. Nothing of ours is mocked."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply

pytestmark = pytest.mark.anyio


def inbound(text: str, key: str = "cli:test") -> InboundMessage:
    return InboundMessage(channel="cli", chat_id="test", text=text, session_key_override=key)


def file_messages(path: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [e["message"] for e in lines if e["type"] == "message"]


def session_path(settings: Settings, key: str) -> Path:
    from gateway.sessions.keys import encode_key

    return settings.sessions_dir / f"{encode_key(key)}.jsonl"


@pytest.mark.parametrize("io", ["loop", "threads"])
async def test_turn_is_persisted_and_carried_into_the_next(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], io: str
) -> None:
    settings = make_settings(fake_openai, workspace_io=io)
    gw = Gateway.build(settings)
    assert gw.agent.sessions.io_on_loop is (io == "loop")
    try:
        first = await gw.agent.handle(inbound("my name is Ada"))
        assert first.text == "echo: my name is Ada" and not first.is_error
        await gw.agent.handle(inbound("what is my name?"))
    finally:
        await gw.aclose()
    sent = fake_openai.chat_requests[-1].messages
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1]["content"] == "my name is Ada"
    stored = file_messages(session_path(settings, "cli:test"))
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[1]["usage"]["total_tokens"] > 0 and stored[1]["model"] == "gpt-4o-mini"


async def test_user_message_is_on_disk_before_the_model_is_called(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    path = session_path(settings, "cli:test")
    seen_on_disk: list[list[str]] = []

    def responder(body: dict[str, Any]) -> str:
        seen_on_disk.append([m["content"] for m in file_messages(path)])
        return "ok"

    fake_openai.responder = responder
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("remember this"))
    finally:
        await gw.aclose()
    assert seen_on_disk == [["remember this"]]


async def test_llm_failure_keeps_the_message_and_tells_the_user(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    fake_openai.fail_model("gpt-4o-mini", status=500, message="boom")
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("are you there?"))
    finally:
        await gw.aclose()
    assert reply.is_error and "boom" not in reply.text and reply.text
    assert file_messages(session_path(settings, "cli:test")) == [
        {"role": "user", "content": "are you there?"}
    ]


def store_of(gw: Gateway, key: str = "cli:test") -> Any:
    session = gw.agent.sessions.cached(key)
    assert session is not None
    return session._store


def assert_settled(gw: Gateway) -> None:
    """Nothing of the session waits for a round: every line it wrote is durable."""
    store = store_of(gw)
    assert not store.unsettled and not store._handle.dirty


async def test_a_turn_makes_question_and_reply_durable_in_one_round(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """Cost: under fsync="batch" the user's message rides the reply's group commit (one
    round a turn, not two); promise: both are durable when the reply is given."""
    settings = make_settings(fake_openai)
    assert settings.sessions.fsync == "batch"
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("first"))  # the file is made
        committer = gw.agent.sessions._async_committer
        rounds = committer.rounds
        for n in range(3):
            reply = await gw.agent.handle(inbound(f"question {n}"))
            assert not reply.is_error
            assert_settled(gw)
        assert committer.rounds == rounds + 3
    finally:
        await gw.aclose()


async def test_a_failed_turn_makes_the_message_durable_before_its_answer(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """Promise: an LLM failure stores nothing after the user's message; the message is
    made durable before the error reply is given all the same."""
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("first"))
        committer = gw.agent.sessions._async_committer
        rounds = committer.rounds
        fake_openai.fail_model("gpt-4o-mini", status=500, message="boom")
        reply = await gw.agent.handle(inbound("are you there?"))
        assert reply.is_error
        assert_settled(gw)
        assert committer.rounds == rounds + 1
    finally:
        await gw.aclose()


async def test_a_message_the_disk_will_not_take_is_answered_so_not_raised(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed turn settles the user's message before its answer; when the disk refuses
    that (the commit log's fsync fails), the person is told the conversation could not
    be saved, as for any storage failure, and `handle` does not raise."""
    from gateway.sessions import commitlog

    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("first"))
        fake_openai.fail_model("gpt-4o-mini", status=500, message="boom")

        def refuse(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(commitlog, "_datasync", refuse)
        reply = await gw.agent.handle(inbound("are you there?"))
        monkeypatch.undo()
        assert reply.is_error and "could not save this conversation" in reply.text
    finally:
        await gw.aclose()


async def test_a_cancelled_turn_makes_the_message_durable(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """A turn cancelled while the model is asked (a shutdown) leaves the user's message
    durable, not only in the file."""
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("first"))
        fake_openai.hold(lambda body: True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(gw.agent.handle, inbound("never answered"))
            await fake_openai.wait_held_async()
            store = store_of(gw)
            assert store.unsettled  # in the file, waiting for the turn's next round
            tg.cancel_scope.cancel()
        assert_settled(gw)
        fake_openai.release()
    finally:
        await gw.aclose()
    stored = [m["content"] for m in file_messages(session_path(settings, "cli:test"))]
    assert stored[-1] == "never answered"


async def test_tool_loop_persists_calls_and_results(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    fake_openai.add_tool_call("current_time", {}, call_id="call_1")
    fake_openai.add_reply("It is now.")
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("what time is it?"))
    finally:
        await gw.aclose()
    assert reply.text == "It is now."
    offered = [tool["function"]["name"] for tool in fake_openai.chat_requests[0].tools]
    assert "current_time" in offered
    second = fake_openai.chat_requests[1].messages
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == "call_1"
    assert "T" in second[-1]["content"]  # an ISO timestamp from the real tool
    roles = [m["role"] for m in file_messages(session_path(settings, "cli:test"))]
    assert roles == ["user", "assistant", "tool", "assistant"]


async def test_tool_loop_is_bounded(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, agent__max_tool_iterations=2)

    def always_call_a_tool(body: dict[str, Any]) -> Reply | str:
        if not body.get("tools"):
            return "final answer"
        return Reply(tool_calls=(FakeToolCall("current_time", {}),))

    fake_openai.responder = always_call_a_tool
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("loop forever"))
    finally:
        await gw.aclose()
    assert reply.text == "final answer"
    requests = fake_openai.chat_requests
    assert len(requests) == 3 and not requests[-1].tools


async def test_interrupted_tool_call_on_disk_is_repaired_for_the_model(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    from gateway.llm import LLMMessage, ToolCall

    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        session = gw.sessions.get_or_create("cli:test")
        session.add_message(LLMMessage(role="user", content="do it"))
        # A crash after the assistant asked for a tool, before the result was written:
        session.add_message(
            LLMMessage(role="assistant", tool_calls=[ToolCall("lost", "current_time", {})])
        )
        reply = await gw.agent.handle(inbound("hello again"))
    finally:
        await gw.aclose()
    # The fake answers 400 to an unanswered tool call, so a normal reply proves the repair.
    assert not reply.is_error, reply.text
    sent = fake_openai.last_request.messages
    assert sent[-2]["role"] == "tool" and sent[-2]["tool_call_id"] == "lost"


async def test_model_switch_is_recorded_and_survives_restart(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("/model other-model"))
        assert "other-model" in reply.text
    finally:
        await gw.aclose()
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("hi"))
        status = await gw.agent.handle(inbound("/status"))
    finally:
        await gw.aclose()
    assert fake_openai.last_request.model == "other-model"
    assert "other-model" in status.text and "cli:test" in status.text
    assert (
        "Tools builtin: on (conversation_search, current_time, history_search, memory_correct, "
        "memory_facts, memory_forget, memory_search, remember)"
    ) in status.text
    types = [
        json.loads(x)["type"] for x in session_path(settings, "cli:test").read_text().splitlines()
    ]
    assert "model_change" in types


async def test_model_switch_needs_an_owner_outside_the_terminal(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, agent__owners='["telegram:42"]')
    gw = Gateway.build(settings)
    try:
        stranger = InboundMessage(channel="telegram", chat_id="7", sender_id="7", text="/model x")
        owner = InboundMessage(channel="telegram", chat_id="42", sender_id="42", text="/model x")
        assert (await gw.agent.handle(stranger)).is_error
        assert not (await gw.agent.handle(owner)).is_error
    finally:
        await gw.aclose()


async def test_new_starts_fresh_and_keeps_the_old_file(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("first conversation"))
        await gw.agent.handle(inbound("/new"))
        await gw.agent.handle(inbound("second conversation"))
    finally:
        await gw.aclose()
    sent = fake_openai.last_request.messages
    assert [m["content"] for m in sent if m["role"] == "user"] == ["second conversation"]
    archived = list((settings.sessions_dir / "archive").rglob("*.jsonl"))
    assert len(archived) == 1 and "first conversation" in archived[0].read_text()


async def test_recent_window_bounds_the_request(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, agent__memory_window=4, memory__auto_consolidate="false")
    gw = Gateway.build(settings)
    try:
        for i in range(12):
            await gw.agent.handle(inbound(f"message {i}"))
    finally:
        await gw.aclose()
    sent = fake_openai.last_request.messages
    assert sent[0]["role"] == "system"
    assert len(sent) == 1 + 4 + 1
    assert sent[-1]["content"] == "message 11"


async def test_bad_input_gets_a_clear_reply_and_no_model_call(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, agent__max_message_chars=1000)
    gw = Gateway.build(settings)
    try:
        too_long = await gw.agent.handle(inbound("x" * 5000))
        empty = await gw.agent.handle(inbound(" \x00\x01 "))
        binary = await gw.agent.handle(inbound("bin\x00ary\udcff"))
    finally:
        await gw.aclose()
    assert too_long.is_error and "too long" in too_long.text
    assert empty.is_error
    assert not binary.is_error
    assert len(fake_openai.chat_requests) == 1
    assert fake_openai.last_request.messages[-1]["content"] == "binary\ufffd"


async def test_turns_of_one_session_run_in_order(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    fake_openai.add_delay(0.3, "slow first")
    gw = Gateway.build(settings)
    replies: list[str] = []
    try:

        async def send(text: str) -> None:
            replies.append((await gw.agent.handle(inbound(text))).text)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send, "one")
            await anyio.sleep(0.05)
            tg.start_soon(send, "two")
    finally:
        await gw.aclose()
    assert replies == ["slow first", "echo: two"]
    stored = file_messages(session_path(settings, "cli:test"))
    assert [m["content"] for m in stored] == ["one", "slow first", "two", "echo: two"]


async def test_streaming_reply_arrives_in_pieces(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, llm__stream="true")
    fake_openai.add_reply("a streamed answer in several pieces")
    gw = Gateway.build(settings)
    pieces: list[str] = []

    async def on_delta(text: str) -> None:
        pieces.append(text)

    try:
        reply = await gw.agent.handle(inbound("stream please"), on_delta=on_delta)
    finally:
        await gw.aclose()
    assert len(pieces) > 1 and "".join(pieces) == reply.text
    assert fake_openai.last_request.stream


async def test_hostile_session_key_gets_a_reply_not_an_exception(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("hi", key="telegram:" + "9" * 400))
        traversal = await gw.agent.handle(inbound("hi", key="../../etc/passwd"))
    finally:
        await gw.aclose()
    assert reply.is_error and "cannot be stored" in reply.text
    assert not traversal.is_error
    assert fake_openai.chat_requests and len(fake_openai.chat_requests) == 1
    assert [p.parent for p in settings.sessions_dir.rglob("*.jsonl")] == [settings.sessions_dir]
