"""The whole gateway with Discord: the real daemon (dispatcher, journal, access gate,
agent, HTTP server) in this process, the real discord.py, the fake Discord and the
fake OpenAI server."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest

from channels.discord import DiscordChannel
from channels.discord.channel import Positions
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.journal.cursors import CURSOR_FILE
from gateway.sessions.keys import encode_key
from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeOpenAI

pytestmark = pytest.mark.anyio

TOKEN = "test-api-token-123"


@dataclass
class Running:
    daemon: Daemon
    channel: DiscordChannel
    url: str
    settings: Settings


@pytest.fixture
async def fake_dc() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(message_limit=50, message_window=1.0) as server:
        yield server


@asynccontextmanager
async def gateway(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    fake_dc: FakeDiscord,
    **overrides: Any,
) -> AsyncIterator[Running]:
    """A daemon serving the fake Discord bot, from settings as `gateway run` reads them."""
    options: dict[str, Any] = {
        "http__port": 0,
        "http__token": TOKEN,
        "channels__discord__enabled": True,
        "channels__discord__token": fake_dc.token,
        "channels__discord__api_url": fake_dc.api_url,
        "channels__discord__gateway_url": fake_dc.gateway_url,
        "channels__discord__dm_policy": "open",
        "channels__discord__group_policy": "open",
    }
    settings = make_settings(fake_openai, **(options | overrides))
    daemon = Daemon(Gateway.build(settings), interactive=False)
    channel = daemon.channels["discord"]
    assert isinstance(channel, DiscordChannel)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        with anyio.fail_after(30):
            await channel.live.wait()
        try:
            yield Running(daemon, channel, f"http://127.0.0.1:{port}", settings)
        finally:
            daemon.stop()


async def wait_bot(fake: FakeDiscord, channel: int, count: int, seconds: float = 10) -> list[Any]:
    with anyio.fail_after(seconds):
        while len(fake.bot_messages(channel)) < count:  # noqa: ASYNC110 (polling the fake)
            await anyio.sleep(0.02)
    return fake.bot_messages(channel)


def saved_positions(settings: Settings, fake: FakeDiscord) -> Positions | None:
    """The channel's read positions as saved in the workspace's cursor file."""
    path = settings.workspace_path / CURSOR_FILE
    if not path.exists():
        return None
    raw = json.loads(path.read_text()).get(f"discord:{fake.bot_id}")
    return Positions.from_json(raw) if raw is not None else None


def session_file(settings: Settings, key: str) -> str:
    return (settings.sessions_dir / f"{encode_key(key)}.jsonl").read_text()


async def test_a_dm_gets_exactly_one_reply_quoting_it_with_typing_before(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_delay(0.8, "Hello **Alice**!")
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    async with gateway(make_settings, fake_openai, fake_dc) as gw:
        asked = fake_dc.user_message(dm, alice, "hi there")
        await wait_bot(fake_dc, dm, 1)
        await anyio.sleep(0.3)
    [reply] = fake_dc.bot_messages(dm)
    assert reply["content"] == "Hello **Alice**!"
    assert reply["message_reference"]["message_id"] == asked["id"]
    typing = fake_dc.calls_to_route("POST /channels/{channel_id}/typing")
    [sent] = fake_dc.calls_to_route("POST /channels/{channel_id}/messages")
    assert typing and max(t.at for t in typing) <= sent.at
    assert "hi there" in session_file(gw.settings, f"discord:{dm}")


async def test_in_a_server_only_what_is_addressed_to_the_bot_is_answered(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    alice = fake_dc.add_user("alice")
    guild = fake_dc.add_guild(members=[alice])
    general = fake_dc.add_text_channel(guild)
    thread = fake_dc.add_thread(general, "plans")
    async with gateway(make_settings, fake_openai, fake_dc) as gw:
        fake_dc.user_message(general, alice, "chatting among us")
        bot = fake_dc.bot_id
        fake_dc.user_message(general, alice, f"<@{bot}> are you there?", mentions=[bot])
        [first] = await wait_bot(fake_dc, general, 1)
        fake_dc.user_message(general, alice, "and this?", reply_to=int(first["id"]))
        fake_dc.user_message(
            thread,
            alice,
            f"<@&{fake_dc.bot_role(guild)}> in the thread",
            mention_roles=[fake_dc.bot_role(guild)],
        )
        await wait_bot(fake_dc, general, 2)
        await wait_bot(fake_dc, thread, 1)
        await anyio.sleep(0.3)
    said = [(r.last_user_text or "").splitlines() for r in fake_openai.chat_requests]
    assert sorted(lines[-1] for lines in said) == ["and this?", "are you there?", "in the thread"]
    assert all(lines[0] == '[from "Alice (@alice)"]' for lines in said)
    assert "in the thread" in session_file(gw.settings, f"discord:{general}:thread:{thread}")
    assert len(fake_dc.bot_messages(general)) == 2


async def test_a_stranger_gets_a_pairing_code_and_after_approval_an_answer(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    async with gateway(
        make_settings, fake_openai, fake_dc, channels__discord__dm_policy="pairing"
    ) as gw:
        fake_dc.user_message(dm, alice, "hello?")
        [code_reply] = await wait_bot(fake_dc, dm, 1)
        [pending] = gw.daemon.pairing.list("discord").pending
        assert pending.code in code_reply["content"] and pending.sender_id == str(alice)
        assert fake_openai.chat_requests == []
        assert "discord" in gw.daemon.admin.sources.pairing_channels  # the admin page lists it
        gw.daemon.pairing.approve("discord", pending.code)
        fake_dc.user_message(dm, alice, "now?")
        await wait_bot(fake_dc, dm, 2)
    assert fake_dc.bot_messages(dm)[-1]["content"] == "echo: now?"


async def test_chat_commands_work_as_typed_text(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    async with gateway(make_settings, fake_openai, fake_dc):
        fake_dc.user_message(dm, alice, "/help")
        [reply] = await wait_bot(fake_dc, dm, 1)
    assert "/new" in reply["content"] and fake_openai.chat_requests == []


async def test_messages_written_while_the_gateway_was_down_are_answered_once_after_start(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    """The backfill with the real journal: what was answered before the restart is not
    answered again, what was written while down is answered once, in order; a message
    older than agent.offline_after_seconds gets the offline notice instead."""
    alice, bob = fake_dc.add_user("alice"), fake_dc.add_user("bob")
    dm_a, dm_b = fake_dc.dm_channel(alice), fake_dc.dm_channel(bob)
    overrides = {"agent__offline_after_seconds": 4}
    async with gateway(make_settings, fake_openai, fake_dc, **overrides) as gw:
        fake_dc.user_message(dm_a, alice, "before")
        fake_dc.user_message(dm_b, bob, "hello")
        await wait_bot(fake_dc, dm_a, 1)
        await wait_bot(fake_dc, dm_b, 1)
        await anyio.sleep(0.3)
    fake_dc.user_message(dm_b, bob, "old news")
    await anyio.sleep(5)  # older than offline_after_seconds by the restart
    fake_dc.user_message(dm_a, alice, "while down 1")
    last = int(fake_dc.user_message(dm_a, alice, "while down 2")["id"])
    async with gateway(make_settings, fake_openai, fake_dc, **overrides) as gw:
        await wait_bot(fake_dc, dm_a, 3)
        await wait_bot(fake_dc, dm_b, 2)
        await anyio.sleep(0.5)
        assert gw.channel.backfilled == 3
    assert [m["content"] for m in fake_dc.bot_messages(dm_a)] == [
        "echo: before",
        "echo: while down 1",
        "echo: while down 2",
    ]
    [hello, notice] = fake_dc.bot_messages(dm_b)
    assert hello["content"] == "echo: hello" and "I was offline" in notice["content"]
    requests = [r.last_user_text for r in fake_openai.chat_requests]
    assert requests.count("before") == 1 and "old news" not in requests
    assert "old news" in session_file(gw.settings, f"discord:{dm_b}")  # kept, not answered
    saved = saved_positions(gw.settings, fake_dc)
    assert saved is not None  # the channel's read positions, saved as it stopped
    assert saved.conversations[dm_a][0] >= last


async def test_a_message_is_journaled_before_its_position_moves_on(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    """While the model still works on it, the message is in the journal (dedupe.sqlite),
    and its conversation's position (channel-cursors.json) is moved past it only after
    that."""
    fake_openai.add_delay(4.0, "slow answer")
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    workspace = make_settings(fake_openai).workspace_path

    def journaled() -> list[str]:
        with sqlite3.connect(workspace / "dedupe.sqlite") as conn:
            return [json.loads(r[0])["text"] for r in conn.execute("SELECT message FROM inbox")]

    def position() -> int | None:
        saved = saved_positions(make_settings(fake_openai), fake_dc)
        found = saved.conversations.get(dm) if saved is not None else None
        return found[0] if found is not None else None

    async with gateway(make_settings, fake_openai, fake_dc):
        asked = int(fake_dc.user_message(dm, alice, "keep me")["id"])
        seen = []
        with anyio.fail_after(3):
            while (now := position()) != asked:
                if now is not None:
                    seen.append(now)
                await anyio.sleep(0.02)
        assert journaled() == ["keep me"]  # journaled, then the position moved past it
        # A new conversation's position is saved just before its first message first.
        assert set(seen) <= {asked - 1}
        assert fake_dc.bot_messages(dm) == []  # the model has not answered yet
        await wait_bot(fake_dc, dm, 1)


async def test_streaming_shows_the_reply_while_it_is_written(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_reply("Once upon a time, the end.", chunk_delay=0.3)
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    async with gateway(
        make_settings,
        fake_openai,
        fake_dc,
        llm__stream=True,
        channels__discord__streaming=True,
    ):
        fake_dc.user_message(dm, alice, "a story")
        await wait_bot(fake_dc, dm, 1)
        final = "Once upon a time, the end."
        with anyio.fail_after(10):
            while fake_dc.bot_messages(dm)[0]["content"] != final:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert len(fake_dc.bot_messages(dm)) == 1
    assert len(fake_dc.calls_to_route("PATCH /channels/{channel_id}/messages/{message_id}")) >= 1


async def test_metrics_and_readiness_show_the_channel(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    async with gateway(make_settings, fake_openai, fake_dc) as gw:
        fake_dc.user_message(dm, alice, "count me")
        await wait_bot(fake_dc, dm, 1)
        await anyio.sleep(0.2)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gw.url}/metrics") as response:
                metrics = await response.text()
            async with http.get(f"{gw.url}/readyz") as response:
                ready = await response.json()
    assert 'gateway_channel_up{channel="discord"} 1.0' in metrics
    assert 'gateway_turns_total{channel="discord",outcome="ok"} 1.0' in metrics
    assert 'gateway_llm_calls_total{channel="discord"' in metrics  # usage, per channel
    assert ready["components"]["discord"]["healthy"] is True


async def test_a_refused_token_shows_on_readyz_in_the_channels_own_words(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(
        fake_openai,
        http__port=0,
        channels__discord__enabled=True,
        channels__discord__token="not-the-bots-token",
        channels__discord__api_url=fake_dc.api_url,
        channels__discord__gateway_url=fake_dc.gateway_url,
    )
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        try:
            async with aiohttp.ClientSession() as http:
                with anyio.fail_after(5):
                    while True:
                        async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
                            status, body = resp.status, await resp.json()
                        discord = body["components"]["discord"]
                        if discord["detail"] != "not reported yet":
                            break
                        await anyio.sleep(0.05)
        finally:
            daemon.stop()
    assert status == 503 and discord["healthy"] is False
    assert discord["detail"].startswith("DiscordSetupError: discord: ")
    assert "refused the bot token" in discord["detail"]
    assert "not-the-bots-token" not in str(body)


async def test_a_heartbeat_job_delivers_into_a_discord_channel(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    guild = fake_dc.add_guild()
    general = fake_dc.add_text_channel(guild)
    thread = fake_dc.add_thread(general)
    fake_openai.add_reply("Good morning!")
    started = time.monotonic()
    async with gateway(
        make_settings,
        fake_openai,
        fake_dc,
        heartbeat__jobs__morning__every="1s",
        heartbeat__jobs__morning__prompt="say hi",
        heartbeat__jobs__morning__deliver_to=f"discord:{general}:thread:{thread}",
    ):
        await wait_bot(fake_dc, thread, 1, seconds=15)
    assert fake_dc.bot_messages(thread)[0]["content"] == "Good morning!"
    assert time.monotonic() - started < 20


async def test_a_file_sent_in_a_dm_reaches_the_model_as_text(
    fake_openai: FakeOpenAI, fake_dc: FakeDiscord, make_settings: Callable[..., Settings]
) -> None:
    alice = fake_dc.add_user("alice")
    dm = fake_dc.dm_channel(alice)
    notes = fake_dc.add_attachment("notes.txt", b"The launch is on Tuesday.", "text/plain")
    async with gateway(make_settings, fake_openai, fake_dc):
        fake_dc.user_message(dm, alice, "what day?", attachments=[notes])
        await wait_bot(fake_dc, dm, 1)
    said = fake_openai.chat_requests[-1].last_user_text or ""
    assert "[document: notes.txt]" in said and "The launch is on Tuesday." in said
    assert "what day?" in said
