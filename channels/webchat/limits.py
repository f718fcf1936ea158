"""How much one visitor, and one address, may ask of the web chat: messages a minute, new
visitors an hour, wrong passwords.

Each bound is a sliding window of events per key (`gateway.http.throttle.AuthThrottle`,
which counts any event, not only wrong tokens, and groups an IPv6 /64 as one address).
The counts are this process's: with replicas behind a load balancer each replica counts
what reaches it.

Promises (tested in tests/test_webchat_limits.py):
- A message past a bound is refused before anything is stored or journaled, with the
  seconds to wait; the page keeps it and sends it again then, so a limit delays a
  message and never loses it.
- A bound of 0 is no bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from channels.webchat.settings import WebChatSettings
from gateway.http.throttle import AuthThrottle

#: Wrong passwords one address may try in `LOGIN_WINDOW` seconds.
LOGIN_FAILURES = 10
LOGIN_WINDOW = 60.0


def _window(limit: int, seconds: float, clock: Callable[[], float]) -> AuthThrottle | None:
    return AuthThrottle(limit, seconds, clock=clock) if limit > 0 else None


def _visitor_key(visitor: str) -> str:
    # Never read as an address: a visitor and an address never share a count.
    return f"visitor {visitor}"


class RateLimits:
    """The web chat's bounds (see the module doc)."""

    def __init__(
        self, settings: WebChatSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._visitor = _window(settings.visitor_messages_per_minute, 60.0, clock)
        self._address = _window(settings.address_messages_per_minute, 60.0, clock)
        self._new = _window(settings.address_new_visitors_per_hour, 3600.0, clock)
        self._logins = AuthThrottle(LOGIN_FAILURES, LOGIN_WINDOW, clock=clock)
        #: Requests refused so far (for /metrics).
        self.refused = 0

    def _take(self, pairs: list[tuple[AuthThrottle | None, str | None]]) -> int | None:
        waits = [w.retry_after(key) for w, key in pairs if w is not None]
        wait = max((s for s in waits if s is not None), default=None)
        if wait is not None:
            self.refused += 1
            return wait
        for window, key in pairs:
            if window is not None:
                window.failed(key)  # counted: one more event in its window
        return None

    def message(self, visitor: str, address: str | None) -> int | None:
        """Count a message; the seconds to wait instead when a bound is reached."""
        return self._take([(self._visitor, _visitor_key(visitor)), (self._address, address)])

    def new_visitor(self, address: str | None) -> int | None:
        """Count a new visitor from `address`; the seconds to wait when it is one too many."""
        return self._take([(self._new, address)])

    def login_wait(self, address: str | None) -> int | None:
        """Seconds this address must wait before its password is checked again."""
        return self._logins.retry_after(address)

    def login_failed(self, address: str | None) -> None:
        self._logins.failed(address)
