"""The whole gateway with Matrix: the real daemon (dispatcher, access gate, agent) in this
process, the real matrix-nio, a real Synapse (tests/synapse_server.py) and the fake OpenAI
server. Test users talk to Synapse over its client-server API, as a Matrix client does."""

from __future__ import annotations

import functools
import json
import os
import sys
import urllib.parse
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.matrix import ENCRYPTED_REFUSAL, MatrixChannel, Pacing
from channels.matrix.channel import RequestFailed
from channels.matrix.settings import MatrixSettings
from gateway.access.policy import Decision
from gateway.channel import DeliveryFailed
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.journal.cursors import CURSOR_FILE
from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.tcp_proxy import tcp_proxy
from tests.synapse_server import MatrixUser, Synapse

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


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


def highlighted(synapse: Synapse, user: MatrixUser, room: str) -> dict[str, bool]:
    """The body of each message in `room` that notified `user` -> whether it highlighted
    them (a mention, or @room), as Synapse's push rules decided (`/notifications`)."""
    answer = synapse.request("GET", "/_matrix/client/v3/notifications", token=user.access_token)
    return {
        str(n["event"]["content"].get("body")): any(
            isinstance(a, dict) and a.get("set_tweak") == "highlight" and a.get("value", True)
            for a in n["actions"]
        )
        for n in answer["notifications"]
        if n["room_id"] == room
    }


async def test_a_reply_that_holds_at_room_pings_nobody(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """The bot never pings a room: its messages name whom they mention (`m.mentions`,
    nobody), so the homeserver does not read an "@room" in the text as a ping, even where
    the bot has the power to ping (a DM made as Element makes one gives it 100). Found by
    the conformance kit's Matrix driver."""
    bot, alice = synapse.register(), synapse.register()
    fake_openai.add_reply("Tell @room about it")
    async with gateway(make_settings, fake_openai, synapse, bot):
        room = await call(
            synapse.create_room,
            alice,
            invite=[bot.user_id],
            direct=True,
            preset="trusted_private_chat",
        )
        await wait_membership(synapse, alice, room, bot.user_id, "join")
        await call(synapse.send, alice, room, "who should know?")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
        notified = await call(highlighted, synapse, alice, room)
    assert notified == {"Tell @room about it": False}
    assert reply["content"]["m.mentions"] == {}


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


async def declined_with_code(synapse: Synapse, user: MatrixUser, room: str, bot: MatrixUser) -> str:
    """The pairing code in the reason the bot gave for declining `user`'s invite."""
    await wait_membership(synapse, user, room, bot.user_id, "leave")
    reason = await call(leave_reason, synapse, user, room, bot.user_id)
    assert reason is not None and "pairing code is" in reason, reason
    return reason.split("pairing code is ", 1)[1].split()[0]


async def approve_with_cli(settings: Settings, code: str) -> str:
    """`gateway pairing approve matrix CODE`, the operator's command, on the workspace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    env |= {"PYTHONPATH": str(ROOT), "GATEWAY_WORKSPACE": str(settings.workspace_path)}
    done = await anyio.run_process(
        [sys.executable, "-m", "gateway.cli", "pairing", "approve", "matrix", code],
        env=env,
        cwd=settings.workspace_path.parent,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_invites_from_strangers_are_declined_with_their_pairing_code_then_accepted(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, stranger = synapse.register(), synapse.register()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__dm_policy="pairing"
    ) as gw:
        room = await call(synapse.create_room, stranger, invite=[bot.user_id], direct=True)
        code = await declined_with_code(synapse, stranger, room, bot)
        await anyio.to_thread.run_sync(gw.daemon.pairing.approve, "matrix", code)
        again = await call(synapse.create_room, stranger, invite=[bot.user_id], direct=True)
        await wait_membership(synapse, stranger, again, bot.user_id, "join")
        await call(synapse.send, stranger, again, "hello now")
        [reply] = await wait_bot_messages(synapse, stranger, again, bot, 1)
    assert reply["content"]["body"] == "echo: hello now"


async def test_an_approved_stranger_who_invites_again_to_the_same_room_is_joined_and_answered(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """docs/matrix.md's way in: the invite is declined with a code, the operator runs
    `gateway pairing approve`, the stranger invites the bot again to the same room."""
    bot, alice = synapse.register(), synapse.register()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__dm_policy="pairing"
    ) as gw:
        room = await call(synapse.create_room, alice, invite=[bot.user_id], direct=True)
        code = await declined_with_code(synapse, alice, room, bot)
        assert "Approved" in await approve_with_cli(gw.settings, code)
        await call(synapse.invite, alice, room, bot.user_id)
        await wait_membership(synapse, alice, room, bot.user_id, "join", seconds=10)
        await call(synapse.send, alice, room, "hello again")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
    assert reply["content"]["body"] == "echo: hello again"
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["hello again"]


async def test_an_approved_strangers_invite_to_the_same_room_after_a_restart_is_joined(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """The approval is in the pairing store, not in the process: a gateway restarted
    between `gateway pairing approve` and the second invite joins it too."""
    bot, alice = synapse.register(), synapse.register()
    pairing = {"channels__matrix__dm_policy": "pairing"}
    async with gateway(make_settings, fake_openai, synapse, bot, **pairing) as gw:
        room = await call(synapse.create_room, alice, invite=[bot.user_id], direct=True)
        code = await declined_with_code(synapse, alice, room, bot)
        assert "Approved" in await approve_with_cli(gw.settings, code)
    async with gateway(make_settings, fake_openai, synapse, bot, **pairing):
        await call(synapse.invite, alice, room, bot.user_id)
        await wait_membership(synapse, alice, room, bot.user_id, "join", seconds=10)
        await call(synapse.send, alice, room, "hello after the restart")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
    assert reply["content"]["body"] == "echo: hello after the restart"


async def test_an_invite_not_yet_answered_when_the_gateway_stops_is_answered_after_it(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """The approved stranger's second invite reaches the gateway, which stops before it
    answered it (its access check still running): the stored since token has not passed
    the invite, so the restarted gateway finds it and joins."""
    bot, alice = synapse.register(), synapse.register()
    pairing = {"channels__matrix__dm_policy": "pairing"}
    arrived = anyio.Event()

    async def never_answers(probe: InboundMessage) -> Decision:
        arrived.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with gateway(make_settings, fake_openai, synapse, bot, **pairing) as gw:
        room = await call(synapse.create_room, alice, invite=[bot.user_id], direct=True)
        code = await declined_with_code(synapse, alice, room, bot)
        assert "Approved" in await approve_with_cli(gw.settings, code)
        gw.channel.invite_check = never_answers
        await call(synapse.invite, alice, room, bot.user_id)
        with anyio.move_on_after(10):
            await arrived.wait()  # then the gateway stops
    assert (await call(synapse.members, alice, room))[bot.user_id] == "invite"
    async with gateway(make_settings, fake_openai, synapse, bot, **pairing):
        await wait_membership(synapse, alice, room, bot.user_id, "join", seconds=10)
        await call(synapse.send, alice, room, "are you in?")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
    assert arrived.is_set()  # the first gateway had the invite, and stopped before answering
    assert reply["content"]["body"] == "echo: are you in?"


async def test_a_strangers_second_invite_gets_no_second_code_within_the_resend_interval(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """Not approved, the stranger invites the bot again to the same room at once: the
    invite is declined without a reason (the code went out moments ago), the pending
    request is the same one, and nothing reaches the model."""
    bot, stranger = synapse.register(), synapse.register()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__dm_policy="pairing"
    ) as gw:
        room = await call(synapse.create_room, stranger, invite=[bot.user_id], direct=True)
        code = await declined_with_code(synapse, stranger, room, bot)
        await call(synapse.invite, stranger, room, bot.user_id)
        await wait_membership(synapse, stranger, room, bot.user_id, "leave", seconds=10)
        reason = await call(leave_reason, synapse, stranger, room, bot.user_id)
        pending = (await anyio.to_thread.run_sync(gw.daemon.pairing.list, "matrix")).pending
        await call(synapse.send, stranger, room, "let me in")
        await anyio.sleep(1.0)
    assert reason is None
    assert [(r.sender_id, r.code) for r in pending] == [(stranger.user_id, code)]
    assert fake_openai.chat_requests == []


async def test_an_invite_whose_answer_failed_is_answered_when_it_comes_again(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """The access check fails twice (it raises): the invite is not confirmed with its
    batch, comes again from the stored since token, and is joined."""
    bot, alice = synapse.register(), synapse.register()
    failed = 0
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        check = gw.channel.invite_check
        assert check is not None

        async def flaky(probe: InboundMessage) -> Decision:
            nonlocal failed
            if failed < 2:
                failed += 1
                raise RuntimeError("the access check failed")
            return await check(probe)

        gw.channel.invite_check = flaky
        room = await dm_room(synapse, alice, bot)
        await call(synapse.send, alice, room, "hi")
        [reply] = await wait_bot_messages(synapse, alice, room, bot, 1)
    assert failed == 2
    assert reply["content"]["body"] == "echo: hi"


async def test_an_invite_that_keeps_failing_is_declined_after_the_patience_and_others_go_on(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """An invite that cannot be answered holds the stored since token back, but not for
    ever: past `Pacing.invite_patience` it is declined with a reason saying to invite
    the bot again, and what other rooms said meanwhile is answered."""
    from channels.matrix.channel import INVITE_FAILED

    bot, alice, bob = synapse.register(), synapse.register(), synapse.register()
    async with gateway(
        make_settings, fake_openai, synapse, bot, pacing=Pacing(invite_patience=2.0)
    ) as gw:
        other = await dm_room(synapse, bob, bot)
        check = gw.channel.invite_check
        assert check is not None

        async def broken_for_alice(probe: InboundMessage) -> Decision:
            if probe.sender_id == alice.user_id:
                raise RuntimeError("the access check failed")
            return await check(probe)

        gw.channel.invite_check = broken_for_alice
        room = await call(synapse.create_room, alice, invite=[bot.user_id], direct=True)
        await call(synapse.send, bob, other, "meanwhile")
        await wait_membership(synapse, alice, room, bot.user_id, "leave", seconds=20)
        reason = await call(leave_reason, synapse, alice, room, bot.user_id)
        [reply] = await wait_bot_messages(synapse, bob, other, bot, 1)
    assert reason == INVITE_FAILED
    assert reply["content"]["body"] == "echo: meanwhile"


async def test_with_encryption_off_encrypted_rooms_are_refused_with_the_reason_in_the_room(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    encryption = {
        "type": "m.room.encryption",
        "state_key": "",
        "content": {"algorithm": "m.megolm.v1.aes-sha2"},
    }
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__encryption=False
    ):
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


#: The channel's own retries of one request, made short: past them a reply that did not
#: go out is the dispatcher's to send again (`DeliveryFailed`).
IMPATIENT = Pacing(retry_attempts=2, retry_backoff=0.05, retry_backoff_max=0.1)


async def test_a_reply_the_homeserver_could_not_take_is_sent_once_it_is_back(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    """The homeserver unreachable (the network cut) past the channel's own retries while
    a reply is on its way: the channel raises `DeliveryFailed`, the dispatcher keeps the
    message unanswered and sends the reply again until it goes out, once. Before, the
    reply was dropped after five attempts (about 8 s) and its message marked answered.
    (The conformance kit's outage, 6 s, ends within those attempts: here they are few.)"""
    bot, alice = synapse.register(), synapse.register()
    fake_openai.add_delay(1.0, "after the outage")
    with tcp_proxy("127.0.0.1", synapse.port) as proxy:
        through = {"channels__matrix__homeserver": f"http://127.0.0.1:{proxy.port}"}
        async with gateway(
            make_settings, fake_openai, synapse, bot, pacing=IMPATIENT, **through
        ) as gw:
            room = await dm_room(synapse, alice, bot)
            asked = await call(synapse.send, alice, room, "are you there?")
            with anyio.fail_after(15):
                while not fake_openai.chat_requests:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await call(proxy.cut)
            await anyio.sleep(3)  # the reply is due meanwhile; its attempts fail
            assert await call(bot_messages, synapse, alice, room, bot) == []
            await call(proxy.restore)
            await wait_bot_messages(synapse, alice, room, bot, 1, seconds=30)
            await anyio.sleep(1)
            replies = await call(bot_messages, synapse, alice, room, bot)
            failures = gw.daemon.dispatcher.stats().delivery_failures
    assert [r["content"]["body"] for r in replies] == ["after the outage"]
    assert replies[0]["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert failures >= 1


async def test_a_reply_cut_short_goes_on_from_the_part_that_failed_as_the_same_transaction(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reply of several events whose second one reached the homeserver but whose answer
    was lost (the connection dropped), then the network stays cut: `DeliveryFailed` says
    one part went out. Sent again, it goes on from the part that failed, with the same
    transaction id, which the homeserver keeps once: every paragraph shows once, in
    order. The reply answers no message (a heartbeat's): its transactions are still the
    same the second time."""
    bot, alice = synapse.register(), synapse.register()
    text = "\n\n".join(f"paragraph {n} " + "x" * 3000 for n in range(12))
    with tcp_proxy("127.0.0.1", synapse.port) as proxy:
        through = {"channels__matrix__homeserver": f"http://127.0.0.1:{proxy.port}"}
        async with gateway(
            make_settings, fake_openai, synapse, bot, pacing=IMPATIENT, **through
        ) as gw:
            room = await dm_room(synapse, alice, bot)
            channel = gw.channel
            put_event = channel._put_event
            puts: list[str] = []

            async def answer_lost_on_the_second(
                room_id: str, event_type: str, content: Any, txn: str, deadline: Any = None
            ) -> str:
                puts.append(txn)
                event_id = await put_event(room_id, event_type, content, txn, deadline)
                if len(puts) == 2:  # it went out; the connection drops before its answer
                    await call(proxy.cut)
                    raise RequestFailed("send: connection reset", retryable=True)
                return event_id

            monkeypatch.setattr(channel, "_put_event", answer_lost_on_the_second)
            message = OutboundMessage("matrix", room, text, f"matrix:{room}")
            with pytest.raises(DeliveryFailed) as failed:
                await channel.send(message)
            assert failed.value.sent == 1
            await call(proxy.restore)
            await channel.send(message)
            replies = await call(bot_messages, synapse, alice, room, bot)
    parts = len(puts) - 1  # the second was sent twice
    assert puts[2] == puts[1]  # again, as the same transaction
    assert len(replies) == parts >= 3
    joined = "".join(r["content"]["body"] for r in replies)
    assert [joined.count(f"paragraph {n} ") for n in range(12)] == [1] * 12
    assert [joined.index(f"paragraph {n} ") for n in range(12)] == sorted(
        joined.index(f"paragraph {n} ") for n in range(12)
    )


async def test_a_reply_while_the_channel_is_not_running_may_be_sent_later() -> None:
    """Between two runs of the channel (it restarts after the homeserver was unreachable
    at start) a reply cannot go out yet: `DeliveryFailed`, not a reply lost."""
    settings = MatrixSettings(
        enabled=True, homeserver="http://127.0.0.1:9", user_id="@bot:localhost"
    )
    channel = MatrixChannel(settings, token="t")
    with pytest.raises(DeliveryFailed):
        await channel.send(OutboundMessage("matrix", "!r:localhost", "hi", "matrix:!r:localhost"))


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


# --------------------------------------------------------------------------- replies shown


def edit_of(event: dict[str, Any]) -> str | None:
    relation = event["content"].get("m.relates_to") or {}
    return relation.get("event_id") if relation.get("rel_type") == "m.replace" else None


async def test_a_streamed_reply_is_one_message_replaced_as_it_is_written(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    words = " ".join(f"word{i}" for i in range(60))
    fake_openai.add_reply(words, chunk_delay=0.04)  # about 2.5 s of streaming
    quick = Pacing(stream_interval=0.3)
    async with gateway(
        make_settings,
        fake_openai,
        synapse,
        bot,
        pacing=quick,
        llm__stream=True,
        channels__matrix__streaming=True,
    ):
        room = await dm_room(synapse, alice, bot)
        asked = await call(synapse.send, alice, room, "write slowly")

        async def final_edit() -> bool:
            said = await call(bot_messages, synapse, alice, room, bot)
            return any(e["content"].get("m.new_content", {}).get("body") == words for e in said)

        with anyio.fail_after(20):
            while not await final_edit():  # noqa: ASYNC110
                await anyio.sleep(0.1)
        await anyio.sleep(0.5)
        said = await call(bot_messages, synapse, alice, room, bot)
    [shown] = [e for e in said if edit_of(e) is None]  # one message, however many edits
    edits = [e for e in said if edit_of(e) is not None]
    assert shown["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert len(shown["content"]["body"]) < len(words)  # the first preview, not the reply
    assert words.startswith(shown["content"]["body"])
    assert len(edits) >= 2  # previews replaced while written, then the final text
    assert all(edit_of(e) == shown["event_id"] for e in edits)
    bodies = [e["content"]["m.new_content"]["body"] for e in edits]
    assert all(words.startswith(b) for b in bodies) and bodies[-1] == words
    assert [len(b) for b in bodies] == sorted(len(b) for b in bodies)
    assert edits[-1]["content"]["body"] == f"* {words}"  # what older clients show


def edit_content(original: str, text: str) -> dict[str, Any]:
    return {
        "msgtype": "m.text",
        "body": f"* {text}",
        "m.new_content": {"msgtype": "m.text", "body": text},
        "m.relates_to": {"rel_type": "m.replace", "event_id": original},
    }


async def test_editing_the_latest_message_reruns_its_turn_and_an_older_one_is_told(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    from gateway.agent.rewind import OLD_EDIT_TEXT

    bot, alice = synapse.register(), synapse.register()
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await dm_room(synapse, alice, bot)
        first = await call(synapse.send, alice, room, "I live in Paris")
        await wait_bot_messages(synapse, alice, room, bot, 1)
        second = await call(synapse.send, alice, room, "whats 2+3")
        await wait_bot_messages(synapse, alice, room, bot, 2)
        await call(synapse.send, alice, room, edit_content(second, "what's 2+2"))
        replies = await wait_bot_messages(synapse, alice, room, bot, 3)
        rerun = fake_openai.last_request
        await call(synapse.send, alice, room, edit_content(first, "I live in Rome"))
        replies = await wait_bot_messages(synapse, alice, room, bot, 4)
        await anyio.sleep(0.5)
        replies = await call(bot_messages, synapse, alice, room, bot)
        calls = len(fake_openai.chat_requests)
    assert [r["content"]["body"] for r in replies] == [
        "echo: I live in Paris",
        "echo: whats 2+3",
        "echo: what's 2+2",
        OLD_EDIT_TEXT,
    ]
    # The re-run answers the message that was edited, and the model saw the new text in
    # place of the old one, not after it.
    assert replies[2]["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": second}}
    sent = [str(m["content"]) for m in rerun.messages[1:]]
    assert sent == ["I live in Paris", "echo: I live in Paris", "what's 2+2"]
    assert replies[3]["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": first}}
    assert calls == 3  # the older edit did not ask the model
    assert "I live in Rome" not in session_file(gw.settings, f"matrix:{room}")


def download(synapse: Synapse, user: MatrixUser, mxc: str) -> bytes:
    """A file from the content repository, as a client fetches it (authenticated)."""
    import urllib.request

    server, media = mxc.removeprefix("mxc://").split("/", 1)
    request = urllib.request.Request(
        f"{synapse.url}/_matrix/client/v1/media/download/{server}/{media}",
        headers={"Authorization": f"Bearer {user.access_token}"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        return bytes(answer.read())


async def test_files_of_a_reply_are_uploaded_and_sent_after_its_text(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    from gateway.messages import OutboundFile, OutboundMessage
    from tests.test_media_e2e import png

    bot, alice = synapse.register(), synapse.register()
    csv = "city,temp\nParis,21\nRome,27\n"
    fake_openai.add_tool_call(
        "send_file", {"name": "weather.csv", "content": csv, "caption": "today"}
    )
    fake_openai.add_reply("Here is the data.")
    async with gateway(
        make_settings, fake_openai, synapse, bot, agent__tools='["send_file"]'
    ) as gw:
        room = await dm_room(synapse, alice, bot)
        asked = await call(synapse.send, alice, room, "weather as csv please")
        text, sheet = await wait_bot_messages(synapse, alice, room, bot, 2)
        chart = OutboundFile("chart.png", png(320, 200), mime_type="image/png", caption="sales")
        await gw.channel.send(OutboundMessage("matrix", room, "", f"matrix:{room}", files=(chart,)))
        *_, image = await wait_bot_messages(synapse, alice, room, bot, 3)
    assert text["content"]["body"] == "Here is the data."
    assert text["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    content = sheet["content"]
    assert content["msgtype"] == "m.file" and content["filename"] == "weather.csv"
    assert content["body"] == "today"  # the caption (Matrix 1.10: body beside filename)
    assert content["info"] == {"mimetype": "text/csv", "size": len(csv)}
    assert await call(download, synapse, alice, content["url"]) == csv.encode()
    shown = image["content"]
    assert shown["msgtype"] == "m.image" and shown["info"]["mimetype"] == "image/png"
    assert await call(download, synapse, alice, shown["url"]) == chart.data


class Ephemeral:
    """Who is typing in a room and what each one marked read, as `user`'s client learns
    it from incremental /syncs (an identical request may be answered from Synapse's
    cache, an incremental one is not)."""

    def __init__(self, synapse: Synapse, user: MatrixUser, room: str) -> None:
        self.synapse, self.user, self.room = synapse, user, room
        self.since: str | None = None
        self.typing: list[str] = []
        self.receipts: dict[str, str] = {}

    def poll(self) -> Ephemeral:
        query = "timeout=0" + (f"&since={urllib.parse.quote(self.since)}" if self.since else "")
        answer = self.synapse.request(
            "GET", f"/_matrix/client/v3/sync?{query}", token=self.user.access_token
        )
        self.since = answer["next_batch"]
        joined = answer.get("rooms", {}).get("join", {}).get(self.room, {})
        for event in joined.get("ephemeral", {}).get("events", []):
            if event["type"] == "m.typing":
                self.typing = list(event["content"].get("user_ids", []))
            if event["type"] == "m.receipt":
                for event_id, kinds in event["content"].items():
                    for reader in kinds.get("m.read", {}):
                        self.receipts[reader] = event_id
        return self


async def test_the_bot_shows_typing_while_it_works_and_marks_what_it_took_read(
    fake_openai: FakeOpenAI, synapse: Synapse, make_settings: Callable[..., Settings]
) -> None:
    bot, alice = synapse.register(), synapse.register()
    fake_openai.add_delay(3.0, "done thinking")
    async with gateway(make_settings, fake_openai, synapse, bot):
        room = await dm_room(synapse, alice, bot)
        seen = await call(Ephemeral(synapse, alice, room).poll)
        asked = await call(synapse.send, alice, room, "think hard")
        with anyio.fail_after(10):
            while bot.user_id not in (await call(seen.poll)).typing:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        assert await call(bot_messages, synapse, alice, room, bot) == []  # still working
        with anyio.fail_after(10):
            while seen.receipts.get(bot.user_id) != asked:  # journaled: marked read
                await anyio.sleep(0.1)
                await call(seen.poll)
        await wait_bot_messages(synapse, alice, room, bot, 1)
        with anyio.fail_after(10):
            while bot.user_id in (await call(seen.poll)).typing:  # noqa: ASYNC110
                await anyio.sleep(0.1)
