"""Example Chat, the platform: an imaginary chat service, small enough to read in one
sitting, served on 127.0.0.1 for the example channel, its tests and anyone trying it.

The channel (`gateway_channel_example.channel`) never imports this module: it speaks to
it over HTTP, as it would to a real service. The conformance kit's driver
(`gateway_channel_example.kit_driver`) runs it and plays people on it.

The bot's API (JSON; every call needs ``Authorization: Bearer <token>``):

| call | what it does |
|---|---|
| ``GET /me`` | the bot's account: ``{"id", "name"}`` |
| ``GET /updates?offset=&timeout=&limit=`` | ``{"updates": [...]}``, waiting for one |
| ``POST /messages`` | ``{"conversation", "text", "reply_to"?, "notify"?}``: a post |
| ``PUT /webhook`` | ``{"url", "secret"}``: updates are POSTed there, signed, instead |
| ``DELETE /webhook`` | back to ``GET /updates`` |

``GET /updates`` answers the updates from `offset` on (`limit`: 100 at most), waiting up
to `timeout` seconds (60 at most) while there is none. ``POST /messages`` answers
``{"message": ...}``, the post as people see it.

Errors are ``{"error": <code>, "description": <text>}``: 400 (a bad request, e.g.
``text_too_long``), 401 (the token), 404 (no such conversation), 409 (a webhook is set, or
a newer ``GET /updates`` ended this one) and 503 (the platform is down: `down`).

Its rules, which the channel must live with:
- An update stays until a ``GET /updates`` with a later `offset` confirms it (Telegram's
  rule): a bot that stops before it confirmed an update gets it again, also after hours.
- Delivery is at least once: the same message may come again in a later update (its
  ``id`` stays, the ``update_id`` does not).
- A post holds 2,000 characters at most (`MAX_TEXT`).
- ``@handle`` in a text notifies that person (the message's ``mentions``); ``@everyone``
  in a group notifies everyone (``everyone``) unless the post's ``notify`` leaves
  ``"everyone"`` out (the default is ``["users", "everyone"]``).
- With a webhook set, each update is POSTed to its URL, one at a time and in order, with
  ``X-Example-Signature: sha256=<HMAC-SHA256 of the body with the secret, in hex>``. Any
  answer but 200 (or none within 10 s) and it is sent again 0.3 s later; a 200 confirms it.

A message: ``{"id", "conversation": {"id", "kind": "dm" | "group"}, "author": {"id",
"name"}, "text", "mentions": [handles], "everyone", "reply_to": {"id", "author"} | null,
"sent_at"}``. A DM with person ``ann`` is conversation ``dm-ann``; a group is ``g-<name>``.

People write through `write` (in this process) or ``POST /people/messages`` (by hand:
``{"author", "conversation", "text", "reply_to"?}``, no token); ``GET
/people/conversations/<id>`` shows a conversation. Run it alone with ``example-chat``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import hashlib
import hmac
import json
import re
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["MAX_TEXT", "SIGNATURE_HEADER", "ExampleChat", "sign"]

#: The longest text one post holds, in characters.
MAX_TEXT = 2000
SIGNATURE_HEADER = "X-Example-Signature"
#: A handle as ``@handle`` names it in a text.
MENTION = re.compile(r"(?<![\w@])@([a-z0-9_]{1,32})\b")
EVERYONE = re.compile(r"(?<![\w@])@everyone\b")
NOTIFY = frozenset({"users", "everyone"})
#: Seconds between two deliveries of an update a webhook did not take.
WEBHOOK_RETRY = 0.3

Json = dict[str, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def sign(secret: str, body: bytes) -> str:
    """The ``X-Example-Signature`` of a webhook delivery of `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def _error(status: int, code: str, description: str) -> web.Response:
    return web.json_response({"error": code, "description": description}, status=status)


class ExampleChat:
    """The platform: its state, its HTTP API, and the people who write on it.

    Serve it with ``with ExampleChat(token=...).serving() as chat:`` (a thread of its own;
    every public method is safe from any thread) or ``await chat.start()`` in a loop."""

    def __init__(
        self, *, token: str, bot: str = "examplebot", host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.token = token
        self.bot = bot
        self.host = host
        self._port = port
        self._lock = threading.Lock()
        self._messages: dict[str, Json] = {}
        self._conversations: dict[str, list[str]] = defaultdict(list)
        self._members: set[str] = {bot}
        self._updates: list[Json] = []  # not confirmed yet, oldest first
        self._next_update = 1
        self._next_message = 1
        self._polls = 0  # the newest GET /updates; an older one still waiting ends
        self._webhook: tuple[str, str] | None = None
        self._down = False
        self._log: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._delivery: asyncio.Task[None] | None = None

    # -- serving --------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The API's root, e.g. ``http://127.0.0.1:8700``."""
        if self._runner is None:
            raise RuntimeError("Example Chat is not running")
        return f"http://{self.host}:{self._port}"

    async def start(self) -> None:
        """Serve in the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        app = web.Application(middlewares=[self._bots_only])
        app.router.add_get("/me", self._me)
        app.router.add_get("/updates", self._get_updates)
        app.router.add_post("/messages", self._post_message)
        app.router.add_put("/webhook", self._set_webhook)
        app.router.add_delete("/webhook", self._delete_webhook)
        app.router.add_post("/people/messages", self._person_writes)
        app.router.add_get("/people/conversations/{id}", self._show_conversation)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self._port)
        await site.start()
        self._runner = runner
        self._port = int(runner.addresses[0][1])
        self._delivery = asyncio.create_task(self._deliver_to_webhook())

    async def stop(self) -> None:
        if self._delivery is not None:
            self._delivery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._delivery
        if self._runner is not None:
            self._notify()  # a long poll that waits ends now
            await self._runner.cleanup()
            self._runner = None

    @contextlib.contextmanager
    def serving(self) -> Iterator[ExampleChat]:
        """Serve from a thread and an event loop of its own for the `with` block."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                failed.append(exc)
                return
            finally:
                ready.set()
            loop.run_forever()
            loop.run_until_complete(self.stop())
            loop.close()

        thread = threading.Thread(target=serve, name="example-chat", daemon=True)
        thread.start()
        ready.wait(10)
        if failed:
            raise failed[0]
        try:
            yield self
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    def _notify(self) -> None:
        """Wake whatever waits for a change (a long poll, the webhook's delivery)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def renew() -> None:
            if self._changed is not None:
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            renew()
        else:
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(renew)

    def _record(self, line: str) -> None:
        with self._lock:
            self._log.append(f"{time.time():.3f} {line}")

    # -- people (from any thread) ------------------------------------------------------

    def write(
        self,
        author: str,
        conversation: str,
        text: str,
        *,
        name: str = "",
        reply_to: str | None = None,
    ) -> Json:
        """`author` writes `text` in `conversation` (``dm-<author>`` is their DM with the
        bot); the update that brings it to the bot."""
        if conversation.startswith("dm-") and conversation != f"dm-{author}":
            raise ValueError(f"{author} cannot write in {conversation}")
        with self._lock:
            message = self._new_message(author, name or author, conversation, text, reply_to)
            update = self._queue(message)
        return self._queued(update)

    def redeliver(self, message_id: str) -> Json:
        """Hand the message over again in a new update (delivery is at least once)."""
        with self._lock:
            update = self._queue(self._messages[message_id])
        return self._queued(update)

    def bot_posts(self) -> list[Json]:
        """What the bot posted, in the order the platform took it."""
        with self._lock:
            return [
                copy.deepcopy(m) for m in self._messages.values() if m["author"]["id"] == self.bot
            ]

    def pending(self) -> list[int]:
        """The ids of the updates not confirmed yet."""
        with self._lock:
            return [int(u["update_id"]) for u in self._updates]

    def down(self) -> None:
        """The platform is down: the bot's calls get 503, webhooks wait; people write on."""
        with self._lock:
            self._down = True
        self._record("DOWN")
        self._notify()

    def up(self) -> None:
        with self._lock:
            self._down = False
        self._record("UP")
        self._notify()

    def log(self) -> list[str]:
        """What the platform did: calls, confirmations, deliveries (for a failure's logs)."""
        with self._lock:
            return list(self._log)

    # -- state (the lock held) ------------------------------------------------------------

    def _new_message(
        self,
        author: str,
        name: str,
        conversation: str,
        text: str,
        reply_to: str | None,
        notify: frozenset[str] = NOTIFY,
    ) -> Json:
        if not text or len(text) > MAX_TEXT:
            raise ValueError(f"a text holds 1 to {MAX_TEXT} characters, not {len(text)}")
        replied = self._messages.get(reply_to) if reply_to else None
        if reply_to and (replied is None or replied["conversation"]["id"] != conversation):
            raise ValueError(f"{reply_to} is no message of {conversation}")
        self._members.add(author)
        kind = "dm" if conversation.startswith("dm-") else "group"
        mentions = sorted({h for h in MENTION.findall(text) if h in self._members} - {author})
        message: Json = {
            "id": f"m{self._next_message}",
            "conversation": {"id": conversation, "kind": kind},
            "author": {"id": author, "name": name},
            "text": text,
            "mentions": mentions if "users" in notify else [],
            "everyone": kind == "group" and "everyone" in notify and bool(EVERYONE.search(text)),
            "reply_to": None
            if replied is None
            else {"id": replied["id"], "author": replied["author"]["id"]},
            "sent_at": time.time(),
        }
        self._next_message += 1
        self._messages[message["id"]] = message
        self._conversations[conversation].append(message["id"])
        return message

    def _queue(self, message: Json) -> Json:
        update = {"update_id": self._next_update, "message": copy.deepcopy(message)}
        self._next_update += 1
        self._updates.append(update)
        return copy.deepcopy(update)

    def _queued(self, update: Json) -> Json:
        """The record of a new update (what it brings, for a failure's evidence)."""
        message = update["message"]
        text = str(message.get("text", ""))[:60]
        self._record(f"update {update['update_id']}: message {message['id']} {text!r}")
        self._notify()
        return update

    # -- the bot's API ----------------------------------------------------------------------

    @web.middleware
    async def _bots_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every call but the people's needs the bot's token, and a platform that is up."""
        if request.path.startswith("/people/"):
            return await handler(request)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "unauthorized", "send Authorization: Bearer <the bot's token>")
        with self._lock:
            down = self._down
        if down:
            return _error(503, "unavailable", "Example Chat is down; try again later")
        return await handler(request)

    async def _me(self, request: web.Request) -> web.Response:
        return web.json_response({"id": self.bot, "name": "Example Bot"})

    async def _get_updates(self, request: web.Request) -> web.Response:
        try:
            offset = int(request.query.get("offset", 0))
            timeout = min(max(int(request.query.get("timeout", 0)), 0), 60)
            limit = min(max(int(request.query.get("limit", 100)), 1), 100)
        except ValueError:
            return _error(400, "bad_request", "offset, timeout and limit are whole numbers")
        with self._lock:
            if self._webhook is not None:
                return _error(409, "webhook_set", "updates go to the webhook; DELETE it first")
            confirmed = [u["update_id"] for u in self._updates if u["update_id"] < offset]
            self._updates = [u for u in self._updates if u["update_id"] >= offset]
            self._polls += 1
            poll = self._polls
        self._record(f"GET /updates offset={offset} confirmed={confirmed}")
        self._notify()  # an older poll that still waits ends
        assert self._loop is not None
        deadline = self._loop.time() + timeout
        while True:
            changed = self._changed
            with self._lock:
                newer, down = self._polls != poll, self._down
                batch = copy.deepcopy(self._updates[:limit])
            if newer:
                return _error(409, "conflict", "ended by a newer GET /updates")
            if down:
                return _error(503, "unavailable", "Example Chat is down; try again later")
            left = deadline - self._loop.time()
            if batch or left <= 0 or self._runner is None:
                if batch:
                    self._record(f"  returned {[u['update_id'] for u in batch]}")
                return web.json_response({"updates": batch})
            assert changed is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    async def _post_message(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            conversation, text = str(body["conversation"]), body["text"]
            reply_to = body.get("reply_to")
            notify = frozenset(body.get("notify", NOTIFY))
        except (ValueError, KeyError, TypeError):
            return _error(400, "bad_request", 'send {"conversation", "text"}')
        if not isinstance(text, str) or not text.strip():
            return _error(400, "empty_text", "a post needs a text")
        if len(text) > MAX_TEXT:
            return _error(400, "text_too_long", f"a post holds {MAX_TEXT} characters at most")
        if not notify <= NOTIFY:
            return _error(400, "bad_request", f"notify is a list of {sorted(NOTIFY)}")
        with self._lock:
            if conversation not in self._conversations:
                return _error(404, "no_such_conversation", f"no conversation {conversation}")
            try:
                message = self._new_message(
                    self.bot, "Example Bot", conversation, text, reply_to, notify
                )
            except ValueError as exc:
                return _error(400, "bad_reply_to", str(exc))
        self._record(f"POST /messages to {conversation}: {text[:60]!r}")
        return web.json_response({"message": message})

    async def _set_webhook(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            url, secret = str(body["url"]), str(body["secret"])
        except (ValueError, KeyError, TypeError):
            return _error(400, "bad_request", 'send {"url", "secret"}')
        if not url.startswith(("http://", "https://")) or not secret:
            return _error(400, "bad_request", "the url is http(s) and the secret not empty")
        with self._lock:
            self._webhook = (url, secret)
        self._record(f"PUT /webhook {url}")
        self._notify()
        return web.json_response({"ok": True})

    async def _delete_webhook(self, request: web.Request) -> web.Response:
        with self._lock:
            self._webhook = None
        self._record("DELETE /webhook")
        return web.json_response({"ok": True})

    async def _deliver_to_webhook(self) -> None:
        """POST the oldest update to the webhook until it answers 200, then the next."""
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                changed = self._changed
                with self._lock:
                    target = None if self._down else self._webhook
                    update = self._updates[0] if target is not None and self._updates else None
                if target is None or update is None:
                    assert changed is not None
                    await changed.wait()
                    continue
                url, secret = target
                body = json.dumps(update).encode()
                headers = {"Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body)}
                try:
                    async with session.post(url, data=body, headers=headers) as answer:
                        status = answer.status
                except (aiohttp.ClientError, TimeoutError):
                    status = 0
                self._record(f"webhook update {update['update_id']}: {status or 'no answer'}")
                if status == 200:
                    with self._lock:
                        self._updates = [u for u in self._updates if u is not update]
                else:
                    await asyncio.sleep(WEBHOOK_RETRY)

    # -- the people's API (for trying it by hand) -----------------------------------------------

    async def _person_writes(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            update = self.write(
                str(body["author"]),
                str(body["conversation"]),
                str(body["text"]),
                reply_to=body.get("reply_to"),
            )
        except (KeyError, TypeError) as exc:
            return _error(400, "bad_request", f'send {{"author", "conversation", "text"}}: {exc}')
        except ValueError as exc:
            return _error(400, "bad_request", str(exc))
        return web.json_response({"message": update["message"]})

    async def _show_conversation(self, request: web.Request) -> web.Response:
        with self._lock:
            ids = self._conversations.get(request.match_info["id"], [])
            messages = [copy.deepcopy(self._messages[i]) for i in ids]
        return web.json_response({"messages": messages})


def main() -> None:
    """``example-chat``: serve Example Chat until Ctrl-C."""
    parser = argparse.ArgumentParser(description="Serve Example Chat on 127.0.0.1.")
    parser.add_argument("--port", type=int, default=8700)
    parser.add_argument("--token", default="example-token", help="the bot's API token")
    parser.add_argument("--bot", default="examplebot", help="the bot's handle")
    options = parser.parse_args()

    async def serve() -> None:
        chat = ExampleChat(token=options.token, bot=options.bot, port=options.port)
        await chat.start()
        print(f"Example Chat on {chat.url}: the bot is @{chat.bot}, its token {chat.token}")
        try:
            await asyncio.Event().wait()
        finally:
            await chat.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
