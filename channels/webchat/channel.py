"""The web chat: a chat page on the gateway's port (`/webchat/`), the same page in a frame
for other sites (the widget), and the small JSON and event-stream API behind it.

Inbound: the page POSTs a message (`/webchat/api/messages`) with an id of its own; the
channel logs it in the visitor's conversation log (`channels.webchat.store`), submits it
(session key `web:<visitor>`, message id the page's id) and answers 200 only once it is
journaled. Outbound: `send` writes the reply into the same log, and every page of the
visitor reads the log from where it stopped (`/webchat/api/events?after=<id>`, a stream
of server-sent events): the page is the platform, the log its inbox.

Promises (each tested in tests/test_webchat_http.py, tests/test_webchat_browser.py and by
the conformance kit, tests/conformance/test_webchat_conformance.py):
- Journal before confirm: a message's POST is answered 200 only once `submit` returned a
  ticket that took it; otherwise 503 (or 429, or 403), and the page keeps the message and
  posts it again with the same id. A message posted again is logged once and journaled
  once, and answered once.
- A reply is in the visitor's log before `send` returns; a failed write raises
  `DeliveryFailed` (the dispatcher sends it again). The same reply sent twice (a crash
  between its sending and its mark) is logged once.
- A page that reconnects with the id of the last event it saw gets every later event,
  once, in order; the page drops an event id it has (a second tab, a reload).
- Only the cookie's visitor is read: no request names a visitor, and a file is served
  only to the visitor it belongs to. A request that changes something carries the
  cookie's CSRF token and, from a browser, this page's own `Origin`.
- Rate limits refuse a message before it is logged (429 with Retry-After).
- Pages, scripts and files are served with the strict CSP; the frame only to the sites of
  `allowed_origins` (`channels.webchat.site`).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import anyio
import anyio.abc
from aiohttp import hdrs, web
from loguru import logger

from channels.webchat.hub import Hub
from channels.webchat.limits import RateLimits
from channels.webchat.render import render
from channels.webchat.settings import VISITOR_ID, WebChatSettings
from channels.webchat.site import API, PREFIX, STATIC, frame_origin, page_response, refusal
from channels.webchat.store import Event, FileRef, NewFile, WebChatStore
from channels.webchat.visitors import (
    CSRF_HEADER,
    EMBED_COOKIE,
    PAGE_COOKIE,
    Visitor,
    VisitorKeys,
    new_key,
    new_visitor_id,
)
from gateway.agent.commands import parse_command
from gateway.channel import DeliveryFailed, Submit, Ticket
from gateway.http import json_error
from gateway.http.pages import StaticFiles, same_origin, secure_enough
from gateway.media import MediaError
from gateway.messages import (
    META_IS_GROUP,
    META_SENDER_NAME,
    Attachment,
    InboundMessage,
    OutboundMessage,
)
from gateway.registry import Mount

CHANNEL = "web"
#: The header the widget's frame sends with every request: read its own cookie.
EMBED_HEADER = "X-Webchat-Embed"
#: A message's id, chosen by the page (a UUID, or any 8-64 such characters).
CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
#: Files one message may carry.
MAX_FILES = 10
#: Events read from the log at once.
BATCH = 200
#: Conversations listed, and events of one conversation shown, at most.
MAX_CONVERSATIONS = 100
MAX_HISTORY = 500
#: Event streams one visitor may hold open at once (tabs, devices).
MAX_STREAMS_PER_VISITOR = 16
#: File types a browser may show as they are; anything else is a download.
INLINE_IMAGES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
_MIME = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]{0,63}/[a-z0-9][a-z0-9!#$&^_.+-]{0,63}")
_FILE_NAME_BAD = re.compile(r"[\x00-\x1f\x7f/\\]")
_NEW_CONVERSATION = frozenset({"new", "reset"})
NEEDS_HTTPS = "open the chat over HTTPS: its cookie comes back only over HTTPS off this machine"
STARTING = "the web chat is starting; retry in a few seconds"


@dataclass(frozen=True, slots=True)
class Pacing:
    """How often the channel looks and writes (seconds)."""

    #: With replicas, how often a page's stream reads the log for replies another replica
    #: wrote (in one process every reply wakes its readers at once).
    poll_interval: float = 1.0
    #: A comment on an idle stream, so proxies and the page's watchdog see it alive.
    heartbeat: float = 15.0
    #: At most one draft of a reply being written per this, per reply.
    draft_interval: float = 0.15
    #: A page that does not take a write within this is dropped (it reconnects).
    write_timeout: float = 30.0
    #: The longest a message is shown as being answered.
    turn_limit: float = 600.0
    #: How often old log entries and files are forgotten.
    purge_every: float = 3600.0


@dataclass(slots=True)
class _Draft:
    text: str
    started: float
    next_at: float


class BodyTooLarge(Exception):
    pass


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (BodyTooLarge past it); read here rather
    than by aiohttp, whose cap is the server's small one for every route."""
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


def file_kind(mime: str) -> str:
    """What the media pipeline makes of an upload (docs/media.md)."""
    if mime.startswith("image/"):
        return "image"
    if mime.startswith("audio/"):
        return "voice"
    return "document"


def clean_file_name(name: str) -> str:
    name = _FILE_NAME_BAD.sub("_", name).strip()[:200]
    return name or "file"


def visitor_cookie(visitor: Visitor, *, embed: bool) -> str:
    """The Set-Cookie of a visitor: for the chat's paths only, over HTTPS (or loopback),
    out of scripts' reach. The page's is same-site only; the frame lives on another site,
    so its cookie travels in a third-party context and is kept in that site's partition
    only (CHIPS: `Partitioned`, which Python's cookie module cannot write before 3.14)."""
    seconds = max(1, int(visitor.expires - time.time()))
    same_site = "None; Partitioned" if embed else "Strict"
    name = EMBED_COOKIE if embed else PAGE_COOKIE
    return (
        f"{name}={visitor.cookie}; Max-Age={seconds}; Path={PREFIX}; Secure; HttpOnly; "
        f"SameSite={same_site}"
    )


def event_json(event: Event) -> dict[str, Any]:
    """An event as the page reads it: a reply's text is also rendered (`html`)."""
    return {
        "id": event.seq,
        "conversation": event.conversation,
        "kind": event.kind,
        "message_id": event.message_id,
        "text": event.text,
        "html": render(event.text) if event.kind == "reply" else None,
        "files": [
            {**ref.to_json(), "url": f"{API}/files/{ref.id}", "inline": ref.mime in INLINE_IMAGES}
            for ref in event.files
        ],
        "error": event.error,
        "at": event.at,
    }


def sse(data: dict[str, Any], *, event: str, event_id: int | None = None) -> bytes:
    """One server-sent event (the JSON holds no newline, so one `data:` line)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


class WebChatChannel:
    """The web chat (see the module doc). `mount` its routes before the server runs."""

    name = CHANNEL

    def __init__(
        self,
        settings: WebChatSettings,
        *,
        store: WebChatStore,
        replicas: bool = False,
        pacing: Pacing | None = None,
    ) -> None:
        self.settings = settings
        self.pacing = pacing or Pacing()
        self._store = store
        self._replicas = replicas
        self._hub = Hub()
        self.rates = RateLimits(settings)
        self._keys: VisitorKeys | None = None
        self._submit: Submit | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._paused = False
        self._closing = False
        self._drafts: dict[tuple[str, str], _Draft] = {}
        self._static = StaticFiles("channels.webchat")
        self._max_upload = int(settings.max_upload_mb * 1024 * 1024)
        #: Counts for /metrics.
        self.messages = 0
        self.replies = 0
        self.new_visitors = 0

    @property
    def streams(self) -> int:
        """Pages reading their log right now, in this process."""
        return len(self._hub)

    # ----------------------------------------------------------------- wiring

    def mount(self, http: Mount) -> None:
        """The pages (served while the gateway starts, too) and the API (503 until it is
        ready, and while it drains: the page sends again)."""
        pages: list[tuple[str, str, Any]] = [
            ("GET", PREFIX, self._to_page),
            ("GET", f"{PREFIX}/", self._page),
            ("GET", f"{PREFIX}/frame", self._frame),
            ("GET", f"{PREFIX}/widget.js", self._widget),
            ("GET", f"{STATIC}/{{name}}", self._static.handler),
        ]
        api: list[tuple[str, str, Any]] = [
            ("GET", f"{API}/state", self._state),
            ("POST", f"{API}/login", self._login),
            ("POST", f"{API}/logout", self._guarded(self._logout, changes=True)),
            ("GET", f"{API}/history", self._guarded(self._history)),
            ("GET", f"{API}/events", self._guarded(self._events)),
            ("POST", f"{API}/messages", self._guarded(self._message, changes=True)),
            ("POST", f"{API}/uploads", self._guarded(self._upload, changes=True)),
            ("GET", f"{API}/files/{{file_id}}", self._guarded(self._file)),
        ]
        for method, path, handler in pages:
            http.mount(method, path, handler, require_ready=False)
        for method, path, handler in api:
            http.mount(method, path, handler)

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Take messages until cancelled; the pages' streams end with it."""
        key = await self._store.signing_key(new_key())
        self._keys = VisitorKeys(key, password=self.settings.resolved_password())
        self._submit = submit
        self._paused = False
        self._closing = False
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                logger.info(
                    "web: the chat is live at {}/ ({} visitors{})",
                    PREFIX,
                    "password" if self._keys.needs_password else self.settings.dm_policy,
                    f"; widget for {', '.join(self.settings.allowed_origins)}"
                    if self.settings.allowed_origins
                    else "",
                )
                task_status.started()
                await self._purge_forever()
        finally:
            self._tg = None
            self._submit = None
            self._closing = True
            self._hub.wake_all()  # every stream sees it is closing and ends

    def pause_intake(self) -> None:
        """Take no more messages (the daemon is draining): their POSTs answer 503 and the
        pages send them again to the next start; replies still reach the log."""
        self._paused = True

    async def _purge_forever(self) -> None:
        while True:
            now = time.time()
            before = now - self.settings.history_days * 86400.0
            # A visitor is remembered as long as a cookie of theirs may live, and then some.
            visitors_before = min(before, now - 2 * self.settings.remember_days * 86400.0)
            try:
                removed = await self._store.purge(before, visitors_before=visitors_before)
                if removed:
                    logger.info(
                        "web: forgot {} log entries and files older than the log keeps", removed
                    )
            except Exception as exc:  # the next round tries again
                logger.warning("web: old log entries not purged: {!r}", exc)
            await anyio.sleep(self.pacing.purge_every)

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    # ----------------------------------------------------------------- who is asking

    def _visitor(self, request: web.Request) -> Visitor | None:
        """The visitor of the request's cookie: the frame's when it says it is the frame,
        else the page's (a request carries only what the browser holds for its context)."""
        if self._keys is None:
            return None
        names = (
            (EMBED_COOKIE, PAGE_COOKIE)
            if request.headers.get(EMBED_HEADER) == "1"
            else (PAGE_COOKIE, EMBED_COOKIE)
        )
        for name in names:
            visitor = self._keys.check(request.cookies.get(name))
            if visitor is not None:
                if self._keys.needs_password and visitor.id != self.settings.owner:
                    continue
                return visitor
        return None

    def _guarded(
        self,
        handler: Callable[[web.Request, Visitor], Coroutine[Any, Any, web.StreamResponse]],
        *,
        changes: bool = False,
    ) -> Callable[[web.Request], Coroutine[Any, Any, web.StreamResponse]]:
        """The cookie, and for a change its CSRF token and origin, before `handler`."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if self._keys is None:
                return json_error(503, STARTING, {hdrs.RETRY_AFTER: "2"})
            visitor = self._visitor(request)
            if visitor is None:
                return self._who_are_you()
            if changes:
                if not VisitorKeys.csrf_ok(visitor, request.headers.get(CSRF_HEADER)):
                    logger.warning(
                        "web: {} {} refused: no valid CSRF token", request.method, request.path
                    )
                    return json_error(
                        403,
                        "refused: the page's security token is missing or stale; reload the page",
                    )
                if not same_origin(request):
                    logger.warning(
                        "web: {} {} refused: foreign origin", request.method, request.path
                    )
                    return json_error(403, "refused: the request came from another site")
            with logger.contextualize(session=f"{CHANNEL}:{visitor.id}"):
                return await handler(request, visitor)

        return guarded

    def _who_are_you(self) -> web.Response:
        needs_password = self._keys is not None and self._keys.needs_password
        what = "sign in with the password" if needs_password else "reload the page"
        response = web.json_response(
            {"error": f"who is this? {what}", "login": "password" if needs_password else "visitor"},
            status=401,
        )
        return response

    def _set_cookie(
        self, response: web.StreamResponse, request: web.Request, visitor: Visitor
    ) -> None:
        response.headers.add(
            hdrs.SET_COOKIE, visitor_cookie(visitor, embed=request.headers.get(EMBED_HEADER) == "1")
        )

    # ----------------------------------------------------------------- pages

    async def _to_page(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPPermanentRedirect(f"{PREFIX}/")

    async def _page(self, request: web.Request) -> web.StreamResponse:
        return page_response(self.settings)

    async def _frame(self, request: web.Request) -> web.StreamResponse:
        allowed = self.settings.allowed_origins
        if not allowed:
            return refusal(404, "The chat widget is off: no site may embed it.")
        origin = frame_origin(request, allowed)
        if origin is None:
            logger.warning(
                "web: the widget's frame refused to {!r}", request.query.get("origin", "")[:100]
            )
            return refusal(403, "This site may not embed the chat.")
        return page_response(self.settings, frame_ancestors=(origin,))

    async def _widget(self, request: web.Request) -> web.StreamResponse:
        # Any site may load the script; only the sites allowed get the frame it opens.
        return self._static.response(
            "widget.js", headers={"Cross-Origin-Resource-Policy": "cross-origin"}
        )

    # ----------------------------------------------------------------- the API

    async def _state(self, request: web.Request) -> web.StreamResponse:
        """Who the visitor is (a new one gets a cookie, unless a password is needed),
        their CSRF token, their conversations and the current one's events."""
        keys = self._keys
        if keys is None:
            return json_error(503, STARTING, {hdrs.RETRY_AFTER: "2"})
        visitor = self._visitor(request)
        fresh = False
        lifetime = self.settings.remember_days * 86400
        if visitor is None:
            if keys.needs_password:
                return self._who_are_you()
            if not secure_enough(request):
                return json_error(
                    400,
                    NEEDS_HTTPS,
                )
            wait = self.rates.new_visitor(request.remote)
            if wait is not None:
                return json_error(
                    429,
                    f"too many new visitors from your address; try again in {wait} s",
                    {hdrs.RETRY_AFTER: str(wait)},
                )
            visitor = keys.issue(new_visitor_id(), lifetime)
            self.new_visitors += 1
            fresh = True
        elif visitor.expires - time.time() < lifetime / 2:
            visitor = keys.issue(visitor.id, lifetime)  # a visitor who comes back stays one
            fresh = True
        state = await self._store.state(visitor.id)
        conversations = await self._store.conversations(visitor.id, MAX_CONVERSATIONS)
        events = await self._store.conversation_events(visitor.id, state.conversation, MAX_HISTORY)
        body = {
            "visitor": visitor.id,
            "csrf": visitor.csrf,
            "title": self.settings.title,
            "conversation": state.conversation,
            "conversations": [
                {"number": c.number, "title": c.title, "started_at": c.started_at}
                for c in conversations
            ],
            "events": [event_json(e) for e in events],
            "last": state.last_seq,
            "max_upload_bytes": self._max_upload,
            "max_message_chars": self.settings.max_message_chars,
            "password": keys.needs_password,
        }
        response = web.json_response(body, headers={"Cache-Control": "no-store"})
        if fresh:
            self._set_cookie(response, request, visitor)
        return response

    async def _login(self, request: web.Request) -> web.StreamResponse:
        keys = self._keys
        if keys is None:
            return json_error(503, STARTING, {hdrs.RETRY_AFTER: "2"})
        if not keys.needs_password:
            return json_error(400, "this chat has no password: reload the page")
        if not same_origin(request):
            return json_error(403, "refused: the request came from another site")
        wait = self.rates.login_wait(request.remote)
        if wait is not None:
            return json_error(
                429,
                f"too many wrong passwords from your address; wait {wait} s",
                {hdrs.RETRY_AFTER: str(wait)},
            )
        try:
            data = json.loads(await read_body(request, 4096))
            given = data.get("password") if isinstance(data, dict) else None
        except (BodyTooLarge, ValueError):
            given = None
        if not isinstance(given, str) or not keys.password_matches(given):
            self.rates.login_failed(request.remote)
            logger.warning("web: wrong password from {}", request.remote or "-")
            return json_error(401, "wrong password")
        if not secure_enough(request):
            return json_error(
                400,
                NEEDS_HTTPS,
            )
        visitor = keys.issue(self.settings.owner, self.settings.remember_days * 86400)
        response = web.json_response({"ok": True})
        self._set_cookie(response, request, visitor)
        logger.info("web: the owner signed in from {}", request.remote or "-")
        return response

    async def _logout(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        response = web.json_response({"ok": True})
        for name in (PAGE_COOKIE, EMBED_COOKIE):
            response.del_cookie(name, path=PREFIX)
        return response

    async def _history(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        try:
            number = int(request.query.get("conversation", ""))
        except ValueError:
            return json_error(400, "say which conversation: ?conversation=<number>")
        events = await self._store.conversation_events(visitor.id, number, MAX_HISTORY)
        return web.json_response(
            {"conversation": number, "events": [event_json(e) for e in events]},
            headers={"Cache-Control": "no-store"},
        )

    async def _message(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        """A visitor's message: logged, journaled, then 200 (see the module doc)."""
        if self._paused or self._submit is None:
            return json_error(
                503,
                "the chat is restarting; your message is kept and sent again",
                {hdrs.RETRY_AFTER: "2"},
            )
        try:
            data = json.loads(await read_body(request, self.settings.max_message_chars * 4 + 4096))
        except BodyTooLarge:
            return json_error(
                413, f"a message may be {self.settings.max_message_chars} characters long"
            )
        except ValueError:
            return json_error(400, 'send JSON: {"id": ..., "text": ..., "files": [...]}')
        if not isinstance(data, dict):
            return json_error(400, "send a JSON object")
        client_id, text, file_ids = data.get("id"), data.get("text", ""), data.get("files") or []
        if not isinstance(client_id, str) or not CLIENT_ID.fullmatch(client_id):
            return json_error(
                400, "a message needs an id of 8-64 characters from A-Z, a-z, 0-9, _ and -"
            )
        if not isinstance(text, str) or not isinstance(file_ids, list) or len(file_ids) > MAX_FILES:
            return json_error(400, f"a message is a text and at most {MAX_FILES} files")
        text = text.strip()
        if len(text) > self.settings.max_message_chars:
            return json_error(
                413, f"a message may be {self.settings.max_message_chars} characters long"
            )
        files: list[FileRef] = []
        for file_id in file_ids:
            stored = await self._store.file_info(file_id) if isinstance(file_id, str) else None
            if stored is None or stored.visitor != visitor.id:
                return json_error(
                    400, "a file of this message is not yours, or no longer kept; attach it again"
                )
            files.append(stored.ref)
        if not text and not files:
            return json_error(400, "the message is empty")
        known = await self._store.message_event(visitor.id, client_id)
        if known is None:  # a message posted again is no new message: never refused for it
            wait = self.rates.message(visitor.id, request.remote)
            if wait is not None:
                return json_error(
                    429,
                    f"slow down: your message is sent in {wait} s",
                    {hdrs.RETRY_AFTER: str(wait)},
                )
        else:  # the message is the one logged under its id, whatever a repost says
            text, files = known.text, list(known.files)
        command = parse_command(text) if text else None
        new_conversation = command is not None and command.name in _NEW_CONVERSATION
        event, created = await self._store.add_message(
            visitor.id,
            client_id,
            text,
            tuple(files),
            new_conversation=new_conversation,
            title="" if command is not None else (text or files[0].name),
        )
        if created:
            self._hub.wake(visitor.id)
        inbound = InboundMessage(
            channel=CHANNEL,
            chat_id=visitor.id,
            sender_id=visitor.id,
            text=text,
            message_id=client_id,
            metadata={META_IS_GROUP: False, META_SENDER_NAME: self._sender_name(visitor.id)},
            attachments=tuple(
                Attachment(file_kind(f.mime), f.id, f.name, f.mime, f.size) for f in files
            ),
        )
        ticket = await self._submit(inbound)
        if not ticket.taken:
            return json_error(
                503,
                "the gateway could not keep your message yet; it is sent again",
                {hdrs.RETRY_AFTER: "2"},
            )
        self.messages += created
        self._spawn(self._typing_until_answered, ticket, visitor.id, client_id)
        return web.json_response({"id": client_id, "event": event.seq})

    def _sender_name(self, visitor: str) -> str:
        if self._keys is not None and self._keys.needs_password:
            return visitor
        return f"web visitor {visitor[:6]}"

    async def _typing_until_answered(self, ticket: Ticket, visitor: str, client_id: str) -> None:
        if str(getattr(ticket, "status", "accepted")) != "accepted":
            return  # a duplicate, a stranger: no turn runs for it here
        self._hub.typing(visitor, client_id, True)
        try:
            with anyio.move_on_after(self.pacing.turn_limit):
                await ticket.reply()
        finally:
            self._hub.typing(visitor, client_id, False)

    async def _upload(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        if self._max_upload <= 0:
            return json_error(403, "this chat takes no files")
        try:
            data = await read_body(request, self._max_upload)
        except BodyTooLarge:
            return json_error(413, f"a file may be {self.settings.max_upload_mb:g} MB at most")
        if not data:
            return json_error(400, "the file is empty")
        wait = self.rates.message(visitor.id, request.remote)
        if wait is not None:
            return json_error(
                429, f"slow down: try again in {wait} s", {hdrs.RETRY_AFTER: str(wait)}
            )
        mime = (request.content_type or "").lower()
        if not _MIME.fullmatch(mime) or mime in (
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ):
            mime = "application/octet-stream"
        name = clean_file_name(unquote(request.headers.get("X-Filename", "")))
        ref = await self._store.save_file(visitor.id, NewFile(name, mime, data))
        return web.json_response(
            {**ref.to_json(), "url": f"{API}/files/{ref.id}", "inline": mime in INLINE_IMAGES}
        )

    async def _file(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        stored = await self._store.file(request.match_info["file_id"])
        if stored is None or stored.visitor != visitor.id:  # another visitor's is no file
            return json_error(404, "no such file (or no longer kept)")
        ref = stored.ref
        inline = ref.mime in INLINE_IMAGES
        disposition = "inline" if inline else "attachment"
        return web.Response(
            body=stored.data,
            content_type=ref.mime if inline else "application/octet-stream",
            headers={
                "Content-Disposition": f"{disposition}; filename*=UTF-8''{quote(ref.name)}",
                "Content-Security-Policy": "default-src 'none'; sandbox",
                "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-store",  # a shared computer keeps no copy
            },
        )

    # ----------------------------------------------------------------- the stream

    async def _events(self, request: web.Request, visitor: Visitor) -> web.StreamResponse:
        """The visitor's log after `?after=<id>` (or `Last-Event-ID`), then each new event as
        it is logged, as server-sent events; passing news (drafts, typing) in between."""
        given = request.query.get("after") or request.headers.get("Last-Event-ID") or "0"
        if not given.isdigit() or len(given) > 18:
            return json_error(400, "after= is the id of the last event the page has")
        if self._hub.readers_of(visitor.id) >= MAX_STREAMS_PER_VISITOR:
            return json_error(429, "too many open chat pages; close some", {hdrs.RETRY_AFTER: "10"})
        after = int(given)
        state = await self._store.state(visitor.id)
        response = web.StreamResponse(
            headers={
                hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
                hdrs.CACHE_CONTROL: "no-store",
                "X-Accel-Buffering": "no",  # nginx passes each event on at once
                "X-Content-Type-Options": "nosniff",
            }
        )
        await response.prepare(request)
        if after > state.last_seq:
            # A position the log never reached (its numbering began again, a restored
            # backup): the page loads its state anew instead of waiting past the end.
            with contextlib.suppress(OSError, TimeoutError):
                await self._write(response, sse({"type": "reset"}, event="news"))
            return response
        reader = self._hub.subscribe(visitor.id)
        wait = self.pacing.poll_interval if self._replicas else self.pacing.heartbeat
        quiet = 0.0
        try:
            await self._write(response, b"retry: 2000\n\n")
            while not self._closing:
                changed = reader.take_changed()
                while True:
                    events = await self._store.events_after(visitor.id, after, BATCH)
                    for event in events:
                        await self._write(
                            response, sse(event_json(event), event="log", event_id=event.seq)
                        )
                        after = event.seq
                    if len(events) < BATCH:
                        break
                for item in reader.take_news():
                    await self._write(response, sse(item, event="news"))
                with anyio.move_on_after(wait) as waited:
                    await changed.wait()
                quiet = quiet + wait if waited.cancelled_caught else 0.0
                if quiet >= self.pacing.heartbeat:
                    await self._write(response, b": ping\n\n")
                    quiet = 0.0
        except (OSError, TimeoutError):
            pass  # the page went away (or stopped reading): it reconnects from `after`
        except Exception as exc:  # the store failed: the page reconnects and reads again
            logger.warning("web: a page's stream ended: {!r}", exc)
        finally:
            self._hub.unsubscribe(reader)
        return response

    async def _write(self, response: web.StreamResponse, data: bytes) -> None:
        with anyio.fail_after(self.pacing.write_timeout):
            await response.write(data)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Write a reply into its visitor's log (and wake their pages). Raises
        DeliveryFailed when the log cannot take it now."""
        visitor = message.chat_id
        if not VISITOR_ID.fullmatch(visitor):
            logger.warning("web: a reply to {!r}, who is no visitor, was not kept", visitor[:80])
            return
        reply_to = message.reply_to or ""
        files = tuple(NewFile(clean_file_name(f.name), f.mime_type, f.data) for f in message.files)
        self._drafts.pop((visitor, reply_to), None)
        try:
            event = await self._store.add_reply(
                visitor, reply_to, message.text, files, error=message.is_error
            )
        except Exception as exc:
            raise DeliveryFailed(
                f"web: the conversation log did not take the reply ({exc!r})"
            ) from exc
        self._hub.draft_done(visitor, reply_to)
        if event is not None:
            self.replies += 1
            self._hub.wake(visitor)
        else:
            logger.info("web: a reply sent again was in the log already; shown once")

    async def stream_delta(self, inbound: InboundMessage, delta: str) -> None:
        """The reply to `inbound` so far, rendered, to the visitor's open pages at most once
        per `Pacing.draft_interval` (not logged: the reply itself is)."""
        if not self.settings.streaming or not delta or not inbound.message_id:
            return
        key = (inbound.chat_id, inbound.message_id)
        now = time.monotonic()
        draft = self._drafts.get(key)
        if draft is None:
            for stale in [
                k for k, d in self._drafts.items() if now - d.started > self.pacing.turn_limit
            ]:
                del self._drafts[stale]
            draft = self._drafts[key] = _Draft("", now, now)
        draft.text += delta
        if now >= draft.next_at:
            draft.next_at = now + self.pacing.draft_interval
            self._hub.draft(inbound.chat_id, inbound.message_id, render(draft.text))

    async def notice(self, message: InboundMessage, text: str) -> None:
        """A line about the turn in progress (the model server still busy), not logged."""
        self._hub.notice(message.chat_id, message.message_id or "", text)

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file a visitor uploaded (the media pipeline reads it when the turn starts)."""
        stored = await self._store.file(attachment.file_id)
        if stored is None:
            raise MediaError("the chat no longer keeps the file; please send it again")
        if len(stored.data) > max_bytes:
            raise MediaError(
                f"it is {len(stored.data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        return stored.data
