"""The QQ channel (channels.qq): which OneBot messages it takes and how they are keyed,
the read positions and the read-back that keep the delivery promise, and how replies go
out; the channel against the fake OneBot implementation (tests/fakes/onebot_server.py),
a recorder standing in for the dispatcher."""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.qq import QQChannel, Skip, conversation_of, target_of, translate_event
from channels.qq.channel import Pacing, QQSendUncertain, QQSetupError
from channels.qq.onebot import NotSent, endpoint, parse_cq, segments_of
from channels.qq.positions import SLACK, Position, Positions
from channels.qq.settings import QQSettings
from channels.qq.spec import SPEC, checks
from channels.qq.translate import META_QUOTES
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.journal.cursors import FileCursorStore, run_with
from gateway.journal.protocol import Lead
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from tests.fakes.onebot_server import DEFAULT_TOKEN, FakeOneBot

pytestmark = pytest.mark.anyio

FAST = Pacing(
    retry_window=1.0,
    retry_backoff=0.01,
    retry_backoff_max=0.05,
    request_timeout=5.0,
    send_timeout=2.0,
    cursor_interval=0.05,
    retry_max=0.2,
    reconnect_max=0.2,
    stop_timeout=5,
)
BOT = "10001"
ALICE, BOB, CAROL, TOWN = 20001, 20002, 20003, 30001


# -- translation (pure) ---------------------------------------------------------------------


def event(message: Any, **extra: Any) -> dict[str, Any]:
    kind = extra.pop("message_type", "private")
    found = {
        "post_type": "message",
        "message_type": kind,
        "sub_type": "normal" if kind == "group" else "friend",
        "message_id": extra.pop("message_id", 1234),
        "user_id": extra.pop("user_id", ALICE),
        "self_id": int(BOT),
        "time": 1_700_000_000,
        "sender": {"user_id": ALICE, "nickname": "Alice", "card": extra.pop("card", "")},
        "message": message,
        **extra,
    }
    if kind == "group":
        found.setdefault("group_id", TOWN)
    return found


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "data": {"text": value}}


def test_a_private_message_is_its_persons_session_with_who_wrote_it() -> None:
    message = translate_event(event([text("hello")]), self_id=BOT)
    assert isinstance(message, InboundMessage)
    assert message.session_key == f"qq:private:{ALICE}" and message.message_id == "1234"
    assert message.text == "hello" and message.sender_id == str(ALICE)
    assert (
        message.metadata[META_IS_GROUP] is False and message.metadata[META_SENDER_NAME] == "Alice"
    )
    assert message.metadata[META_SENT_AT] == 1_700_000_000
    assert META_REPLY_CONTEXT not in message.metadata


def test_in_a_group_an_at_of_the_bot_addresses_it_and_is_cut_out() -> None:
    segments = [{"type": "at", "data": {"qq": BOT}}, text(" what is up?")]
    message = translate_event(event(segments, message_type="group", card="Ali"), self_id=BOT)
    assert isinstance(message, InboundMessage)
    assert message.session_key == f"qq:group:{TOWN}" and message.text == "what is up?"
    assert message.metadata[META_MENTIONED] is True and message.metadata[META_IS_GROUP] is True
    assert message.metadata[META_SENDER_NAME] == "Ali"
    assert message.metadata[META_REPLY_CONTEXT] == {"user_id": str(ALICE)}


def test_at_all_and_other_people_do_not_address_the_bot() -> None:
    segments = [
        {"type": "at", "data": {"qq": "all"}},
        text(" and "),
        {"type": "at", "data": {"qq": str(BOB), "name": "Bob"}},
    ]
    message = translate_event(event(segments, message_type="group"), self_id=BOT)
    assert isinstance(message, InboundMessage)
    assert message.metadata[META_MENTIONED] is False and message.text == "@all and @Bob"


def test_a_quote_of_the_bots_message_is_a_reply_to_it() -> None:
    segments = [{"type": "reply", "data": {"id": "777"}}, text("and then?")]
    to_bot = translate_event(event(segments, message_type="group"), self_id=BOT, quoted_author=BOT)
    to_bob = translate_event(
        event(segments, message_type="group"), self_id=BOT, quoted_author=str(BOB)
    )
    assert isinstance(to_bot, InboundMessage) and isinstance(to_bob, InboundMessage)
    assert to_bot.metadata[META_REPLY_TO_BOT] is True and to_bot.metadata[META_QUOTES] == "777"
    assert to_bob.metadata[META_REPLY_TO_BOT] is False


def test_the_string_format_reads_as_the_array_format() -> None:
    raw = f"[CQ:at,qq={BOT}] 1 &#91;x&#93; &amp; y[CQ:face,id=178]"
    assert segments_of(raw) == parse_cq(raw)
    message = translate_event(event(raw, message_type="group"), self_id=BOT)
    assert isinstance(message, InboundMessage)
    assert message.text == "1 [x] & y[face]" and message.metadata[META_MENTIONED] is True


def test_a_temporary_chat_is_answered_through_its_group() -> None:
    message = translate_event(event([text("hi")], sub_type="group", group_id=TOWN), self_id=BOT)
    assert isinstance(message, InboundMessage)
    assert message.session_key == f"qq:private:{ALICE}"
    assert message.metadata[META_REPLY_CONTEXT] == {"group_id": str(TOWN)}


def test_pictures_become_attachments_with_their_download_address() -> None:
    image = {
        "type": "image",
        "data": {"file": "abc.png", "url": "https://q/abc", "file_size": "12"},
    }
    message = translate_event(event([image]), self_id=BOT)
    assert isinstance(message, InboundMessage) and message.text == ""
    (found,) = message.attachments
    assert (found.kind, found.url, found.size, found.mime_type) == (
        "image",
        "https://q/abc",
        12,
        "image/png",
    )


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (event([text("me")], user_id=int(BOT)), "own"),
        (event([text("x")], post_type="notice"), "not a message"),
        (event([text("anon")], message_type="group", sub_type="anonymous"), "anonymous"),
        (event([{"type": "face", "data": {}}][:0]), "no text"),
        (event([{"type": "at", "data": {"qq": BOT}}], message_type="group"), "no text"),
    ],
)
def test_what_is_skipped(item: dict[str, Any], reason: str) -> None:
    result = translate_event(item, self_id=BOT)
    assert isinstance(result, Skip) and reason in result.reason


def test_conversations_and_targets() -> None:
    assert conversation_of(event([], message_type="group"), BOT) == f"group:{TOWN}"
    own = event([], user_id=int(BOT), target_id=ALICE)
    assert conversation_of(own, BOT) == f"private:{ALICE}"
    assert target_of(f"group:{TOWN}") == ("group", str(TOWN))
    with pytest.raises(ValueError):
        target_of("channel:1")


def test_endpoints_keep_a_proxys_path_and_drop_the_query() -> None:
    assert endpoint("ws://h:3001", "/api") == "ws://h:3001/api"
    assert endpoint("wss://h/onebot/?access_token=x", "/") == "wss://h/onebot/"
    with pytest.raises(ValueError):
        endpoint("http://h:3001", "/")


def test_positions_take_again_a_margin_before_and_survive_a_round_trip() -> None:
    position = Position.before(1000, 5.0)
    assert position.at == 999 and position.read_from == 999 - SLACK
    assert position.settle(1000, 6.0) and not position.settle(1000, 7.0)
    assert not position.settle(998, 7.0) and position.at == 1000
    saved = Positions(watermark=123, conversations={"group:1": position})
    again = Positions.from_json(saved.to_json())
    assert again.watermark == 123 and again.conversations["group:1"] == position
    for raw in ('{"version": 9}', '{"version": 1}', "[]"):
        with pytest.raises(ValueError):
            Positions.from_json(raw)


def test_a_url_that_is_no_websocket_is_a_configuration_error() -> None:
    lead = run_with(FileCursorStore(Path(tempfile.mkdtemp()) / "c.json"))
    with pytest.raises(ConfigError, match=r"channels\.qq\.url"):
        QQChannel(QQSettings(enabled=True, url="http://127.0.0.1:3001"), token="t", lead=lead)


def test_the_spec_declares_the_leader_role_and_what_qq_offers() -> None:
    assert SPEC.leader_roles == ("qq websocket",) and SPEC.extra == "qq"
    assert SPEC.offers.groups and SPEC.offers.catch_up and not SPEC.offers.edits
    assert not SPEC.offers.threads and SPEC.people is not None


# -- the channel against the fake ---------------------------------------------------------------


class StubTicket:
    def __init__(self, taken: bool = True) -> None:
        self.taken = taken

    async def reply(self) -> OutboundMessage | None:
        return None


class Recorder:
    """Stands in for the dispatcher: records what the channel submits; `taken` False
    refuses (the journal failed)."""

    def __init__(self, *, taken: bool = True) -> None:
        self.messages: list[InboundMessage] = []
        self.refused: list[InboundMessage] = []
        self.taken = taken

    async def submit(self, message: InboundMessage) -> StubTicket:
        if not self.taken:
            self.refused.append(message)
            return StubTicket(taken=False)
        self.messages.append(message)
        return StubTicket()

    def texts(self) -> list[str]:
        return [m.text for m in self.messages]

    async def wait(self, count: int, seconds: float = 10) -> list[InboundMessage]:
        with anyio.fail_after(seconds):
            while len(self.messages) < count:  # noqa: ASYNC110 (polling a test recorder)
                await anyio.sleep(0.01)
        return self.messages


@pytest.fixture
async def fake() -> AsyncIterator[FakeOneBot]:
    async with FakeOneBot() as server:
        server.add_friend(ALICE, "Alice")
        server.add_friend(BOB, "Bob")
        server.add_group(TOWN, "Town", {ALICE: "Alice", BOB: "Bob", CAROL: "Carol"})
        yield server


class Saved:
    """Where a channel saves its read positions (a cursor file), and what is there."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def fresh(cls) -> Saved:
        return cls(Path(tempfile.mkdtemp(prefix="qq-cursors-")) / "cursors.json")

    def lead(self) -> Lead:
        return run_with(FileCursorStore(self.path))

    def positions(self) -> Positions | None:
        if not self.path.exists():
            return None
        raw = json.loads(self.path.read_text()).get(f"qq:{BOT}")
        return Positions.from_json(raw) if raw is not None else None


def ws_url(fake: FakeOneBot) -> str:
    return fake.url.replace("http://", "ws://")


@asynccontextmanager
async def running(
    fake: FakeOneBot,
    recorder: Recorder | None = None,
    cursors: Saved | None = None,
    *,
    token: str | None = DEFAULT_TOKEN,
    **overrides: Any,
) -> AsyncIterator[QQChannel]:
    settings = QQSettings(**({"enabled": True, "url": ws_url(fake)} | overrides))
    channel = QQChannel(settings, token=token, lead=(cursors or Saved.fresh()).lead(), pacing=FAST)
    submit = (recorder or Recorder()).submit
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        with anyio.fail_after(10):
            await channel.live.wait()
        try:
            yield channel
        finally:
            tg.cancel_scope.cancel()


def reply_to(message: InboundMessage, body: str, **extra: Any) -> OutboundMessage:
    metadata = {}
    if META_REPLY_CONTEXT in message.metadata:
        metadata[META_REPLY_CONTEXT] = message.metadata[META_REPLY_CONTEXT]
    return OutboundMessage(
        channel="qq",
        chat_id=message.chat_id,
        text=body,
        session_key=message.session_key,
        reply_to=message.message_id,
        metadata=metadata,
        **extra,
    )


async def until(condition: Callable[[], object], seconds: float = 10) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 (polling the fake)
            await anyio.sleep(0.02)


async def test_private_and_group_messages_are_submitted_in_order_with_their_mentions(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(ALICE, "one")
        fake.user_message(ALICE, fake.mention("two"), group_id=TOWN)
        fake.user_message(CAROL, "chatter", group_id=TOWN)
        messages = await recorder.wait(3)
    assert [m.text for m in messages] == ["one", "two", "chatter"]
    assert [m.session_key for m in messages] == [
        f"qq:private:{ALICE}",
        f"qq:group:{TOWN}",
        f"qq:group:{TOWN}",
    ]
    assert [m.metadata[META_MENTIONED] for m in messages[1:]] == [True, False]


async def test_a_quote_of_the_bots_message_is_told_by_the_implementation(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        first = fake.user_message(ALICE, fake.mention("hi"), group_id=TOWN)
        (message,) = await recorder.wait(1)
        await channel.send(reply_to(message, "hello Alice"))
        mine = fake.bot_messages()[0].message_id
        fake.user_message(BOB, fake.quote(mine, "and me?"), group_id=TOWN)
        fake.user_message(BOB, fake.quote(first.message_id, "me too"), group_id=TOWN)
        messages = await recorder.wait(3)
    assert [m.metadata[META_REPLY_TO_BOT] for m in messages[1:]] == [True, False]


async def test_a_quote_of_a_message_from_before_the_start_is_looked_up_with_get_msg(
    fake: FakeOneBot,
) -> None:
    async with running(fake) as channel:
        (message,) = await _one(fake, channel, "earlier")
        await channel.send(reply_to(message, "said before"))
    mine = fake.bot_messages()[0].message_id
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(BOB, fake.quote(mine, "about that"), group_id=TOWN)
        *_, quoting = await recorder.wait(1)
    assert quoting.metadata[META_REPLY_TO_BOT] is True
    assert [c.method for c in fake.calls_to("get_msg")] == ["get_msg"]


async def _one(fake: FakeOneBot, channel: QQChannel, body: str) -> list[InboundMessage]:
    recorder = Recorder()
    channel._submit = recorder.submit
    fake.user_message(ALICE, fake.mention(body), group_id=TOWN)
    return await recorder.wait(1)


async def test_what_was_written_while_away_is_read_back_oldest_first_ties_included(
    fake: FakeOneBot,
) -> None:
    cursors = Saved.fresh()
    recorder = Recorder()
    async with running(fake, recorder, cursors):
        fake.user_message(ALICE, "before")
        fake.user_message(BOB, "group before", group_id=TOWN)
        await recorder.wait(2)
    fake.freeze_clock(fake.now() + 5)
    for n in range(70):  # more than a history page, all in one second
        fake.user_message(ALICE, f"away {n}")
    fake.user_message(BOB, "group away", group_id=TOWN)
    fake.freeze_clock(None)
    again = Recorder()
    async with running(fake, again, cursors):
        fake.user_message(ALICE, "live")
        await until(lambda: "live" in again.texts())
    texts = again.texts()
    assert [t for t in texts if t.startswith("away")] == [f"away {n}" for n in range(70)]
    assert texts.index("away 69") < texts.index("live") and "group away" in texts
    # What was settled within `SLACK` seconds before the positions is taken again (the
    # journal drops it), nothing twice within one run.
    assert set(texts) - {f"away {n}" for n in range(70)} <= {
        "before",
        "group before",
        "group away",
        "live",
    }
    assert len(texts) == len({(m.chat_id, m.message_id) for m in again.messages})


async def test_a_friends_first_message_while_away_is_found_from_the_watermark(
    fake: FakeOneBot,
) -> None:
    cursors = Saved.fresh()
    async with running(fake, Recorder(), cursors):
        await until(lambda: (cursors.positions() or Positions()).watermark is not None)
    fake.add_friend(CAROL, "Carol")
    fake.user_message(CAROL, "hello from someone new")
    recorder = Recorder()
    async with running(fake, recorder, cursors):
        (message,) = await recorder.wait(1)
    assert message.session_key == f"qq:private:{CAROL}"


async def test_a_first_run_answers_nothing_from_before_it(fake: FakeOneBot) -> None:
    fake.user_message(ALICE, "ancient")
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(ALICE, "now")
        await recorder.wait(1)
        await anyio.sleep(0.3)
    assert recorder.texts() == ["now"]


async def test_a_message_the_journal_did_not_take_is_read_back_and_nothing_after_it_first(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder(taken=False)
    cursors = Saved.fresh()
    async with running(fake, recorder, cursors):
        fake.user_message(ALICE, "first")
        await until(lambda: recorder.refused)
        fake.user_message(ALICE, "second")
        await anyio.sleep(0.2)
        assert recorder.messages == []
        recorder.taken = True
        await recorder.wait(2)
    assert recorder.texts() == ["first", "second"]
    saved = cursors.positions()
    assert saved is not None and f"private:{ALICE}" in saved.conversations


async def test_a_new_conversations_position_is_saved_before_its_first_message(
    fake: FakeOneBot,
) -> None:
    cursors = Saved.fresh()
    seen: list[Positions | None] = []

    class Peeking(Recorder):
        async def submit(self, message: InboundMessage) -> StubTicket:
            seen.append(cursors.positions())
            return await super().submit(message)

    recorder = Peeking()
    async with running(fake, recorder, cursors):
        fake.user_message(ALICE, "first ever")
        await recorder.wait(1)
    assert seen[0] is not None and f"private:{ALICE}" in seen[0].conversations


async def test_the_same_message_delivered_twice_is_submitted_once(fake: FakeOneBot) -> None:
    recorder = Recorder()
    async with running(fake, recorder):
        record = fake.user_message(ALICE, "once")
        fake.redeliver(record.message_id)
        fake.user_message(ALICE, "next")
        await recorder.wait(2)
        await anyio.sleep(0.2)
    assert recorder.texts() == ["once", "next"]


async def test_a_dropped_connection_is_reopened_and_what_it_missed_read_back(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(ALICE, "before")
        await recorder.wait(1)
        await until(lambda: channel._positions.watermark is not None)
        fake.drop_connections()
        await until(lambda: fake.event_connections == 0)
        fake.user_message(ALICE, "during")
        await recorder.wait(2)
    assert recorder.texts() == ["before", "during"] and channel.stats.connections >= 2


async def test_without_a_history_the_channel_still_runs_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with FakeOneBot(history=False) as fake:
        fake.add_friend(ALICE, "Alice")
        recorder = Recorder()
        async with running(fake, recorder, Saved.fresh()) as channel:
            fake.user_message(ALICE, "live only")
            await recorder.wait(1)
            assert channel._history is False


async def test_without_a_history_a_message_not_taken_is_submitted_again_in_place() -> None:
    async with FakeOneBot(history=False) as fake:
        fake.add_friend(ALICE, "Alice")
        recorder = Recorder(taken=False)
        async with running(fake, recorder, Saved.fresh()) as channel:
            channel._history = False
            fake.user_message(ALICE, "held")
            await until(lambda: recorder.refused)
            recorder.taken = True
            fake.user_message(ALICE, "after")
            await recorder.wait(2)
    assert recorder.texts() == ["held", "after"]


async def test_a_refused_token_fails_run_with_what_to_fix(fake: FakeOneBot) -> None:
    settings = QQSettings(enabled=True, url=ws_url(fake))
    channel = QQChannel(settings, token="wrong", lead=Saved.fresh().lead(), pacing=FAST)
    with anyio.fail_after(10), pytest.raises(QQSetupError, match="ACCESS_TOKEN"):
        await channel.run(Recorder().submit)


async def test_an_unreachable_implementation_fails_run_with_what_to_fix() -> None:
    settings = QQSettings(enabled=True, url="ws://127.0.0.1:9")
    channel = QQChannel(settings, token=None, lead=Saved.fresh().lead(), pacing=FAST)
    with anyio.fail_after(10), pytest.raises(QQSetupError, match="cannot reach"):
        await channel.run(Recorder().submit)


# -- replies ---------------------------------------------------------------------------------


async def test_a_group_reply_quotes_its_message_and_mentions_its_sender_only(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(ALICE, fake.mention("hi"), group_id=TOWN)
        (message,) = await recorder.wait(1)
        await channel.send(reply_to(message, "**hello** [CQ:at,qq=all] @all"))
    (sent,) = fake.bot_messages()
    assert sent.conversation == f"group:{TOWN}" and not sent.pings_everyone
    assert sent.segments == [
        {"type": "reply", "data": {"id": message.message_id}},
        {"type": "at", "data": {"qq": str(ALICE)}},
        {"type": "text", "data": {"text": " "}},
        {"type": "text", "data": {"text": "hello [CQ:at,qq=all] @all"}},
    ]


async def test_a_private_reply_is_plain_text_and_a_long_one_is_split_in_order(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder, max_message_chars=500) as channel:
        fake.user_message(ALICE, "long please")
        (message,) = await recorder.wait(1)
        lines = [f"line {n:04d} " + "x" * 40 for n in range(40)]
        await channel.send(reply_to(message, "\n".join(lines)))
    sent = fake.bot_messages()
    assert len(sent) > 2 and all(s.conversation == f"private:{ALICE}" for s in sent)
    texts = ["".join(seg["data"]["text"] for seg in s.segments) for s in sent]
    assert all(len(t) <= 500 for t in texts)
    assert "\n".join(texts).split("\n") == lines


async def test_a_reply_in_a_temporary_chat_goes_through_its_group(fake: FakeOneBot) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(CAROL, "hi from the group", temp_group=TOWN)
        (message,) = await recorder.wait(1)
        await channel.send(reply_to(message, "hello"))
    (sent,) = fake.bot_messages()
    assert (sent.conversation, sent.temp_group) == (f"private:{CAROL}", TOWN)


async def test_an_unreachable_implementation_fails_delivery_and_a_resend_goes_on_from_the_part(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    async with running(fake, recorder, max_message_chars=200) as channel:
        fake.user_message(ALICE, "hi")
        (message,) = await recorder.wait(1)
        reply = reply_to(message, "\n\n".join(f"part {n} " + "y" * 150 for n in range(3)))
        original = channel._call
        sends = 0

        async def flaky(action: str, params: dict[str, Any] | None = None, *, wait: float) -> Any:
            nonlocal sends
            if action == "send_private_msg":
                sends += 1
                if sends >= 2:  # the implementation is gone for longer than the retries
                    raise NotSent("the connection is closed")
            return await original(action, params, wait=wait)

        channel._call = flaky  # type: ignore[method-assign]
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 1 and len(fake.bot_messages()) == 1
        channel._call = original  # type: ignore[method-assign]
        await channel.send(reply)
    texts = [s.segments[-1]["data"]["text"] for s in fake.bot_messages()]
    assert [t.split(" ")[1] for t in texts] == ["0", "1", "2"]


async def test_a_send_that_may_have_gone_out_is_not_sent_again(fake: FakeOneBot) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(ALICE, "hi")
        (message,) = await recorder.wait(1)
        fake.fail_next("send_private_msg", cut=True)
        with pytest.raises(QQSendUncertain):
            await channel.send(reply_to(message, "maybe"))
        fake.fail_next("send_private_msg", message="Timeout: NTEvent serviceAndMethod:...")
        with pytest.raises(QQSendUncertain):
            await channel.send(reply_to(message, "maybe again"))
    assert len(fake.bot_messages()) == 1  # the cut one went out; nothing was repeated


async def test_a_muted_bots_reply_is_refused_by_name_and_handed_back(fake: FakeOneBot) -> None:
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(ALICE, fake.mention("hi"), group_id=TOWN)
        (message,) = await recorder.wait(1)
        fake.mute(TOWN)
        with pytest.raises(DeliveryFailed, match="muted"):
            await channel.send(reply_to(message, "shh"))
        fake.mute(TOWN, False)
        await channel.send(reply_to(message, "shh"))
    assert len(fake.bot_messages()) == 1 and channel.stats.refused == 1


async def test_pictures_go_out_as_image_segments_and_come_in_as_attachments(
    fake: FakeOneBot,
) -> None:
    recorder = Recorder()
    png = b"\x89PNG\r\n\x1a\n" + b"0" * 16
    async with running(fake, recorder) as channel:
        fake.user_message(ALICE, [fake.image_segment(png)])
        (message,) = await recorder.wait(1)
        (attachment,) = message.attachments
        assert await channel.fetch_file(attachment, max_bytes=1000) == png
        picture = OutboundFile("chart.png", png, "image/png")
        await channel.send(reply_to(message, "here", files=(picture,)))
    words, image = fake.bot_messages()
    assert words.segments[-1]["data"]["text"] == "here"
    assert image.segments[0]["type"] == "image" and image.files["image"] == png


async def test_doctor_says_who_the_account_is_and_whether_there_is_a_history(
    fake: FakeOneBot,
) -> None:
    settings = QQSettings(enabled=True, url=ws_url(fake))
    found = await checks(settings.model_copy(update={"access_token": _secret(DEFAULT_TOKEN)}))
    lines = [f.line() for f in found]
    assert found[0].status == "ok" and "kit-bot (10001) on NapCat.Onebot" in lines[0]
    assert any("history answers" in line for line in lines)
    refused = await checks(settings.model_copy(update={"access_token": _secret("wrong")}))
    assert refused[0].status == "fail" and "refused the access token" in refused[0].what


def _secret(value: str) -> Any:
    from pydantic import SecretStr

    return SecretStr(value)
