"""/stop: the whole daemon with Telegram (the real python-telegram-bot against the fake
Bot API, the real openai client against the fake OpenAI server). /stop cancels the
running turn at once, records what was said so far, answers that it stopped, and the
messages queued behind the stopped turn still run."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from gateway.agent.loop import STOP_DONE_TEXT, STOP_IDLE_TEXT, STOPPED_EMPTY_TEXT
from gateway.agent.loop import STOPPED_TOOL_RESULT as STOPPED_RESULT
from gateway.agent.tools import Tool, ToolContext
from gateway.config import Settings
from gateway.llm.types import ToolSpec
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI, Reply
from tests.fakes.telegram_server import FakeTelegram
from tests.test_telegram_e2e import CHAT, gateway, wait_sent

pytestmark = pytest.mark.anyio

KEY = f"telegram:{CHAT}"


@pytest.fixture
async def fake_tg() -> Any:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


def stored_messages(settings: Settings, key: str = KEY) -> list[dict[str, Any]]:
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in entries if e["type"] == "message"]


class SlowTool:
    """A tool that runs until cancelled (or a minute), and says what happened to it."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.cancelled = False

    async def handler(self, args: dict[str, Any], context: ToolContext) -> str:
        self.started.set()
        try:
            await anyio.sleep(60)
        except BaseException:
            self.cancelled = True
            raise
        return "slow result"

    @property
    def tool(self) -> Tool:
        spec = ToolSpec(
            name="slow_lookup",
            description="A lookup that takes long.",
            parameters={"type": "object", "properties": {}},
        )
        return Tool(spec, self.handler, timeout=120)


async def test_stop_during_a_slow_tool_cancels_it_and_the_queued_message_still_runs(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    slow = SlowTool()
    fake_openai.add_tool_call("slow_lookup", {}, text="Looking it up.")
    async with gateway(make_settings, fake_openai, fake_tg) as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        fake_tg.push_update(fake_tg.user_message(CHAT, "and then this"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "/stop"))
        sent = await wait_sent(fake_tg, CHAT, 3, seconds=20)
    texts = [m["text"] for m in sent]
    # /stop is answered on arrival, before the turn it stopped and the queued message.
    assert texts[0] == STOP_DONE_TEXT
    assert texts[1] == STOPPED_EMPTY_TEXT  # "Looking it up." is stored with its call
    assert texts[2] == "echo: and then this"
    assert slow.cancelled
    messages = [e["message"] for e in stored_messages(gw.settings)]
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert messages[1]["tool_calls"][0]["function_name"] == "slow_lookup"
    # The cut call keeps its result: the transcript never holds an unanswered call.
    assert messages[2]["content"] == STOPPED_RESULT
    assert messages[3]["content"] == texts[1]
    stopped_entry = stored_messages(gw.settings)[3]
    assert stopped_entry["meta"]["stopped"] is True
    # /stop itself never reached the model, and is not in the session.
    assert all("/stop" not in (r.last_user_text or "") for r in fake_openai.chat_requests)
    assert len(fake_openai.chat_requests) == 2  # the tool call, then "and then this"


async def test_stop_during_a_streaming_answer_keeps_what_was_said(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    words = " ".join(f"word{i}" for i in range(400))
    fake_openai.add(Reply(text=words, chunk_delay=0.05))
    async with gateway(
        make_settings,
        fake_openai,
        fake_tg,
        llm__stream=True,
        channels__telegram__streaming=True,
    ) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "talk a lot"))
        [preview] = await wait_sent(fake_tg, CHAT, 1, seconds=20)  # the streamed preview
        assert preview["text"].startswith("word0 word1")
        fake_tg.push_update(fake_tg.user_message(CHAT, "/stop"))
        with anyio.fail_after(20):
            while not any(m["text"] == STOP_DONE_TEXT for m in fake_tg.sent_messages(CHAT)):  # noqa: ASYNC110
                await anyio.sleep(0.05)
            while len(stored_messages(gw.settings)) < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    stored = stored_messages(gw.settings)
    answer = stored[1]["message"]["content"]
    assert stored[1]["meta"]["stopped"] is True
    assert answer.startswith(preview["text"]) and answer.endswith("(stopped)")
    said = answer.removesuffix("(stopped)").strip()
    assert words.startswith(said) and len(said) < len(words)
    # The chat shows the same text the session keeps (the preview edited a last time).
    assert any(m["text"] == answer for m in fake_tg.sent_messages(CHAT))


async def test_stop_with_nothing_running_says_so_and_stores_nothing(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    async with gateway(make_settings, fake_openai, fake_tg) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "/stop"))
        [reply] = await wait_sent(fake_tg, CHAT, 1)
        fake_tg.push_update(fake_tg.user_message(CHAT, "hello"))
        await wait_sent(fake_tg, CHAT, 2)
    assert reply["text"] == STOP_IDLE_TEXT
    assert [e["message"]["content"] for e in stored_messages(gw.settings)] == [
        "hello",
        "echo: hello",
    ]
    assert fake_openai.chat_requests[-1].last_user_text == "hello"


async def test_a_stranger_cannot_stop_someone_elses_turn(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    slow = SlowTool()
    fake_openai.add_tool_call("slow_lookup", {})
    owner, stranger = 111, 222
    group = -100555
    async with gateway(
        make_settings,
        fake_openai,
        fake_tg,
        channels__telegram__group_policy="allowlist",
        channels__telegram__require_mention="false",
        channels__telegram__allow_from=f'["{owner}"]',
    ) as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(
            fake_tg.user_message(group, "look it up", chat_type="supergroup", user_id=owner)
        )
        with anyio.fail_after(20):
            await slow.started.wait()
        fake_tg.push_update(
            fake_tg.user_message(group, "/stop", chat_type="supergroup", user_id=stranger)
        )
        dispatcher = gw.daemon.dispatcher
        with anyio.fail_after(20):
            while dispatcher.stats().ignored + dispatcher.stats().denied < 1:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert not slow.cancelled
        assert gw.daemon.gateway.agent.stop(f"telegram:{group}")  # the turn still runs
        await wait_sent(fake_tg, group, 1)
    assert STOP_DONE_TEXT not in [m["text"] for m in fake_tg.sent_messages(group)]


# -- a model server still busy with what was stopped -------------------------------------


async def test_stop_closes_the_model_request_and_the_next_turn_says_the_server_is_busy(
    make_settings: Callable[..., Settings],
) -> None:
    """A server that works one request at a time and finishes one whose client went away
    (llama-cpp-python's, docs/real-llm.md row 9) keeps the next turn waiting after /stop:
    the stopped request's connection is closed (a server that stops on disconnect
    stops), and the person is told once why the next answer is slow; a turn with the
    server free again is told nothing."""
    from gateway.agent.loop import MODEL_BUSY_TEXT
    from gateway.daemon import Gateway
    from gateway.messages import InboundMessage

    async with FakeOpenAI(one_at_a_time=True) as fake:
        gw = Gateway.build(make_settings(fake))
        gw.agent.busy_notice_after = 0.3
        notices: list[str] = []

        async def note(text: str) -> None:
            notices.append(text)

        def said(text: str) -> InboundMessage:
            return InboundMessage(channel="cli", chat_id="direct", sender_id="me", text=text)

        try:
            fake.add(Reply(text="a long answer", delay=2.0))
            replies = []
            async with anyio.create_task_group() as tg:

                async def first() -> None:
                    replies.append(await gw.agent.handle(said("tell me everything")))

                tg.start_soon(first)
                with anyio.fail_after(5):
                    await fake.wait_for_requests_async(1)
                assert gw.agent.stop("cli:direct")
            assert replies[0].metadata.get("stopped")
            with anyio.fail_after(2):
                await fake.wait_disconnected_async(1)  # the connection was closed
            started = anyio.current_time()
            second = await gw.agent.handle(said("and now?"), on_notice=note)
            assert second.text == "echo: and now?"
            assert anyio.current_time() - started >= 1.0  # it waited for the long one
            assert notices == [MODEL_BUSY_TEXT]
            third = await gw.agent.handle(said("quick one"), on_notice=note)
            assert third.text == "echo: quick one" and notices == [MODEL_BUSY_TEXT]
        finally:
            await gw.aclose()
