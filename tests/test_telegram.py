"""The Telegram adapter on its own: the real python-telegram-bot against the fake Bot API
server, with a recording stand-in for the dispatcher. (The whole gateway with Telegram
is in tests/test_telegram_e2e.py.)"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from telegram import Update
from telegram.error import BadRequest, Forbidden, NetworkError, RetryAfter, TimedOut

from channels.telegram import (
    Address,
    Notice,
    Pacing,
    Skip,
    TelegramChannel,
    TelegramSetupError,
    check_credentials,
    failure_kind,
    parse_target,
    telegram_message_id,
    translate_update,
)
from channels.telegram.format import markdown_to_html, split_markdown
from channels.telegram.settings import TelegramSettings
from gateway.config import ConfigError
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    InboundMessage,
    OutboundMessage,
)
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.telegram_server import FakeTelegram, parse_html

pytestmark = pytest.mark.anyio

CHAT = 4242
GROUP = -1001234567890
BOT_ID = 123456789
FAST = Pacing(
    retry_backoff=0.01, retry_window=1.0, typing_grace=0.05, stream_interval=0.05, stop_timeout=5
)


class StubTicket:
    """A dispatcher ticket the test resolves by hand."""

    def __init__(self, taken: bool = True) -> None:
        self.answered = anyio.Event()
        self.taken = taken

    async def reply(self) -> OutboundMessage | None:
        await self.answered.wait()
        return None


class Recorder:
    """Stands in for the dispatcher: records what the channel submits."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self.tickets: list[StubTicket] = []

    async def submit(self, message: InboundMessage) -> StubTicket:
        self.messages.append(message)
        ticket = StubTicket()
        self.tickets.append(ticket)
        return ticket

    async def wait(self, count: int) -> list[InboundMessage]:
        with anyio.fail_after(5):
            while len(self.messages) < count:  # noqa: ASYNC110 (polling a test recorder)
                await anyio.sleep(0.01)
        return self.messages


def tg_settings(fake: FakeTelegram, **overrides: Any) -> TelegramSettings:
    options: dict[str, Any] = {
        "enabled": True,
        "base_url": fake.api_url,
        "base_file_url": fake.file_url,
        "poll_timeout": 1,
    }
    return TelegramSettings(**(options | overrides))


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


@asynccontextmanager
async def running(
    fake: FakeTelegram, recorder: Recorder | None = None, **overrides: Any
) -> AsyncIterator[TelegramChannel]:
    channel = TelegramChannel(tg_settings(fake, **overrides), token=fake.token, pacing=FAST)
    submit = (recorder or Recorder()).submit
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        try:
            yield channel
        finally:
            tg.cancel_scope.cancel()


async def wait_sent(fake: FakeTelegram, chat: int, count: int) -> list[dict[str, Any]]:
    with anyio.fail_after(5):
        while len(fake.sent_messages(chat)) < count:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    return fake.sent_messages(chat)


def reply_to(message: InboundMessage, text: str) -> OutboundMessage:
    return OutboundMessage(
        channel="telegram",
        chat_id=message.chat_id,
        text=text,
        session_key=message.session_key,
        reply_to=message.message_id,
        thread_id=message.thread_id,
    )


def translated(update: dict[str, Any]) -> InboundMessage | Notice | Skip:
    return translate_update(
        Update.de_json(copy.deepcopy(update), None), bot_id=BOT_ID, bot_username="gateway_bot"
    )


# --------------------------------------------------------------------------- inbound


def test_a_private_message_becomes_an_inbound_message() -> None:
    fake = FakeTelegram()
    update = fake.user_message(CHAT, "hello **there**", first_name="Ann", username="ann")
    msg = translated(update)
    assert isinstance(msg, InboundMessage)
    assert (msg.channel, msg.chat_id, msg.sender_id) == ("telegram", str(CHAT), str(CHAT))
    assert msg.text == "hello **there**"
    assert msg.session_key == f"telegram:{CHAT}"
    assert msg.message_id == f"{CHAT}:{update['message']['message_id']}"
    assert msg.metadata[META_IS_GROUP] is False
    assert msg.metadata[META_SENDER_NAME] == "Ann (@ann)"


def test_forum_topics_get_their_own_session_and_are_no_replies() -> None:
    fake = FakeTelegram()
    update = fake.user_message(
        GROUP, "hi", chat_type="supergroup", message_thread_id=7, is_topic_message=True
    )
    # The topic was created by the bot: its pseudo-reply is still not a reply to the bot.
    update["message"]["reply_to_message"]["from"] = fake.bot_user
    msg = translated(update)
    assert isinstance(msg, InboundMessage)
    assert msg.session_key == f"telegram:{GROUP}:topic:7"
    assert (msg.thread_kind, msg.thread_id) == ("topic", "7")
    assert msg.metadata[META_REPLY_TO_BOT] is False
    assert msg.metadata[META_IS_GROUP] is True
    plain = translated(fake.user_message(GROUP, "no topic", chat_type="supergroup"))
    assert isinstance(plain, InboundMessage) and plain.session_key == f"telegram:{GROUP}"


def test_group_mentions_are_found_and_cut_out() -> None:
    fake = FakeTelegram()
    cases = {
        "@gateway_bot what's up?": ("what's up?", True),
        "hey @Gateway_Bot, what's up?": ("hey what's up?", True),
        "ask @someone_else": ("ask @someone_else", False),
        "@gateway_bot": ("@gateway_bot", True),
        "/new@gateway_bot": ("/new", True),
        "plain chatter": ("plain chatter", False),
    }
    for text, (expected, mentioned) in cases.items():
        msg = translated(fake.user_message(GROUP, text, chat_type="supergroup"))
        assert isinstance(msg, InboundMessage), text
        assert (msg.text, msg.metadata[META_MENTIONED]) == (expected, mentioned), text
    other_bot = translated(fake.user_message(GROUP, "/start@other_bot", chat_type="supergroup"))
    assert isinstance(other_bot, Skip)
    entity = {
        "type": "text_mention",
        "offset": 0,
        "length": 3,
        "user": {"id": BOT_ID, "is_bot": True, "first_name": "Gateway Bot"},
    }
    by_name = translated(
        fake.user_message(GROUP, "Bot, hi", chat_type="supergroup", entities=[entity])
    )
    assert isinstance(by_name, InboundMessage) and by_name.metadata[META_MENTIONED] is True
    assert by_name.text == "Bot, hi"


def test_mentions_after_astral_characters_are_cut_at_the_right_place() -> None:
    fake = FakeTelegram()
    msg = translated(fake.user_message(GROUP, "😀😀 @gateway_bot hi", chat_type="supergroup"))
    assert isinstance(msg, InboundMessage)
    assert (msg.text, msg.metadata[META_MENTIONED]) == ("😀😀 hi", True)


def test_replies_to_the_bot_are_marked() -> None:
    fake = FakeTelegram()
    update = fake.user_message(GROUP, "and then?", chat_type="supergroup")
    update["message"]["reply_to_message"] = {
        "message_id": 1,
        "from": fake.bot_user,
        "chat": update["message"]["chat"],
        "date": 0,
        "text": "earlier answer",
    }
    msg = translated(update)
    assert isinstance(msg, InboundMessage) and msg.metadata[META_REPLY_TO_BOT] is True


def test_captions_are_text_and_other_content_gets_a_notice_where_sensible() -> None:
    fake = FakeTelegram()
    photo = translated(fake.user_message(CHAT, "what is this?", photo=True))
    assert isinstance(photo, InboundMessage)
    assert photo.text == "what is this?"  # the photo is an attachment the agent reads
    assert [a.kind for a in photo.attachments] == ["image"]
    sticker = translated(fake.user_message(CHAT, sticker="👍"))
    assert isinstance(sticker, Notice) and "a sticker" in sticker.text
    in_group = translated(fake.user_message(GROUP, sticker="👍", chat_type="supergroup"))
    assert isinstance(in_group, Skip)


def test_an_edit_is_a_message_of_its_own_naming_the_one_it_changes() -> None:
    fake = FakeTelegram()
    original = fake.user_message(CHAT, "helo")
    first = translated(original)
    edit = translated(fake.edited_message(original, "hello"))
    again = translated(fake.edited_message(original, "hello!"))
    assert isinstance(first, InboundMessage) and isinstance(edit, InboundMessage)
    assert isinstance(again, InboundMessage)
    assert edit.text == "hello" and edit.session_key == first.session_key
    assert edit.metadata[META_EDIT_OF] == first.message_id
    assert edit.message_id != first.message_id  # dedupe keeps the edit
    assert edit.metadata[META_SENT_AT] > first.metadata[META_SENT_AT] > 0
    # In a group an edit follows the same addressing rules as a new message.
    group_original = fake.user_message(GROUP, "@gateway_bot helo", chat_type="supergroup")
    group_edit = translated(fake.edited_message(group_original, "@gateway_bot hi"))
    assert isinstance(group_edit, InboundMessage) and group_edit.metadata[META_MENTIONED]


def test_targets_and_message_ids_parse_back() -> None:
    assert parse_target("42") == Address(42, None)
    assert parse_target("-100123", "7") == Address(-100123, 7)
    assert parse_target("-100123:topic:7") == Address(-100123, 7)
    assert parse_target("@news") == Address("@news", None)
    assert telegram_message_id("-100123:55") == 55
    assert telegram_message_id(None) is None


# --------------------------------------------------------------------------- failures


def _timed_out(cause: Exception) -> TimedOut:
    error = TimedOut()
    error.__cause__ = cause
    return error


def test_only_requests_that_cannot_have_arrived_are_retried() -> None:
    assert failure_kind(RetryAfter(3)) == "retry"
    assert failure_kind(NetworkError("Internal Server Error")) == "retry"  # a 5xx answer
    assert failure_kind(_timed_out(httpx.ConnectTimeout("connect"))) == "retry"
    assert failure_kind(_timed_out(httpx.PoolTimeout("pool"))) == "retry"
    assert failure_kind(_timed_out(httpx.ReadTimeout("read"))) == "ambiguous"
    assert failure_kind(_timed_out(httpx.WriteTimeout("write"))) == "ambiguous"
    assert failure_kind(BadRequest("Chat not found")) == "final"
    assert failure_kind(Forbidden("Forbidden: bot was blocked by the user")) == "final"


async def test_a_send_that_may_have_arrived_is_not_repeated_but_an_edit_is() -> None:
    channel = TelegramChannel(TelegramSettings(), token="1:x", pacing=FAST)
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise _timed_out(httpx.ReadTimeout("read"))
        return "ok"

    with pytest.raises(TimedOut):
        await channel.call_api("sendMessage", CHAT, flaky, idempotent=False)
    assert calls == 1
    calls = 0
    assert await channel.call_api("editMessageText", CHAT, flaky, idempotent=True) == "ok"
    assert calls == 2


async def test_retries_are_bounded() -> None:
    """A request that keeps failing is repeated for `Pacing.retry_window` seconds, then
    given up."""
    pacing = Pacing(retry_backoff=0.01, retry_backoff_max=0.02, retry_window=0.3)
    channel = TelegramChannel(TelegramSettings(), token="1:x", pacing=pacing)
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise NetworkError("Bad Gateway")

    started = time.monotonic()
    with pytest.raises(NetworkError):
        await channel.call_api("sendMessage", CHAT, down, idempotent=False)
    assert 0.3 <= time.monotonic() - started < 2
    assert calls > 5


# --------------------------------------------------------------------------- running


async def test_updates_queued_before_start_are_all_handled_and_confirmed_at_stop(
    fake: FakeTelegram,
) -> None:
    recorder = Recorder()
    for text in ("one", "two", "three"):
        fake.push_update(fake.user_message(CHAT, text))
    async with running(fake, recorder):
        messages = await recorder.wait(3)
    assert [m.text for m in messages] == ["one", "two", "three"]
    assert not any(c.params.get("drop_pending_updates") for c in fake.calls)
    assert fake.pending_updates == []  # confirmed on the way out: no redelivery


class GatedSubmit:
    """A dispatcher stand-in whose `submit` is held open for chosen texts (as a slow
    journal commit would be), and which can refuse to take messages (a failed one)."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self.hold: dict[str, anyio.Event] = {}
        self.entered: dict[str, anyio.Event] = {}
        self.refuse: set[str] = set()

    async def submit(self, message: InboundMessage) -> StubTicket:
        self.messages.append(message)
        if message.text in self.hold:
            self.entered.setdefault(message.text, anyio.Event()).set()
            await self.hold[message.text].wait()
        return StubTicket(taken=message.text not in self.refuse)

    async def wait_entered(self, text: str) -> None:
        with anyio.fail_after(5):
            await self.entered.setdefault(text, anyio.Event()).wait()


def offsets_sent(fake: FakeTelegram) -> list[int]:
    return [int(c.params.get("offset") or 0) for c in fake.calls_to("getUpdates")]


async def test_an_update_is_confirmed_only_after_submit_returned_for_it(
    fake: FakeTelegram,
) -> None:
    """Journal before confirm: while the second update of a fetched batch is being
    journaled (its `submit` has not returned), no getUpdates offset has passed it, so
    Telegram still holds it and everything after it: a crash now loses nothing."""
    gate = GatedSubmit()
    gate.hold["two"] = anyio.Event()
    updates = [fake.push_update(fake.user_message(CHAT, t)) for t in ("one", "two", "three")]
    ids = [u["update_id"] for u in updates]
    channel = TelegramChannel(tg_settings(fake), token=fake.token, pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, gate.submit)
        await gate.wait_entered("two")
        await anyio.sleep(0.2)  # PTB's Updater would have confirmed the batch by now
        assert max(offsets_sent(fake)) <= ids[0]  # not even "one": no poll since the batch
        pending = [u["update_id"] for u in fake.pending_updates]
        assert pending == ids  # "one" is confirmed by the next poll, not before
        gate.hold["two"].set()
        with anyio.fail_after(5):
            while len(gate.messages) < 3 or fake.pending_updates:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [m.text for m in gate.messages] == ["one", "two", "three"]
    assert max(offsets_sent(fake)) == ids[-1] + 1


async def test_an_update_not_taken_stays_with_telegram_and_is_fetched_again(
    fake: FakeTelegram,
) -> None:
    """An update the gateway could not keep (the journal failed) is not confirmed, nor
    anything after it; it is fetched again, and taken once the journal works."""
    gate = GatedSubmit()
    gate.refuse.add("two")
    for text in ("one", "two", "three"):
        fake.push_update(fake.user_message(CHAT, text))
    channel = TelegramChannel(tg_settings(fake), token=fake.token, pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, gate.submit)
        with anyio.fail_after(5):
            while [m.text for m in gate.messages].count("two") < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert "three" not in [m.text for m in gate.messages]  # order kept: not past "two"
        assert [u["message"]["text"] for u in fake.pending_updates] == ["two", "three"]
        gate.refuse.clear()
        with anyio.fail_after(5):
            while "three" not in [m.text for m in gate.messages]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    texts = [m.text for m in gate.messages]
    assert (
        texts[0] == "one"
        and texts[-2:] == ["two", "three"]
        and set(texts)
        == {
            "one",
            "two",
            "three",
        }
    )


async def test_pause_intake_stops_polling_and_leaves_updates_with_telegram(
    fake: FakeTelegram,
) -> None:
    recorder = Recorder()
    channel = TelegramChannel(tg_settings(fake), token=fake.token, pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, recorder.submit)
        fake.push_update(fake.user_message(CHAT, "before"))
        await recorder.wait(1)
        await anyio.sleep(0.1)
        channel.pause_intake()  # the long poll in flight is abandoned
        polls = len(fake.calls_to("getUpdates"))
        later = fake.push_update(fake.user_message(CHAT, "during the drain"))
        await anyio.sleep(0.3)
        assert len(fake.calls_to("getUpdates")) <= polls + 1  # at most the final confirm
        tg.cancel_scope.cancel()
    assert [m.text for m in recorder.messages] == ["before"]
    assert [u["update_id"] for u in fake.pending_updates] == [later["update_id"]]


async def test_an_update_delivered_twice_is_submitted_once(fake: FakeTelegram) -> None:
    recorder = Recorder()
    update = fake.user_message(CHAT, "once")
    fake.push_update(update)
    fake.push_update(update)  # the same update_id again
    fake.push_update(fake.user_message(CHAT, "next"))
    async with running(fake, recorder):
        await recorder.wait(2)
        await anyio.sleep(0.1)
    assert [m.text for m in recorder.messages] == ["once", "next"]


async def test_reply_is_html_in_order_and_quoted_only_in_groups(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "dm"))
    fake.push_update(fake.user_message(GROUP, "@gateway_bot group", chat_type="supergroup"))
    async with running(fake, recorder) as channel:
        dm, group = await recorder.wait(2)
        await channel.send(reply_to(dm, "**bold** `code`"))
        await channel.send(reply_to(group, "_sure_"))
    [private] = fake.sent_messages(CHAT)
    assert private["text"] == "bold code" and "reply_to_message" not in private
    assert [e["type"] for e in private["entities"]] == ["bold", "code"]
    [public] = fake.sent_messages(GROUP)
    assert public["reply_to_message"]["message_id"] == telegram_message_id(group.message_id)
    assert public["entities"][0]["type"] == "italic"


async def test_forum_topic_reply_goes_to_the_topic(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(
        fake.user_message(
            GROUP,
            "@gateway_bot in topic",
            chat_type="supergroup",
            message_thread_id=7,
            is_topic_message=True,
        )
    )
    async with running(fake, recorder) as channel:
        [msg] = await recorder.wait(1)
        await channel.send(reply_to(msg, "topic answer"))
    [sent] = fake.sent_messages(GROUP)
    assert sent["message_thread_id"] == 7 and sent["is_topic_message"] is True


async def test_typing_shows_while_the_turn_runs_and_stops_with_the_reply(
    fake: FakeTelegram,
) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "think hard"))
    pacing = Pacing(typing_grace=0.05, typing_interval=0.1)
    channel = TelegramChannel(tg_settings(fake), token=fake.token, pacing=pacing)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, recorder.submit)
        await recorder.wait(1)
        await anyio.sleep(0.35)
        recorder.tickets[0].answered.set()
        await anyio.sleep(0.05)
        stopped_at = time.time()
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()
    actions = fake.calls_to("sendChatAction")
    assert len(actions) >= 3
    assert all(a.params["action"] == "typing" and a.params["chat_id"] == CHAT for a in actions)
    assert all(a.timestamp < stopped_at for a in actions)


async def test_no_typing_for_a_message_settled_at_once(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "ignored"))

    async def settled(message: InboundMessage) -> StubTicket:
        ticket = await recorder.submit(message)
        ticket.answered.set()  # refused, ignored or a duplicate
        return ticket

    channel = TelegramChannel(tg_settings(fake), token=fake.token, pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, settled)
        await recorder.wait(1)
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    assert fake.calls_to("sendChatAction") == []


async def test_flood_control_is_waited_out_and_nothing_is_lost(fake: FakeTelegram) -> None:
    async with running(fake) as channel:
        fake.fail_next("sendMessage", 429, retry_after=1, count=2)
        started = time.monotonic()
        message = OutboundMessage("telegram", str(CHAT), "patience", f"telegram:{CHAT}")
        await channel.send(message)
        elapsed = time.monotonic() - started
    assert elapsed >= 2
    assert [m["text"] for m in fake.sent_messages(CHAT)] == ["patience"]
    assert [c.status for c in fake.calls_to("sendMessage")] == [429, 429, 200]


async def test_server_errors_are_retried(fake: FakeTelegram) -> None:
    async with running(fake) as channel:
        fake.fail_next("sendMessage", 500)
        await channel.send(OutboundMessage("telegram", str(CHAT), "again", f"telegram:{CHAT}"))
    assert [c.status for c in fake.calls_to("sendMessage")] == [500, 200]
    assert [m["text"] for m in fake.sent_messages(CHAT)] == ["again"]


@asynccontextmanager
async def behind_a_proxy(
    fake: FakeTelegram, pacing: Pacing
) -> AsyncIterator[tuple[TelegramChannel, TcpProxy]]:
    """A channel that reaches `fake` through a proxy the test can cut (the network)."""
    proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
    proxy.restore()
    root = f"http://127.0.0.1:{proxy.port}"
    settings = tg_settings(fake, base_url=f"{root}/bot", base_file_url=f"{root}/file/bot")
    channel = TelegramChannel(settings, token=fake.token, pacing=pacing)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, Recorder().submit)
            try:
                yield channel, proxy
            finally:
                tg.cancel_scope.cancel()
    finally:
        proxy.close()


async def test_a_reply_rides_out_a_network_outage(fake: FakeTelegram) -> None:
    """Telegram unreachable (every connection refused: nothing went out) for longer
    than a few attempts: the reply is retried until it is back, within
    `Pacing.retry_window`, and arrives once. (The conformance kit's outage scenario
    found a reply given up after four attempts, 3.5 s at the default backoff, and its
    message marked answered all the same.)"""
    pacing = Pacing(retry_backoff=0.01, retry_backoff_max=0.1, retry_window=10, stop_timeout=5)
    async with behind_a_proxy(fake, pacing) as (channel, proxy):
        proxy.cut()
        message = OutboundMessage("telegram", str(CHAT), "after the outage", f"telegram:{CHAT}")
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.send, message)
            await anyio.sleep(1.0)  # some ten attempts refused
            assert fake.sent_messages(CHAT) == []
            proxy.restore()
    assert [m["text"] for m in fake.sent_messages(CHAT)] == ["after the outage"]


async def test_an_outage_past_the_window_says_the_reply_may_be_sent_again(
    fake: FakeTelegram,
) -> None:
    """Past `Pacing.retry_window` a reply that certainly did not go out raises
    `DeliveryFailed` (the dispatcher sends it again later, the message not answered);
    a reply cut short after some parts went out goes on from there when sent again."""
    from gateway.channel import DeliveryFailed

    pacing = Pacing(retry_backoff=0.01, retry_backoff_max=0.05, retry_window=0.3, stop_timeout=5)
    long_text = "\n\n".join(f"paragraph {n} " + "x" * 3000 for n in range(12))
    async with behind_a_proxy(fake, pacing) as (channel, _proxy):
        message = OutboundMessage("telegram", str(CHAT), long_text, f"telegram:{CHAT}")

        async def cut_after_first() -> None:  # the first part goes out; then Telegram fails
            while not fake.sent_messages(CHAT):  # noqa: ASYNC110
                await anyio.sleep(0.001)
            fake.fail_next("sendMessage", 502, count=10_000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cut_after_first)
            with pytest.raises(DeliveryFailed) as failed:
                await channel.send(message)
        assert failed.value.sent >= 1
        parts_before = len(fake.sent_messages(CHAT))
        fake.clear_faults()
        await channel.send(message)  # sent again: only what had not gone out
    texts = [m["text"] for m in fake.sent_messages(CHAT)]
    assert 1 <= parts_before == failed.value.sent < len(texts)
    joined = "".join(texts)
    assert [joined.count(f"paragraph {n} ") for n in range(12)] == [1] * 12
    assert [joined.index(f"paragraph {n} ") for n in range(12)] == sorted(
        joined.index(f"paragraph {n} ") for n in range(12)
    )


async def test_refused_html_is_sent_again_as_plain_text(fake: FakeTelegram) -> None:
    async with running(fake) as channel:
        fake.fail_next(
            "sendMessage",
            400,
            description='Bad Request: can\'t parse entities: Unsupported start tag "x" at byte '
            "offset 0",
        )
        await channel.send(OutboundMessage("telegram", str(CHAT), "**hi**", f"telegram:{CHAT}"))
    first, second = fake.calls_to("sendMessage")
    assert first.params["parse_mode"] == "HTML" and first.status == 400
    assert "parse_mode" not in second.params and second.params["text"] == "**hi**"
    assert [m["text"] for m in fake.sent_messages(CHAT)] == ["**hi**"]


async def test_a_bad_request_is_not_retried_and_reaches_the_caller(fake: FakeTelegram) -> None:
    async with running(fake) as channel:
        fake.fail_next("sendMessage", 403)
        with pytest.raises(Forbidden):
            await channel.send(OutboundMessage("telegram", str(CHAT), "hi", f"telegram:{CHAT}"))
    assert len(fake.calls_to("sendMessage")) == 1


async def test_notices_for_unsupported_content_are_rate_limited(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, sticker="👍"))
    fake.push_update(fake.user_message(CHAT, sticker="👎"))
    fake.push_update(fake.user_message(GROUP, sticker="👍", chat_type="supergroup"))
    original = fake.push_update(fake.user_message(GROUP, "@gateway_bot hi", chat_type="supergroup"))
    fake.push_update(fake.edited_message(original, "@gateway_bot hello"))
    async with running(fake, recorder):
        await recorder.wait(2)
        await wait_sent(fake, CHAT, 1)
        await anyio.sleep(0.2)
    [notice] = fake.sent_messages(CHAT)
    assert notice["text"].startswith("Sorry, I can't open a sticker yet")
    assert fake.sent_messages(GROUP) == []
    # The edit is submitted (naming the message it changes), never answered with a notice.
    assert [m.text for m in recorder.messages] == ["hi", "hello"]
    assert recorder.messages[1].metadata[META_EDIT_OF] == recorder.messages[0].message_id


async def test_streaming_edits_one_message_and_send_finalizes_it(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "tell me"))
    async with running(fake, recorder, streaming=True) as channel:
        [inbound] = await recorder.wait(1)
        text = ""
        for part in ("Once", " upon", " a", " time", ", the **end**."):
            text += part
            await channel.stream_delta(inbound, part)
            await anyio.sleep(0.08)
        await channel.send(reply_to(inbound, text))
    assert len(fake.calls_to("sendMessage")) == 1
    edits = [c for c in fake.calls_to("editMessageText") if c.ok]
    assert len(edits) >= 2
    shown = fake.sent_messages(CHAT)
    assert len({m["message_id"] for m in shown}) == 1
    assert shown[-1]["text"] == "Once upon a time, the end."
    assert shown[-1]["entities"] == [{"type": "bold", "offset": 22, "length": 3}]


async def test_a_refused_final_edit_falls_back_to_plain_text(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "go"))
    async with running(fake, recorder, streaming=True) as channel:
        [inbound] = await recorder.wait(1)
        await channel.stream_delta(inbound, "partial *answer*")
        await anyio.sleep(0.08)
        await channel.stream_delta(inbound, " and more")
        await wait_sent(fake, CHAT, 1)
        fake.fail_next("editMessageText", 400, description="Bad Request: can't parse entities")
        await channel.send(reply_to(inbound, "final *answer*"))
    last = fake.calls_to("editMessageText")[-1]
    assert last.ok and "parse_mode" not in last.params
    assert fake.sent_messages(CHAT)[-1]["text"] == "final *answer*"
    assert len(fake.calls_to("sendMessage")) == 1


async def test_a_long_streamed_reply_fills_the_message_then_continues(
    fake: FakeTelegram,
) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "long please"))
    paragraphs = [f"Paragraph {i}. " + "words " * 150 for i in range(12)]
    text = "\n\n".join(paragraphs)
    async with running(fake, recorder, streaming=True) as channel:
        [inbound] = await recorder.wait(1)
        for paragraph in paragraphs:
            await channel.stream_delta(inbound, paragraph + "\n\n")
            await anyio.sleep(0.06)
        await channel.send(reply_to(inbound, text))
    final: dict[int, str] = {}  # message id -> its last text, in order of first sending
    for message in fake.sent_messages(CHAT):
        final[message["message_id"]] = message["text"]
    expected = [parse_html(markdown_to_html(chunk))[0] for chunk in split_markdown(text)]
    assert list(final.values()) == expected
    assert len(expected) > 1


async def test_streaming_is_off_unless_configured(fake: FakeTelegram) -> None:
    recorder = Recorder()
    fake.push_update(fake.user_message(CHAT, "q"))
    async with running(fake, recorder) as channel:
        [inbound] = await recorder.wait(1)
        await channel.stream_delta(inbound, "partial")
        await anyio.sleep(0.2)
    assert fake.calls_to("sendMessage") == []


# --------------------------------------------------------------------------- webhook


async def test_webhook_mode_sets_the_webhook_and_does_not_poll(fake: FakeTelegram) -> None:
    overrides = {
        "mode": "webhook",
        "webhook_url": "https://bot.example/telegram/webhook",
        "webhook_secret": "s3cret_-token",
    }
    async with running(fake, **overrides):
        pass
    webhook = fake.webhook
    assert webhook["url"] == "https://bot.example/telegram/webhook"
    assert webhook["secret_token"] == "s3cret_-token"
    assert webhook["allowed_updates"] == ["message", "edited_message"]
    assert webhook["drop_pending_updates"] is False
    assert fake.calls_to("getUpdates") == []


# --------------------------------------------------------------------------- setup


def test_configuration_mistakes_are_explained() -> None:
    with pytest.raises(ConfigError, match="TELEGRAM__TOKEN"):
        TelegramChannel(TelegramSettings(), token="")
    with pytest.raises(ConfigError, match="webhook_url"):
        TelegramChannel(TelegramSettings(mode="webhook"), token="1:x")
    bad_secret = TelegramSettings(mode="webhook", webhook_url="https://x", webhook_secret="a b")
    with pytest.raises(ConfigError, match="webhook_secret"):
        TelegramChannel(bad_secret, token="1:x")


async def test_check_credentials_names_the_bot(fake: FakeTelegram) -> None:
    assert await check_credentials(tg_settings(fake), fake.token) == "@gateway_bot (123456789)"
    wrong = "123456789:AAwrongwrongwrongwrongwrongwrongwrong"
    with pytest.raises(TelegramSetupError, match="refused the bot token") as caught:
        await check_credentials(tg_settings(fake), wrong)
    assert wrong not in str(caught.value)
    with pytest.raises(TelegramSetupError, match="no bot token"):
        await check_credentials(tg_settings(fake), "")


async def test_a_refused_token_stops_the_channel_with_a_clear_error(fake: FakeTelegram) -> None:
    wrong = "123456789:AAwrongwrongwrongwrongwrongwrongwrong"
    channel = TelegramChannel(tg_settings(fake), token=wrong, pacing=FAST)
    with pytest.raises(TelegramSetupError, match="refused the bot token") as caught:
        await channel.run(Recorder().submit)
    assert wrong not in str(caught.value)
