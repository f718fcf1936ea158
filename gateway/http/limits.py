"""Bounds on the HTTP port's connections: how long a request's header, its body and an
idle kept-alive connection may take, and how many connections are open at once.

aiohttp has the keep-alive timeout, and its timer also closes a connection whose
request header is still incomplete when the timer fires; it has no header timeout of
its own, no body timeout and no cap on connections. `GuardedRunner` adds the header
timeout and the cap at the protocol (a `RequestHandler` subclass), and
`body_deadline` the body timeout inside the request (`HttpServer`'s edge middleware).

Promises (tested with raw sockets in tests/test_http_limits.py):
- A connection that has not sent a complete request header `header_timeout` seconds
  after it opened, or after the first byte of a later request, is closed.
- A kept-alive connection idle for `keepalive_timeout` seconds after a response is closed.
- A request body still incomplete `body_timeout` seconds after its header is answered
  408 and its connection closed.
- At most `max_connections` connections are open: at the bound a new connection takes the
  place of the longest-idle kept-alive one, or is answered 503 with Retry-After and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.web import RequestHandler
from loguru import logger

RETRY_AFTER_SECONDS = 5
# A refusal is logged at most this often; the others of the interval are counted into it.
_REFUSAL_LOG_SECONDS = 60.0


class LimitSettingsLike(Protocol):
    """What `ConnectionLimits.from_settings` reads from `gateway.config.HTTPSettings`."""

    @property
    def header_timeout_seconds(self) -> float: ...
    @property
    def body_timeout_seconds(self) -> float: ...
    @property
    def keepalive_timeout_seconds(self) -> float: ...
    @property
    def max_connections(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The four bounds (see the module doc); the defaults are `[http]`'s."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    max_connections: int = 512

    def __post_init__(self) -> None:
        if min(self.header_timeout, self.body_timeout, self.keepalive_timeout) <= 0:
            raise ValueError("connection timeouts must be positive")
        if self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    @classmethod
    def from_settings(cls, settings: LimitSettingsLike) -> ConnectionLimits:
        return cls(
            header_timeout=settings.header_timeout_seconds,
            body_timeout=settings.body_timeout_seconds,
            keepalive_timeout=settings.keepalive_timeout_seconds,
            max_connections=settings.max_connections,
        )


#: Told why the server closed a connection: one of `gateway.http.metrics.HTTP_DROP_REASONS`.
OnDrop = Callable[[str], None]


def _refusal() -> bytes:
    body = json.dumps(
        {"error": "the gateway has too many open connections; retry in a few seconds"}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Retry-After: {RETRY_AFTER_SECONDS}\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("ascii") + body


_REFUSAL = _refusal()


class _GuardedHandler(RequestHandler):
    """aiohttp's protocol for one connection, with the header timeout and the cap.

    It reads two of aiohttp's internals: `_waiter` (pending while the connection waits
    for its next request, after the previous one is fully handled) and `_messages` (the
    requests whose header is complete, queued for handling). The raw-socket tests fail if
    a new aiohttp changes them.
    """

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        #: Loop time of the last byte received (or of the connection's start).
        self.last_active = 0.0

    # -------------------------------------------------------------- aiohttp's hooks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit(self):
            self._refused = True
            writer = cast(asyncio.WriteTransport, transport)  # uvloop's is no subclass
            writer.write(_REFUSAL)
            writer.close()
            return
        super().connection_made(transport)
        self.last_active = self._loop.time()
        self._arm_header_timer()  # the first request's header is due from the start

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self.last_active = self._loop.time()
        if self._header_timer is None and self.waiting_for_request():
            self._arm_header_timer()  # the first byte of the next request
        queued = len(self._messages)
        super().data_received(data)
        if self._header_timer is not None and len(self._messages) > queued:
            self._disarm_header_timer()  # a complete header: its request is queued

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_header_timer()
        self._guard.release(self)
        super().connection_lost(exc)

    # -------------------------------------------------------------- the guard

    def waiting_for_request(self) -> bool:
        """True while the connection waits for a request, the previous one (if any) done."""
        waiter = self._waiter
        return waiter is not None and not waiter.done()

    def idle(self) -> bool:
        """A kept-alive connection between requests, with no byte of the next one yet."""
        return self._header_timer is None and self.waiting_for_request()

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self._loop.call_later(
            self._guard.limits.header_timeout, self._header_late
        )

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_late(self) -> None:
        self._header_timer = None
        if self.transport is None or not self.waiting_for_request():
            return  # closed already, or a request is being handled (its body has a deadline)
        self._guard.dropped("header_timeout")
        logger.debug(
            "http: closed a connection from {}: no complete request header within {:g}s",
            _peer(self),
            self._guard.limits.header_timeout,
        )
        self.force_close()

    def evict(self) -> None:
        self._guard.dropped("idle_evicted")
        self.force_close()


def _peer(handler: RequestHandler) -> str:
    peer = handler.peername
    if isinstance(peer, tuple):
        return str(peer[0])
    return str(peer or "-")


class GuardedServer(web.Server):
    """aiohttp's low-level server, making `_GuardedHandler`s and counting them."""

    def __init__(
        self,
        handler: Any,
        *,
        limits: ConnectionLimits,
        on_drop: OnDrop | None = None,
        clock: Callable[[], float] = time.monotonic,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self._on_drop = on_drop
        self._clock = clock
        self._handler_kwargs = {
            key: value
            for key, value in kwargs.items()
            if key not in ("request_factory", "handler_cancellation", "loop")
        }
        # Weak: a protocol whose connection never came up must not hold a place.
        self._open: weakref.WeakSet[_GuardedHandler] = weakref.WeakSet()
        self._refusals = 0
        self._refusal_logged = float("-inf")

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=asyncio.get_running_loop(), **self._handler_kwargs)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def admit(self, handler: _GuardedHandler) -> bool:
        """Make room for a new connection: True when it may stay."""
        if len(self._open) >= self.limits.max_connections:
            idle = [other for other in self._open if other.idle()]
            if not idle:
                self._refused()
                return False
            longest_idle = min(idle, key=lambda other: other.last_active)
            longest_idle.evict()
            self._open.discard(longest_idle)
        self._open.add(handler)
        return True

    def release(self, handler: _GuardedHandler) -> None:
        self._open.discard(handler)

    def dropped(self, reason: str) -> None:
        if self._on_drop is not None:
            self._on_drop(reason)

    def _refused(self) -> None:
        self.dropped("over_limit")
        self._refusals += 1
        now = self._clock()
        if now - self._refusal_logged >= _REFUSAL_LOG_SECONDS:
            logger.warning(
                "http: {} new connection(s) refused with 503: http.max_connections = {} "
                "are open; raise it if these are real clients, or look for slow ones",
                self._refusals,
                self.limits.max_connections,
            )
            self._refusal_logged = now
            self._refusals = 0


class GuardedRunner(web.AppRunner):
    """`web.AppRunner` whose server is a `GuardedServer` with aiohttp's keep-alive
    timeout set from `limits` (see the module doc)."""

    def __init__(
        self,
        app: web.Application,
        limits: ConnectionLimits,
        *,
        on_drop: OnDrop | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout, **kwargs)
        self.limits = limits
        self._on_drop = on_drop
        self._handler_args = dict(kwargs, keepalive_timeout=limits.keepalive_timeout)
        self._handler_args.pop("handle_signals", None)
        self._handler_args.pop("shutdown_timeout", None)

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts and freezes the app
        return GuardedServer(
            plain.request_handler,
            limits=self.limits,
            on_drop=self._on_drop,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            **self._handler_args,
        )


class BodyTimeout(TimeoutError):
    """A request body did not arrive in time (raised by the body's reads).

    A `TimeoutError`, so aiohttp's lingering read after the response stops quietly on it
    and closes the connection."""


@contextlib.contextmanager
def body_deadline(request: web.BaseRequest, seconds: float) -> Iterator[None]:
    """Around a request's handler: once `seconds` have passed with the body still
    incomplete, its reads raise `BodyTimeout` (the caller answers 408)."""
    payload = request.content
    if payload.is_eof():  # no body, or all of it there already
        yield
        return

    def expire() -> None:
        if not payload.is_eof() and payload.exception() is None:
            message = f"the request body did not arrive within {seconds:g}s"
            payload.set_exception(BodyTimeout(message))

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        yield
    finally:
        timer.cancel()
