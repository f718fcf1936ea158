"""Subagents (the spawn tool): the real agent loop, sessions on disk and the real openai
client against the fake OpenAI server; background results through the whole daemon
with Telegram (python-telegram-bot against the fake Bot API)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply, content_text
from tests.fakes.telegram_server import FakeTelegram
from tests.test_telegram_e2e import CHAT, gateway, wait_sent

pytestmark = pytest.mark.anyio

ROOT = "cli:boss"


def inbound(text: str, key: str = ROOT) -> InboundMessage:
    return InboundMessage(channel="cli", chat_id="boss", text=text, session_key_override=key)


def messages_of(settings: Settings, key: str) -> list[dict[str, Any]]:
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [e["message"] for e in entries if e["type"] == "message"]


def last(body: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = body["messages"][-1]
    return message


def spawn(task: str, *, background: bool = False) -> FakeToolCall:
    return FakeToolCall("spawn", {"task": task, "background": background})


async def test_spawn_runs_the_task_in_its_own_session_and_returns_the_result(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_tool_call("spawn", {"task": "count to three"})
    fake_openai.add_reply("one, two, three")  # the subagent's answer
    fake_openai.add_reply("My helper counted: one, two, three.")
    settings = make_settings(fake_openai, subagents__enabled=True)
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("please count"))
        keys = [info.key for info in gw.sessions.list_sessions()]
        status = await gw.agent.handle(inbound("/status"))
    finally:
        await gw.aclose()
    assert reply.text == "My helper counted: one, two, three."
    assert "Tools subagents: on (spawn)" in status.text.splitlines()
    [sub] = [k for k in keys if k.startswith(f"{ROOT}:sub:")]
    # The subagent's request: its own session (only the task), the spawn tool offered.
    sub_request = fake_openai.chat_requests[1]
    assert [m["role"] for m in sub_request.messages] == ["system", "user"]
    assert sub_request.last_user_text == "count to three"
    assert "spawn" in [t["function"]["name"] for t in sub_request.tools]
    # The parent's session records the spawn and the result.
    parent = messages_of(settings, ROOT)
    assert [m["role"] for m in parent] == ["user", "assistant", "tool", "assistant"]
    assert parent[1]["tool_calls"][0]["function_name"] == "spawn"
    assert parent[2]["content"] == f"subagent {sub} finished:\none, two, three"
    # The subagent's session is a normal session.
    assert [m["content"] for m in messages_of(settings, sub)] == [
        "count to three",
        "one, two, three",
    ]
    # It shares the memory scope of the conversation it serves.
    assert gw.memory is not None
    assert gw.memory.scope_for(sub) == gw.memory.scope_for(ROOT) == ROOT


async def test_a_model_that_spawns_recursively_stops_at_the_depth_limit(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    def runaway(body: dict[str, Any]) -> Reply | str:
        message = last(body)
        if message["role"] == "tool":
            return f"done ({content_text(message['content'])[:60]})"
        return Reply(tool_calls=(spawn("go one level deeper"),))

    fake_openai.responder = runaway
    settings = make_settings(fake_openai, subagents__enabled=True, subagents__max_depth=2)
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(inbound("start"))
        keys = [info.key for info in gw.sessions.list_sessions()]
        assert gw.subagents is not None
        refused, active = gw.subagents.refused, gw.subagents.active
    finally:
        await gw.aclose()
    assert reply.text.startswith("done (subagent cli:boss:sub:")
    subs = sorted(k for k in keys if k.startswith(f"{ROOT}:sub:"))
    assert len(subs) == 2  # depth 1 and depth 2, nothing deeper
    deepest = max(subs, key=len)
    assert deepest.count(":sub:") == 2
    assert refused == 1 and active == 0
    [refusal] = [m for m in messages_of(settings, deepest) if m["role"] == "tool"]
    assert refusal["content"].startswith("error: subagents may not spawn further subagents")
    assert len(fake_openai.chat_requests) == 6  # 3 spawns asked, 3 answers after a result


async def test_a_subagent_stops_when_its_token_budget_is_spent(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    def endless(body: dict[str, Any]) -> Reply | str:
        message = last(body)
        if body["messages"][1]["content"] == "start":  # the parent
            return (
                "parent done"
                if message["role"] == "tool"
                else Reply(tool_calls=(spawn("work forever"),))
            )
        return Reply(
            tool_calls=(FakeToolCall("current_time"),), prompt_tokens=90, completion_tokens=20
        )

    fake_openai.responder = endless
    settings = make_settings(fake_openai, subagents__enabled=True, subagents__token_budget=200)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("start"))
        keys = [info.key for info in gw.sessions.list_sessions()]
    finally:
        await gw.aclose()
    [sub] = [k for k in keys if k.startswith(f"{ROOT}:sub:")]
    sub_messages = messages_of(settings, sub)
    # Two rounds of 110 tokens reach the budget of 200: the second round's call is not run.
    assert [m["role"] for m in sub_messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert sub_messages[4]["content"] == "error: not run: the token budget (200) is spent"
    ending = "(stopped: the token budget of 200 tokens is spent)"
    assert sub_messages[-1]["content"] == ending
    parent_result = messages_of(settings, ROOT)[2]["content"]
    assert parent_result == f"subagent {sub} finished:\n{ending}"
    assert len(fake_openai.chat_requests) == 4  # parent, 2 subagent rounds, parent


async def test_a_spawn_that_is_a_chat_command_or_empty_is_refused(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_tool_calls([spawn("/new"), FakeToolCall("spawn", {"task": " "})])
    fake_openai.add_reply("ok")
    settings = make_settings(fake_openai, subagents__enabled=True)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(inbound("go"))
        keys = [info.key for info in gw.sessions.list_sessions()]
    finally:
        await gw.aclose()
    results = [m["content"] for m in messages_of(settings, ROOT) if m["role"] == "tool"]
    assert results == [
        "error: a task cannot be a chat command; describe the work in words",
        "error: spawn needs a non-empty 'task' string",
    ]
    assert keys == [ROOT]


@pytest.fixture
async def fake_tg() -> Any:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


async def test_background_subagents_are_capped_and_their_results_reach_the_chat(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    def script(body: dict[str, Any]) -> Reply | str:
        message = last(body)
        text = content_text(message.get("content"))
        if message["role"] == "tool":
            return "I asked my helpers; their findings will follow."
        if text.startswith("[Background subagent"):
            return "Helper report: " + text.split("\n", 2)[1]
        if text.startswith("topic "):
            # Slow enough that all three spawns are asked while two still run.
            return Reply(text=f"all about {text[6:]}", delay=2.0)
        return Reply(tool_calls=tuple(spawn(f"topic {name}", background=True) for name in "ABC"))

    fake_openai.responder = script
    async with gateway(
        make_settings,
        fake_openai,
        fake_tg,
        subagents__enabled=True,
        subagents__max_concurrent=2,
    ) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "research A, B and C"))
        sent = await wait_sent(fake_tg, CHAT, 3, seconds=30)
        subagents = gw.daemon.gateway.subagents
        assert subagents is not None and subagents.refused == 1
    texts = [m["text"] for m in sent]
    assert texts[0] == "I asked my helpers; their findings will follow."
    assert sorted(texts[1:]) == ["Helper report: all about A", "Helper report: all about B"]
    key = f"telegram:{CHAT}"
    parent = messages_of(gw.settings, key)
    results = [m["content"] for m in parent if m["role"] == "tool"]
    assert sum(r.startswith("started subagent") for r in results) == 2
    assert results[2].startswith("error: 2 subagents are running")
    arrived = [m["content"] for m in parent if m["role"] == "user"][1:]
    assert len(arrived) == 2 and all(a.startswith("[Background subagent") for a in arrived)
