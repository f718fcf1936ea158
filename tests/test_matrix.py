"""The whole gateway with Matrix: the real daemon (dispatcher, access gate, agent) in this
process, the real matrix-nio, a real Synapse (tests/synapse_server.py) and the fake OpenAI
server. Test users talk to Synapse over its client-server API, as a Matrix client does."""

from __future__ import annotations

import functools
import json
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from channels.matrix import ENCRYPTED_REFUSAL, MatrixChannel, Pacing
from gateway.config import Settings
from gateway.cursors import CURSOR_FILE
from gateway.daemon import Daemon, Gateway
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.synapse_server import MatrixUser, Synapse

pytestmark = pytest.mark.anyio


async def call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A blocking Synapse call off the event loop the daemon runs on."""
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


@dataclass
class Running:
    daemon: Daemon
    channel: MatrixChannel
    settings: Settings


@asynccontextmanager
async def gateway(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    bot: MatrixUser,
    *,
    pacing: Pacing | None = None,
    **overrides: Any,
) -> AsyncIterator[Running]:
    """A daemon answering as `bot` on `synapse` (open to everyone unless overridden)."""
    options: dict[str, Any] = {
        "http__port": 0,
        "channels__matrix__enabled": True,
        "channels__matrix__homeserver": synapse.url,
        "channels__matrix__user_id": bot.user_id,
        "channels__matrix__access_token": bot.access_token,
        "channels__matrix__sync_timeout": 1,
        "channels__matrix__dm_policy": "open",
        "channels__matrix__group_policy": "open",
    }
    settings = make_settings(fake_openai, **(options | overrides))
    daemon = Daemon(Gateway.build(settings), interactive=False)
    channel = daemon.channels["matrix"]
    assert isinstance(channel, MatrixChannel)
    if pacing is not None:
        channel.pacing = pacing
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        with anyio.fail_after(30):
            await channel.live.wait()
        try:
            yield Running(daemon, channel, settings)
        finally:
            daemon.stop()


def bot_messages(synapse: Synapse, user: MatrixUser, room: str, bot: MatrixUser) -> list[Any]:
    return [e for e in synapse.messages(user, room) if e["sender"] == bot.user_id]


async def wait_bot_messages(
    synapse: Synapse, user: MatrixUser, room: str, bot: MatrixUser, count: int, seconds: float = 15
) -> list[dict[str, Any]]:
    with anyio.fail_after(seconds):
        while True:
            found = await call(bot_messages, synapse, user, room, bot)
            if len(found) >= count:
                return found
            await anyio.sleep(0.1)


async def wait_membership(
    synapse: Synapse, user: MatrixUser, room: str, who: str, state: str, seconds: float = 15
) -> None:
    with anyio.fail_after(seconds):
        while (await call(synapse.members, user, room)).get(who) != state:  # noqa: ASYNC110
            await anyio.sleep(0.1)


def session_file(settings: Settings, key: str) -> str:
    return (settings.sessions_dir / f"{encode_key(key)}.jsonl").read_text()


async def dm_room(synapse: Synapse, user: MatrixUser, bot: MatrixUser) -> str:
    """A direct-message room `user` made and invited the bot to, once the bot joined."""
    room = await call(synapse.create_room, user, invite=[bot.user_id], direct=True)
    await wait_membership(synapse, user, room, bot.user_id, "join")
    return str(room)


def leave_reason(synapse: Synapse, user: MatrixUser, room: str, who: str) -> str | None:
    quoted = urllib.parse.quote(room)
    state = synapse.request(
        "GET",
        f"/_matrix/client/v3/rooms/{quoted}/state/m.room.member/{urllib.parse.quote(who)}",
        token=user.access_token,
    )
    assert state["membership"] == "leave"
    return state.get("reason")


async def test_a_direct_message_is_answered_once_as_a_formatted_reply_and_marked_read(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    fake_openai.add_delay(0.6, "Hello **Alice**!")
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await dm_room(synapse, alice, bot)
        asked = await call(synapse.send, alice, room, "hi there")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
        await anyio.sleep(0.5)
        assert len(await call(bot_messages, synapse, alice, room, bot)) == 1
        receipts = await call(read_receipts, synapse, alice, room)
    content = reply["content"]
    assert content["body"] == "Hello **Alice**!"
    assert content["format"] == "org.matrix.custom.html"
    assert content["formatted_body"] == "Hello <strong>Alice</strong>!"
    assert content["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert fake_openai.last_request.last_user_text == "hi there"
    assert receipts.get(bot.user_id) == asked
    assert "hi there" in session_file(gw.settings, f"matrix:{room}")
    assert (gw.settings.workspace_path / CURSOR_FILE).is_file()


def read_receipts(synapse: Synapse, user: MatrixUser, room: str) -> dict[str, str]:
    """user id -> the event each one marked read in `room` (from `user`'s /sync)."""
    answer = synapse.request("GET", "/_matrix/client/v3/sync?timeout=0", token=user.access_token)
    found: dict[str, str] = {}
    joined = answer["rooms"]["join"].get(room, {})
    for event in joined.get("ephemeral", {}).get("events", []):
        if event["type"] != "m.receipt":
            continue
        for event_id, kinds in event["content"].items():
            for reader in kinds.get("m.read", {}):
                found[reader] = event_id
    return found


async def test_rooms_of_more_than_two_answer_only_when_addressed_with_names_and_quotes(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice, bob = synapse.register(), synapse.register(), synapse.register()
    await call(
        synapse.request,
        "PUT",
        f"/_matrix/client/v3/profile/{urllib.parse.quote(bot.user_id)}/displayname",
        {"displayname": "Gateway"},
        token=bot.access_token,
    )
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await call(synapse.create_room, alice, invite=[bot.user_id, bob.user_id])
        await call(synapse.join, bob, room)
        await wait_membership(synapse, alice, room, bot.user_id, "join")
        await call(synapse.send, bob, room, "just chatting")
        await call(
            synapse.send,
            alice,
            room,
            {
                "msgtype": "m.text",
                "body": "Gateway: what now?",
                "m.mentions": {"user_ids": [bot.user_id]},
            },
        )
        [first] = await wait_bot_messages(synapse, alice, room, bot, 1)
        # A reply to the bot's message needs no mention; its text travels with it.
        await call(
            synapse.send,
            bob,
            room,
            {
                "msgtype": "m.text",
                "body": "and then?",
                "m.relates_to": {"m.in_reply_to": {"event_id": first["event_id"]}},
            },
        )
        await wait_bot_messages(synapse, alice, room, bot, 2)
        await anyio.sleep(0.5)
        replies = await call(bot_messages, synapse, alice, room, bot)
    assert len(replies) == 2
    assert "what now?" in first["content"]["body"]
    texts = [r.last_user_text or "" for r in fake_openai.chat_requests]
    assert not any("just chatting" in t for t in texts)
    assert any("what now?" in t and alice.user_id in t for t in texts)
    second = fake_openai.chat_requests[-1]
    assert "and then?" in (second.last_user_text or "")
    assert "what now?" in json.dumps(second.messages)  # the quoted bot message
    assert "just chatting" not in session_file(gw.settings, f"matrix:{room}")


async def test_a_thread_is_its_own_conversation_answered_in_the_thread(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await dm_room(synapse, alice, bot)
        root = await call(synapse.send, alice, room, "a topic")
        await wait_bot_messages(synapse, alice, room, bot, 1)
        asked = await call(
            synapse.send,
            alice,
            room,
            {
                "msgtype": "m.text",
                "body": "in the thread",
                "m.relates_to": {
                    "rel_type": "m.thread",
                    "event_id": root,
                    "is_falling_back": True,
                    "m.in_reply_to": {"event_id": root},
                },
            },
        )
        replies = await wait_bot_messages(synapse, alice, room, bot, 2)
    relation = replies[-1]["content"]["m.relates_to"]
    assert relation["rel_type"] == "m.thread" and relation["event_id"] == root
    assert relation["m.in_reply_to"] == {"event_id": asked}
    assert "in the thread" in session_file(gw.settings, f"matrix:{room}:thread:{root}")
    assert "in the thread" not in session_file(gw.settings, f"matrix:{room}")


async def test_invites_from_strangers_are_declined_with_their_pairing_code_then_accepted(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, stranger = synapse.register(), synapse.register()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__dm_policy="pairing"
    ) as gw:
        room = await call(synapse.create_room, stranger, invite=[bot.user_id], direct=True)
        await wait_membership(synapse, stranger, room, bot.user_id, "leave")
        reason = await call(leave_reason, synapse, stranger, room, bot.user_id)
        assert reason is not None and "pairing code is" in reason
        code = reason.split("pairing code is ", 1)[1].split()[0]
        await anyio.to_thread.run_sync(gw.daemon.pairing.approve, "matrix", code)
        again = await call(synapse.create_room, stranger, invite=[bot.user_id], direct=True)
        await wait_membership(synapse, stranger, again, bot.user_id, "join")
        await call(synapse.send, stranger, again, "hello now")
        [reply] = await wait_bot_messages(synapse, stranger, again, bot, 1)
    assert reply["content"]["body"] == "echo: hello now"


async def test_encrypted_rooms_are_refused_with_the_reason_in_the_room_and_the_log(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    encryption = {
        "type": "m.room.encryption",
        "state_key": "",
        "content": {"algorithm": "m.megolm.v1.aes-sha2"},
    }
    async with gateway(make_settings, fake_openai, synapse, bot):
        room = await call(
            synapse.create_room, alice, invite=[bot.user_id], initial_state=[encryption]
        )
        await wait_membership(synapse, alice, room, bot.user_id, "leave")
        assert await call(leave_reason, synapse, alice, room, bot.user_id) == ENCRYPTED_REFUSAL
        # A room that turns encryption on after the bot joined: said once, then left.
        later = await dm_room(synapse, alice, bot)
        quoted = urllib.parse.quote(later)
        await call(
            synapse.request,
            "PUT",
            f"/_matrix/client/v3/rooms/{quoted}/state/m.room.encryption/",
            encryption["content"],
            token=alice.access_token,
        )
        await wait_membership(synapse, alice, later, bot.user_id, "leave")
        said = await call(bot_messages, synapse, alice, later, bot)
    assert [m["content"]["body"] for m in said] == [ENCRYPTED_REFUSAL]


async def test_messages_sent_while_it_was_down_are_answered_once_after_a_restart(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """More messages than one /sync timeline holds (a `limited` timeline): the gap is
    fetched back to the stored token; nothing is lost, nothing answered twice."""
    bot, alice = synapse.register(), synapse.register()
    small = Pacing(timeline_limit=3)
    async with gateway(make_settings, fake_openai, synapse, bot, pacing=small):
        room = await dm_room(synapse, alice, bot)
        await call(synapse.send, alice, room, "before")
        await wait_bot_messages(synapse, alice, room, bot, 1)
        await anyio.sleep(0.3)
    for i in range(10):
        await call(synapse.send, alice, room, f"while down {i}")
    async with gateway(make_settings, fake_openai, synapse, bot, pacing=small):
        replies = await wait_bot_messages(synapse, alice, room, bot, 11, seconds=30)
        await anyio.sleep(1.0)
        replies = await call(bot_messages, synapse, alice, room, bot)
    assert [r["content"]["body"] for r in replies] == ["echo: before"] + [
        f"echo: while down {i}" for i in range(10)
    ]


async def test_a_long_reply_is_split_in_order_and_files_go_through_the_content_repository(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    reply = "\n\n".join(f"Paragraph {i}: " + "many words " * 300 for i in range(12))
    fake_openai.add_reply(reply)
    async with gateway(make_settings, fake_openai, synapse, bot):
        room = await dm_room(synapse, alice, bot)
        await call(synapse.send, alice, room, "write a lot")
        replies = await wait_bot_messages(synapse, alice, room, bot, 3)
        await anyio.sleep(0.5)
        replies = await call(bot_messages, synapse, alice, room, bot)
        joined = "\n\n".join(r["content"]["body"] for r in replies)
        assert "".join(joined.split()) == "".join(reply.split())  # cut at whitespace
        # A file in: the user uploads a text document and sends it.
        upload = await call(upload_file, synapse, alice, b"The secret word is PLUM.", "note.txt")
        await call(
            synapse.send,
            alice,
            room,
            {
                "msgtype": "m.file",
                "body": "what does it say?",
                "filename": "note.txt",
                "url": upload,
                "info": {"mimetype": "text/plain", "size": 24},
            },
        )
        await wait_bot_messages(synapse, alice, room, bot, len(replies) + 1)
    asked = fake_openai.last_request.last_user_text or ""
    assert "PLUM" in asked and "what does it say?" in asked


def upload_file(synapse: Synapse, user: MatrixUser, data: bytes, name: str) -> str:
    import urllib.request

    request = urllib.request.Request(
        f"{synapse.url}/_matrix/media/v3/upload?filename={urllib.parse.quote(name)}",
        data=data,
        headers={"Authorization": f"Bearer {user.access_token}", "Content-Type": "text/plain"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return str(json.loads(answer.read())["content_uri"])


async def test_a_refused_token_stops_the_channel_with_what_to_do(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    from channels.matrix import MatrixSetupError, check_credentials

    bot = synapse.register()
    settings = make_settings(
        fake_openai,
        channels__matrix__homeserver=synapse.url,
        channels__matrix__user_id=bot.user_id,
    ).channels.matrix
    name = bot.user_id[1:].split(":")[0]  # Synapse's default display name: the localpart
    who = await check_credentials(settings, bot.access_token)
    assert who == f"{bot.user_id} ({name}) on {synapse.url}"
    with pytest.raises(MatrixSetupError, match="refused the access token"):
        await check_credentials(settings, "syt_not_a_token")
    with pytest.raises(MatrixSetupError, match="cannot reach the homeserver"):
        unreachable = settings.model_copy(update={"homeserver": "http://127.0.0.1:9"})
        await check_credentials(unreachable, bot.access_token)
