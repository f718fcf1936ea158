"""A person on Matrix with an encrypting client for the Matrix tests: matrix-nio with its
own device, its own crypto store (SQLite in a folder of its own) and its own /sync loop,
talking to Synapse (tests/synapse_server.py) as Element would. It reads the bot's
encrypted replies by decrypting them, and can send a message whose room key it hands
over only later (or never), as a slow or broken client does.

`Peer` is async (for tests that run the daemon in their event loop); `PeerThread` runs
peers on an event loop of their own in a thread, for the tests that drive a real
`gateway run` subprocess from plain threads.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import urllib.parse
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from nio import (
    AsyncClient,
    AsyncClientConfig,
    KeysQueryResponse,
    MatrixRoom,
    MegolmEvent,
    RoomMessage,
    SyncResponse,
)
from nio.store import SqliteStore

from tests.synapse_server import MatrixUser, Synapse

T = TypeVar("T")

ENCRYPTION = {
    "type": "m.room.encryption",
    "state_key": "",
    "content": {"algorithm": "m.megolm.v1.aes-sha2"},
}


@dataclass
class Seen:
    """A message the peer's client showed: its id, sender, decrypted content, and whether
    it arrived encrypted."""

    event_id: str
    sender: str
    content: dict[str, Any]
    encrypted: bool

    @property
    def body(self) -> str:
        return str(self.content.get("body", ""))


@dataclass
class LateKey:
    """The room key of a message sent without it: `release` hands it over."""

    room_id: str
    to_device: list[dict[str, Any]]


class Peer:
    """One user's encrypting client (see the module docstring)."""

    def __init__(self, synapse: Synapse, user: MatrixUser, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        config = AsyncClientConfig(
            encryption_enabled=True, store=SqliteStore, store_sync_tokens=True
        )
        self.synapse = synapse
        self.user = user
        self.client = AsyncClient(
            synapse.url,
            user.user_id,
            device_id=user.device_id,
            store_path=str(folder),
            config=config,
        )
        self.client.restore_login(user.user_id, user.device_id, user.access_token)
        self.seen: dict[str, list[Seen]] = {}  # room -> messages, in timeline order
        self.undecryptable: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()

    @property
    def user_id(self) -> str:
        return self.user.user_id

    async def start(self) -> None:
        """Upload this device's keys and sync in the background."""
        await self.client.keys_upload()
        self.client.add_event_callback(self._on_message, (RoomMessage, MegolmEvent))
        await self.client.sync(timeout=0, full_state=True)
        self._task = asyncio.create_task(self._sync_forever())

    async def _sync_forever(self) -> None:
        while True:
            response = await self.client.sync(timeout=300)
            if not isinstance(response, SyncResponse):
                await asyncio.sleep(0.2)
                continue
            if self.client.should_upload_keys:
                await self.client.keys_upload()
            if self.client.should_query_keys:
                await self.client.keys_query()
            if self.client.should_claim_keys:
                await self.client.keys_claim(self.client.get_users_for_key_claiming())
            await self.client.send_to_device_messages()
            self._synced.set()

    async def _on_message(self, room: MatrixRoom, event: Any) -> None:
        if isinstance(event, MegolmEvent):
            self.undecryptable.append(event.event_id)
            return
        source = event.source
        self.seen.setdefault(room.room_id, []).append(
            Seen(event.event_id, event.sender, dict(source.get("content", {})), event.decrypted)
        )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.client.close()

    async def synced(self) -> None:
        """Wait for one more /sync of the background loop."""
        self._synced.clear()
        await asyncio.wait_for(self._synced.wait(), 30)

    # ---------------------------------------------------------------- rooms

    async def encrypted_room(self, invite: list[str], *, direct: bool = True) -> str:
        """A new encrypted room (the bot invited); its id, once this client knows it."""
        room = await asyncio.to_thread(
            self.synapse.create_room,
            self.user,
            invite=invite,
            direct=direct,
            initial_state=[ENCRYPTION],
        )
        await self.wait(lambda: room in self.client.rooms)
        return room

    async def wait_member(self, room_id: str, user_id: str, seconds: float = 30) -> None:
        """Until `user_id` joined `room_id` (as this client's /sync shows it)."""

        def joined() -> bool:
            known = self.client.rooms.get(room_id)
            return (
                known is not None
                and user_id in known.users
                and user_id not in (known.invited_users)
            )

        await self.wait(joined, seconds)

    async def wait(self, check: Callable[[], object], seconds: float = 30) -> Any:
        deadline = asyncio.get_running_loop().time() + seconds
        while True:
            value = check()
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out after {seconds}s waiting for {check}")
            await asyncio.sleep(0.05)

    def messages(self, room_id: str, sender: str | None = None) -> list[Seen]:
        return [m for m in self.seen.get(room_id, []) if sender is None or m.sender == sender]

    async def wait_messages(
        self, room_id: str, sender: str, count: int, seconds: float = 30
    ) -> list[Seen]:
        await self.wait(lambda: len(self.messages(room_id, sender)) >= count, seconds)
        return self.messages(room_id, sender)

    # ---------------------------------------------------------------- sending

    async def send(self, room_id: str, content: dict[str, Any] | str) -> str:
        """Send (encrypted: the room is) a text or the content given; its event id."""
        if isinstance(content, str):
            content = {"msgtype": "m.text", "body": content}
        answer = await self.client.room_send(
            room_id, "m.room.message", content, ignore_unverified_devices=True
        )
        event_id = getattr(answer, "event_id", None)
        assert event_id, f"send failed: {answer}"
        return str(event_id)

    async def send_without_key(self, room_id: str, text: str) -> tuple[str, LateKey]:
        """Send a message in a new Megolm session whose key nobody has yet: the key's
        to-device messages are made (at message index 0) but held back."""
        client = self.client
        olm = client.olm
        assert olm is not None
        room = client.rooms[room_id]
        if client.should_query_keys:
            answer = await client.keys_query()
            assert isinstance(answer, KeysQueryResponse), answer
        missing = client.get_missing_sessions(room_id)
        if missing:
            await client.keys_claim(missing)
        olm.create_outbound_group_session(room_id)
        held = [
            to_device
            for _, to_device in olm.share_group_session_parallel(
                room_id, list(room.users), ignore_unverified_devices=True
            )
        ]
        session = olm.outbound_group_sessions[room_id]
        session.shared = True  # for group_encrypt; nobody has it yet
        payload = olm.group_encrypt(
            room_id, {"type": "m.room.message", "content": {"msgtype": "m.text", "body": text}}
        )
        event_id = await asyncio.to_thread(self._put, room_id, "m.room.encrypted", payload)
        return event_id, LateKey(room_id, held)

    def forget_session(self, room_id: str) -> None:
        """Start a new Megolm session with the next message (shared as usual)."""
        olm = self.client.olm
        assert olm is not None
        olm.outbound_group_sessions.pop(room_id, None)

    async def release(self, key: LateKey) -> None:
        """Hand over a held room key (its to-device messages)."""
        for to_device in key.to_device:
            txn = secrets.token_hex(8)
            await asyncio.to_thread(
                self.synapse.request,
                "PUT",
                f"/_matrix/client/v3/sendToDevice/m.room.encrypted/{txn}",
                to_device,
                token=self.user.access_token,
            )

    def _put(self, room_id: str, event_type: str, content: dict[str, Any]) -> str:
        quoted = urllib.parse.quote(room_id)
        answer = self.synapse.request(
            "PUT",
            f"/_matrix/client/v3/rooms/{quoted}/send/{event_type}/{secrets.token_hex(8)}",
            content,
            token=self.user.access_token,
        )
        return str(answer["event_id"])


class PeerThread:
    """An event loop in a thread for `Peer`s, driven from synchronous tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.peers: list[Peer] = []  # closed with the loop
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def call(self, func: Callable[[], T]) -> T:
        """Run a plain function on the loop's thread (to read a peer's state safely)."""

        async def wrapped() -> T:
            return func()

        return self.run(wrapped())

    def close(self, peers: list[Peer]) -> None:
        async def stop_all() -> None:
            await asyncio.gather(*(p.stop() for p in peers), return_exceptions=True)

        try:
            self.run(stop_all(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


async def start_peer(synapse: Synapse, user: MatrixUser, folder: Path) -> Peer:
    peer = Peer(synapse, user, folder)
    await peer.start()
    return peer
