"""Liveness and readiness: the daemon's phase and each component's health, as pure logic.

The daemon moves through three phases: starting -> ready -> draining. Components (a
channel, the cache backend, ...) report their own health through a handle from
`HealthState.component(name)`. `readiness()` combines both into one answer for /readyz.

Invariants (tested in tests/test_http_health.py):
- Ready means: phase is ready AND every registered component last reported healthy.
- A component counts as unhealthy from registration until it first reports healthy:
  a part that never comes up keeps the gateway out of the load balancer.
- Draining is one-way: once `set_draining()` is called, neither `set_ready()` nor
  `set_starting()` brings the gateway back (a late starter cannot undo a SIGTERM).
- Every method is safe to call from any thread or task; reads see a consistent snapshot.
- A detail is redacted as it is reported (the settings' redactor, `gateway.redaction`):
  /readyz is public, and a channel's error may quote its token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from loguru import logger

from gateway.redaction import Redactor

# Details end up in a public probe response and in logs: keep them short.
MAX_DETAIL_CHARS = 200
NOT_REPORTED = "not reported yet"


class Phase(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class ComponentStatus:
    healthy: bool
    detail: str
    since: float


@dataclass(frozen=True, slots=True)
class Readiness:
    """One consistent answer to "should traffic come here?"."""

    ready: bool
    phase: Phase
    reasons: tuple[str, ...]
    components: Mapping[str, ComponentStatus]
    #: Optional components that are down: shown, yet traffic still comes here (a cache
    #: outage slows answers, it does not stop them).
    degraded: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The /readyz body; `status` is ready, starting, draining or unhealthy."""
        if self.ready:
            status = "ready"
        else:
            status = "unhealthy" if self.phase is Phase.READY else self.phase.value
        return {
            "status": status,
            "ready": self.ready,
            "reasons": list(self.reasons),
            "degraded": list(self.degraded),
            "components": {
                name: {"healthy": entry.healthy, "detail": entry.detail}
                for name, entry in sorted(self.components.items())
            },
        }


class ComponentHealth:
    """The handle one component uses to report its own health."""

    __slots__ = ("_state", "name")

    def __init__(self, state: HealthState, name: str) -> None:
        self._state = state
        self.name = name

    def healthy(self, ok: bool = True, detail: str = "", *, fix: str = "") -> None:
        """Report the component healthy (`ok=True`) or not, with a short reason and
        what to do about it (`fix`, kept whole when the detail is shortened)."""
        state = self._state
        state._report(self.name, ok, _clean_detail(state.redactor.redact(detail), fix))


def _clean_detail(detail: str, fix: str = "") -> str:
    flat, fix = " ".join(detail.split()), " ".join(fix.split())
    room = MAX_DETAIL_CHARS - (len(fix) + 2 if fix else 0)
    if room < 20:  # a fix that long is shortened like any detail
        flat, fix, room = f"{flat}; {fix}", "", MAX_DETAIL_CHARS
    if len(flat) > room:
        flat = flat[: room - 1] + "…"
    return f"{flat}; {fix}" if fix else flat


class HealthState:
    """The daemon's phase and its components' health (see the module doc)."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, redactor: Redactor | None = None
    ) -> None:
        """`redactor` is the settings' (None: token shapes only)."""
        self._clock = clock
        self.redactor = redactor or Redactor()
        self._lock = threading.Lock()
        self._phase = Phase.STARTING
        self._components: dict[str, ComponentStatus] = {}
        self._optional: set[str] = set()

    # ---- phase

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    @property
    def accepting(self) -> bool:
        """Whether new work (a chat request, a webhook delivery) should be taken now.
        Component health does not matter here: a Slack outage must not stop the API."""
        return self.phase is Phase.READY

    def _move_to(self, phase: Phase) -> bool:
        with self._lock:
            previous = self._phase
            refused = previous is Phase.DRAINING and phase is not Phase.DRAINING
            if not refused:
                self._phase = phase
        if refused:
            logger.debug("health: staying in draining; ignoring a move to {}", phase.value)
            return False
        if previous is not phase:
            logger.info("health: {} -> {}", previous.value, phase.value)
        return True

    def set_starting(self) -> bool:
        """Back to starting (e.g. re-initializing); False if already draining."""
        return self._move_to(Phase.STARTING)

    def set_ready(self) -> bool:
        """Every part has started; False (and no change) if already draining."""
        return self._move_to(Phase.READY)

    def set_draining(self) -> bool:
        """Stop taking new work; one-way."""
        return self._move_to(Phase.DRAINING)

    # ---- components

    def component(self, name: str, *, required: bool = True) -> ComponentHealth:
        """Register `name` (unhealthy until it reports) and return its handle; asking
        again for a registered name returns a handle to the same entry. A component
        that is not `required` never makes the gateway unready: it is reported as
        degraded instead."""
        if not name or not name.isprintable():
            raise ValueError(f"component name {name!r} must be non-empty printable text")
        with self._lock:
            if not required:
                self._optional.add(name)
            if name not in self._components:
                self._components[name] = ComponentStatus(False, NOT_REPORTED, self._clock())
        return ComponentHealth(self, name)

    def _report(self, name: str, ok: bool, detail: str) -> None:
        with self._lock:
            previous = self._components.get(name)
            changed = previous is None or previous.healthy != ok
            since = self._clock() if changed or previous is None else previous.since
            self._components[name] = ComponentStatus(bool(ok), detail, since)
        if changed:
            state = "healthy" if ok else "unhealthy"
            logger.info("health: {} is {}{}", name, state, f": {detail}" if detail else "")

    # ---- the combined answer

    def readiness(self) -> Readiness:
        with self._lock:
            phase = self._phase
            components = dict(self._components)
            optional = set(self._optional)
        reasons: list[str] = []
        degraded: list[str] = []
        if phase is not Phase.READY:
            reasons.append(phase.value)
        for name, status in sorted(components.items()):
            if not status.healthy:
                line = f"{name}: {status.detail or 'unhealthy'}"
                (degraded if name in optional else reasons).append(line)
        return Readiness(
            ready=not reasons,
            phase=phase,
            reasons=tuple(reasons),
            components=MappingProxyType(components),
            degraded=tuple(degraded),
        )
