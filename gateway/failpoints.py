"""Failpoints: named places in a turn where a test pauses this process, to prove what a
pause at the worst moment does (a replica frozen past its lease: `gateway.plumbing.fence`).

Inert unless armed: `reach` is one dictionary check when nothing is. Armed two ways:
- from the environment, for a real `gateway run` in a multi-process test:
  ``GATEWAY_FAILPOINTS="dispatch.before_mark=sigstop@telegram:42"`` (comma-separated
  ``NAME=ACTION[@SESSION_KEY]``). The one action is ``sigstop``: the process stops itself
  there (as a stop-the-world pause would), once, and goes on where it stopped when the
  test sends SIGCONT;
- in-process, with `arm` and a coroutine function, for tests that run replicas in one
  process.

The places (`POINTS`) are where a pause decides what a replica may still write or send:
before a platform's message is journaled (its platform must still hold it), before the
user's message is stored (or one that joined the running turn), before the
reply is recorded in the outbox, before it is sent, and before the message is marked
answered. A channel declares its own (its `ChannelSpec.failpoints`, e.g. just before and
after a read position is stored, or between the journal and the platform's confirmation);
the daemon declares them (`declare`) and then checks that every armed name is known
(`check_armed`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Iterable

from loguru import logger

POINTS = frozenset(
    {
        # A platform's message, about to be journaled: its channel must not have confirmed
        # it yet (the conformance kit's `kill_before_journal_loses_nothing`).
        "dispatch.before_journal",
        "turn.before_user_append",
        # A message that joined a running turn (the steer mode), about to be stored.
        "turn.before_steered_append",
        "dispatch.before_outbox",
        "dispatch.before_send",
        "dispatch.before_mark",
        # Messages journaled past the bound, about to be read back for their lanes: the
        # read takes a while, and other conversations take room meanwhile.
        "dispatch.before_refill",
    }
)
#: The core's places and those the channels declared.
_declared: set[str] = set(POINTS)
ENV = "GATEWAY_FAILPOINTS"

Action = Callable[[str, str], Awaitable[None]]

#: name -> (session key or None for any, action); each fires once.
_armed: dict[str, tuple[str | None, Action]] = {}


async def _sigstop(name: str, session_key: str) -> None:
    logger.warning(
        "failpoint {} reached for {}: stopping this process (SIGSTOP)", name, session_key
    )
    os.kill(os.getpid(), signal.SIGSTOP)  # a test sends SIGCONT


def declare(names: Iterable[str]) -> None:
    """Make a channel's failpoints known (its `ChannelSpec.failpoints`)."""
    _declared.update(names)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(_declared))}")


def arm(name: str, action: Action, session_key: str | None = None) -> None:
    """Run `action(name, session_key)` the first time a turn of `session_key` (any
    session: None) reaches failpoint `name`. A core place must be one of `POINTS`; a
    channel's is checked once the channels declared theirs (`check_armed`)."""
    core = {point.partition(".")[0] for point in POINTS}
    if name not in _declared and name.partition(".")[0] in core:
        raise _unknown(name)
    _armed[name] = (session_key, action)


def check_armed() -> None:
    """ValueError naming an armed failpoint nobody declared (a typo in
    ``GATEWAY_FAILPOINTS``, or a channel that is not installed)."""
    for name in _armed:
        if name not in _declared:
            raise _unknown(name)


def disarm_all() -> None:
    _armed.clear()


def arm_from(spec: str) -> None:
    """Arm what `spec` names (the format of ``GATEWAY_FAILPOINTS``)."""
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, rest = part.partition("=")
        action, _, key = rest.partition("@")
        if not sep or action != "sigstop":
            raise ValueError(f"{ENV}: {part!r} is not NAME=sigstop[@SESSION_KEY]")
        arm(name.strip(), _sigstop, key or None)


async def reach(name: str, session_key: str) -> None:
    """Failpoint `name`, reached by a turn of `session_key`."""
    if not _armed:
        return
    armed = _armed.get(name)
    if armed is None or armed[0] not in (None, session_key):
        return
    del _armed[name]
    await armed[1](name, session_key)


if os.environ.get(ENV):
    arm_from(os.environ[ENV])
