"""A circuit breaker per model provider: skip a provider that keeps failing, try it
again after a cool-down, one request at a time.

States (`BreakerState`):

| state | requests | leaves it |
|---|---|---|
| closed | all go through | after `failures_to_open` provider failures in a row: open |
| open | none (the failover asks the next provider) | after `cooldown` seconds: half-open |
| half-open | one at a time (a probe) | the probe succeeds: closed; it fails: open again |

Only failures that mean "this provider, not this request" count (the failover decides
which, `gateway.llm.failover.judge`); anything the provider answers closes it. A server
that asks to be left alone for long (a 429 with a long Retry-After) opens it at once,
for that long. The state lives in this process: each replica has its own.

Pure bookkeeping with an injected clock, and no locks: the event loop is the only
writer (every method is called from it).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from loguru import logger

#: The longest a provider is skipped because of one Retry-After (a misbehaving server's
#: "come back tomorrow" must not take a provider out of a replica for a day).
MAX_OPEN_SECONDS = 3600.0


class BreakerState(enum.StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


#: The value of `gateway_llm_breaker_state` for each state.
STATE_VALUES = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True, slots=True)
class BreakerStatus:
    """One provider's breaker as /status, the admin page and /metrics show it."""

    provider: str
    #: Where the provider is (its base URL without a password), for people.
    where: str
    state: BreakerState
    #: Provider failures in a row (reset by any answer).
    failures_in_a_row: int
    #: Requests sent to the provider, provider failures among them, requests not sent
    #: because the breaker was open, and how often it opened (since start).
    requests: int
    failures: int
    skipped: int
    opened: int
    #: Seconds until an open breaker lets a probe through (None unless open).
    retry_in: float | None
    #: What the last provider failure was (empty: none yet).
    last_failure: str

    def describe(self) -> str:
        """One line: ``backup (http://10.0.0.2/v1): open, tried again in 12 s``."""
        text = f"{self.provider} ({self.where}): {self.state.value}"
        if self.state is BreakerState.OPEN and self.retry_in is not None:
            text += f", tried again in {math.ceil(self.retry_in)} s"
        elif self.failures_in_a_row:
            text += f", {self.failures_in_a_row} failures in a row"
        return text


class CircuitBreaker:
    """The breaker of one provider (see the module docstring for the states).

    The promise: while open, `allow` says no until the cool-down has passed; then it
    says yes to exactly one caller (the probe) until that caller reports `success`,
    `failure` or `release`. Every caller `allow` said yes to must report one of them."""

    def __init__(
        self,
        provider: str,
        *,
        where: str = "",
        failures_to_open: int = 3,
        cooldown: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.provider = provider
        self.where = where
        self.failures_to_open = failures_to_open
        self.cooldown = cooldown
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._in_a_row = 0
        self._reopens_at = 0.0
        self._probing = False
        self.requests = 0
        self.failures = 0
        self.skipped = 0
        self.opened = 0
        self.last_failure = ""

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker past its cool-down reads half-open)."""
        if self._state is BreakerState.OPEN and self._clock() >= self._reopens_at:
            return BreakerState.HALF_OPEN
        return self._state

    def would_allow(self) -> bool:
        """Whether `allow` would say yes now (without taking the probe)."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self._probing
        )

    def allow(self) -> bool:
        """May a request go to this provider now? Counts it as sent, or as skipped."""
        if not self.would_allow():
            self.skipped += 1
            return False
        if self.state is BreakerState.HALF_OPEN:
            self._state = BreakerState.HALF_OPEN
            self._probing = True
        self.requests += 1
        return True

    def force(self) -> None:
        """Send a request whatever the state: the last resort when every provider that
        could answer is open (a person is never refused without one being asked)."""
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.HALF_OPEN
            self._probing = True
        self.requests += 1

    def reopens_in(self) -> float:
        """Seconds until the cool-down ends (0 when it has, or the breaker is closed)."""
        if self._state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._reopens_at - self._clock())

    def success(self) -> None:
        """The provider answered (whatever the answer said): it works."""
        self._in_a_row = 0
        self._probing = False
        if self._state is not BreakerState.CLOSED:
            self._state = BreakerState.CLOSED
            logger.info("LLM provider {} answers again: its breaker is closed", self.provider)

    def failure(self, detail: str, *, open_for: float | None = None) -> None:
        """A provider failure. Opens the breaker at the `failures_to_open`-th in a row,
        when a probe fails, or at once when `open_for` (a long Retry-After) is given,
        then for at least that long."""
        self.failures += 1
        self._in_a_row += 1
        self.last_failure = detail
        probing, self._probing = self._probing, False
        opens = probing or open_for is not None or self._in_a_row >= self.failures_to_open
        if not opens:
            return
        seconds = self.cooldown
        if open_for is not None:
            seconds = max(seconds, min(open_for, MAX_OPEN_SECONDS))
        was = self._state
        self._state = BreakerState.OPEN
        self._reopens_at = self._clock() + seconds
        if was is BreakerState.CLOSED:
            self.opened += 1
            logger.warning(
                "LLM provider {} is failing ({} in a row, last: {}): its breaker is open; "
                "it is skipped for {:g} s, then tried with one request",
                self.provider,
                self._in_a_row,
                detail,
                seconds,
            )
        else:  # a probe failed: it stays out of use; said once when it opened
            logger.debug("LLM provider {} still fails: open for {:g} s", self.provider, seconds)

    def release(self) -> None:
        """A request ended without saying anything of the provider (it was stopped, or
        refused as a bad request): a probe's turn passes to the next request."""
        self._probing = False

    def status(self) -> BreakerStatus:
        state = self.state
        return BreakerStatus(
            provider=self.provider,
            where=self.where,
            state=state,
            failures_in_a_row=self._in_a_row,
            requests=self.requests,
            failures=self.failures,
            skipped=self.skipped,
            opened=self.opened,
            retry_in=self.reopens_in() if state is BreakerState.OPEN else None,
            last_failure=self.last_failure,
        )
