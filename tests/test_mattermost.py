"""The Mattermost channel (channels.mattermost): which posts it takes and how they are
keyed, the read positions and the read-back that keep the delivery promise, and how
replies go out; the channel against the fake Mattermost (tests/fakes/mattermost_server.py),
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

from channels.mattermost import MattermostChannel, Pacing, Sender, Skip, target_of, translate_post
from channels.mattermost.channel import MattermostSetupError, pending_post_id
from channels.mattermost.positions import Position, Positions
from channels.mattermost.settings import MattermostSettings
from channels.mattermost.spec import checks
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.journal.cursors import FileCursorStore, run_with
from gateway.journal.protocol import Lead
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from tests.fakes.mattermost_server import DEFAULT_TOKEN, FakeMattermost

pytestmark = pytest.mark.anyio

FAST = Pacing(
    retry_window=2.0,
    retry_backoff=0.01,
    retry_backoff_max=0.05,
    typing_grace=0.05,
    typing_interval=0.2,
    stream_interval=0.05,
    cursor_interval=0.05,
    hello_timeout=5.0,
    stop_timeout=5,
)
BOT_ID = "b" * 26


# -- translation (pure) ---------------------------------------------------------------------


def post(message: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": extra.pop("id", "p" * 26),
        "channel_id": extra.pop("channel_id", "c" * 26),
        "user_id": extra.pop("user_id", "u" * 26),
        "root_id": extra.pop("root_id", ""),
        "create_at": 1_700_000_000_000,
        "update_at": 1_700_000_000_000,
        "edit_at": 0,
        "delete_at": 0,
        "type": "",
        "props": {},
        "message": message,
        **extra,
    }


ALICE = Sender("u" * 26, "alice", "Alice Liddell")


def take(item: dict[str, Any], kind: str, **extra: Any) -> InboundMessage | Skip:
    return translate_post(item, kind, bot_id=BOT_ID, bot_username="kit-bot", sender=ALICE, **extra)


def test_a_dm_is_its_channels_session_with_who_wrote_it() -> None:
    message = take(post("hello"), "D")
    assert isinstance(message, InboundMessage)
    assert message.session_key == f"mattermost:{'c' * 26}"
    assert message.text == "hello" and message.sender_id == "u" * 26
    assert message.metadata[META_IS_GROUP] is False
    assert message.metadata[META_SENDER_NAME] == "Alice Liddell (@alice)"
    assert META_REPLY_CONTEXT not in message.metadata


def test_in_a_channel_the_mention_is_cut_out_said_and_the_reply_will_name_the_sender() -> None:
    message = take(post("@kit-bot, what is up?"), "O")
    assert isinstance(message, InboundMessage)
    assert message.text == "what is up?"
    assert message.metadata[META_MENTIONED] is True and message.metadata[META_IS_GROUP] is True
    assert message.metadata[META_REPLY_CONTEXT] == {"mention": "alice"}
    chatter = take(post("just chatting, kit-bot@example.com `@kit-bot`"), "P")
    assert isinstance(chatter, InboundMessage) and chatter.metadata[META_MENTIONED] is False


def test_a_thread_is_a_session_of_its_own_and_a_reply_to_the_bots_thread_is_addressed() -> None:
    message = take(post("more", root_id="r" * 26), "O", root_author=BOT_ID)
    assert isinstance(message, InboundMessage)
    assert message.session_key == f"mattermost:{'c' * 26}:thread:{'r' * 26}"
    assert message.metadata[META_REPLY_TO_BOT] is True
    assert target_of(message.chat_id, message.thread_id) == ("c" * 26, "r" * 26)
    assert target_of(f"{'c' * 26}:thread:{'r' * 26}") == ("c" * 26, "r" * 26)


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (post("me", user_id=BOT_ID), "own"),
        (post("joined", type="system_join_channel"), "system"),
        (post("hook", props={"from_webhook": "true"}), "bot"),
        (post("other bot", props={"from_bot": "true"}), "bot"),
        (post(""), "no text"),
    ],
)
def test_what_is_not_a_person_writing_is_skipped(item: dict[str, Any], reason: str) -> None:
    skipped = take(item, "O")
    assert isinstance(skipped, Skip) and reason in skipped.reason


def test_files_become_references_by_kind() -> None:
    files = [
        {"id": "f1", "name": "a.png", "mime_type": "image/png", "size": 3},
        {"id": "f2", "name": "v.ogg", "mime_type": "audio/ogg", "size": 4},
        {"id": "f3", "name": "r.pdf", "mime_type": "application/pdf", "size": 5},
    ]
    message = take(post("", file_ids=["f1", "f2", "f3"], metadata={"files": files}), "D")
    assert isinstance(message, InboundMessage)
    assert [(a.kind, a.file_id, a.name) for a in message.attachments] == [
        ("image", "f1", "a.png"),
        ("voice", "f2", "v.ogg"),
        ("document", "f3", "r.pdf"),
    ]


def test_an_edit_is_a_message_of_its_own_naming_the_post_it_changes() -> None:
    edited = take(post("fixed", edit_at=1_700_000_000_500), "D", edited=True)
    assert isinstance(edited, InboundMessage)
    assert edited.message_id == f"{'p' * 26}:edit:1700000000500"
    assert edited.metadata[META_EDIT_OF] == "p" * 26


def test_pending_post_ids_repeat_for_the_same_part_and_differ_otherwise() -> None:
    one = pending_post_id(BOT_ID, "m1", "part 0", "hi")
    assert one == pending_post_id(BOT_ID, "m1", "part 0", "hi")
    assert one != pending_post_id(BOT_ID, "m1", "part 1", "hi")
    assert pending_post_id(BOT_ID, None, "part 0", "hi") != pending_post_id(
        BOT_ID, None, "part 0", "hi"
    )


# -- read positions (pure) -------------------------------------------------------------------


def test_a_position_never_skips_a_post_of_the_millisecond_it_stopped_at() -> None:
    position = Position.before(100, 0.0)
    assert position.is_new("a", 100) and position.anchor is None
    position.settle("a", 100, 1.0)
    position.settle("b", 100, 1.0)
    assert not position.is_new("a", 100) and not position.is_new("b", 100)
    assert position.is_new("c", 100), "a third post of that millisecond is still new"
    position.settle("d", 105, 2.0)
    # The read-back starts after a post of 100 (strictly later: 105 and on), and a post
    # of 105 not settled yet is new.
    assert position.anchor in {"a", "b"} and position.anchor_at == 100
    assert position.is_new("e", 105) and not position.is_new("d", 105)
    assert not position.settle("old", 90, 3.0)


def test_the_positions_document_round_trips_and_refuses_what_it_cannot_read() -> None:
    positions = Positions(123, {"c1": Position(5, {"x"}, "y", 4, 10.0)})
    again = Positions.from_json(positions.to_json())
    assert again.watermark == 123 and again.channels["c1"].last_ids == {"x"}
    for raw in ('{"version": 9}', '{"version": 1}', "[]"):
        with pytest.raises(ValueError):
            Positions.from_json(raw)


def test_missing_settings_are_configuration_errors() -> None:
    lead = run_with(FileCursorStore(Path(tempfile.mkdtemp()) / "c.json"))
    with pytest.raises(ConfigError, match="TOKEN"):
        MattermostChannel(MattermostSettings(enabled=True, url="http://x"), token="", lead=lead)
    with pytest.raises(ConfigError, match="url"):
        MattermostChannel(MattermostSettings(enabled=True), token="t", lead=lead)


# -- the channel against the fake ---------------------------------------------------------------


class StubTicket:
    def __init__(self, taken: bool = True) -> None:
        self.answered = anyio.Event()
        self.taken = taken

    async def reply(self) -> OutboundMessage | None:
        await self.answered.wait()
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
        ticket = StubTicket()
        ticket.answered.set()
        return ticket

    def texts(self) -> list[str]:
        return [m.text for m in self.messages]

    async def wait(self, count: int, seconds: float = 10) -> list[InboundMessage]:
        with anyio.fail_after(seconds):
            while len(self.messages) < count:  # noqa: ASYNC110 (polling a test recorder)
                await anyio.sleep(0.01)
        return self.messages


@pytest.fixture
async def fake() -> AsyncIterator[FakeMattermost]:
    async with FakeMattermost(bot_username="kit-bot") as server:
        yield server


class Saved:
    """Where a channel saves its read positions (a cursor file), and what is there."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def fresh(cls) -> Saved:
        return cls(Path(tempfile.mkdtemp(prefix="mattermost-cursors-")) / "cursors.json")

    def lead(self) -> Lead:
        return run_with(FileCursorStore(self.path))

    def positions(self, fake: FakeMattermost) -> Positions | None:
        if not self.path.exists():
            return None
        raw = json.loads(self.path.read_text()).get(f"mattermost:{fake.bot_id}")
        return Positions.from_json(raw) if raw is not None else None


@asynccontextmanager
async def running(
    fake: FakeMattermost,
    recorder: Recorder | None = None,
    cursors: Saved | None = None,
    pacing: Pacing = FAST,
    **overrides: Any,
) -> AsyncIterator[MattermostChannel]:
    settings = MattermostSettings(**({"enabled": True, "url": fake.url} | overrides))
    channel = MattermostChannel(
        settings, token=DEFAULT_TOKEN, lead=(cursors or Saved.fresh()).lead(), pacing=pacing
    )
    submit = (recorder or Recorder()).submit
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        with anyio.fail_after(10):
            await channel.live.wait()
        try:
            yield channel
        finally:
            tg.cancel_scope.cancel()


def reply_to(message: InboundMessage, text: str, **extra: Any) -> OutboundMessage:
    metadata = {}
    if META_REPLY_CONTEXT in message.metadata:
        metadata[META_REPLY_CONTEXT] = message.metadata[META_REPLY_CONTEXT]
    return OutboundMessage(
        channel="mattermost",
        chat_id=message.chat_id,
        text=text,
        session_key=message.session_key,
        reply_to=message.message_id,
        thread_id=message.thread_id,
        metadata=metadata,
        **extra,
    )


async def until(condition: Callable[[], object], seconds: float = 10) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 (polling the fake)
            await anyio.sleep(0.02)


def people(fake: FakeMattermost) -> tuple[str, str, str]:
    alice = str(fake.add_user("alice", first_name="Alice")["id"])
    dm = str(fake.dm_channel(alice, fake.bot_id)["id"])
    town = str(fake.open_channel("town", [alice, fake.bot_id])["id"])
    return alice, dm, town


async def test_posts_in_dms_channels_and_threads_are_submitted_in_order(
    fake: FakeMattermost,
) -> None:
    alice, dm, town = people(fake)
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "one")
        root = fake.user_message(town, alice, "@kit-bot two")
        fake.user_message(town, alice, "three", root_id=root["id"])
        fake.user_message(town, alice, "chatter")
        messages = await recorder.wait(4)
    assert [m.text for m in messages] == ["one", "two", "three", "chatter"]
    assert messages[2].session_key == f"mattermost:{town}:thread:{root['id']}"
    assert [m.metadata[META_MENTIONED] for m in messages[1:]] == [True, False, False]


async def test_what_was_written_while_away_is_read_back_oldest_first_ties_included(
    fake: FakeMattermost,
) -> None:
    alice, dm, town = people(fake)
    saved = Saved.fresh()
    recorder = Recorder()
    async with running(fake, recorder, saved) as channel:
        fake.user_message(dm, alice, "before")
        await recorder.wait(1)
        await until(lambda: (p := saved.positions(fake)) is not None and p.watermark is not None)
        await until(lambda: dm in (saved.positions(fake) or Positions()).channels)
        await until(lambda: not channel._dirty)
    # While away: posts of one millisecond (the last settled one's too), in a DM, and a
    # channel the bot never heard from.
    settled = fake.posts[recorder.messages[0].message_id or ""]["create_at"]
    fake.freeze_clock(settled)
    fake.user_message(dm, alice, "same millisecond")
    fake.freeze_clock(settled + 5)
    fake.user_message(dm, alice, "later a")
    fake.user_message(dm, alice, "later b")
    fake.freeze_clock(None)
    fake.user_message(town, alice, "@kit-bot in town")
    async with running(fake, recorder, saved):
        await recorder.wait(5)
        fake.user_message(dm, alice, "live")
        await recorder.wait(6)
    in_dm = [m.text for m in recorder.messages if m.chat_id == dm]
    assert in_dm == ["before", "same millisecond", "later a", "later b", "live"]
    assert [m.text for m in recorder.messages if m.chat_id == town] == ["in town"]


async def test_the_read_back_is_bounded_by_age_and_count(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    saved = Saved.fresh()
    recorder = Recorder()
    async with running(fake, recorder, saved):
        fake.user_message(dm, alice, "hello")
        await recorder.wait(1)
        await until(lambda: dm in (saved.positions(fake) or Positions()).channels)
    for n in range(5):
        fake.user_message(dm, alice, f"away {n}")
    async with running(fake, recorder, saved, backfill_max_messages=3):
        await recorder.wait(4)
        await anyio.sleep(0.3)
    assert recorder.texts() == ["hello", "away 0", "away 1", "away 2"]


async def test_a_post_not_taken_stops_its_channel_until_it_is_read_back(
    fake: FakeMattermost,
) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder(taken=False)
    async with running(fake, recorder):
        fake.user_message(dm, alice, "first")
        fake.user_message(dm, alice, "second")
        await until(lambda: len(recorder.refused) >= 1)
        recorder.taken = True
        await recorder.wait(2)
    assert recorder.texts() == ["first", "second"]


async def test_a_reconnect_loses_nothing_and_submits_nothing_twice(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "one")
        await recorder.wait(1)
        fake.drop_websockets()
        fake.user_message(dm, alice, "while dropped")
        await recorder.wait(2)
        fake.user_message(dm, alice, "after")
        await recorder.wait(3)
        post = fake.user_message(dm, alice, "twice")
        fake.rebroadcast(post["id"])
        await recorder.wait(4)
        await anyio.sleep(0.3)
    assert recorder.texts() == ["one", "while dropped", "after", "twice"]


async def test_paused_intake_leaves_posts_for_the_next_start(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    saved = Saved.fresh()
    recorder = Recorder()
    async with running(fake, recorder, saved) as channel:
        fake.user_message(dm, alice, "taken")
        await recorder.wait(1)
        channel.pause_intake()
        fake.user_message(dm, alice, "left")
        await anyio.sleep(0.3)
    assert recorder.texts() == ["taken"]
    async with running(fake, recorder, saved):
        await recorder.wait(2)
    assert recorder.texts() == ["taken", "left"]


async def test_an_edit_is_submitted_as_an_edit(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder):
        first = fake.user_message(dm, alice, "typo")
        await recorder.wait(1)
        fake.edit_message(first["id"], "fixed")
        messages = await recorder.wait(2)
    assert messages[1].text == "fixed" and messages[1].metadata[META_EDIT_OF] == first["id"]


async def test_a_reply_names_its_sender_in_a_channel_pings_no_one_and_is_split(
    fake: FakeMattermost,
) -> None:
    alice, _, town = people(fake)
    recorder = Recorder()
    async with running(fake, recorder, max_post_chars=1000) as channel:
        fake.user_message(town, alice, "@kit-bot hi")
        message = (await recorder.wait(1))[0]
        text = "Hello @channel and @alice!\n\n" + "\n\n".join(f"line {n} " * 20 for n in range(12))
        await channel.send(reply_to(message, text))
    posts = fake.bot_posts()
    assert len(posts) >= 2 and all(len(p["message"]) <= 1000 for p in posts)
    assert posts[0]["message"].startswith("@alice Hello")
    mentioned, everyone = fake.mentioned_users(posts[0])
    assert mentioned == {alice} and not everyone
    assert all(not fake.mentioned_users(p)[0] for p in posts[1:])


async def test_a_reply_sent_again_posts_nothing_new(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "hi")
        message = (await recorder.wait(1))[0]
        await channel.send(reply_to(message, "once"))
        await channel.send(reply_to(message, "once"))
    assert [p["message"] for p in fake.bot_posts()] == ["once"]


async def test_a_post_whose_answer_was_lost_is_repeated_without_a_second_post(
    fake: FakeMattermost,
) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "hi")
        message = (await recorder.wait(1))[0]
        fake.fail_next("POST /posts", cut_after=True)
        await channel.send(reply_to(message, "exactly once"))
    assert [p["message"] for p in fake.bot_posts()] == ["exactly once"]


async def test_server_errors_and_rate_limits_are_ridden_out(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "hi")
        message = (await recorder.wait(1))[0]
        fake.fail_next("POST /posts", 503, count=2)
        fake.fail_next("POST /posts", 429, retry_after=0.1)
        await channel.send(reply_to(message, "patient"))
    assert [p["message"] for p in fake.bot_posts()] == ["patient"]


async def test_a_reply_cut_short_raises_delivery_failed_and_resumes_at_the_failed_post(
    fake: FakeMattermost,
) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder, max_post_chars=1000) as channel:
        fake.user_message(dm, alice, "hi")
        message = (await recorder.wait(1))[0]
        text = "\n\n".join(f"part {n} " + "x" * 600 for n in range(3))
        reply = reply_to(message, text)
        # The first post goes out; the server then fails for longer than the window.
        fake.fail_next("POST /posts", 503, count=10_000, skip=1)
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 1
        fake._faults.clear()
        await channel.send(reply)
    texts = [p["message"][:6] for p in fake.bot_posts()]
    assert texts == ["part 0", "part 1", "part 2"]


async def test_typing_shows_while_a_turn_runs(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)

    class Slow(Recorder):
        async def submit(self, message: InboundMessage) -> StubTicket:
            self.messages.append(message)
            return StubTicket()  # never answered while the test runs

    recorder = Slow()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "think")
        await recorder.wait(1)
        await until(lambda: len(fake.calls_to("POST /users/{id}/typing")) >= 2)
    body = fake.calls_to("POST /users/{id}/typing")[0].body
    assert body == {"channel_id": dm, "parent_id": ""}


async def test_streaming_posts_early_edits_and_finishes_in_place(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder, streaming=True) as channel:
        fake.user_message(dm, alice, "stream")
        message = (await recorder.wait(1))[0]
        for word in ("one ", "two ", "three "):
            await channel.stream_delta(message, word)
            await anyio.sleep(0.1)
        await channel.send(reply_to(message, "one two three four"))
    posts = fake.bot_posts()
    assert [p["message"] for p in posts] == ["one two three four"]
    assert posts[0]["edit_at"] > 0


async def test_files_in_are_fetched_and_files_out_follow_the_text(fake: FakeMattermost) -> None:
    alice, dm, _ = people(fake)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        info = fake.upload_as(alice, dm, "cat.png", b"PNG!", "image/png")
        fake.user_message(dm, alice, "look", file_ids=[info["id"]])
        message = (await recorder.wait(1))[0]
        attachment = message.attachments[0]
        assert await channel.fetch_file(attachment, max_bytes=100) == b"PNG!"
        big = Attachment("image", attachment.file_id, "cat.png", "image/png", 10_000)
        with pytest.raises(Exception, match="limit"):
            await channel.fetch_file(big, max_bytes=100)
        file = OutboundFile("chart.png", b"CHART", "image/png", caption="the chart")
        await channel.send(reply_to(message, "here it is", files=(file,)))
    posts = fake.bot_posts()
    assert [p["message"] for p in posts] == ["here it is", "the chart"]
    assert posts[1]["metadata"]["files"][0]["name"] == "chart.png"


async def test_a_refused_token_fails_run_with_what_to_fix(fake: FakeMattermost) -> None:
    settings = MattermostSettings(enabled=True, url=fake.url)
    channel = MattermostChannel(settings, token="wrong", lead=Saved.fresh().lead(), pacing=FAST)
    with pytest.raises(MattermostSetupError, match="Bot Accounts"):
        await channel.run(Recorder().submit)


async def test_a_token_revoked_while_running_ends_the_channel_with_what_to_fix(
    fake: FakeMattermost,
) -> None:
    settings = MattermostSettings(enabled=True, url=fake.url)
    channel = MattermostChannel(
        settings, token=DEFAULT_TOKEN, lead=Saved.fresh().lead(), pacing=FAST
    )
    with anyio.fail_after(10), pytest.raises(ExceptionGroup) as ended:
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, Recorder().submit)
            await channel.live.wait()
            del fake.tokens[DEFAULT_TOKEN]
            fake.drop_websockets()
    failure = ended.value.exceptions[0]
    assert isinstance(failure, MattermostSetupError) and "Create New Token" in str(failure)


async def test_doctor_says_who_the_bot_is_and_that_the_websocket_answers(
    fake: FakeMattermost,
) -> None:
    settings = MattermostSettings(enabled=True, url=fake.url, token=DEFAULT_TOKEN)
    lines = [(f.status, f.what) for f in await checks(settings)]
    assert ("ok", f"mattermost credentials work: @kit-bot ({fake.bot_id})") in lines
    assert ("ok", "mattermost: the WebSocket answers") in lines
    assert all(status == "ok" for status, _ in lines), lines
    small = MattermostSettings(
        enabled=True, url=fake.url, token=DEFAULT_TOKEN, max_post_chars=20000
    )
    assert any(f.status == "fail" and "16383" in f.what for f in await checks(small))
    missing = await checks(MattermostSettings(enabled=True))
    assert [f.status for f in missing] == ["fail", "fail"]
