"""Messages that arrive while a turn runs (`gateway.dispatch.queue_modes`): the whole daemon with
Telegram (the real python-telegram-bot against the fake Bot API, the real openai client
against the fake OpenAI server), a slow model or a slow tool keeping the turn busy.

- steer: the new message joins the running turn after its tool calls, stored once after
  their results, seen by the model at its next call, answered by the turn's one reply
  and marked answered in the journal; one arriving during the final answer is the next
  turn;
- interrupt: the running turn stops as /stop stops it, the next one starts with the new
  message and everything said before;
- `/queue MODE` is kept in the session (a restart keeps it), `[dispatch] channel_modes`
  gives a channel's default;
- a crash replay of a turn a message joined neither runs that message as a new turn nor
  loses it, and sends the turn's reply once;
- however many messages join a turn, every request of the turn holds all of them and
  the turn's own message (the context's window never cuts into the running turn), also
  when a replay goes on with the turn.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from gateway.agent.loop import STOPPED_EMPTY_TEXT
from gateway.agent.tools import Tool, ToolContext
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.dispatch.dispatcher import Dispatcher
from gateway.journal.protocol import dedupe_key
from gateway.journal.store import FileDedupeStore
from gateway.llm.types import LLMMessage, ToolCall, ToolSpec
from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply
from tests.fakes.telegram_server import FakeTelegram
from tests.test_telegram_e2e import CHAT, gateway, wait_sent

pytestmark = pytest.mark.anyio

KEY = f"telegram:{CHAT}"


@pytest.fixture
async def fake_tg() -> Any:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


def stored(settings: Settings, key: str = KEY) -> list[dict[str, Any]]:
    """The message entries of `key`'s session file."""
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [e for e in entries if e["type"] == "message"]


class GatedTool:
    """A tool that runs until the test lets it finish (`release`)."""

    def __init__(self, name: str = "slow_lookup") -> None:
        self.name = name
        self.started = anyio.Event()
        self.release = anyio.Event()

    async def handler(self, args: dict[str, Any], context: ToolContext) -> str:
        self.started.set()
        await self.release.wait()
        return "slow result"

    @property
    def tool(self) -> Tool:
        spec = ToolSpec(
            name=self.name,
            description="A lookup that takes long.",
            parameters={"type": "object", "properties": {}},
        )
        return Tool(spec, self.handler, timeout=120)


async def wait_queued(daemon: Daemon, count: int = 1) -> None:
    """Until `count` messages wait in the dispatcher's lanes (taken in, checked)."""
    with anyio.fail_after(10):
        while daemon.dispatcher.stats().queued_total < count:  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def unanswered(daemon: Daemon) -> list[str]:
    """The journal's messages not marked answered (their texts)."""
    return [entry.message.text for entry in await daemon.dedupe.unanswered()]


# -- steer ---------------------------------------------------------------------------------


async def test_steer_a_message_joins_the_turn_after_its_tool_calls(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {}, text="Looking it up.")
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="steer") as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        fake_tg.push_update(fake_tg.user_message(CHAT, "and in Paris too"))
        await wait_queued(gw.daemon)  # it waits behind the turn, its tool still running
        slow.release.set()
        [reply] = await wait_sent(fake_tg, CHAT, 1, seconds=20)
        await anyio.sleep(0.3)  # a second reply would come now
        assert len(fake_tg.sent_messages(CHAT)) == 1
        left = await unanswered(gw.daemon)
        stats = gw.daemon.dispatcher.stats()
    # One reply, to the first message, from a model that saw the second one.
    assert reply["text"] == "echo: and in Paris too"
    assert stats.steered_messages == 1 and stats.turns_started == 1
    assert left == []  # both marked answered by that reply
    entries = stored(gw.settings)
    roles = [e["message"]["role"] for e in entries]
    assert roles == ["user", "assistant", "tool", "user", "assistant"]
    joined = entries[3]
    assert joined["message"]["content"] == "and in Paris too"
    assert joined["meta"]["steered"] is True and joined["meta"]["message_id"]
    assert joined["meta"]["message_id"] != entries[0]["meta"]["message_id"]
    # The model's second call saw the tool's result, then the joined message.
    second = fake_openai.chat_requests[1].messages
    assert [m["role"] for m in second[-2:]] == ["tool", "user"]
    assert second[-1]["content"] == "and in Paris too"
    assert len(fake_openai.chat_requests) == 2


async def test_steer_a_message_sent_during_the_final_answer_is_the_next_turn(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add(Reply(text="the first answer", delay=1.0))
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="steer") as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "first"))
        with anyio.fail_after(10):
            await fake_openai.wait_for_requests_async(1)
        fake_tg.push_update(fake_tg.user_message(CHAT, "second"))
        sent = await wait_sent(fake_tg, CHAT, 2, seconds=20)
        stats = gw.daemon.dispatcher.stats()
    assert [m["text"] for m in sent] == ["the first answer", "echo: second"]
    assert stats.steered_messages == 0 and stats.turns_started == 2
    assert [e["message"]["content"] for e in stored(gw.settings)] == [
        "first",
        "the first answer",
        "second",
        "echo: second",
    ]


async def test_steer_keeps_order_a_command_waits_and_what_follows_it_too(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    """Only messages that would run as plain turns join: a command does not, and a
    message behind it stays behind it."""
    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {})
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="steer") as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        for text in ("joins", "/help", "after the command"):
            fake_tg.push_update(fake_tg.user_message(CHAT, text))
        await wait_queued(gw.daemon, 3)
        slow.release.set()
        sent = await wait_sent(fake_tg, CHAT, 3, seconds=20)
    texts = [m["text"] for m in sent]
    assert texts[0] == "echo: joins"
    assert texts[1].startswith("Commands:")
    assert texts[2] == "echo: after the command"
    contents = [e["message"].get("content") for e in stored(gw.settings)]
    assert contents.count("joins") == 1 and contents.index("joins") < contents.index(
        "after the command"
    )


async def test_steer_with_streaming_the_turn_is_still_one_reply(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {}, text="Looking it up.")
    async with gateway(
        make_settings,
        fake_openai,
        fake_tg,
        dispatch__mode="steer",
        llm__stream=True,
        channels__telegram__streaming=True,
    ) as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        fake_tg.push_update(fake_tg.user_message(CHAT, "and in Paris too"))
        await wait_queued(gw.daemon)
        slow.release.set()
        with anyio.fail_after(20):
            while not any(  # noqa: ASYNC110
                m["text"] == "echo: and in Paris too" for m in fake_tg.sent_messages(CHAT)
            ):
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)
        stats = gw.daemon.dispatcher.stats()
    sent = fake_tg.sent_messages(CHAT)
    # One message in the chat (a preview, edited into the final reply), not two replies.
    assert len({m["message_id"] for m in sent}) == 1
    assert sent[-1]["text"] == "echo: and in Paris too"
    assert stats.steered_messages == 1


# -- interrupt -----------------------------------------------------------------------------


async def test_interrupt_stops_the_turn_and_the_next_starts_with_everything_said(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {})
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="interrupt") as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        started = anyio.current_time()
        fake_tg.push_update(fake_tg.user_message(CHAT, "no, in Paris"))
        sent = await wait_sent(fake_tg, CHAT, 2, seconds=20)
        took = anyio.current_time() - started
        stats = gw.daemon.dispatcher.stats()
    assert not slow.release.is_set() and took < 10  # stopped, not waited for
    assert [m["text"] for m in sent] == [STOPPED_EMPTY_TEXT, "echo: no, in Paris"]
    assert stats.interrupted_turns == 1
    entries = stored(gw.settings)
    assert [e["message"]["role"] for e in entries] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert entries[3]["meta"]["stopped"] is True
    # The new turn's request holds everything said so far, the stopped turn included.
    last = fake_openai.chat_requests[-1].messages
    said = [m.get("content") for m in last if m["role"] in ("user", "assistant")]
    assert said[0] == "look it up"
    assert said[-2:] == [STOPPED_EMPTY_TEXT, "no, in Paris"]


async def test_interrupt_a_command_interrupts_nothing_and_waits_its_turn(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add(Reply(text="a long answer", delay=30.0))
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="interrupt") as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "tell me everything"))
        with anyio.fail_after(10):
            await fake_openai.wait_for_requests_async(1)
        fake_tg.push_update(fake_tg.user_message(CHAT, "/queue"))
        await wait_queued(gw.daemon)
        await anyio.sleep(0.3)
        assert gw.daemon.dispatcher.stats().interrupted_turns == 0
        fake_tg.push_update(fake_tg.user_message(CHAT, "shorter please"))
        sent = await wait_sent(fake_tg, CHAT, 3, seconds=20)
        stats = gw.daemon.dispatcher.stats()
    texts = [m["text"] for m in sent]
    assert texts[0] == STOPPED_EMPTY_TEXT
    assert texts[1].startswith("Queue mode: interrupt")
    assert texts[2] == "echo: shorter please"
    assert stats.interrupted_turns == 1


# -- /queue and the configured defaults ---------------------------------------------------


async def test_queue_is_kept_in_the_session_across_a_restart(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    async with gateway(
        make_settings, fake_openai, fake_tg, dispatch__channel_modes__telegram="collect"
    ) as gw:
        for text in ("/queue", "/queue steering", "/queue steer", "/queue"):
            fake_tg.push_update(fake_tg.user_message(CHAT, text))
        sent = await wait_sent(fake_tg, CHAT, 4)
        mode = gw.daemon.gateway.agent.queue_mode(
            InboundMessage(channel="telegram", chat_id=str(CHAT), text="x")
        )
    texts = [m["text"] for m in sent]
    assert texts[0].startswith("Queue mode: collect (this channel's default)")
    assert texts[1].startswith("There is no queue mode 'steering'")
    assert "/queue followup|collect|steer|interrupt" in texts[1]
    assert texts[2].startswith("Queue mode for this conversation: steer")
    assert texts[3].startswith("Queue mode: steer (set here with /queue)")
    assert mode == "steer"
    # A new daemon on the same workspace reads it from the session.
    async with gateway(
        make_settings, fake_openai, fake_tg, dispatch__channel_modes__telegram="collect"
    ) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "/queue"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "/queue default"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "/queue"))
        sent = await wait_sent(fake_tg, CHAT, 7)
    texts = [m["text"] for m in sent][4:]
    assert texts[0].startswith("Queue mode: steer (set here with /queue)")
    assert texts[1].startswith("Queue mode for this conversation: collect")
    assert texts[2].startswith("Queue mode: collect (this channel's default)")


async def test_a_conversations_own_mode_wins_over_the_channels(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    """/queue steer in a conversation of a channel whose default is followup: its next
    busy turn takes the message in; another conversation keeps the default."""
    slow = GatedTool()
    other = CHAT + 1
    async with gateway(make_settings, fake_openai, fake_tg) as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "/queue steer"))
        await wait_sent(fake_tg, CHAT, 1)
        fake_openai.add_tool_call("slow_lookup", {})
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        fake_tg.push_update(fake_tg.user_message(CHAT, "and in Paris too"))
        await wait_queued(gw.daemon)
        slow.release.set()
        sent = await wait_sent(fake_tg, CHAT, 2, seconds=20)
        await anyio.sleep(0.3)
        agent = gw.daemon.gateway.agent
        modes = [
            agent.queue_mode(InboundMessage(channel="telegram", chat_id=str(c), text="x"))
            for c in (CHAT, other)
        ]
    assert [m["text"] for m in sent][1:] == ["echo: and in Paris too"]
    assert len(fake_tg.sent_messages(CHAT)) == 2
    assert modes == ["steer", "followup"]


async def test_collect_never_merges_a_command_with_a_message(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    """Merged into one text, "/help" and "hello" were one command ("/help" with the
    argument "hello"): "hello" never reached the model."""
    fake_openai.add(Reply(text="the first answer", delay=2.0))
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="collect") as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "first"))
        with anyio.fail_after(10):
            await fake_openai.wait_for_requests_async(1)
        fake_tg.push_update(fake_tg.user_message(CHAT, "/help"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "hello"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "again"))
        await wait_queued(gw.daemon, 3)
        sent = await wait_sent(fake_tg, CHAT, 3, seconds=20)
    texts = [m["text"] for m in sent]
    assert texts[0] == "the first answer"
    assert texts[1].startswith("Commands:")
    assert texts[2] == "echo: hello\n\nagain"


# -- a crash replay of a turn a message joined ----------------------------------------------


def _said(text: str, n: int) -> InboundMessage:
    return InboundMessage(
        channel="telegram",
        chat_id=str(CHAT),
        sender_id=str(CHAT),
        text=text,
        message_id=f"{CHAT}:{n}",
    )


@pytest.mark.parametrize("answered", [False, True], ids=["cut-short", "answered"])
async def test_a_replay_runs_the_turn_a_message_joined_once_and_sends_one_reply(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], answered: bool
) -> None:
    """The kill came after a message joined a turn (its entry stored) and, in one case,
    after the turn's final answer was stored too; both messages are journaled, neither
    marked answered. The replay goes on with the first message's turn (cut short) or
    gives its stored answer, and the joined message is answered by that same reply:
    one reply goes out, no message is stored twice, the model is asked at most once."""
    settings = make_settings(fake_openai)
    first, second = _said("look it up", 1), _said("and in Paris too", 2)
    before = FileDedupeStore(settings.workspace_path / "dedupe.sqlite")
    for msg in (first, second):
        key = dedupe_key(msg)
        assert key is not None and not await before.seen_or_add(key)
        await before.journal(key, msg)
    await before.aclose()  # the kill; what follows is the restarted gateway
    journal = FileDedupeStore(settings.workspace_path / "dedupe.sqlite")
    gw = Gateway.build(settings)
    session = await gw.sessions.aget_or_create(KEY)
    call = ToolCall(id="c1", function_name="current_time")
    session.add_message(LLMMessage("user", "look it up"), {"message_id": first.message_id})
    session.add_message(LLMMessage("assistant", "", tool_calls=[call]))
    session.add_message(LLMMessage("tool", "noon", tool_call_id="c1", name="current_time"))
    session.add_message(
        LLMMessage("user", "and in Paris too"),
        {"message_id": second.message_id, "steered": True},
    )
    if answered:
        session.add_message(LLMMessage("assistant", "noon in Paris too"))
    sent: list[OutboundMessage] = []

    async def deliver(reply: OutboundMessage) -> None:
        sent.append(reply)

    dispatcher = Dispatcher(gw.agent.handle, deliver, dedupe=journal)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(dispatcher.run)
            assert await dispatcher.replay() == 2
            with anyio.fail_after(10):
                while dispatcher.stats().turns_finished < 2:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await dispatcher.drain(5)
        left = await journal.unanswered()
    finally:
        await journal.aclose()
        await gw.aclose()
    expected = "noon in Paris too" if answered else "echo: and in Paris too"
    assert [r.text for r in sent] == [expected]
    assert left == []
    contents = [e["message"].get("content") for e in stored(settings)]
    assert contents.count("look it up") == 1 and contents.count("and in Paris too") == 1
    assert contents[-1] == expected
    assert len(fake_openai.chat_requests) == (0 if answered else 1)


def echo_the_turn(body: dict[str, Any]) -> Reply:
    """A model for steered turns (as in tests/test_kill_delivery.py): a turn's first call
    asks for `current_time`; the call after its result answers ``echo: `` and the user
    messages of the turn (since the last final answer), joined by `` | ``."""
    turn: list[dict[str, Any]] = []
    for message in body["messages"]:
        if message["role"] == "assistant" and not message.get("tool_calls"):
            turn = []
        elif message["role"] != "system":
            turn.append(message)
    if not any(m["role"] == "tool" for m in turn):
        return Reply(tool_calls=(FakeToolCall("current_time", {}),))
    return Reply(text="echo: " + " | ".join(m["content"] for m in turn if m["role"] == "user"))


#: The turn's own message and nine that join it: with the default window of ten
#: messages (`agent.memory_window`), the window cut the turn's own message.
#: Made by each test, not at import: a message older than `agent.offline_after_seconds`
#: gets the offline notice, and a whole suite run in one process can take over an hour.
def _turn() -> list[InboundMessage]:
    return [_said("look it up", 1), *(_said(f"and {n}", n) for n in range(2, 11))]


TURN_REPLY = "echo: " + " | ".join(m.text for m in _turn())


async def test_steer_a_turn_that_many_messages_joined_answers_every_one(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    from gateway.dispatch.queue_modes import TurnInbox, receiving

    fake_openai.responder = echo_the_turn
    settings = make_settings(fake_openai, dispatch__mode="steer", memory__auto_consolidate=False)
    gw = Gateway.build(settings)
    turn = _turn()
    waiting = turn[1:]

    def take(accept: Callable[[InboundMessage], bool]) -> list[InboundMessage]:
        taken = [m for m in waiting if accept(m)]
        waiting.clear()
        return taken

    try:
        await gw.agent.handle(_said("before", 0))  # an earlier exchange, left out first
        with receiving(TurnInbox(KEY, take)):
            reply = await gw.agent.handle(turn[0])
    finally:
        await gw.aclose()
    assert reply.text == TURN_REPLY
    final = fake_openai.chat_requests[-1].messages
    assert [m["content"] for m in final if m["role"] == "user"] == [m.text for m in turn]
    contents = [e["message"].get("content") for e in stored(settings)]
    assert contents[-1] == TURN_REPLY


async def test_a_replay_goes_on_with_a_turn_that_many_messages_joined(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The kill came after nine messages joined a turn (stored after its tool round),
    before its final answer; all ten are journaled. The replay goes on with the turn:
    the model sees all ten, its one reply answers them all and goes out once, and all
    are marked answered."""
    fake_openai.responder = echo_the_turn
    settings = make_settings(fake_openai, dispatch__mode="steer", memory__auto_consolidate=False)
    turn = _turn()
    before = FileDedupeStore(settings.workspace_path / "dedupe.sqlite")
    for msg in turn:
        key = dedupe_key(msg)
        assert key is not None and not await before.seen_or_add(key)
        await before.journal(key, msg)
    await before.aclose()  # the kill; what follows is the restarted gateway
    journal = FileDedupeStore(settings.workspace_path / "dedupe.sqlite")
    gw = Gateway.build(settings)
    session = await gw.sessions.aget_or_create(KEY)
    call = ToolCall(id="c1", function_name="current_time")
    session.add_message(LLMMessage("user", turn[0].text), {"message_id": turn[0].message_id})
    session.add_message(LLMMessage("assistant", "", tool_calls=[call]))
    session.add_message(LLMMessage("tool", "noon", tool_call_id="c1", name="current_time"))
    for msg in turn[1:]:
        session.add_message(
            LLMMessage("user", msg.text), {"message_id": msg.message_id, "steered": True}
        )
    sent: list[OutboundMessage] = []

    async def deliver(reply: OutboundMessage) -> None:
        sent.append(reply)

    dispatcher = Dispatcher(gw.agent.handle, deliver, dedupe=journal)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(dispatcher.run)
            assert await dispatcher.replay() == len(turn)
            with anyio.fail_after(10):
                while dispatcher.stats().turns_finished < len(turn):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await dispatcher.drain(5)
        left = await journal.unanswered()
    finally:
        await journal.aclose()
        await gw.aclose()
    assert [r.text for r in sent] == [TURN_REPLY]
    assert left == []
    assert len(fake_openai.chat_requests) == 1


async def test_undo_after_a_steered_turn_takes_back_the_whole_turn(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(_said("before", 0))
        session = await gw.sessions.aget_or_create(KEY)
        kept = session.leaf_id
        call = ToolCall(id="c1", function_name="current_time")
        session.add_message(LLMMessage("user", "look it up"), {"message_id": f"{CHAT}:1"})
        session.add_message(LLMMessage("assistant", "", tool_calls=[call]))
        session.add_message(LLMMessage("tool", "noon", tool_call_id="c1", name="current_time"))
        session.add_message(
            LLMMessage("user", "and in Paris too"), {"message_id": f"{CHAT}:2", "steered": True}
        )
        session.add_message(LLMMessage("assistant", "noon in Paris too"))
        undone = await gw.agent.handle(_said("/undo", 3))
        leaf = session.leaf_id
    finally:
        await gw.aclose()
    assert undone.text.startswith('Undone: your message "look it up" and my answer')
    assert leaf == kept


# -- the shared mode: two replicas over one PostgreSQL ---------------------------------------

API_TOKEN = "shared-api-token-0123456789abcdef"


@asynccontextmanager
async def two_replicas(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    pg_url: str,
    tmp_path: Path,
    **overrides: Any,
) -> AsyncIterator[tuple[Callable[[str, str, str], Awaitable[str]], Daemon, Daemon]]:
    """Replicas a and b sharing `pg_url`, and `ask(replica, session, text)`: a message
    to `/api/chat` of replica "a" or "b", returning its reply."""
    common = {"http__port": 0, "http__token": API_TOKEN, "storage__url": pg_url} | overrides
    a = Daemon(Gateway.build(make_settings(fake_openai, **common)), interactive=False)
    b_settings = make_settings(fake_openai, workspace=tmp_path / "ws-b", **common)
    b = Daemon(Gateway.build(b_settings), interactive=False)
    headers = {"Authorization": f"Bearer {API_TOKEN}"}
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        urls = {
            "a": f"http://127.0.0.1:{await tg.start(a.run)}/api/chat",
            "b": f"http://127.0.0.1:{await tg.start(b.run)}/api/chat",
        }

        async def ask(replica: str, session: str, text: str) -> str:
            body = {"session": session, "text": text}
            async with http.post(urls[replica], json=body, headers=headers) as resp:
                answer = await resp.json()
            assert resp.status == 200, answer
            return str(answer["reply"])

        try:
            yield ask, a, b
        finally:
            a.stop()
            b.stop()


def shared_entries(pg_url: str, key: str) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(role, content, meta) of `key`'s message entries in PostgreSQL, in order."""
    import psycopg

    with psycopg.connect(pg_url) as conn:
        rows = conn.execute(
            "SELECT e.body::text FROM gw_session_entries e JOIN gw_sessions s USING "
            "(session_id) WHERE s.key = %s AND e.type = 'message' ORDER BY e.seq",
            (key,),
        ).fetchall()
    bodies = [json.loads(row[0]) for row in rows]
    return [
        (body["message"]["role"], body["message"].get("content"), body.get("meta") or {})
        for body in bodies
    ]


def journal_states(pg_url: str) -> list[tuple[str, int]]:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        rows = conn.execute("SELECT state, count(*) FROM gw_inbound GROUP BY 1").fetchall()
    return [(str(state), int(n)) for state, n in rows]


async def test_shared_a_message_taken_in_by_another_replica_joins_the_turn_where_it_runs(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    migrated_pg_url: str,
    tmp_path: Path,
) -> None:
    """Replica a runs a conversation's turn (its tool still running); the next message
    reaches b, which journals it; a, holding the session's lease, is fed it and its
    turn takes it in: stored once (behind a's fence), and both requests get the turn's
    one reply."""
    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {})
    async with two_replicas(
        make_settings, fake_openai, migrated_pg_url, tmp_path, dispatch__mode="steer"
    ) as (ask, a, b):
        for replica in (a, b):
            replica.gateway.agent.tools.register(slow.tool)
        answers: dict[str, str] = {}

        async def first() -> None:
            answers["first"] = await ask("a", "trip", "look it up")

        async def second() -> None:
            answers["second"] = await ask("b", "trip", "and in Paris too")

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(20):
                await slow.started.wait()
            tg.start_soon(second)
            await wait_queued(a)  # fed to a, the lease holder, behind its running turn
            slow.release.set()
        stats = a.dispatcher.stats(), b.dispatcher.stats()
    assert answers == {"first": "echo: and in Paris too", "second": "echo: and in Paris too"}
    assert stats[0].steered_messages == 1 and stats[1].turns_started == 0
    entries = shared_entries(migrated_pg_url, "api:trip")
    assert [role for role, _, _ in entries] == ["user", "assistant", "tool", "user", "assistant"]
    assert entries[3][1] == "and in Paris too" and entries[3][2]["steered"] is True
    assert journal_states(migrated_pg_url) == [("done", 2)]


async def test_shared_interrupt_stops_the_turn_on_the_replica_that_runs_it(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    migrated_pg_url: str,
    tmp_path: Path,
) -> None:
    fake_openai.add(Reply(text="a long answer", delay=30.0))
    async with two_replicas(
        make_settings, fake_openai, migrated_pg_url, tmp_path, dispatch__mode="interrupt"
    ) as (ask, a, _b):
        answers: dict[str, str] = {}

        async def first() -> None:
            answers["first"] = await ask("a", "talk", "tell me everything")

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(10):
                await fake_openai.wait_for_requests_async(1)
            started = anyio.current_time()
            answers["second"] = await ask("b", "talk", "shorter please")
        took = anyio.current_time() - started
        stats = a.dispatcher.stats()
    assert took < 10  # long before the model's 30 s answer
    assert answers == {"first": STOPPED_EMPTY_TEXT, "second": "echo: shorter please"}
    assert stats.interrupted_turns == 1
    contents = [content for _, content, _ in shared_entries(migrated_pg_url, "api:talk")]
    said = ["tell me everything", STOPPED_EMPTY_TEXT, "shorter please", "echo: shorter please"]
    assert contents == said


async def test_shared_a_joined_message_is_stored_behind_the_turns_fence(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    migrated_pg_url: str,
    tmp_path: Path,
) -> None:
    """The lease moves on (a replica paused past it) just as a's turn is about to store
    the message that joined it: the write is refused, a stores and sends nothing more,
    and both messages stay journaled. Once the lease is free, a replica takes the
    conversation up: the first message's turn goes on, the joined one (never stored)
    gets a turn of its own; each is answered once and stored once."""
    from gateway import failpoints
    from tests.test_fencing import expire, take_lease

    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {})
    stolen = anyio.Event()

    async def steal(name: str, key: str) -> None:
        def move() -> None:
            expire(migrated_pg_url, key)
            assert take_lease(migrated_pg_url, "paused-replica", key, ttl=1.0) is not None

        await anyio.to_thread.run_sync(move)
        stolen.set()

    failpoints.arm("turn.before_steered_append", steal, "api:trip")
    try:
        async with two_replicas(
            make_settings, fake_openai, migrated_pg_url, tmp_path, dispatch__mode="steer"
        ) as (ask, a, b):
            for replica in (a, b):
                replica.gateway.agent.tools.register(slow.tool)
            answers: dict[str, str] = {}

            async def first() -> None:
                answers["first"] = await ask("a", "trip", "look it up")

            async def second() -> None:
                answers["second"] = await ask("b", "trip", "and in Paris too")

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                with anyio.fail_after(20):
                    await slow.started.wait()
                tg.start_soon(second)
                await wait_queued(a)
                slow.release.set()
                with anyio.fail_after(10):
                    await stolen.wait()
                await anyio.sleep(0.3)
                # Refused: nothing of the joined message is stored, nothing was sent.
                assert not answers
                contents = [c for _, c, _ in shared_entries(migrated_pg_url, "api:trip")]
                assert "and in Paris too" not in contents
                assert journal_states(migrated_pg_url) == [("journaled", 2)]
    finally:
        failpoints.disarm_all()
    assert answers == {"first": "echo: look it up", "second": "echo: and in Paris too"}
    entries = shared_entries(migrated_pg_url, "api:trip")
    contents = [content for _, content, _ in entries]
    assert contents.count("look it up") == 1 and contents.count("and in Paris too") == 1
    assert [role for role, _, _ in entries] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert journal_states(migrated_pg_url) == [("done", 2)]


async def test_a_message_the_gateway_made_is_a_turn_of_its_own(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    """A reminder firing (or a subagent's result) while a steered turn runs does not join
    it: it is the gateway's, not something the person added."""
    from gateway.messages import META_MENTIONED
    from gateway.schedules.protocol import META_SCHEDULE

    slow = GatedTool()
    fake_openai.add_tool_call("slow_lookup", {})
    async with gateway(make_settings, fake_openai, fake_tg, dispatch__mode="steer") as gw:
        gw.daemon.gateway.agent.tools.register(slow.tool)
        fake_tg.push_update(fake_tg.user_message(CHAT, "look it up"))
        with anyio.fail_after(20):
            await slow.started.wait()
        reminder = InboundMessage(
            channel="telegram",
            chat_id=str(CHAT),
            sender_id=str(CHAT),
            text="[reminder r1] water the plants",
            message_id="schedule:r1:1",
            metadata={META_SCHEDULE: "r1", META_MENTIONED: True},
        )
        await gw.daemon.submit(reminder)
        await wait_queued(gw.daemon)
        slow.release.set()
        sent = await wait_sent(fake_tg, CHAT, 2, seconds=20)
        stats = gw.daemon.dispatcher.stats()
    assert [m["text"] for m in sent] == ["echo: look it up", "echo: [reminder r1] water the plants"]
    assert stats.steered_messages == 0


async def test_a_turn_asked_to_stop_before_its_model_call_stops_there(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The interrupt mode can ask a turn to stop before it reaches its model call (it
    was still building its context): it stops there, as /stop would have, and the model
    is not asked."""
    from gateway.dispatch.queue_modes import TurnInbox, receiving

    settings = make_settings(fake_openai, memory__auto_consolidate=False)
    gw = Gateway.build(settings)
    inbox = TurnInbox(KEY, lambda accept: [])
    assert inbox.stop() and not inbox.stop()  # asked once
    try:
        with receiving(inbox):
            reply = await gw.agent.handle(_said("tell me everything", 1))
    finally:
        await gw.aclose()
    assert reply.text == STOPPED_EMPTY_TEXT and reply.metadata["stopped"] is True
    assert fake_openai.chat_requests == []
    assert [e["message"]["content"] for e in stored(settings)] == [
        "tell me everything",
        STOPPED_EMPTY_TEXT,
    ]


async def test_shared_a_conversations_queue_mode_holds_on_every_replica(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    migrated_pg_url: str,
    tmp_path: Path,
) -> None:
    """/queue steer taken in and run by replica a is kept in the session in PostgreSQL:
    once b runs the conversation (a's lease let go), b reads it there."""
    async with two_replicas(make_settings, fake_openai, migrated_pg_url, tmp_path) as (
        ask,
        a,
        b,
    ):
        set_here = await ask("a", "prefs", "/queue steer")
        assert a.dispatcher.stats().turns_started == 1
        await anyio.sleep(a.router.linger + 1)  # a lets the session's lease go
        said = await ask("b", "prefs", "/queue")
        ran = a.dispatcher.stats().turns_started, b.dispatcher.stats().turns_started
    assert ran == (1, 1)
    assert set_here.startswith("Queue mode for this conversation: steer")
    assert said.startswith("Queue mode: steer (set here with /queue)")
