"""A browser of the web chat played over HTTP, as the page (channels/webchat/static/chat.js)
behaves: its cookies, its CSRF token, an outbox posted one message at a time, in order,
again with the same id until the gateway answers 200, and the visitor's log read as a
stream from the last event it has, reconnecting after any failure.

Used by the conformance driver (tests/conformance/webchat_driver.py), the channel's HTTP
tests and bench/channels.py. `Browsers` runs any number of them on an event loop of its
own, for callers in a plain thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

T = TypeVar("T")

API = "/webchat/api"


@dataclass
class Outgoing:
    id: str
    text: str
    files: list[str] = field(default_factory=list)
    sent_at: float | None = None  # when the gateway answered 200
    attempts: int = 0
    statuses: list[int] = field(default_factory=list)


class Browser:
    """One browser (one cookie jar) of one visitor; see the module doc."""

    def __init__(
        self,
        base_url: str,
        *,
        password: str | None = None,
        embed: bool = False,
        retry_pause: float = 0.2,
        name: str = "",
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.password = password
        self.embed = embed
        self.retry_pause = retry_pause
        self.name = name
        self.visitor = ""
        self.csrf = ""
        self.last = 0
        #: Log events by id, each once (as the page shows them), in the order they came.
        self.events: dict[int, dict[str, Any]] = {}
        #: How often each event id reached this browser (a stream sends each once).
        self.deliveries: Counter[int] = Counter()
        self.news: list[dict[str, Any]] = []
        self.outbox: list[Outgoing] = []
        self.sent: dict[str, Outgoing] = {}
        self.journal: list[str] = []  # what happened, for a failure's logs
        self.connected = asyncio.Event()
        self._wake_sender = asyncio.Event()
        self._changed = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stream: aiohttp.ClientResponse | None = None

    # -- plumbing ---------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            jar = aiohttp.CookieJar(unsafe=True, treat_as_secure_origin=[self.base_url])
            self._session = aiohttp.ClientSession(
                cookie_jar=jar, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
            )
        return self._session

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        found = dict(extra or {})
        if self.embed:
            found.setdefault("X-Webchat-Embed", "1")
        if self.csrf:
            found.setdefault("X-CSRF-Token", self.csrf)  # a forger's own stays
        return found

    def note(self, line: str) -> None:
        self.journal.append(f"{time.time():.3f} {self.name or self.visitor[:6]} {line}")

    async def request(
        self, method: str, path: str, **kwargs: Any
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(status, JSON body or {}, headers) of one request; status 0 when it did not
        get through."""
        headers = self.headers(kwargs.pop("headers", None))
        try:
            async with self.session.request(
                method,
                self.base_url + path,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=30),
                **kwargs,
            ) as answer:
                try:
                    body = await answer.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    body = {}
                return answer.status, body if isinstance(body, dict) else {}, dict(answer.headers)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.note(f"{method} {path}: {type(exc).__name__}")
            return 0, {}, {}

    # -- who this is ------------------------------------------------------------------

    async def load_state(self, *, wait: bool = True, within: float = 120.0) -> dict[str, Any]:
        """The state the page loads (a new visitor gets its cookie); with `wait`, asks again
        while the gateway is away (for `within` seconds)."""
        deadline = time.monotonic() + within
        while True:
            status, body, _ = await self.request("GET", f"{API}/state")
            if status == 401 and body.get("login") == "password" and self.password is not None:
                status, body, _ = await self.request(
                    "POST", f"{API}/login", json={"password": self.password}
                )
                if status == 200:
                    continue
            if status == 200:
                self.visitor, self.csrf = body["visitor"], body["csrf"]
                return body
            if not wait or time.monotonic() > deadline:
                raise RuntimeError(f"the chat's state answered {status}: {body}")
            await asyncio.sleep(self.retry_pause)

    # -- running ----------------------------------------------------------------------

    async def start(self) -> None:
        """Become a visitor, then keep reading the log and sending the outbox."""
        state = await self.load_state()
        self.last = max(self.last, int(state["last"]))
        for event in state["events"]:
            self._take(event)
        self._tasks = [
            asyncio.create_task(self._read_forever()),
            asyncio.create_task(self._send_forever()),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._session is not None:
            await self._session.close()

    def drop_stream(self) -> None:
        """End the open stream (a network hiccup); it is read again from `last`."""
        if self._stream is not None:
            self._stream.close()

    def _take(self, event: dict[str, Any]) -> None:
        number = int(event["id"])
        self.deliveries[number] += 1
        if number not in self.events:
            self.events[number] = event
        self.last = max(self.last, number)
        self._changed.set()

    async def _read_forever(self) -> None:
        while True:
            try:
                async with self.session.get(
                    f"{self.base_url}{API}/events",
                    params={"after": str(self.last)},
                    headers=self.headers(),
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=40),
                ) as answer:
                    if answer.status == 401:
                        await self.load_state()
                        continue
                    if answer.status != 200:
                        raise aiohttp.ClientError(f"events answered {answer.status}")
                    self._stream = answer
                    self.connected.set()
                    self._wake_sender.set()
                    buffer = b""
                    async for chunk in answer.content.iter_any():
                        buffer += chunk
                        while b"\n\n" in buffer:
                            block, buffer = buffer.split(b"\n\n", 1)
                            self._block(block.decode())
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                self.note(f"stream: {type(exc).__name__}: {exc}")
            finally:
                self._stream = None
                self.connected.clear()
            await asyncio.sleep(self.retry_pause)

    def _block(self, block: str) -> None:
        kind, data = "message", []
        for line in block.split("\n"):
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if not data:
            return
        item = json.loads("\n".join(data))
        if kind == "log":
            self._take(item)
        elif kind == "news":
            self.news.append(item)

    async def _send_forever(self) -> None:
        while True:
            if not self.outbox:
                self._wake_sender.clear()
                await self._wake_sender.wait()
                continue
            item = self.outbox[0]
            if await self.post(item):
                self.outbox.pop(0)
                continue
            await asyncio.sleep(self.retry_pause)

    async def post(self, item: Outgoing) -> bool:
        """One attempt at a message; True once the gateway answered 200."""
        item.attempts += 1
        status, body, headers = await self.request(
            "POST", f"{API}/messages", json={"id": item.id, "text": item.text, "files": item.files}
        )
        item.statuses.append(status)
        if status == 200:
            item.sent_at = time.time()
            return True
        if status in (401, 403):
            self.note(f"message {item.id} refused {status}: {body}; loading the state")
            await self.load_state()
        elif status == 429:
            await asyncio.sleep(float(headers.get("Retry-After", "1")))
        elif status not in (0, 502, 503):
            self.note(f"message {item.id} refused {status}: {body}")
        return False

    # -- people's side ------------------------------------------------------------------

    def queue(self, text: str, *, files: list[str] | None = None, message_id: str = "") -> str:
        """Put a message in the outbox (posted in order, again until 200); its id."""
        item = Outgoing(message_id or uuid.uuid4().hex, text, files or [])
        self.sent[item.id] = item
        self.outbox.append(item)
        self._wake_sender.set()
        return item.id

    def replies(self) -> list[dict[str, Any]]:
        return [e for e in self.events.values() if e["kind"] == "reply"]

    async def wait_for(
        self, predicate: Callable[[Browser], bool], within: float = 30.0, what: str = ""
    ) -> None:
        deadline = time.monotonic() + within
        while not predicate(self):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{what or 'condition'} not within {within:g}s")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(remaining, 0.2))


class Browsers:
    """Browsers on an event loop of their own (a thread), for synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="browsers", daemon=True)
        self._thread.start()
        self.all: list[Browser] = []

    def call(self, make: Callable[[], Awaitable[T]], timeout: float = 180.0) -> T:
        async def run() -> T:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def soon(self, func: Callable[[], Any]) -> None:
        """Run `func` on the browsers' loop (not waiting for it)."""
        self.loop.call_soon_threadsafe(func)

    def open(self, base_url: str, **kwargs: Any) -> Browser:
        """A started browser (a visitor with its cookie, reading its log)."""

        async def make() -> Browser:
            browser = Browser(base_url, **kwargs)
            await browser.start()
            return browser

        browser = self.call(make)
        self.all.append(browser)
        return browser

    def close(self) -> None:
        async def close_all() -> None:
            for browser in self.all:
                await browser.close()

        with contextlib.suppress(Exception):
            self.call(close_all, timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
