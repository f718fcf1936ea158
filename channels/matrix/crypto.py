"""End-to-end encryption for the Matrix channel: the bot device's Olm account, its Olm
and Megolm sessions and the devices it knows (matrix-nio's machine over vodozemac), held
in memory and persisted as one blob (`gateway.journal.cursors.CursorStore.save_blob`: a private
workspace file, or PostgreSQL on the sync leader's lock connection).

Promises kept here:
- Crypto state is durable before anything that depends on it leaves the process: the
  state after a /sync batch before the next /sync (which lets the homeserver delete the
  to-device messages that carried room keys) and before the batch's token is stored; a
  new account's one-time keys before they are uploaded; Olm sessions advanced by sharing
  a room key before the to-device messages that carry it are sent. A kill at any moment
  therefore never loses a room key the journal's messages need, nor forks an Olm session.
- One process at a time uses a device's state: only the /sync loop's holder opens it (in
  file mode, one gateway per workspace; in the shared mode, the "matrix sync" leader).
- Trust: room keys go to every device of the room's members except blacklisted ones,
  verified or not (nio's "ignore unverified devices"); a device id's keys are pinned the
  first time they are seen, and changed keys for a known device are refused (nio keeps
  the first). docs/matrix.md, section 7, says what that risks.

matrix-nio's crypto parts are imported only when a channel with encryption starts.
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import anyio
from loguru import logger

from gateway.journal.protocol import CursorStore

if TYPE_CHECKING:
    from nio import AsyncClient, Event, MegolmEvent
    from nio.crypto import Olm
    from nio.store import SqliteMemoryStore

#: The scheme-less fragment an encrypted file's reference carries (`Attachment.file_id`):
#: `mxc://server/id#e2e=<base64url of its key, iv and hash>`.
E2E_FRAGMENT = "e2e="

#: One client-server API request with the channel's retries: (method, path, body, what).
Request = Callable[..., Awaitable[dict[str, Any]]]
#: What nio's own requests raise when the homeserver is not reachable or answers garbage.
_TRANSPORT_ERRORS = (OSError, TimeoutError, ValueError, aiohttp.ClientError)


class CryptoUnavailable(Exception):
    """Encryption cannot be used with this device; the message says why and what to do."""


class CryptoFailed(Exception):
    """A crypto step failed for now (a key query or claim the homeserver did not answer);
    trying again later may help."""


class CryptoClosed(CryptoFailed):
    """This process handed the device's keys over (another replica syncs now)."""


def crypto_available() -> str | None:
    """None when matrix-nio's encryption can run here; else why not (for the log)."""
    try:
        from nio.crypto import ENCRYPTION_ENABLED
    except ImportError as exc:  # pragma: no cover - nio is a dependency
        return f"matrix-nio is not installed ({exc})"
    if not ENCRYPTION_ENABLED:
        return "vodozemac is not installed (pip install 'matrix-nio[e2e]')"
    return None


def blob_name(user_id: str, device_id: str) -> str:
    """The name of a device's crypto state in the channel's `CursorStore`."""
    return f"matrix-crypto:{user_id}:{device_id}"


class MatrixCrypto:
    """The bot device's encryption, attached to one nio client (see the module)."""

    def __init__(
        self,
        client: AsyncClient,
        store: CursorStore,
        name: str,
        memory: SqliteMemoryStore,
        request: Request,
    ) -> None:
        self.client = client
        self.store = store
        self.name = name
        self._memory = memory
        self._request = request
        self._persisted = -1  # total_changes of the in-memory database when last saved
        self._persisting = anyio.Lock()
        self._sharing: dict[str, anyio.Lock] = {}
        self._asked: set[str] = set()  # sessions whose key was requested
        self.closed = False

    @property
    def olm(self) -> Olm:
        olm = self.client.olm
        assert olm is not None
        return olm

    @property
    def device_id(self) -> str:
        return str(self.client.device_id)

    @classmethod
    async def open(
        cls,
        client: AsyncClient,
        store: CursorStore,
        *,
        user_id: str,
        device_id: str,
        request: Request,
    ) -> MatrixCrypto:
        """Load the device's state from `store` (or make a new account), attach it to
        `client`, make sure the homeserver has its keys. Raises CryptoUnavailable when
        the homeserver already holds other keys for this device (its state was lost)."""
        from nio.crypto import Olm
        from nio.store import SqliteMemoryStore

        name = blob_name(user_id, device_id)
        image = await store.load_blob(name)
        memory = SqliteMemoryStore(user_id, device_id)
        if image is not None:
            # The whole database, as `persist` took it: tables, account, sessions.
            memory.database.connection().deserialize(image)
        client.device_id = device_id
        client.store = memory
        client.olm = Olm(user_id, device_id, memory)
        client.encrypted_rooms = memory.load_encrypted_rooms()
        crypto = cls(client, store, name, memory, request)
        if image is None:
            await crypto._check_new_device()
            logger.info("matrix: new encryption keys made for device {}", device_id)
        await crypto.persist()
        await crypto.upload_keys()
        return crypto

    async def _check_new_device(self) -> None:
        """A new account for a device the homeserver already holds keys for means the
        device's crypto state was lost: its old keys cannot be replaced, and people's
        clients would encrypt to keys this process does not have."""
        answer = await self._request(
            "POST",
            "/_matrix/client/v3/keys/query",
            {"device_keys": {self.olm.user_id: [self.device_id]}},
            what="keys of this device",
        )
        known = (answer.get("device_keys") or {}).get(self.olm.user_id, {}).get(self.device_id)
        if not known:
            return
        ours = self.olm.account.identity_keys["ed25519"]
        if (known.get("keys") or {}).get(f"ed25519:{self.device_id}") != ours:
            raise CryptoUnavailable(
                f"matrix: the homeserver already holds encryption keys for device "
                f"{self.device_id}, but this gateway has no crypto store for it (it was lost, "
                "or the token was used elsewhere); log in again to get a new device and set "
                "its access token (docs/matrix.md, section 7)"
            )

    # ------------------------------------------------------------------ persistence

    async def persist(self) -> None:
        """Save the state if it changed since the last save; returns once it is durable."""
        async with self._persisting:
            connection = self._memory.database.connection()
            changes = int(connection.total_changes)
            if changes == self._persisted:
                return
            image = connection.serialize()  # a consistent copy: no await since reading it
            await self.store.save_blob(self.name, image)
            self._persisted = changes

    async def close(self) -> None:
        """Stop encrypting here (another replica takes the device over): wait for the
        room keys being shared, then save the state a last time."""
        self.closed = True
        for lock in list(self._sharing.values()):
            async with lock:
                pass
        await self.persist()

    # ------------------------------------------------------------------ keys

    async def upload_keys(self) -> None:
        """Publish the device keys (once) and top up one-time keys, their private halves
        saved first: keys people may claim must never be lost."""
        from nio import KeysUploadResponse

        if not self.olm.should_upload_keys:
            return
        keys = self.olm.share_keys()
        self.olm.save_account()  # the new one-time keys are in the account object only
        await self.persist()
        answer = await self._request(
            "POST", "/_matrix/client/v3/keys/upload", keys, what="upload of encryption keys"
        )
        response = KeysUploadResponse.from_dict(answer)
        if not isinstance(response, KeysUploadResponse):
            raise CryptoFailed(f"keys/upload: unexpected answer {answer!r:.200}")
        await self.client.receive_response(response)
        await self.persist()

    async def after_sync(self) -> None:
        """What a /sync batch asks of the device (nio already took its to-device messages
        and decrypted what it could): publish one-time keys, learn changed devices, mend
        wedged sessions; then save the state, before the next /sync."""
        from nio import KeysClaimResponse, KeysQueryResponse

        try:
            await self.upload_keys()
            if self.client.should_query_keys:
                answer: Any = await self.client.keys_query()
                if not isinstance(answer, KeysQueryResponse):
                    logger.warning("matrix: device keys not queried: {}", answer)
            if self.client.should_claim_keys:
                claim = self.client.get_users_for_key_claiming()
                answer = await self.client.keys_claim(claim)
                if not isinstance(answer, KeysClaimResponse):
                    logger.warning("matrix: one-time keys not claimed: {}", answer)
            await self.persist()
            for message in list(self.client.outgoing_to_device_messages):
                await self.client.to_device(message)
        except _TRANSPORT_ERRORS as exc:  # tried again after the next batch
            raise CryptoFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            await self.persist()

    # ------------------------------------------------------------------ decrypting

    def decrypt(self, event: MegolmEvent, room_id: str) -> Event | None:
        """The decrypted event, or None while its room key is missing."""
        from nio import BadEvent, UnknownBadEvent
        from nio.exceptions import EncryptionError

        event.room_id = room_id
        try:
            decrypted = self.client.decrypt_event(event)
        except EncryptionError:
            return None
        if isinstance(decrypted, BadEvent | UnknownBadEvent):
            logger.warning("matrix: encrypted event {} holds a malformed event", event.event_id)
            return None
        return decrypted

    async def request_key(self, event: MegolmEvent) -> None:
        """Ask the sender's device for a room key we lack (once per session): a client
        that shared it with our device before answers with it again."""
        if not event.session_id or event.session_id in self._asked:
            return
        self._asked.add(event.session_id)
        message = event.as_key_request(
            event.sender, self.device_id, event.session_id, event.device_id
        )
        try:
            await self.client.to_device(message)
        except Exception as exc:  # a courtesy: the key may still come on its own
            logger.debug("matrix: room key request not sent: {!r}", exc)

    # ------------------------------------------------------------------ encrypting

    async def encrypt(
        self, room_id: str, event_type: str, content: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The `m.room.encrypted` content of an event for `room_id`; the room's members'
        devices get the room key first when they need it. Its relation (reply, thread,
        edit) stays readable outside, as the spec asks."""
        if self.closed:
            raise CryptoClosed("this replica no longer holds the device's keys")
        if room_id not in self.client.rooms:
            raise CryptoFailed(f"room {room_id} is not known yet")
        lock = self._sharing.setdefault(room_id, anyio.Lock())
        async with lock:
            if self.closed:
                raise CryptoClosed("this replica no longer holds the device's keys")
            if self.olm.should_share_group_session(room_id):
                await self._share_room_key(room_id)
            payload: dict[str, Any] = self.olm.group_encrypt(
                room_id, {"type": event_type, "content": dict(content)}
            )
        relation = content.get("m.relates_to")
        if relation is not None:
            payload["m.relates_to"] = relation
        return payload

    async def _share_room_key(self, room_id: str) -> None:
        """Send this room's outbound Megolm session key to every device of its members
        (the trust policy in the module docstring), over Olm."""
        from nio import KeysClaimResponse, KeysQueryResponse, ShareGroupSessionResponse

        room = self.client.rooms[room_id]
        self.olm.update_tracked_users(room)
        try:
            if self.client.should_query_keys:
                queried: Any = await self.client.keys_query()
                if not isinstance(queried, KeysQueryResponse):
                    raise CryptoFailed(f"device keys of {room_id}'s members unknown: {queried}")
            missing = self.client.get_missing_sessions(room_id)
            if missing:
                claimed: Any = await self.client.keys_claim(missing)
                if not isinstance(claimed, KeysClaimResponse):
                    raise CryptoFailed(f"one-time keys not claimed: {claimed}")
        except _TRANSPORT_ERRORS as exc:
            raise CryptoFailed(f"{type(exc).__name__}: {exc}") from None
        batches = list(
            self.olm.share_group_session_parallel(
                room_id, list(room.users), ignore_unverified_devices=True
            )
        )
        session = self.olm.outbound_group_sessions[room_id]
        await self.persist()  # the Olm sessions these messages advanced, before they go
        for shared_with, to_device in batches:
            txn = secrets.token_hex(16)
            await self._request(
                "PUT",
                f"/_matrix/client/v3/sendToDevice/m.room.encrypted/{txn}",
                to_device,
                what=f"room key for {room_id}",
            )
            await self.client.receive_response(ShareGroupSessionResponse(room_id, shared_with))
        # A membership change meanwhile replaced the session: that one is shared anew.
        if self.olm.outbound_group_sessions.get(room_id) is session:
            session.shared = True
        logger.info(
            "matrix: room key of {} shared with {} devices",
            room_id,
            sum(len(shared) for shared, _ in batches),
        )


# --------------------------------------------------------------------------- files


def encrypted_file_id(file: Mapping[str, Any]) -> str | None:
    """The reference (`Attachment.file_id`) of an encrypted file (`content.file`): its
    mxc URI with what decrypts it in the fragment; None when it is malformed."""
    url = file.get("url")
    key = file.get("key")
    hashes = file.get("hashes")
    iv = file.get("iv")
    if not (
        isinstance(url, str)
        and url.startswith("mxc://")
        and isinstance(key, Mapping)
        and isinstance(key.get("k"), str)
        and isinstance(hashes, Mapping)
        and isinstance(hashes.get("sha256"), str)
        and isinstance(iv, str)
    ):
        return None
    secret = json.dumps({"k": key["k"], "iv": iv, "sha256": hashes["sha256"]})
    packed = base64.urlsafe_b64encode(secret.encode()).decode().rstrip("=")
    return f"{url}#{E2E_FRAGMENT}{packed}"


def split_file_id(file_id: str) -> tuple[str, dict[str, str] | None]:
    """(mxc URI, its decryption key, iv and hash or None) of a file reference."""
    url, _, fragment = file_id.partition("#")
    if not fragment.startswith(E2E_FRAGMENT):
        return url, None
    packed = fragment[len(E2E_FRAGMENT) :]
    try:
        data = json.loads(base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4)))
    except ValueError:
        return url, {}
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        return url, {}
    return url, {str(k): str(v) for k, v in data.items()}


def decrypt_file(data: bytes, secret: Mapping[str, str]) -> bytes:
    """An encrypted file's bytes (AES-CTR, its SHA-256 checked first). Raises
    ValueError when the key does not fit or the file was changed."""
    from nio.crypto.attachments import decrypt_attachment
    from nio.exceptions import EncryptionError

    try:
        return bytes(decrypt_attachment(data, secret["k"], secret["sha256"], secret["iv"]))
    except (EncryptionError, KeyError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def encrypt_file(data: bytes) -> tuple[bytes, dict[str, Any]]:
    """(ciphertext, the `file` fields but its url) of a file for an encrypted room."""
    from nio.crypto.attachments import encrypt_attachment

    ciphertext, keys = encrypt_attachment(data)
    return ciphertext, dict(keys)
