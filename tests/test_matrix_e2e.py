"""End-to-end encrypted Matrix rooms: the real daemon with encryption on (matrix-nio over
vodozemac), a real Synapse, and people whose own encrypting clients (tests/matrix_peer.py:
nio with a device and crypto store of their own) write to the bot and read its replies
by decrypting them."""

from __future__ import annotations

import functools
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.matrix import MatrixChannel, Pacing
from channels.matrix.channel import UNREADABLE_NOTICE
from channels.matrix.settings import MatrixSettings
from gateway.access.policy import Allow, Decision
from gateway.config import Settings
from gateway.dispatch.lanes import Ticket
from gateway.journal.cursors import STATE_DIR
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI
from tests.matrix_peer import Peer, start_peer
from tests.synapse_server import Synapse
from tests.test_matrix import dm_room, gateway, wait_bot_messages

pytestmark = pytest.mark.anyio


async def call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs))


@pytest.fixture
async def peers(synapse: Synapse, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Peer] = []

    async def make() -> Peer:
        user = synapse.register()
        peer = await start_peer(synapse, user, tmp_path / "peers" / user.user_id)
        made.append(peer)
        return peer

    try:
        yield make
    finally:
        for peer in made:
            await peer.stop()


def raw_events(synapse: Synapse, peer: Peer, room: str) -> list[dict[str, Any]]:
    """What the homeserver holds of the room's messages (encrypted or not)."""
    import json
    import urllib.parse

    query = urllib.parse.urlencode(
        {
            "dir": "b",
            "limit": 1000,
            "filter": json.dumps({"types": ["m.room.message", "m.room.encrypted"]}),
        }
    )
    answer = synapse.request(
        "GET",
        f"/_matrix/client/v3/rooms/{urllib.parse.quote(room)}/messages?{query}",
        token=peer.user.access_token,
    )
    return list(reversed(answer.get("chunk") or []))


async def test_an_encrypted_direct_room_is_answered_in_encrypted_formatted_replies(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    bot = synapse.register()
    alice = await peers()
    fake_openai.add_reply("Hello **Alice**!")
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        asked = await alice.send(room, "hi, secretly")
        [reply] = await alice.wait_messages(room, bot.user_id, 1)
    assert reply.encrypted
    assert reply.content["body"] == "Hello **Alice**!"
    assert reply.content["formatted_body"] == "Hello <strong>Alice</strong>!"
    assert reply.content["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert fake_openai.last_request.last_user_text == "hi, secretly"
    # Nothing the bot said went out in clear; the relation stays readable outside.
    held = [e for e in await call(raw_events, synapse, alice, room) if e["sender"] == bot.user_id]
    assert [e["type"] for e in held] == ["m.room.encrypted"]
    assert held[0]["content"]["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert "Alice" not in str(held[0]["content"])
    # The device's crypto store is a private file of the workspace.
    channel = gw.channel
    assert isinstance(channel, MatrixChannel)
    [state] = list((gw.settings.workspace_path / STATE_DIR).iterdir())
    assert "matrix-crypto" in state.name
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert stat.S_IMODE(state.parent.stat().st_mode) == 0o700


async def test_a_message_whose_key_comes_late_waits_for_it_in_order_and_others_go_on(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """The room key of two messages reaches the bot seconds after them (a slow client,
    federation): they wait for it, in order, and are answered once it comes; the stored
    since token does not pass them meanwhile, and another room is answered at once."""
    bot, bob = synapse.register(), synapse.register()
    alice = await peers()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__room_key_wait=60
    ) as gw:
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        plain = await dm_room(synapse, bob, bot)
        await alice.send(room, "before")
        await alice.wait_messages(room, bot.user_id, 1)
        first, key = await alice.send_without_key(room, "first, key late")
        second = await alice.send(room, "second, same session")
        await anyio.sleep(1.5)  # several /syncs: the key is not there
        held = gw.channel.since
        await call(synapse.send, bob, plain, "meanwhile elsewhere")
        await wait_bot_messages(synapse, bob, plain, bot, 1)
        await anyio.sleep(1.5)
        assert len(alice.messages(room, bot.user_id)) == 1  # nothing answered yet
        assert gw.channel.since == held  # the stored token waits for them
        await alice.release(key)
        replies = await alice.wait_messages(room, bot.user_id, 3)
        await anyio.sleep(1.0)
        replies = alice.messages(room, bot.user_id)
        assert gw.channel.since != held
    assert [r.body for r in replies] == [
        "echo: before",
        "echo: first, key late",
        "echo: second, same session",
    ]
    assert replies[1].content["m.relates_to"] == {"m.in_reply_to": {"event_id": first}}
    assert replies[2].content["m.relates_to"] == {"m.in_reply_to": {"event_id": second}}


async def test_a_message_whose_key_never_comes_is_answered_once_with_why(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    bot = synapse.register()
    alice = await peers()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__room_key_wait=2
    ) as gw:
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        lost, _ = await alice.send_without_key(room, "you will never read this")
        await alice.send(room, "nor this (same session)")
        [notice] = await alice.wait_messages(room, bot.user_id, 1, seconds=20)
        alice.forget_session(room)  # a new session, shared as usual
        await alice.send(room, "but this")
        replies = await alice.wait_messages(room, bot.user_id, 2)
        await anyio.sleep(1.5)
        replies = alice.messages(room, bot.user_id)
        stored = session_file(gw.settings, f"matrix:{room}")
    assert [r.body for r in replies] == [UNREADABLE_NOTICE, "echo: but this"]  # told once
    assert notice.content["msgtype"] == "m.notice" and notice.encrypted
    assert notice.content["m.relates_to"] == {"m.in_reply_to": {"event_id": lost}}
    assert "never read" not in stored and "but this" in stored
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["but this"]


async def test_an_unreadable_message_in_a_group_tells_nobody(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """In a group an unreadable message cannot say whether it addressed the bot: when
    its key never comes, it is skipped without a notice (which would ping its sender,
    perhaps a bystander), and the room goes on: a later mention is answered."""
    bot, bob = synapse.register(), synapse.register()
    alice = await peers()
    async with gateway(
        make_settings, fake_openai, synapse, bot, channels__matrix__room_key_wait=2
    ) as gw:
        room = await alice.encrypted_room([bot.user_id, bob.user_id], direct=False)
        await call(synapse.join, bob, room)
        await alice.wait_member(room, bot.user_id)
        await alice.wait_member(room, bob.user_id)
        await alice.send_without_key(room, "chatter nobody can read")
        await anyio.sleep(4)  # past room_key_wait: given up on
        alice.forget_session(room)
        await alice.send(room, f"{bot.user_id}: but this")
        await alice.wait_messages(room, bot.user_id, 1, seconds=30)
        await anyio.sleep(1.5)
        replies = alice.messages(room, bot.user_id)
        assert gw.channel.since is not None
    # One reply, to the mention (a group's messages carry their speaker's name).
    assert len(replies) == 1 and replies[0].body.endswith("\nbut this"), replies
    assert [r.last_user_text.endswith("but this") for r in fake_openai.chat_requests] == [True]


async def test_the_device_and_its_keys_survive_a_restart(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """What the device learnt (its account, the room keys people shared with it) is in
    the workspace: after a restart the same device decrypts the same session's next
    messages, including one sent while it was down, and makes no new keys."""
    bot = synapse.register()
    alice = await peers()
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        await alice.send(room, "one")
        await alice.wait_messages(room, bot.user_id, 1)
        crypto = gw.channel._crypto
        assert crypto is not None
        identity = crypto.olm.account.identity_keys
    await alice.send(room, "two, while it is down")
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        await alice.send(room, "three")
        replies = await alice.wait_messages(room, bot.user_id, 3)
        crypto = gw.channel._crypto
        assert crypto is not None and crypto.olm.account.identity_keys == identity
    assert [r.body for r in replies] == ["echo: one", "echo: two, while it is down", "echo: three"]
    assert alice.undecryptable == []


def session_file(settings: Settings, key: str) -> str:
    from gateway.sessions.keys import encode_key

    return (settings.sessions_dir / f"{encode_key(key)}.jsonl").read_text()


async def test_streamed_replies_and_edits_in_an_encrypted_room(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """Streaming previews and their replacements go out encrypted (the replacement's
    relation readable outside, as the spec wants); the person's edits are decrypted: an
    edit of the latest message re-runs the turn, one of an older message is told so."""
    from gateway.agent.rewind import OLD_EDIT_TEXT
    from tests.test_matrix import edit_content

    bot = synapse.register()
    alice = await peers()
    words = " ".join(f"word{i}" for i in range(40))
    fake_openai.add_reply(words, chunk_delay=0.04)
    async with gateway(
        make_settings,
        fake_openai,
        synapse,
        bot,
        pacing=Pacing(stream_interval=0.3),
        llm__stream=True,
        channels__matrix__streaming=True,
    ):
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        first = await alice.send(room, "stream it")
        await alice.wait(
            lambda: any(
                m.content.get("m.new_content", {}).get("body") == words
                for m in alice.messages(room, bot.user_id)
            )
        )
        streamed = alice.messages(room, bot.user_id)
        second = await alice.send(room, "whats 2+3")
        count = len(streamed) + 1
        await alice.wait_messages(room, bot.user_id, count)
        await alice.send(room, edit_content(second, "what's 2+2"))
        await alice.wait_messages(room, bot.user_id, count + 1)
        await alice.send(room, edit_content(first, "stream it again"))
        await alice.wait_messages(room, bot.user_id, count + 2)
        await anyio.sleep(0.5)
        said = alice.messages(room, bot.user_id)
        held = await call(raw_events, synapse, alice, room)
        raw = [e for e in held if e["sender"] == bot.user_id]
    shown = streamed[0]
    assert shown.content["m.relates_to"] == {"m.in_reply_to": {"event_id": first}}
    edits = streamed[1:]
    assert len(edits) >= 2
    assert all(
        e.content["m.relates_to"] == {"rel_type": "m.replace", "event_id": shown.event_id}
        for e in edits
    )
    assert edits[-1].content["m.new_content"]["body"] == words
    assert [m.body for m in said[len(streamed) :]] == [
        "echo: whats 2+3",
        "echo: what's 2+2",
        OLD_EDIT_TEXT,
    ]
    assert said[-2].content["m.relates_to"] == {"m.in_reply_to": {"event_id": second}}
    assert all(m.encrypted for m in said)
    assert {e["type"] for e in raw} == {"m.room.encrypted"}
    replaced = [e for e in raw if e["content"].get("m.relates_to", {}).get("rel_type")]
    assert len(replaced) == len(edits)  # the edits' relation is outside the ciphertext


async def test_files_in_and_out_of_an_encrypted_room_and_typing_and_receipts(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """A file someone sends is encrypted in the content repository: the bot decrypts it
    for the model. A file the bot sends is encrypted before it is uploaded, and the
    person's client decrypts it. Typing and read receipts are shown as in any room."""
    import io

    from nio import UploadResponse

    from tests.test_matrix import Ephemeral, download

    bot = synapse.register()
    alice = await peers()
    note = b"The secret word is PLUM."
    csv = "city,temp\nParis,21\n"
    fake_openai.add_delay(2.5, "reading it")
    fake_openai.add_tool_call("send_file", {"name": "weather.csv", "content": csv})
    fake_openai.add_reply("Here it is.")
    async with gateway(make_settings, fake_openai, synapse, bot, agent__tools='["send_file"]'):
        room = await alice.encrypted_room([bot.user_id])
        await alice.wait_member(room, bot.user_id)
        uploaded, keys = await alice.client.upload(
            io.BytesIO(note), "text/plain", "note.txt", encrypt=True, filesize=len(note)
        )
        assert isinstance(uploaded, UploadResponse) and keys is not None
        assert await call(download, synapse, alice.user, uploaded.content_uri) != note
        seen = await call(Ephemeral(synapse, alice.user, room).poll)
        sent = await alice.send(
            room,
            {
                "msgtype": "m.file",
                "body": "what does it say?",
                "filename": "note.txt",
                "info": {"mimetype": "text/plain", "size": len(note)},
                "file": {"url": uploaded.content_uri, **keys},
            },
        )
        with anyio.fail_after(10):
            while bot.user_id not in (await call(seen.poll)).typing:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        assert seen.receipts.get(bot.user_id) == sent
        await alice.wait_messages(room, bot.user_id, 1)
        asked = fake_openai.last_request.last_user_text or ""
        await alice.send(room, "weather as csv please")
        text, sheet = (await alice.wait_messages(room, bot.user_id, 3))[1:]
        file = sheet.content["file"]
        ciphertext = await call(download, synapse, alice.user, file["url"])
    assert "PLUM" in asked and "what does it say?" in asked
    assert text.body == "Here it is."
    assert "url" not in sheet.content and sheet.content["filename"] == "weather.csv"
    assert ciphertext != csv.encode()
    from nio.crypto.attachments import decrypt_attachment

    plain = decrypt_attachment(ciphertext, file["key"]["k"], file["hashes"]["sha256"], file["iv"])
    assert plain == csv.encode()


# --------------------------------------------------------------------------- replicas


class Replica:
    """One replica's Matrix channel in the shared mode: the "matrix sync" role through
    PostgreSQL, the relay, and a dispatcher stand-in that records what it took."""

    def __init__(self, settings: MatrixSettings, token: str, url: str) -> None:
        from gateway.journal.pg_cursors import lead_as
        from gateway.journal.pg_relay import PostgresRelay
        from gateway.journal.pg_store import PostgresDedupeStore

        self.store = PostgresDedupeStore(url)
        self.channel = MatrixChannel(settings, token=token)
        self.channel.lead = lead_as(url, "matrix sync")
        self.relay = PostgresRelay(self.store, "matrix sync")
        self.channel.relay = self.relay
        self.channel.invite_check = self._allow
        self.took: list[InboundMessage] = []
        self.scope = anyio.CancelScope()

    async def _allow(self, message: InboundMessage) -> Decision:
        return Allow()

    async def submit(self, message: InboundMessage) -> Ticket:
        self.took.append(message)
        ticket = Ticket(message)
        ticket._resolve(None)
        return ticket

    async def run(self) -> None:
        with self.scope:
            await self.channel.run(self.submit)

    async def wait_took(self, count: int, seconds: float = 30) -> list[str]:
        with anyio.fail_after(seconds):
            while len(self.took) < count:  # noqa: ASYNC110 (polling a test recorder)
                await anyio.sleep(0.05)
        return [m.text for m in self.took]


async def test_a_standby_replicas_reply_is_encrypted_by_the_leader_and_the_keys_hand_over(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
    migrated_pg_url: str,
) -> None:
    """Two replicas share one bot device. The leader holds its keys; a reply the standby
    sends to an encrypted room is encrypted and sent by the leader (never in clear).
    When the leader drains, it saves the keys and lets the role go: the standby takes
    the role and the device's keys from PostgreSQL, reads the same Megolm session's next
    message, replies itself, and encrypts the draining replica's last replies. (A leader
    SIGKILLed: tests/test_matrix_kill.py.)"""
    import psycopg

    from gateway.messages import OutboundMessage

    bot = synapse.register()
    alice = await peers()
    settings = make_settings(
        fake_openai,
        channels__matrix__homeserver=synapse.url,
        channels__matrix__user_id=bot.user_id,
        channels__matrix__sync_timeout=1,
    ).channels.matrix
    first, second = (Replica(settings, bot.access_token, migrated_pg_url) for _ in range(2))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run)
            with anyio.fail_after(30):
                await first.channel._crypto_ready.wait()  # it is the leader
            tg.start_soon(second.run)
            with anyio.fail_after(30):
                await second.channel.live.wait()
                await second.relay.listening.wait()
            room = await alice.encrypted_room([bot.user_id])
            await alice.wait_member(room, bot.user_id)
            asked = await alice.send(room, "hello replicas")
            assert await first.wait_took(1) == ["hello replicas"]
            await second.channel.send(
                OutboundMessage(
                    "matrix", room, "from the standby", f"matrix:{room}", reply_to=asked
                )
            )
            [reply] = await alice.wait_messages(room, bot.user_id, 1)
            assert first.relay.served == 1 and second.channel._crypto is None
            held = [
                e
                for e in await call(raw_events, synapse, alice, room)
                if e["sender"] == bot.user_id
            ]
            with psycopg.connect(migrated_pg_url) as conn:
                blobs = conn.execute("SELECT name FROM gw_channel_blobs").fetchall()
            # The leader drains: it saves the keys, stops using them and lets the role go.
            first.channel.pause_intake()
            await alice.send(room, "after the handover")
            assert await second.wait_took(1) == ["after the handover"]
            crypto = second.channel._crypto
            assert crypto is not None and crypto.device_id == bot.device_id
            assert first.channel._crypto is None
            await second.channel.send(
                OutboundMessage("matrix", room, "the new leader", f"matrix:{room}")
            )
            # The draining replica's last replies go through the new holder.
            await first.channel.send(
                OutboundMessage("matrix", room, "the old one, draining", f"matrix:{room}")
            )
            replies = await alice.wait_messages(room, bot.user_id, 3)
            assert second.relay.served == 1 and first.relay.served == 1
            first.scope.cancel()
            second.scope.cancel()
    finally:
        for replica in (first, second):
            await replica.store.aclose()
    assert reply.body == "from the standby" and reply.encrypted
    assert reply.content["m.relates_to"] == {"m.in_reply_to": {"event_id": asked}}
    assert [e["type"] for e in held] == ["m.room.encrypted"]
    assert blobs == [(f"matrix-crypto:{bot.user_id}:{bot.device_id}",)]
    assert [r.body for r in replies] == [
        "from the standby",
        "the new leader",
        "the old one, draining",
    ]
    assert alice.undecryptable == []


async def test_a_room_key_is_kept_even_when_its_message_got_no_answer(
    fake_openai: FakeOpenAI,
    synapse: Synapse,
    make_settings: Callable[..., Settings],
    peers: Callable[..., Any],
) -> None:
    """In a group the bot reads everything but answers only when addressed: the room key
    of a message it did not answer must be durable all the same (the homeserver deletes
    the to-device message that brought it at the next /sync), or the same session's
    later message, addressed to it after a restart, could never be read."""
    bot, bob = synapse.register(), synapse.register()
    alice = await peers()
    async with gateway(make_settings, fake_openai, synapse, bot) as gw:
        room = await alice.encrypted_room([bot.user_id, bob.user_id], direct=False)
        await call(synapse.join, bob, room)
        await alice.wait_member(room, bot.user_id)
        await alice.wait_member(room, bob.user_id)
        crypto = gw.channel._crypto
        assert crypto is not None

        async def keys_held(count: int) -> None:
            with anyio.fail_after(15):
                while len(list(crypto.olm.inbound_group_store)) < count:  # noqa: ASYNC110
                    await anyio.sleep(0.1)

        await alice.send(room, "hello everyone")
        await keys_held(1)
        # A new session whose key comes over the Olm session alice has with the bot now:
        # no one-time key is claimed, so no key upload saves the state by the way.
        alice.forget_session(room)
        await alice.send(room, "just chatting")
        await keys_held(2)
        await anyio.sleep(2.5)  # more /syncs: the key's to-device message is gone
    async with gateway(make_settings, fake_openai, synapse, bot, channels__matrix__room_key_wait=3):
        await alice.send(
            room,
            {
                "msgtype": "m.text",
                "body": f"{bot.user_id}: what now?",
                "m.mentions": {"user_ids": [bot.user_id]},
            },
        )
        [reply] = await alice.wait_messages(room, bot.user_id, 1, seconds=20)
    assert reply.body.startswith("echo: ") and "what now?" in reply.body
    assert [r.last_user_text for r in fake_openai.chat_requests][-1].endswith("what now?")
