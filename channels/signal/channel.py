"""The Signal channel: signal-cli's JSON-RPC daemon over HTTP (`signal-cli -a NUMBER daemon
--http HOST:PORT --receive-mode manual`), on the gateway's own aiohttp.

Why no library: pysignalclijsonrpc (the one maintained Python client of this API) is
synchronous (requests, without a timeout), has no `receive`, typing, receipts or
attachments, and folds every failure into one exception, so a reply could not be told
"certainly not sent" from "may have gone out"; semaphore-bot and signalbot own the receive
loop (a socket subscription, or signal-cli-rest-api's websocket) and hand messages over
after signal-cli already dropped its copy. The protocol is a dozen JSON-RPC methods; the
channel speaks them itself (`channels.signal.client`).

Inbound: the channel asks for one message at a time (`receive` with `maxMessages: 1`, a
long poll of `receive_timeout` seconds) and asks for the next only once `submit` returned
for it: signal-cli receives nothing meanwhile, so what people write waits at Signal's
servers while the gateway is busy, stopped or down. The events stream (`/api/v1/events`)
is not used: with it signal-cli pushes every message as it comes, and what the gateway had
not read when it died is gone (signal-cli acknowledges a message to Signal's servers
before it hands it to anyone, and keeps no copy after; `ReceiveHelper`). A daemon left in
its default `--receive-mode on-start` receives by itself and drops what no client reads;
it refuses `receive`, which the channel reports.

What is promised (docs/signal.md, "Delivery"; tested in tests/test_signal*.py and the
conformance kit):
- Journal before asking for more: a message signal-cli handed over is submitted before
  the next `receive`. One that is not taken (the journal failed, the gateway is full or
  stopping) is kept in the channel's held list (a blob of the storage seam's cursor
  store, `signal-held:<number>`), durable before anything else happens, and submitted
  first at the next start, in order.
- A stop waits for the `receive` in flight (at most `receive_timeout` seconds, shielded
  from cancellation) and keeps what it brought: a graceful stop loses nothing.
- What cannot be kept: a `receive` whose answer never reaches the gateway (the gateway
  killed, or the network to signal-cli cut, while a call is open) loses the one message
  signal-cli takes for it, if one arrives before the call's end. signal-cli cannot be
  asked for it again. The read receipt tells the sender: "Read" shows only under a
  message the journal holds.
- A reply is never sent twice by the channel: a request is repeated only when it
  certainly did not take effect (no connection to signal-cli, a rate limit, signal-cli
  unable to reach Signal's servers), for up to `Pacing.retry_window`, then
  `DeliveryFailed` (the dispatcher sends it again later), resuming at the part that
  failed. A request that went out and got no answer is not repeated (it may have
  arrived).
- In groups the bot answers messages that mention it or quote it (the access policy's
  `require_mention`), quoting them; DMs go through pairing like every channel.
- Replies: the model's Markdown as Signal's text styles, in messages of at most 2,000
  bytes (`channels.signal.format`); files after the text, as attachments. Typing shows
  while a turn runs. No streaming: Signal's apps take at most 10 edits of a message
  and mark it edited.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from loguru import logger

from channels.notices import NoticeCooldown
from channels.signal.client import SignalError, SignalRpc
from channels.signal.format import Styled, signal_messages
from channels.signal.inbound import (
    CHANNEL,
    Me,
    Notice,
    Received,
    Skip,
    Target,
    parse_target,
    split_message_id,
    translate,
)
from channels.signal.settings import SignalSettings
from channels.typing_indicators import TypingIndicators
from gateway.channel import DeliveryFailed, PartsSent, Submit, Ticket
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead
from gateway.media import MediaError
from gateway.messages import META_REPLY_CONTEXT, Attachment, OutboundFile, OutboundMessage

#: The held list's format version.
HELD_VERSION = 1
_REMEMBERED_REPLIES = 10_000
_FILE_NAME = re.compile(r"[;,\s]+")


@dataclass
class SignalStats:
    """What the channel counted since start (mirrored into /metrics)."""

    #: `receive` calls whose answer never came: a message signal-cli took for one is lost.
    receive_cut: int = 0
    #: Messages held now (handed over, not yet taken by the gateway).
    held: int = 0


class SignalSetupError(Exception):
    """signal-cli cannot be used as configured; says what to fix."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to signal-cli (seconds)."""

    # A request that certainly did not take effect is retried this long (under the
    # dispatcher's cap on one delivery, 120 s): a reply rides out a restart of signal-cli.
    retry_window: float = 60.0
    retry_backoff: float = 0.5  # doubled per attempt
    retry_backoff_max: float = 8.0
    # The HTTP timeout of a `receive` beyond its own: the call is never abandoned while
    # signal-cli may still answer it.
    receive_margin: float = 15.0
    # `receive` refused as busy this long before it is logged as an error (a call of a
    # killed gateway ends within receive_timeout).
    busy_grace: float = 30.0
    typing_interval: float = 10.0  # Signal shows "typing" for 15 s
    typing_grace: float = 0.5
    turn_limit: float = 600.0
    notice_cooldown: float = 60.0
    request_timeout: float = 60.0


def data_uri(file: OutboundFile) -> str:
    """A file as signal-cli's attachment parameter (RFC 2397 with `filename=`)."""
    name = _FILE_NAME.sub("_", file.name) or "file"
    payload = base64.b64encode(file.data).decode("ascii")
    return f"data:{file.mime_type};filename={name};base64,{payload}"


class SignalChannel:
    """The Signal adapter (the Channel protocol); see the module docstring."""

    name = CHANNEL

    def __init__(
        self,
        settings: SignalSettings,
        *,
        lead: Lead,
        pacing: Pacing | None = None,
    ) -> None:
        if not settings.account:
            raise ConfigError(
                "channels.signal.account: set the bot's number as signal-cli knows it "
                "(GATEWAY_CHANNELS__SIGNAL__ACCOUNT=+15551234567); docs/signal.md"
            )
        self.settings = settings
        self.lead = lead
        self.pacing = pacing or Pacing()
        self.rpc = SignalRpc(settings.url, settings.account, timeout=self.pacing.request_timeout)
        self.me = Me(settings.account)
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._notices = NoticeCooldown()
        self._typing = TypingIndicators[Target](self._show_typing)
        #: Replies a failure cut short, by (session, reply_to, text): the parts sent.
        self._sent_parts = PartsSent[tuple[str, str | None, str], int](_REMEMBERED_REPLIES)
        self._held_stored = False
        self.stats = SignalStats()
        self.live = anyio.Event()  # set once messages flow (for tests and probes)

    @property
    def held_name(self) -> str:
        """The blob of messages signal-cli handed over that the gateway did not take."""
        return f"signal-held:{self.settings.account}"

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Check signal-cli and the account, then receive until cancelled. Raises
        SignalSetupError when signal-cli cannot serve the account (the daemon restarts
        the channel with backoff)."""
        self._submit = submit
        self._paused = False
        try:
            found = await self._connect()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                logger.info(
                    "signal: {} via signal-cli at {} ({})", self.me.number, self.rpc.root, found
                )
                self.live.set()
                task_status.started()
                # With replicas, one receives (signal-cli serves one `receive` at a time);
                # every replica sends.
                await self.lead(self._intake)
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self.live = anyio.Event()
            with anyio.CancelScope(shield=True):
                await self.rpc.aclose()

    async def _connect(self) -> str:
        """signal-cli is up and serves the account; its version and mode, for the log."""
        try:
            mode = await self.rpc.learn_mode()
            version = await self.rpc.call("version")
        except SignalError as exc:
            raise SignalSetupError(f"signal: {exc}") from None
        await self._learn_uuid()
        number = version.get("version") if isinstance(version, Mapping) else None
        return f"signal-cli {number or 'of unknown version'}, {mode}"

    async def _learn_uuid(self) -> None:
        """The bot's own uuid (mentions and quotes name it): best effort."""
        try:
            found = await self.rpc.call(
                "listContacts", {"recipient": [self.me.number], "allRecipients": True}
            )
        except SignalError as exc:
            logger.debug("signal: the bot's uuid is unknown ({}); mentions by number only", exc)
            return
        for contact in found or ():
            if isinstance(contact, Mapping) and contact.get("number") == self.me.number:
                self.me = Me(self.me.number, str(contact.get("uuid") or ""))

    def pause_intake(self) -> None:
        """Ask signal-cli for nothing more (the daemon is draining): the `receive` in
        flight ends by itself within `receive_timeout`, and what it brings is submitted
        or held; what people write meanwhile waits at Signal's servers."""
        self._paused = True

    async def _intake(self, store: CursorStore) -> None:
        """Receive one message at a time, and submit it before asking for the next."""
        held = await self._load_held(store)
        failures = 0
        busy_since: float | None = None
        while not self._paused:
            # Every call below is shielded: a stop is taken here, between two of them.
            await anyio.lowlevel.checkpoint()
            if held:
                held = await self._take_all(held, store)
                if held:
                    failures += 1
                    await anyio.sleep(self._backoff(failures))
                    continue
            try:
                items = await self._receive()
            except SignalError as exc:
                failures += 1
                if exc.busy:
                    busy_since = busy_since or time.monotonic()
                    self._log_busy(time.monotonic() - busy_since)
                elif exc.kind == "final":
                    raise SignalSetupError(f"signal: receive failed: {exc}") from None
                elif exc.kind == "maybe_done":
                    self.stats.receive_cut += 1
                    logger.error(
                        "signal: {}; a message signal-cli took for that call, if any, is "
                        "lost (it was already acknowledged to Signal's servers)",
                        exc,
                    )
                else:
                    logger.warning("signal: receiving failed ({}); retrying", exc)
                await anyio.sleep(self._backoff(failures))
                continue
            failures, busy_since = 0, None
            if items:
                held = await self._take_all(items, store)

    def _backoff(self, failures: int) -> float:
        delay = self.pacing.retry_backoff * 2 ** min(failures - 1, 10)
        return float(min(delay, self.pacing.retry_backoff_max))

    def _log_busy(self, waited: float) -> None:
        if waited < self.pacing.busy_grace:
            logger.info("signal: signal-cli is still answering an earlier receive; waiting")
            return
        logger.error(
            "signal: signal-cli refuses `receive` because it receives for someone else: "
            "start it with --receive-mode manual (in its default on-start mode it receives by "
            "itself and drops what no client reads), and let nothing else read "
            "/api/v1/events or run `receive` for {}",
            self.me.number,
        )

    async def _receive(self) -> list[Mapping[str, Any]]:
        """One `receive`: at most one message, within `receive_timeout`. Shielded: once
        asked, signal-cli takes the message off Signal's servers whether or not anyone
        reads its answer, so the call is never abandoned."""
        timeout = self.settings.receive_timeout
        with anyio.CancelScope(shield=True):
            found = await self.rpc.call(
                "receive",
                {"timeout": timeout, "maxMessages": 1},
                within=timeout + self.pacing.receive_margin,
            )
        return [i for i in found if isinstance(i, Mapping)] if isinstance(found, list) else []

    async def _take_all(
        self, items: list[Mapping[str, Any]], store: CursorStore
    ) -> list[Mapping[str, Any]]:
        """Submit `items` in order; from the first one not taken on, they are held
        (durably) and returned. Shielded: nothing signal-cli handed over is dropped by a
        stop."""
        with anyio.CancelScope(shield=True):
            for index, item in enumerate(items):
                if not await self._take(item):
                    rest = list(items[index:])
                    await self._save_held(store, rest)
                    return rest
            if self._held_stored:
                await self._save_held(store, [])
        return []

    async def _take(self, item: Mapping[str, Any]) -> bool:
        """Translate and submit one message; True once only the journal needs it."""
        result = translate(item, self.me)
        if isinstance(result, Skip):
            logger.debug("signal: skipped: {}", result.reason)
            return True
        if isinstance(result, Notice):
            self._spawn(self._send_notice, result)
            return True
        if self._submit is None:
            return False
        ticket = await self._submit(result.message)
        if not ticket.taken:
            return False
        if result.receipt is not None:
            self._spawn(self._acknowledge, result)
            self._spawn(self._typing_while_pending, ticket, result.target)
        return True

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- held messages

    async def _load_held(self, store: CursorStore) -> list[Mapping[str, Any]]:
        raw = await store.load_blob(self.held_name)
        self._held_stored = bool(raw)
        if not raw:
            return []
        try:
            document = json.loads(raw)
            items = document["items"] if document.get("version") == HELD_VERSION else None
        except (ValueError, TypeError, KeyError, AttributeError):
            items = None
        if not isinstance(items, list):
            logger.error(
                "signal: the held messages ({}) are unreadable; kept as they are, not used",
                self.held_name,
            )
            self._held_stored = False  # never overwritten by an empty list
            return []
        logger.info("signal: {} message(s) held from before; submitting them first", len(items))
        self.stats.held = len(items)
        return [i for i in items if isinstance(i, Mapping)]

    async def _save_held(self, store: CursorStore, items: list[Mapping[str, Any]]) -> None:
        data = json.dumps({"version": HELD_VERSION, "items": items}).encode()
        await store.save_blob(self.held_name, data)
        self._held_stored = bool(items)
        self.stats.held = len(items)
        if items:
            logger.warning(
                "signal: {} message(s) not taken by the gateway now; held, submitted again first",
                len(items),
            )

    # ----------------------------------------------------------------- telling people

    async def _acknowledge(self, received: Received) -> None:
        """The read receipt (and "seen" reaction) of a journaled message: best effort."""
        assert received.receipt is not None
        author, timestamp = received.receipt
        try:
            if self.settings.read_receipts:
                await self.rpc.call(
                    "sendReceipt",
                    {"recipient": author, "targetTimestamp": [timestamp], "type": "read"},
                )
            if self.settings.seen_reaction:
                await self.rpc.call(
                    "sendReaction",
                    {
                        **received.target.params(),
                        "emoji": self.settings.seen_reaction,
                        "targetAuthor": author,
                        "targetTimestamp": timestamp,
                    },
                )
        except SignalError as exc:
            logger.debug("signal: read receipt not sent: {}", exc)

    async def _typing_while_pending(self, ticket: Ticket, where: Target) -> None:
        if not self.settings.read_receipts:
            return
        await self._typing.while_pending(
            ticket,
            where,
            spawn=self._spawn,
            grace=self.pacing.typing_grace,
            interval=self.pacing.typing_interval,
            limit=self.pacing.turn_limit,
        )

    async def _show_typing(self, where: Target) -> None:
        try:
            await self.rpc.call("sendTyping", where.params())
        except SignalError as exc:
            logger.debug("signal: typing indicator failed: {}", exc)

    async def _send_notice(self, notice: Notice) -> None:
        where = notice.target.group_id or notice.target.recipient
        if not self._notices.allow(where, self.pacing.notice_cooldown):
            return
        try:
            await self.rpc.call("send", {**notice.target.params(), "message": notice.text})
        except SignalError as exc:
            logger.warning("signal: a notice was not sent: {}", exc)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Markdown as text styles, split under Signal's body limit, in
        order, the first part quoting the message it answers in a group; files after.
        Raises DeliveryFailed when a part certainly did not go out (the same reply sent
        again goes on from that part); another SignalError when it never can, or may
        have gone out."""
        target = parse_target(message.chat_id)
        parts = signal_messages(message.text)
        if not parts and not message.files:
            logger.warning("signal: empty reply not sent")
            return
        quote = self._quote(message) if target.group_id is not None else {}
        key = (message.session_key, message.reply_to, message.text)
        done = self._sent_parts.take(key, 0)
        with logger.contextualize(session=message.session_key):
            try:
                for index, part in enumerate(parts):
                    if index >= done:
                        await self._send_part(target, part, quote if index == 0 else {})
                        done = index + 1
                for number, file in enumerate(message.files, start=len(parts)):
                    if number >= done:
                        await self._send_file(target, file)
                        done = number + 1
            except SignalError as exc:
                if exc.kind != "not_done":
                    raise
                self._sent_parts.keep(key, done)
                raise DeliveryFailed(f"signal: {exc}", sent=done) from exc

    def _quote(self, message: OutboundMessage) -> dict[str, Any]:
        context = message.metadata.get(META_REPLY_CONTEXT)
        post = context.get("quote") if isinstance(context, Mapping) else None
        found = split_message_id(str(post) if post else message.reply_to)
        if found is None:
            return {}
        author, timestamp = found
        return {"quoteTimestamp": timestamp, "quoteAuthor": author}

    async def _send_part(self, target: Target, part: Styled, quote: dict[str, Any]) -> None:
        params: dict[str, Any] = {**target.params(), "message": part.text, **quote}
        if part.styles:
            params["textStyle"] = part.params()
        await self.call("send", params, idempotent=False)

    async def _send_file(self, target: Target, file: OutboundFile) -> None:
        params: dict[str, Any] = {**target.params(), "attachment": [data_uri(file)]}
        if file.caption:
            params["message"] = file.caption
        await self.call("send", params, idempotent=False)

    async def call(self, method: str, params: dict[str, Any], *, idempotent: bool) -> Any:
        """One request, repeated only when that is safe: when it certainly did not take
        effect (waiting out a rate limit), or, if `idempotent`, when its answer was lost;
        for at most `Pacing.retry_window`."""
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await self.rpc.call(method, params)
            except SignalError as exc:
                if exc.kind == "final" or (exc.kind == "maybe_done" and not idempotent):
                    if exc.kind == "maybe_done":
                        logger.error(
                            "signal: {} went out and got no answer; not repeated (it may "
                            "have arrived; repeating could show it twice): {}",
                            method,
                            exc,
                        )
                    raise
                attempt += 1
                delay = exc.retry_after or min(
                    self.pacing.retry_backoff * 2 ** (attempt - 1), self.pacing.retry_backoff_max
                )
                if time.monotonic() - started + delay > self.pacing.retry_window:
                    raise
                logger.warning(
                    "signal: {} failed ({}); retry {} in {:g}s", method, exc, attempt, delay
                )
                await anyio.sleep(delay)

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file someone sent, as signal-cli downloaded it when it received the message
        (`getAttachment`, base64 in the answer)."""
        if attachment.size is not None and attachment.size > max_bytes:
            raise MediaError(
                f"it is {attachment.size / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        try:
            found = await self.call("getAttachment", {"id": attachment.file_id}, idempotent=True)
        except SignalError as exc:
            logger.warning("signal: getAttachment failed: {}", exc)
            raise MediaError(
                "signal-cli does not have the file (was it started with "
                "--ignore-attachments?); please send it again"
            ) from None
        encoded = found.get("data") if isinstance(found, Mapping) else None
        try:
            data = base64.b64decode(str(encoded or ""), validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(
                "signal-cli handed over the file in a form it cannot be read"
            ) from None
        if len(data) > max_bytes:
            raise MediaError(
                f"it is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        return data


async def check_daemon(settings: SignalSettings) -> str:
    """`gateway doctor`: signal-cli answers, serves the account, and its version. Raises
    SignalSetupError saying what to fix."""
    rpc = SignalRpc(settings.url, settings.account or "", timeout=15)
    try:
        await rpc.check()
        mode = await rpc.learn_mode()
        version = await rpc.call("version")
    except SignalError as exc:
        raise SignalSetupError(
            f"signal: {exc}; is `signal-cli -a {settings.account} daemon --http ... "
            "--receive-mode manual` running?"
        ) from None
    finally:
        await rpc.aclose()
    number = version.get("version") if isinstance(version, Mapping) else "?"
    return f"signal-cli {number} at {rpc.root} serves {settings.account} ({mode})"
