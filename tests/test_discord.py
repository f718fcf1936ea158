"""The Discord channel (channels.discord): what it takes in and how, the backfill that
keeps the delivery promise, and how replies go out; the real discord.py against the
fake Discord (tests/fakes/discord_server.py), a recorder standing in for the
dispatcher."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import discord
import pytest
from loguru import logger

from channels.discord import (
    DiscordChannel,
    DiscordSetupError,
    Notice,
    Pacing,
    Place,
    Skip,
    target_channel,
    translate_message,
)
from channels.discord.channel import (
    NO_PINGS,
    Positions,
    not_sent,
    reply_nonce,
    snowflake_at,
    snowflake_time,
)
from channels.discord.format import discord_messages
from channels.discord.settings import DiscordSettings
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.journal.cursors import FileCursorStore, run_with
from gateway.journal.protocol import Lead
from gateway.media import MediaError
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_SENDER,
    META_QUOTED_TEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)
from tests.fakes.discord_server import IS_VOICE_MESSAGE, FakeDiscord
from tests.fakes.tcp_proxy import TcpProxy

pytestmark = pytest.mark.anyio

FAST = Pacing(
    retry_backoff=0.01,
    typing_grace=0.05,
    typing_interval=0.2,
    stream_interval=0.05,
    cursor_interval=0.05,
    guild_ready_timeout=0.1,
    heartbeat_timeout=2.0,
    stop_timeout=5,
)


def sf(n: int) -> int:
    """A realistic snowflake (discord.py reads mentions of 15-20 digits only)."""
    return (300_000_000_000 + n) << 22


BOT = sf(1000)
ROUTE = "POST /channels/{channel_id}/messages"


# -- translation (pure) -------------------------------------------------------------------


def user(user_id: int, name: str, *, bot: bool = False) -> dict[str, Any]:
    return {
        "id": str(user_id),
        "username": name,
        "discriminator": "0",
        "global_name": name.title(),
        "avatar": None,
        **({"bot": True} if bot else {}),
    }


def payload(
    message_id: int, channel_id: int, author: dict[str, Any], content: str, **extra: Any
) -> dict[str, Any]:
    data = {
        "id": str(message_id),
        "channel_id": str(channel_id),
        "author": author,
        "content": content,
        "timestamp": "2026-01-02T03:04:05+00:00",
        "edited_timestamp": None,
        "tts": False,
        "mention_everyone": False,
        "mentions": [],
        "mention_roles": [],
        "attachments": [],
        "embeds": [],
        "pinned": False,
        "type": 0,
        "flags": 0,
    }
    data.update(extra)
    return data


def message_of(data: dict[str, Any]) -> discord.Message:
    """A discord.py Message from a payload, built by the library itself (no network)."""
    client = discord.Client(intents=discord.Intents(guilds=True))
    channel = client.get_partial_messageable(int(data["channel_id"]))
    return discord.Message(state=client._connection, channel=channel, data=data)  # type: ignore[arg-type]


ALICE = user(sf(7), "alice")
DM = Place(sf(50), "dm")
TEXT = Place(sf(60), "guild", guild_id=sf(70))
THREAD = Place(sf(61), "thread", parent_id=sf(60), guild_id=sf(70))


def test_a_dm_is_its_channels_conversation_with_who_wrote_and_when() -> None:
    message = message_of(payload(sf(9), DM.channel_id, ALICE, "hello there"))
    inbound = translate_message(message, DM, bot_id=BOT)
    assert isinstance(inbound, InboundMessage)
    assert inbound.session_key == f"discord:{DM.channel_id}"
    assert inbound.text == "hello there" and inbound.sender_id == ALICE["id"]
    assert inbound.message_id == str(sf(9))
    assert inbound.metadata[META_IS_GROUP] is False
    assert inbound.metadata[META_SENDER_NAME] == "Alice (@alice)"
    assert inbound.metadata[META_SENT_AT] == message.created_at.timestamp()


def test_in_a_server_the_mention_is_cut_out_and_said() -> None:
    bot = user(BOT, "gateway", bot=True)
    data = payload(
        sf(9),
        TEXT.channel_id,
        ALICE,
        f"<@{BOT}>, what about <@{sf(8)}>?",
        mentions=[bot, user(sf(8), "bob")],
    )
    inbound = translate_message(message_of(data), TEXT, bot_id=BOT)
    assert isinstance(inbound, InboundMessage)
    assert inbound.text == "what about @Bob?"
    assert inbound.metadata[META_MENTIONED] is True and inbound.metadata[META_IS_GROUP] is True
    assert inbound.session_key == f"discord:{TEXT.channel_id}"
    chatter = translate_message(
        message_of(payload(sf(10), TEXT.channel_id, ALICE, "hi")), TEXT, bot_id=BOT
    )
    assert isinstance(chatter, InboundMessage) and chatter.metadata[META_MENTIONED] is False


def test_the_bots_managed_role_counts_as_a_mention() -> None:
    role = sf(99)
    data = payload(sf(9), TEXT.channel_id, ALICE, f"<@&{role}> help", mention_roles=[str(role)])
    inbound = translate_message(message_of(data), TEXT, bot_id=BOT, bot_roles=frozenset({role}))
    assert isinstance(inbound, InboundMessage)
    assert inbound.metadata[META_MENTIONED] is True and inbound.text == "help"


def test_a_reply_to_the_bot_is_addressed_to_it_and_carries_the_quoted_text() -> None:
    bot = user(BOT, "gateway", bot=True)
    earlier = payload(sf(8), THREAD.channel_id, bot, "Forty-two.")
    data = payload(
        sf(9),
        THREAD.channel_id,
        ALICE,
        "why?",
        type=19,
        message_reference={"message_id": str(sf(8)), "channel_id": str(THREAD.channel_id)},
        referenced_message=earlier,
    )
    inbound = translate_message(message_of(data), THREAD, bot_id=BOT)
    assert isinstance(inbound, InboundMessage)
    assert inbound.session_key == f"discord:{TEXT.channel_id}:thread:{THREAD.channel_id}"
    assert inbound.metadata[META_REPLY_TO_BOT] is True
    assert inbound.metadata[META_QUOTED_TEXT] == "Forty-two."
    assert inbound.metadata[META_QUOTED_SENDER] == "Gateway"


@pytest.mark.parametrize(
    ("author", "extra", "reason"),
    [
        (user(BOT, "gateway", bot=True), {}, "own"),
        (user(sf(5), "other", bot=True), {}, "bot"),
        (ALICE, {"webhook_id": str(sf(4))}, "webhook"),
        (ALICE, {"type": 7}, "system"),
    ],
)
def test_what_is_not_a_person_writing_is_skipped(
    author: dict[str, Any], extra: dict[str, Any], reason: str
) -> None:
    data = payload(sf(9), DM.channel_id, author, "text", **extra)
    assert isinstance(translate_message(message_of(data), DM, bot_id=BOT), Skip), reason


def test_attachments_become_references_by_kind() -> None:
    files = [
        {
            "id": "1",
            "filename": "cat.png",
            "size": 10,
            "url": "http://cdn/cat.png",
            "proxy_url": "http://cdn/cat.png",
            "content_type": "image/png",
        },
        {
            "id": "2",
            "filename": "notes.pdf",
            "size": 20,
            "url": "http://cdn/n.pdf",
            "proxy_url": "http://cdn/n.pdf",
            "content_type": "application/pdf",
        },
    ]
    inbound = translate_message(
        message_of(payload(sf(9), DM.channel_id, ALICE, "", attachments=files)), DM, bot_id=BOT
    )
    assert isinstance(inbound, InboundMessage)
    assert [(a.kind, a.name, a.mime_type, a.url) for a in inbound.attachments] == [
        ("image", "cat.png", "image/png", "http://cdn/cat.png"),
        ("document", "notes.pdf", "application/pdf", "http://cdn/n.pdf"),
    ]
    assert inbound.attachments[0].file_id == f"{DM.channel_id}:{sf(9)}:1"
    voice = [
        {
            "id": "3",
            "filename": "voice-message.ogg",
            "size": 30,
            "url": "http://cdn/v.ogg",
            "proxy_url": "http://cdn/v.ogg",
            "content_type": "audio/ogg",
            "duration_secs": 2.0,
            "waveform": "AA==",
        }
    ]
    said = translate_message(
        message_of(
            payload(sf(9), DM.channel_id, ALICE, "", attachments=voice, flags=IS_VOICE_MESSAGE)
        ),
        DM,
        bot_id=BOT,
    )
    assert isinstance(said, InboundMessage) and said.attachments[0].kind == "voice"


def test_a_sticker_gets_a_notice_in_a_dm_and_silence_in_a_server() -> None:
    sticker = {"sticker_items": [{"id": "5", "name": "wave", "format_type": 1}]}
    alone = translate_message(
        message_of(payload(sf(9), DM.channel_id, ALICE, "", **sticker)), DM, bot_id=BOT
    )
    assert isinstance(alone, Notice) and "sticker" in alone.text
    chatter = translate_message(
        message_of(payload(sf(9), TEXT.channel_id, ALICE, "", **sticker)), TEXT, bot_id=BOT
    )
    assert isinstance(chatter, Skip)


def test_an_edit_is_a_message_of_its_own_naming_the_one_it_changes() -> None:
    data = payload(
        sf(9), DM.channel_id, ALICE, "fixed", edited_timestamp="2026-01-02T03:05:00+00:00"
    )
    inbound = translate_message(message_of(data), DM, bot_id=BOT, edited=True)
    assert isinstance(inbound, InboundMessage)
    assert inbound.metadata[META_EDIT_OF] == str(sf(9))
    assert inbound.message_id.startswith(f"{sf(9)}:edit:")
    assert inbound.message_id != str(sf(9))


def test_targets_nonces_and_snowflakes() -> None:
    assert target_channel("123") == 123
    assert target_channel("123", "456") == 456
    assert target_channel("123:thread:456") == 456  # as a heartbeat names a thread
    with pytest.raises(ValueError):
        target_channel("general")
    assert reply_nonce("9", "part 0", "hi") == reply_nonce("9", "part 0", "hi")
    assert reply_nonce("9", "part 0", "hi") != reply_nonce("9", "part 1", "hi")
    assert reply_nonce("9", "part 0", "hi") != reply_nonce("9", "part 0", "other")
    assert len(reply_nonce("9", "part 0", "hi") or "") <= 25
    assert reply_nonce(None, "part 0", "hi") is None
    now = time.time()
    assert abs(snowflake_time(snowflake_at(now)) - now) < 0.002


def test_a_missing_token_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_CHANNELS__DISCORD__TOKEN"):
        DiscordChannel(DiscordSettings(enabled=True), token="", lead=Saved.fresh().lead())


# -- the channel against the fake -----------------------------------------------------------


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
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(message_limit=50, message_window=1.0) as server:
        yield server


def settings_for(fake: FakeDiscord, **overrides: Any) -> DiscordSettings:
    options: dict[str, Any] = {
        "enabled": True,
        "api_url": fake.api_url,
        "gateway_url": fake.gateway_url,
    }
    return DiscordSettings(**(options | overrides))


class Saved:
    """Where a channel saves its read positions (a cursor file), and what is there."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def fresh(cls) -> Saved:
        return cls(Path(tempfile.mkdtemp(prefix="discord-cursors-")) / "channel-cursors.json")

    def lead(self) -> Lead:
        return run_with(FileCursorStore(self.path))

    def positions(self, fake: FakeDiscord) -> Positions | None:
        if not self.path.exists():
            return None
        raw = json.loads(self.path.read_text()).get(f"discord:{fake.bot_id}")
        return Positions.from_json(raw) if raw is not None else None


@asynccontextmanager
async def running(
    fake: FakeDiscord,
    recorder: Recorder | None = None,
    cursors: Saved | None = None,
    pacing: Pacing = FAST,
    **overrides: Any,
) -> AsyncIterator[DiscordChannel]:
    channel = DiscordChannel(
        settings_for(fake, **overrides),
        token=fake.token,
        lead=(cursors or Saved.fresh()).lead(),
        pacing=pacing,
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
    return OutboundMessage(
        channel="discord",
        chat_id=message.chat_id,
        text=text,
        session_key=message.session_key,
        reply_to=message.message_id,
        thread_id=message.thread_id,
        **extra,
    )


async def until(condition: Callable[[], object], seconds: float = 10) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 (polling the fake)
            await anyio.sleep(0.02)


async def test_messages_in_dms_servers_and_threads_are_submitted_in_order(
    fake: FakeDiscord,
) -> None:
    alice = fake.add_user("alice")
    guild = fake.add_guild(members=[alice])
    general = fake.add_text_channel(guild)
    thread = fake.add_thread(general, "plans")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "one")
        fake.user_message(general, alice, f"<@{fake.bot_id}> two", mentions=[fake.bot_id])
        fake.user_message(thread, alice, "three")
        fake.user_message(dm, alice, "four")
        messages = await recorder.wait(4)
    assert [m.text for m in messages] == ["one", "two", "three", "four"]
    assert [m.session_key for m in messages] == [
        f"discord:{dm}",
        f"discord:{general}",
        f"discord:{general}:thread:{thread}",
        f"discord:{dm}",
    ]
    assert messages[1].metadata[META_MENTIONED] is True
    assert messages[2].metadata[META_MENTIONED] is False  # require_mention is the gate's


async def test_what_was_written_while_away_is_read_back_oldest_first_before_new_messages(
    fake: FakeDiscord,
) -> None:
    """The backfill after READY: a DM conversation the bot had read before (its saved
    position), and a server channel it never read but whose last message is newer than
    the last moment everything had been read (the watermark)."""
    alice = fake.add_user("alice")
    guild = fake.add_guild(members=[alice])
    general = fake.add_text_channel(guild)
    dm = fake.dm_channel(alice)
    cursors = Saved.fresh()
    first = Recorder()
    async with running(fake, first, cursors) as channel:
        fake.user_message(dm, alice, "before")
        await first.wait(1)
        await until(lambda: (p := cursors.positions(fake)) is not None and p.watermark)
        assert channel.backfilled == 0
    # Away: the connection closed with 1000, the session is over; nothing replays it.
    fake.user_message(dm, alice, "away 1")
    fake.user_message(general, alice, f"<@{fake.bot_id}> away 2", mentions=[fake.bot_id])
    fake.user_message(dm, alice, "away 3")
    second = Recorder()
    async with running(fake, second, cursors) as channel:
        fake.user_message(dm, alice, "after")
        await second.wait(4)
        await anyio.sleep(0.2)
        assert channel.backfilled == 3
    assert sorted(second.texts()[:3]) == ["away 1", "away 2", "away 3"]
    assert second.texts()[3] == "after"  # read back before the live message
    per_dm = [m.text for m in second.messages if m.chat_id == str(dm)]
    assert per_dm == ["away 1", "away 3", "after"]  # in order within the conversation
    assert [m.text for m in first.messages] == ["before"]


async def test_the_backfill_is_bounded_by_age_and_count(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    cursors = Saved.fresh()
    async with running(fake, Recorder(), cursors) as channel:
        fake.user_message(dm, alice, "seen")
        await until(lambda: (p := cursors.positions(fake)) is not None and dm in p.conversations)
        del channel
    fake.user_message(dm, alice, "too old")
    await anyio.sleep(1.2)
    for n in range(4):
        fake.user_message(dm, alice, f"recent {n}")
    recorder = Recorder()
    async with running(
        fake, recorder, cursors, backfill_max_age_seconds=1.0, backfill_max_messages=3
    ):
        await recorder.wait(3)
        await anyio.sleep(0.3)
    assert recorder.texts() == ["recent 0", "recent 1", "recent 2"]


async def test_a_message_not_taken_stops_its_conversation_until_it_is_read_back(
    fake: FakeDiscord,
) -> None:
    """Journal, then move on: the journal refuses one message; the ones after it in the
    same conversation are not submitted ahead of it, other conversations go on, and once
    the journal works again the conversation is read back from where it stopped."""
    alice, bob = fake.add_user("alice"), fake.add_user("bob")
    dm_a, dm_b = fake.dm_channel(alice), fake.dm_channel(bob)
    recorder = Recorder()
    async with running(fake, recorder):
        recorder.taken = False
        fake.user_message(dm_a, alice, "a1")
        await until(lambda: recorder.refused)
        recorder.taken = True
        fake.user_message(dm_a, alice, "a2")
        fake.user_message(dm_b, bob, "b1")
        await until(lambda: "b1" in recorder.texts())
        assert "a2" not in recorder.texts()  # not ahead of a1
        await recorder.wait(3)
    assert [m.text for m in recorder.messages if m.chat_id == str(dm_a)] == ["a1", "a2"]


async def test_a_resumed_session_loses_nothing_and_submits_nothing_twice(
    fake: FakeDiscord,
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "one")
        await recorder.wait(1)
        fake.drop_connections()
        fake.user_message(dm, alice, "two")  # in the session's replay
        await fake.wait_for_connections_async(2)
        fake.user_message(dm, alice, "three")
        await recorder.wait(3)
        await anyio.sleep(0.3)
    assert recorder.texts() == ["one", "two", "three"]
    assert [(c.identified, c.resumed) for c in fake.identified_connections()] == [
        (True, False),
        (False, True),
    ]


async def test_a_refused_resume_starts_afresh_at_the_configured_gateway_and_reads_back(
    fake: FakeDiscord,
) -> None:
    """INVALID_SESSION: discord.py identifies again at DiscordWebSocket.DEFAULT_GATEWAY,
    which follows the setting; the backfill finds what the lost session had."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "one")
        await recorder.wait(1)
        fake.end_sessions()
        fake.drop_connections()
        fake.user_message(dm, alice, "two")  # in no session: only the history has it
        await fake.wait_for_connections_async(2)
        await recorder.wait(2)
        await anyio.sleep(0.3)
        assert channel.backfilled >= 1
    assert recorder.texts() == ["one", "two"]
    paths = [c.path for c in fake.connections]
    assert paths[0] == "/" and paths[-1] == "/"
    # With gateway_url set, even the RESUME went there, not to READY's resume URL.
    assert "/resume" not in paths


async def test_a_zombie_connection_is_noticed_and_resumed() -> None:
    recorder = Recorder()
    async with FakeDiscord(heartbeat_interval_ms=300) as quick:
        alice = quick.add_user("alice")
        dm = quick.dm_channel(alice)
        async with running(quick, recorder):
            quick.ack_heartbeats = False  # the connection goes quiet, but stays open
            quick.user_message(dm, alice, "one")
            await recorder.wait(1)
            await quick.wait_for_connections_async(2)
            quick.ack_heartbeats = True
            quick.user_message(dm, alice, "two")
            await recorder.wait(2)
    assert recorder.texts() == ["one", "two"]


async def test_paused_intake_leaves_messages_for_the_next_start(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    cursors = Saved.fresh()
    first = Recorder()
    async with running(fake, first, cursors) as channel:
        fake.user_message(dm, alice, "one")
        await first.wait(1)
        channel.pause_intake()
        fake.user_message(dm, alice, "while draining")
        await anyio.sleep(0.3)
    assert first.texts() == ["one"]
    second = Recorder()
    async with running(fake, second, cursors):
        await second.wait(1)
    assert second.texts() == ["while draining"]


async def test_an_edit_in_a_dm_is_submitted_as_an_edit(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder):
        sent = fake.user_message(dm, alice, "helo")
        await recorder.wait(1)
        fake.edit_user_message(dm, int(sent["id"]), "hello")
        await recorder.wait(2)
    original, edit = recorder.messages
    assert edit.text == "hello" and edit.metadata[META_EDIT_OF] == original.message_id


# -- replies ------------------------------------------------------------------------------


async def test_a_reply_quotes_the_message_pings_no_one_and_is_split(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    guild = fake.add_guild(members=[alice])
    general = fake.add_text_channel(guild)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        asked = fake.user_message(general, alice, f"<@{fake.bot_id}> q", mentions=[fake.bot_id])
        [inbound] = await recorder.wait(1)
        long = f"Hey @everyone and <@{alice}>!\n\n" + "\n\n".join("word " * 70 for _ in range(10))
        await channel.send(reply_to(inbound, long))
    sent = fake.bot_messages(general)
    assert len(sent) >= 2 and all(len(m["content"]) <= 2000 for m in sent)
    assert sent[0]["message_reference"]["message_id"] == asked["id"]
    assert all("message_reference" not in m for m in sent[1:])
    pings = fake.pings[int(sent[0]["id"])]
    assert pings["everyone"] is False and pings["roles"] == []
    assert pings["users"] == [alice]  # the person asked, as the author replied to only
    assert pings["allowed_mentions"] == NO_PINGS.to_dict()
    assert "@\u200beveryone" in sent[0]["content"]


async def test_a_reply_sent_again_posts_nothing_new(fake: FakeDiscord) -> None:
    """The outbox re-sends a reply after a crash: the nonces make Discord hand back the
    messages it already has."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        answer = reply_to(inbound, "part one\n\n" + "x " * 1200)
        await channel.send(answer)
        await channel.send(answer)
        await channel.send(reply_to(inbound, "a different answer"))
    contents = [m["content"] for m in fake.bot_messages(dm)]
    assert contents == [*discord_messages(answer.text), "a different answer"]


async def test_a_send_whose_answer_was_lost_is_repeated_without_a_second_message(
    fake: FakeDiscord,
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        fake.fail_next(ROUTE, cut_after=True)  # carried out, the connection cut
        await channel.send(reply_to(inbound, "exactly once"))
    assert [m["content"] for m in fake.bot_messages(dm)] == ["exactly once"]
    assert len(fake.calls_to_route(ROUTE)) == 2  # the cut one and its repeat


async def test_rate_limits_are_waited_out_and_nothing_is_lost(fake: FakeDiscord) -> None:
    logged: list[str] = []
    sink = logger.add(lambda m: logged.append(str(m)), level="WARNING")
    async with FakeDiscord(message_limit=2, message_window=0.5) as limited:
        alice = limited.add_user("alice")
        dm = limited.dm_channel(alice)
        recorder = Recorder()
        async with running(limited, recorder) as channel:
            limited.user_message(dm, alice, "q")
            [inbound] = await recorder.wait(1)
            started = time.monotonic()
            limited.fail_next(ROUTE, 429, retry_after=0.4)
            text = "\n\n".join(f"part {n} " + "y " * 990 for n in range(5))
            await channel.send(reply_to(inbound, text))
            took = time.monotonic() - started
        parts = [m["content"] for m in limited.bot_messages(dm)]
        assert [p.split()[1] for p in parts] == ["0", "1", "2", "3", "4"]
        assert took >= 0.4 + 0.5  # the 429's retry_after, then the bucket's window
        # Waited out before a 429 where the headers said the bucket was empty.
        assert len(limited.rate_limited) <= 2
    logger.remove(sink)
    # discord.py's own warning reaches the gateway's log (its format, its redaction).
    assert any("discord.py: We are being rate limited" in line for line in logged)


async def test_a_global_rate_limit_holds_every_request(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        fake.fail_next(ROUTE, 429, retry_after=0.6, is_global=True)
        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.send, reply_to(inbound, "first"))
            await anyio.sleep(0.1)  # the 429 has come
            client = channel._client
            assert client is not None
            await client.http.send_typing(dm)  # another route waits for it too
            typed = time.monotonic() - started
    assert typed >= 0.55
    assert [m["content"] for m in fake.bot_messages(dm)] == ["first"]


TYPING = "POST /channels/{channel_id}/typing"


async def test_a_typing_indicator_stopped_during_a_global_limit_holds_nothing_up(
    fake: FakeDiscord,
) -> None:
    """The turn ends while the typing indicator's request waits out a global 429: the
    indicator stops, and the reply still goes out once the limit is over (discord.py
    opens its global lock only from the request that shut it; cancelled, that request
    would keep it shut, and the reply would wait forever)."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)

    class Slow(Recorder):
        async def submit(self, message: InboundMessage) -> StubTicket:
            self.messages.append(message)
            self.ticket = StubTicket()
            return self.ticket

    recorder = Slow()
    async with running(fake, recorder) as channel:
        fake.fail_next(TYPING, 429, retry_after=0.5, is_global=True)
        fake.user_message(dm, alice, "think")
        [inbound] = await recorder.wait(1)
        await until(lambda: fake.rate_limited)  # the indicator waits out the limit
        recorder.ticket.answered.set()  # the turn is done: the indicator stops
        await anyio.sleep(0.05)
        with anyio.fail_after(5):
            await channel.send(reply_to(inbound, "done thinking"))
    assert [m["content"] for m in fake.bot_messages(dm)] == ["done thinking"]
    assert [c.body for c in fake.rate_limited] == [{"retry_after": 0.5, "global": True}]


async def test_a_request_whose_caller_gave_up_still_opens_the_global_limit(
    fake: FakeDiscord,
) -> None:
    """The same, for any request: one cancelled (a delivery timed out) while it sleeps
    out a global 429 does not hold up the requests after it."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        fake.fail_next(ROUTE, 429, retry_after=0.5, is_global=True)
        with anyio.move_on_after(0.2):
            await channel.send(reply_to(inbound, "first"))
        started = time.monotonic()
        with anyio.fail_after(5):
            await channel.send(reply_to(inbound, "second"))
        took = time.monotonic() - started
    # The first went out too: its request was not cancelled, only no longer waited for.
    assert [m["content"] for m in fake.bot_messages(dm)] == ["first", "second"]
    assert took < 2


async def test_a_reply_discord_py_gave_up_on_after_429s_is_sent_again(fake: FakeDiscord) -> None:
    """discord.py tries a request five times and then raises the last 429; the reply
    is made again after its Retry-After, once (its nonce)."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        fake.fail_next(ROUTE, 429, retry_after=0.05, is_global=True, times=7)
        with anyio.fail_after(10):
            await channel.send(reply_to(inbound, "at last"))
    assert [m["content"] for m in fake.bot_messages(dm)] == ["at last"]
    assert len(fake.rate_limited) == 7


@asynccontextmanager
async def behind_a_proxy(
    fake: FakeDiscord, recorder: Recorder
) -> AsyncIterator[tuple[DiscordChannel, TcpProxy]]:
    """A channel that reaches `fake` (its HTTP API and its Gateway) through a proxy the
    test can cut: the network between the gateway and Discord."""
    proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
    proxy.restore()
    root = f"127.0.0.1:{proxy.port}"
    try:
        async with running(
            fake, recorder, api_url=f"http://{root}/api/v10", gateway_url=f"ws://{root}/"
        ) as channel:
            yield channel, proxy
    finally:
        proxy.close()


async def test_an_outage_longer_than_the_retries_leaves_the_reply_to_be_sent_again(
    fake: FakeDiscord,
) -> None:
    """Discord unreachable (every connection refused: nothing went out) past the
    channel's own attempts: `send` raises `DeliveryFailed`, so the dispatcher sends the
    reply again later and leaves its message unanswered meanwhile; once Discord is
    back, the reply sent again arrives once. (The conformance kit's outage scenario
    found it given up after four attempts and its message marked answered: the reply
    lost.)"""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with behind_a_proxy(fake, recorder) as (channel, proxy):
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        answer = reply_to(inbound, "after the outage")
        proxy.cut()
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(answer)
        assert failed.value.sent == 0 and fake.bot_messages(dm) == []
        proxy.restore()
        with anyio.fail_after(10):
            await channel.send(answer)
    assert [m["content"] for m in fake.bot_messages(dm)] == ["after the outage"]


async def test_a_reply_cut_short_goes_on_from_the_part_that_failed(fake: FakeDiscord) -> None:
    """A 429 longer than the channel waits (discord.py's `RateLimited`) after some parts
    of a reply went out: `DeliveryFailed` says how many; sent again, the reply goes on
    from the part that failed, each part posted once, in order."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    text = "\n\n".join(f"part {n} " + "y " * 990 for n in range(12))
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "q")
        [inbound] = await recorder.wait(1)
        answer = reply_to(inbound, text)

        async def limit_after_the_first_part() -> None:
            while not fake.bot_messages(dm):  # noqa: ASYNC110 (polling the fake)
                await anyio.sleep(0.001)
            fake.fail_next(ROUTE, 429, retry_after=100)

        async with anyio.create_task_group() as tg:
            tg.start_soon(limit_after_the_first_part)
            with pytest.raises(DeliveryFailed) as failed:
                await channel.send(answer)
        posted_before = len(fake.bot_messages(dm))
        await channel.send(answer)
    parts = [m["content"].split()[1] for m in fake.bot_messages(dm)]
    assert 1 <= posted_before == failed.value.sent < 12
    assert parts == [str(n) for n in range(12)]
    assert fake.nonce_repeats == 0  # resumed, not every part sent again


def test_what_certainly_did_not_reach_discord_is_told_from_what_may_have() -> None:
    """Refused connections, 5xx answers (after discord.py's own retries), 429s longer
    than the channel waits and a channel not running now: the reply may be sent again.
    A timeout or a connection dropped mid-request may have posted it; a 403 or a 404
    never will be."""
    from types import SimpleNamespace

    def answer(status: int) -> Any:
        return SimpleNamespace(status=status, reason="")

    key = SimpleNamespace(host="discord.com", port=443, ssl=True)
    refused = aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))  # type: ignore[arg-type]
    retry = [
        refused,
        discord.DiscordServerError(answer(502), "Bad Gateway"),
        discord.RateLimited(120.0),
        DiscordSetupError("discord: the channel is not running; reply not sent"),
    ]
    final = [
        TimeoutError(),
        aiohttp.ServerDisconnectedError(),
        discord.Forbidden(answer(403), "Missing Access"),
        discord.NotFound(answer(404), "Unknown Channel"),
    ]
    assert [not_sent(exc) for exc in retry] == [True] * len(retry)
    assert [not_sent(exc) for exc in final] == [False] * len(final)


async def test_typing_shows_while_a_turn_runs(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)

    class Slow(Recorder):
        async def submit(self, message: InboundMessage) -> StubTicket:
            ticket = StubTicket()
            self.messages.append(message)
            self.ticket = ticket
            return ticket

    recorder = Slow()
    async with running(fake, recorder):
        fake.user_message(dm, alice, "think")
        await recorder.wait(1)
        await anyio.sleep(0.5)
        recorder.ticket.answered.set()
        await anyio.sleep(0.3)
        typed = len(fake.calls_to_route("POST /channels/{channel_id}/typing"))
    assert typed >= 2


async def test_streaming_posts_early_edits_and_finishes_in_place(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    async with running(fake, recorder, streaming=True) as channel:
        fake.user_message(dm, alice, "tell me")
        [inbound] = await recorder.wait(1)
        for word in ("Once ", "upon ", "a ", "time"):
            await channel.stream_delta(inbound, word)
            await anyio.sleep(0.08)
        await channel.send(reply_to(inbound, "Once upon a time."))
    [message] = fake.bot_messages(dm)
    assert message["content"] == "Once upon a time."
    assert message["message_reference"]["message_id"] == inbound.message_id
    edits = fake.calls_to_route("PATCH /channels/{channel_id}/messages/{message_id}")
    assert len(edits) >= 1


async def test_files_in_are_fetched_and_files_out_follow_the_text(fake: FakeDiscord) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    picture = fake.add_attachment("cat.png", b"\x89PNG fake", "image/png")
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "look", attachments=[picture])
        [inbound] = await recorder.wait(1)
        [attachment] = inbound.attachments
        assert await channel.fetch_file(attachment, max_bytes=1000) == b"\x89PNG fake"
        # A link that expired: the message is read again for a fresh one.
        stale = Attachment(
            attachment.kind,
            attachment.file_id,
            attachment.name,
            attachment.mime_type,
            attachment.size,
            f"{fake.url}/attachments/0/gone",
        )
        assert await channel.fetch_file(stale, max_bytes=1000) == b"\x89PNG fake"
        out = OutboundFile("report.txt", b"numbers", "text/plain", caption="the report")
        await channel.send(reply_to(inbound, "Here it is.", files=(out,)))
    text, upload = fake.bot_messages(dm)
    assert text["content"] == "Here it is."
    assert upload["content"] == "the report"
    assert upload["attachments"][0]["filename"] == "report.txt"


async def test_a_file_over_the_limit_is_refused_without_asking_for_a_fresh_link(
    fake: FakeDiscord,
) -> None:
    """Only a failed download (an expired link) is worth a fresh link; a file over the
    limit would be just as large from a new one."""
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    big = fake.add_attachment("big.bin", b"x" * 5000)
    recorder = Recorder()
    async with running(fake, recorder) as channel:
        fake.user_message(dm, alice, "look", attachments=[big])
        [inbound] = await recorder.wait(1)
        [attachment] = inbound.attachments
        unsized = Attachment(
            attachment.kind,
            attachment.file_id,
            attachment.name,
            attachment.mime_type,
            None,  # size unknown: the download itself finds it too large
            attachment.url,
        )
        with pytest.raises(MediaError, match="limit"):
            await channel.fetch_file(unsized, max_bytes=1000)
    assert fake.calls_to_route("GET /channels/{channel_id}/messages/{message_id}") == []


# -- setup failures -------------------------------------------------------------------------


async def test_a_refused_token_fails_run_with_what_to_fix(fake: FakeDiscord) -> None:
    channel = DiscordChannel(
        settings_for(fake), token="nope", lead=Saved.fresh().lead(), pacing=FAST
    )
    with pytest.raises(DiscordSetupError, match="GATEWAY_CHANNELS__DISCORD__TOKEN"):
        await channel.run(Recorder().submit)


async def test_a_message_content_intent_not_enabled_says_where_to_enable_it() -> None:
    async with FakeDiscord(application_flags=0) as fake:
        channel = DiscordChannel(
            settings_for(fake), token=fake.token, lead=Saved.fresh().lead(), pacing=FAST
        )
        with pytest.raises(DiscordSetupError, match="Message Content Intent"):
            with anyio.fail_after(10):
                await channel.run(Recorder().submit)
        recorder = Recorder()
        alice = fake.add_user("alice")
        dm = fake.dm_channel(alice)
        async with running(fake, recorder, message_content=False):
            fake.user_message(dm, alice, "DMs still come with their text")
            await recorder.wait(1)


def test_the_read_positions_document_round_trips_and_refuses_what_it_cannot_read() -> None:
    positions = Positions(sf(5), {sf(1): (sf(2), 1700000000.5), sf(3): (sf(4), 1700000001.0)})
    assert Positions.from_json(positions.to_json()) == positions
    assert Positions.from_json(Positions(None, {}).to_json()) == Positions(None, {})
    for damaged in ("{", "[]", '{"version": 99}', '{"version": 1, "watermark": null}'):
        with pytest.raises(ValueError):
            Positions.from_json(damaged)


async def test_unreadable_positions_are_reported_and_the_channel_starts_afresh(
    fake: FakeDiscord,
) -> None:
    saved = Saved.fresh()
    saved.path.write_text(json.dumps({f"discord:{fake.bot_id}": "not json"}))
    logged: list[str] = []
    sink = logger.add(lambda m: logged.append(str(m)), level="ERROR")
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    recorder = Recorder()
    try:
        async with running(fake, recorder, saved):
            fake.user_message(dm, alice, "hello")
            await recorder.wait(1)
            await until(lambda: (p := saved.positions(fake)) is not None and dm in p.conversations)
    finally:
        logger.remove(sink)
    assert any("saved read positions are unreadable" in line for line in logged)
