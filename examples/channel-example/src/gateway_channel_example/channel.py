"""The example channel: Example Chat's updates in, the bot's replies out, over its HTTP API
(`gateway_channel_example.platform` says what the platform does).

Inbound: the channel long-polls ``GET /updates`` (or, in webhook mode, takes each update
on the gateway's ``POST /example/webhook``) and turns each message into an
`InboundMessage` (`translate`): session key ``example:<conversation>``, the platform's
message id, and in a group whether the bot was mentioned or replied to, which the gateway
reads to ignore the rest. Outbound: `send` splits a reply at 2,000 characters and posts the
parts in order, the first one replying to the person's message in a group.

Promises (checked by the conformance kit: tests/test_conformance.py):
- Journal before confirm: the poll's offset moves past an update only after `submit`
  returned a taken ticket for it (the message is in the gateway's journal); the webhook
  answers 200 only then. A kill at any moment leaves every message either in the journal
  or with Example Chat, which hands it over again. A ticket not taken stops the batch
  there: the update is fetched again after a pause, and the webhook answers 503.
- A message keeps its id however often the platform hands it over: the gateway's journal
  answers it once.
- No post notifies everyone: every post asks for ``"notify": ["users"]``.
- A reply the platform certainly did not take (the connection refused, a 5xx) raises
  `DeliveryFailed`, and the gateway sends it again later; the parts that went out are not
  sent twice. Any other failure (a 4xx, a timeout after the request went out) is raised
  as it is: sending again would not help, or could show it twice.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import anyio
import anyio.abc
from aiohttp import web
from gateway.channel import DeliveryFailed, Submit
from gateway.config import ConfigError
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    InboundMessage,
    OutboundMessage,
)
from gateway.registry import Mount
from loguru import logger

from gateway_channel_example.settings import ExampleSettings

CHANNEL = "example"
WEBHOOK_PATH = "/example/webhook"
SIGNATURE_HEADER = "X-Example-Signature"
#: The longest text one Example Chat post holds.
MAX_TEXT = 2000
#: Seconds to wait before polling again after a failure (doubling up to `MAX_PAUSE`).
FIRST_PAUSE = 0.5
MAX_PAUSE = 30.0
#: Replies cut short by a failure, remembered so a resend skips the parts that went out.
REMEMBERED_REPLIES = 1024

Update = Mapping[str, Any]
Leader = Callable[[Callable[[], Awaitable[None]]], Awaitable[None]]


class PlatformDown(Exception):
    """Example Chat did not take the request (no connection, or a 5xx): nothing happened."""


class PlatformRefused(Exception):
    """Example Chat refused the request (a 4xx): sending it again would not help."""


def translate(update: Update, *, bot: str) -> InboundMessage | None:
    """The gateway's message for an update; None for one the bot does not answer (its own
    posts, anything but a text message)."""
    message = update.get("message")
    if not isinstance(message, Mapping) or not isinstance(message.get("text"), str):
        return None
    author, conversation = message["author"], message["conversation"]
    if author["id"] == bot:
        return None
    metadata: dict[str, Any] = {
        META_SENDER_NAME: author.get("name") or author["id"],
        META_SENT_AT: message.get("sent_at"),
    }
    if conversation["kind"] == "group":
        replied = message.get("reply_to") or {}
        metadata[META_IS_GROUP] = True
        metadata[META_MENTIONED] = bot in message.get("mentions", ())
        metadata[META_REPLY_TO_BOT] = replied.get("author") == bot
    return InboundMessage(
        channel=CHANNEL,
        chat_id=conversation["id"],
        text=without_mention(message["text"], bot),
        sender_id=author["id"],
        message_id=message["id"],
        metadata=metadata,
    )


def without_mention(text: str, bot: str) -> str:
    """`text` without the ``@bot`` it starts with (the model needs no address)."""
    mention = f"@{bot}"
    if text.startswith(mention) and text[len(mention) : len(mention) + 1] in ("", " ", ","):
        return text[len(mention) :].lstrip(" ,") or text
    return text


def split_text(text: str, limit: int = MAX_TEXT) -> list[str]:
    """`text` in parts of at most `limit` characters, in order: cut at a blank line, else
    at a line's end, else at a space, else anywhere; only whitespace at a cut is dropped."""
    parts = []
    rest = text.strip()
    while len(rest) > limit:
        window = rest[: limit + 1]
        cut = next(
            (at for sep in ("\n\n", "\n", " ") if (at := window.rfind(sep)) > limit // 2),
            limit,
        )
        parts.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip()
    if rest:
        parts.append(rest)
    return parts


def signed(secret: str, body: bytes, signature: str) -> bool:
    """Is `signature` Example Chat's for `body` (compared in constant time)?"""
    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(signature.encode("utf-8", "replace"), expected.encode())


class ExampleChannel:
    """The adapter; the module docstring says what it promises."""

    name = CHANNEL

    def __init__(self, settings: ExampleSettings, *, token: str) -> None:
        if settings.mode == "webhook" and not (
            settings.webhook_url and settings.resolved_webhook_secret()
        ):
            raise ConfigError(
                "channels.example: webhook mode needs webhook_url and a secret "
                "(GATEWAY_CHANNELS__EXAMPLE__WEBHOOK_SECRET)"
            )
        self.settings = settings
        self._token = token
        self._root = settings.api_url.rstrip("/")
        #: With replicas, runs the poll only on the replica holding the poll role.
        self.poll_leader: Leader | None = None
        self._http: aiohttp.ClientSession | None = None
        self._submit: Submit | None = None
        self._bot = ""
        self._offset = 0  # the next update wanted; Example Chat forgets those below it
        self._confirmed = 0  # the offset Example Chat was last sent
        self._paused = False
        self._poll_scope: anyio.CancelScope | None = None
        self._sent_parts: OrderedDict[tuple[str, str | None, str], int] = OrderedDict()

    def mount(self, http: Mount) -> None:
        """Webhook mode: route the gateway's ``POST /example/webhook`` here."""
        if self.settings.mode == "webhook":
            http.mount("POST", WEBHOOK_PATH, self._webhook)

    # -- running ------------------------------------------------------------------------

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Take updates until cancelled; only once the bot knows its own handle (without
        it, a mention of the bot would read as chatter and be settled unanswered)."""
        self._paused = False
        headers = {"Authorization": f"Bearer {self._token}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            self._http = http
            try:
                self._bot = str((await self._call("GET", "/me"))["id"])
                self._submit = submit  # the webhook answers 503 until now
                if self.settings.mode == "webhook":
                    secret = self.settings.resolved_webhook_secret()
                    await self._call(
                        "PUT", "/webhook", body={"url": self.settings.webhook_url, "secret": secret}
                    )
                else:
                    await self._call("DELETE", "/webhook")
                logger.info("example: @{} is live ({})", self._bot, self.settings.mode)
                task_status.started()
                if self.settings.mode == "polling":
                    if self.poll_leader is None:
                        await self._poll()
                    else:
                        await self.poll_leader(self._poll)
                await anyio.sleep_forever()  # replies go out until the gateway stops
            finally:
                self._submit = None
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await self._confirm_last()
                self._http = None

    def pause_intake(self) -> None:
        """Take no more updates (the gateway drains): what Example Chat holds stays there
        for the next start; the webhook answers 503."""
        self._paused = True
        if self._poll_scope is not None:
            self._poll_scope.cancel()

    async def _poll(self) -> None:
        """Long polling that confirms only what the journal holds: the offset moves past
        an update once `_take` says the gateway has it, and the next ``GET /updates``
        tells Example Chat so. Updates are taken one at a time, in order."""
        failures = 0
        while not self._paused:
            updates: list[Update] = []
            with anyio.CancelScope() as self._poll_scope:
                try:
                    found = await self._call(
                        "GET",
                        "/updates",
                        params={"offset": self._offset, "timeout": self.settings.poll_timeout},
                        seconds=self.settings.poll_timeout + 10,
                    )
                    updates, failures = found["updates"], 0
                    self._confirmed = self._offset
                except (PlatformDown, PlatformRefused, aiohttp.ClientError, TimeoutError) as exc:
                    failures += 1
                    logger.warning("example: fetching updates failed ({}); retrying", exc)
            self._poll_scope = None
            for update in updates:
                if self._paused:
                    return
                if not await self._take(update):
                    failures += 1  # left with Example Chat: fetched again after a pause
                    break
                self._offset = int(update["update_id"]) + 1
            if failures:
                await anyio.sleep(min(FIRST_PAUSE * 2 ** (failures - 1), MAX_PAUSE))

    async def _confirm_last(self) -> None:
        """Confirm what the journal holds before stopping, so that the next start is not
        handed it again (it would only be dropped as a duplicate)."""
        if self.settings.mode != "polling" or self._offset == self._confirmed:
            return
        try:
            await self._call("GET", "/updates", params={"offset": self._offset, "limit": 1})
        except (PlatformDown, PlatformRefused, aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("example: last confirmation skipped: {}", exc)

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        """One update from Example Chat: 401 unless signed with the secret; 200 once the
        gateway has it; 503, and Example Chat sends it again, when it does not."""
        body = await request.read()
        secret = self.settings.resolved_webhook_secret() or ""
        if not signed(secret, body, request.headers.get(SIGNATURE_HEADER, "")):
            return web.json_response({"error": "bad signature"}, status=401)
        if self._paused or self._submit is None:
            return web.json_response({"error": "not taking updates"}, status=503)
        try:
            update = json.loads(body)
        except ValueError:
            return web.json_response({"error": "not JSON"}, status=400)
        if not isinstance(update, dict):
            return web.json_response({"error": "not an update"}, status=400)
        if not await self._take(update):
            return web.json_response({"error": "not taken; send it again"}, status=503)
        return web.json_response({"ok": True})

    # -- one update ----------------------------------------------------------------------

    async def _take(self, update: Update) -> bool:
        """Hand an update's message to the gateway. True when Example Chat may forget the
        update: the message is journaled (or settled: a duplicate, a refusal, ignored,
        or unreadable: it would fail the same way every time it came again)."""
        try:
            message = self._translate(update)
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning(
                "example: update {} is unreadable, skipped: {!r}", update.get("update_id"), exc
            )
            return True
        if message is None or self._submit is None:
            return message is None
        ticket = await self._submit(message)
        return ticket.taken

    def _translate(self, update: Update) -> InboundMessage | None:
        return translate(update, bot=self._bot)

    # -- replies ---------------------------------------------------------------------------

    async def send(self, message: OutboundMessage) -> None:
        """Post a reply in parts of at most 2,000 characters, in order; in a group the
        first part replies to the person's message. Raises `DeliveryFailed` when Example
        Chat certainly did not take a part: the same reply sent again goes on from it."""
        if message.files:
            logger.warning("example: Example Chat takes no files; {} not sent", len(message.files))
        parts = split_text(message.text)
        group = not message.chat_id.startswith("dm-")
        reply = (message.session_key, message.reply_to, message.text)
        done = self._sent_parts.pop(reply, 0)
        for index, part in enumerate(parts):
            if index < done:
                continue
            body: dict[str, Any] = {
                "conversation": message.chat_id,
                "text": part,
                "notify": ["users"],  # never everyone, whatever the model wrote
            }
            if group and index == 0 and message.reply_to:
                body["reply_to"] = message.reply_to
            try:
                await self._call("POST", "/messages", body=body)
            except PlatformDown as exc:
                self._sent_parts[reply] = index
                while len(self._sent_parts) > REMEMBERED_REPLIES:
                    self._sent_parts.popitem(last=False)
                raise DeliveryFailed(f"example: {exc}", sent=index) from exc

    # -- the API ------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Mapping[str, Any] | None = None,
        seconds: float = 30,
    ) -> dict[str, Any]:
        """One call of Example Chat's API; its JSON answer. Raises `PlatformDown` when it
        certainly did not take effect, `PlatformRefused` for a 4xx; `seconds` bounds it."""
        http = self._http
        if http is None:
            raise PlatformDown("the channel is not connected")
        try:
            async with http.request(
                method,
                self._root + path,
                params=params,
                json=body,
                timeout=aiohttp.ClientTimeout(total=seconds),
            ) as answer:
                status = answer.status
                try:
                    data = await answer.json(content_type=None)
                except ValueError:
                    data = None
        except aiohttp.ClientConnectorError as exc:  # never connected: nothing was sent
            raise PlatformDown(f"{method} {path}: cannot connect ({exc})") from exc
        found: dict[str, Any] = data if isinstance(data, dict) else {}
        if status >= 500:
            raise PlatformDown(f"{method} {path}: {status} {found.get('description', '')}")
        if status >= 400:
            raise PlatformRefused(f"{method} {path}: {status} {found.get('description', '')}")
        return found


async def who_am_i(settings: ExampleSettings) -> str:
    """The bot's handle and where it is, from ``GET /me`` (for `gateway doctor`)."""
    headers = {"Authorization": f"Bearer {settings.resolved_token()}"}
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(headers=headers, timeout=timeout) as http,
        http.get(settings.api_url.rstrip("/") + "/me") as answer,
    ):
        if answer.status != 200:
            raise PlatformRefused(f"GET /me answered {answer.status}")
        me = await answer.json()
    return f"@{me['id']} on {settings.api_url}"
