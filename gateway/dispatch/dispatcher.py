"""The dispatcher: one FIFO lane per session key, a global cap on concurrent turns.

Channel adapters `submit` inbound messages and return at once; the dispatcher checks
access (optional, `gateway.access.policy.AccessGate`) and dedupe, runs one turn at a time per
session through the handler (`AgentLoop.handle`) and hands every reply to `deliver`.
The promises it keeps (each one tested in tests/test_dispatch.py):

- Messages of one session are handled strictly in arrival order (the order `submit`
  was called, whatever the timing of the access check and the dedupe store), one turn
  at a time.
- A slow session never delays another: a lane takes a slot of the global cap only
  when it starts a turn, and lanes wait for slots independently (no head-of-line
  blocking); a reply is delivered after the slot is given back.
- A message the bot never answers whoever sent it (group chatter not addressed to the
  bot: `AccessCheck.screen`) is judged first, before it takes a place in a queue or
  costs a journal write, and its sender is told nothing, whatever the gateway is doing.
- A queued message is never silently dropped: every accepted message ends in a reply
  (the handler's, or a short error reply if the handler raised), and every refused one
  is told why and counted.
- A platform's message (it has a platform id and is journaled) is never refused for want
  of room: the lane bound (`max_queue_per_lane`) holds only for messages whose sender
  still has them (the chat APIs, the terminal, scheduled runs), so a backlog after
  downtime waits its turn however long it is. Past `max_queued_total` a platform's
  message is journaled but not held in memory (`SubmitStatus.KEPT`, taken: the
  channel confirms it): it waits in the journal, behind its session's, and is fed to
  its lane from there once the gateway is down to half its bound (`_refill`), or by the
  next start's replay; nobody is told anything. Many platforms would hand it over
  again only at a reconnect, or a few times within minutes, so leaving it with them is
  no promise. (In the shared mode the router feeds the journal: there a message past
  the bound is left with its platform, `SubmitStatus.RETRY_LATER`.)
  While draining, a platform's message is left with its platform, which hands it over
  again at the next start; a platform that never does (`redelivers(channel)` is False:
  a push with no receipt, a webhook nobody retries) has it journaled for the next
  start instead (`KEPT`), since leaving it with the platform loses it.
  At a drain deadline a journaled message waits for the next start's replay; only
  senders who hold their message get a "please send it again" notice.
- A message carrying a platform id is answered once, also when the platform
  redelivers it after a restart (see `gateway.journal`). `submit` returns only once it
  is journaled (journal before confirm: the channel confirms it to the platform after
  that); a message that cannot be journaled is not taken (`Ticket.taken` is False), so
  the platform keeps it and sends it again.
- A reply is durable before it is delivered and the message is marked answered after,
  so `replay` after a crash re-sends it (at most once per crash) instead of running its
  turn again, and runs the turns that never finished. Durable means: in the session as
  the answer to its message (`META_IN_SESSION`: the handler finds it there again), or
  else recorded in the outbox (errors, commands, a merged turn's reply).
- A reply its channel certainly could not send (`gateway.channel.DeliveryFailed`: the
  platform or the network is down) is sent again, with backoff, for up to
  `redeliver_window` seconds, its conversation's later replies waiting behind it; the
  message is not marked answered meanwhile, so a stop leaves it journaled for the next
  start. Only a reply that can never go out (or the window running out, logged as an
  error) lets a message be marked answered without its reply.
- An urgent message (`urgent(msg)` is true: /stop) is handled on arrival, outside its
  lane, after the access check: it never waits behind the turn it is meant to stop.
  It is not journaled (it acts on what runs now, which a crash ends anyway).
- A message that arrives while its session's turn runs does what the session's queue
  mode says (`gateway.dispatch.queue_modes`; `mode_for`): waits for a turn of its own
  (followup), is merged into the next turn (collect), joins the running turn when the
  turn takes it (steer: `TurnInbox.take`), or stops the running turn and is merged into
  the next (interrupt). Whatever the mode, a session's messages keep their order, each
  is answered (a joined message by the reply of the turn it joined, which marks it
  answered too), and only messages new to the session join another's turn: a replayed
  one, which may be in the session already, always gets a turn of its own.
- In the shared mode a fed message's turn runs behind the fence of its session's lease
  (`gateway.plumbing.fence`): once another replica holds the session, the turn stores,
  records, marks and sends nothing more, and its message is left to the new holder. A
  reply goes out only after its durable write passed the fence and while the lease is
  surely still held (`SessionRouter.confirm`).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import anyio
import anyio.abc
from loguru import logger

from gateway.dispatch.lanes import Router, SubmitStatus, Ticket

if TYPE_CHECKING:
    from gateway.journal.protocol import LeaseAsk

from gateway import failpoints
from gateway.access.policy import Allow, Challenge, Decision, Deny, Ignore
from gateway.channel import DeliveryFailed
from gateway.dispatch.queue_modes import QUEUE_MODES, Accept, QueueMode, TurnInbox, receiving
from gateway.journal.protocol import ClaimBusy, DedupeStore, Unanswered, dedupe_key
from gateway.messages import (
    MERGED_IDS_KEY,
    META_IN_SESSION,
    META_REPLAYED,
    META_REPLY_ENTRY,
    META_REPLY_WANTED,
    META_SESSION_CURRENT,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from gateway.plumbing.fence import Fence, FencedOut, fenced
from gateway.telemetry import META_TRACEPARENT, SpanLike, Telemetry, telemetry, trace_id_of

__all__ = ["MERGED_IDS_KEY", "Dispatcher", "SubmitStatus", "Ticket", "merge_messages"]

Handler = Callable[[InboundMessage], Awaitable[OutboundMessage]]
Deliver = Callable[[OutboundMessage], Awaitable[None]]
TurnDoneCallback = Callable[[OutboundMessage, float], None]
#: Replies re-sent by a replay that are remembered, so that messages which joined one
#: turn get its reply once (`_finish_fenced`).
RESENT_REMEMBERED = 4096
#: Seconds between two attempts at a reply its channel could not deliver (doubling).
REDELIVER_FIRST_PAUSE = 1.0
REDELIVER_MAX_PAUSE = 60.0


class AccessCheck(Protocol):
    """Who may talk to the bot (`gateway.access.policy.AccessGate`)."""

    def screen(self, msg: InboundMessage) -> Ignore | None:
        """`Ignore` for a message never answered whoever sent it (group chatter not
        addressed to the bot), judged without I/O before it takes a place in a queue;
        None when `check` decides."""
        ...

    async def check(self, msg: InboundMessage) -> Decision: ...


BUSY_TEXT = (
    "I'm still working through your earlier messages. Please wait for my replies, "
    "then send this one again."
)
DRAINING_TEXT = (
    "I'm restarting right now and can't take new messages. Please send yours again in a minute."
)
ERROR_TEXT = "Something went wrong while answering that. Please try again."
RESTART_TEXT = (
    "I was restarting and could not answer your last message. Please send it again in a minute."
)


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """A snapshot of the dispatcher's counters (since start) and gauges (now).

    `queue_depths` holds non-empty lanes only; export the total and the maximum to
    metrics rather than one series per session key.
    """

    accepted: int
    duplicates: int
    denied: int
    ignored: int
    access_errors: int
    dropped_full: int
    rejected_draining: int
    turns_started: int
    turns_finished: int
    turn_failures: int
    merged_messages: int
    steered_messages: int
    interrupted_turns: int
    delivery_failures: int
    dedupe_errors: int
    not_taken: int
    in_flight: int
    lanes: int
    queued_total: int
    max_queue_depth: int
    queue_depths: Mapping[str, int] = field(default_factory=dict)
    #: Platform messages journaled but not held in memory (`SubmitStatus.KEPT`): past
    #: `max_queued_total`, or while draining when their platform never hands one over
    #: again.
    kept_in_journal: int = 0
    #: Of those, still waiting in the journal for room.
    waiting_in_journal: int = 0


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What `drain` did: turns finished while draining, and what was left unanswered
    (those senders got `RESTART_TEXT`)."""

    seconds: float
    finished: int
    unfinished_in_flight: int
    unfinished_queued: int
    sessions_left: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not self.sessions_left


def merge_messages(messages: Sequence[InboundMessage]) -> InboundMessage:
    """Collect mode: the messages of one lane as one, texts joined by blank lines in
    order; ids, sender and metadata are the last message's, and the metadata records
    the merged platform ids under `MERGED_IDS_KEY`."""
    if not messages:
        raise ValueError("nothing to merge")
    last = messages[-1]
    if len(messages) == 1:
        return last
    ids = [m.message_id for m in messages if m.message_id]
    return replace(
        last,
        text="\n\n".join(m.text for m in messages),
        metadata={**last.metadata, MERGED_IDS_KEY: ids},
    )


class _Admission:
    """A platform message being taken in (claimed, its journal write not finished):
    `kept` once the journal holds it (or it was settled without one). A copy of it that
    arrives meanwhile `wait`s for the `end`; the event is made only then (a copy while
    the write runs is rare, and every platform message has an admission)."""

    __slots__ = ("_ended", "kept")

    def __init__(self) -> None:
        self._ended: anyio.Event | None = None
        self.kept = False

    async def wait(self) -> bool:
        """Whether the first copy was kept, once its admission ended."""
        if self._ended is None:
            self._ended = anyio.Event()
        await self._ended.wait()
        return self.kept

    def end(self) -> None:
        if self._ended is not None:
            self._ended.set()


class _Item:
    """One submitted message while it waits in its lane."""

    __slots__ = (
        "claimed",
        "dedupe_key",
        "enqueued_ns",
        "fence",
        "message",
        "ready",
        "recorded",
        "skip",
        "ticket",
    )

    def __init__(
        self,
        ticket: Ticket,
        dedupe_key: str | None,
        *,
        checked: bool,
        recorded: Unanswered | None = None,
        fence: Fence | None = None,
        claimed: bool = False,
    ) -> None:
        self.message = ticket.message
        # Journaled by this process past the bound: its key is claimed here already.
        self.claimed = claimed
        self.ticket = ticket
        self.dedupe_key = dedupe_key
        # Set once access and dedupe have answered; None when there is nothing to ask.
        self.ready: anyio.Event | None = anyio.Event() if checked or dedupe_key else None
        self.skip = False  # a duplicate, or not allowed: the lane drops it
        # A replayed message (on file in the journal already), with its recorded reply.
        self.recorded = recorded
        # The lease its turn runs under (shared mode): its writes carry it.
        self.fence = fence
        self.enqueued_ns = time.time_ns()  # the start of its queue wait (traces)

    @property
    def is_ready(self) -> bool:
        return self.ready is None or self.ready.is_set()

    @property
    def is_new(self) -> bool:
        """New to its session: no turn of it can have begun (a message taken in now, or
        one the router knows is new), so it may join another message's turn."""
        recorded = self.recorded
        return recorded is None or (
            recorded.reply is None and self.message.metadata.get(META_SESSION_CURRENT) is True
        )


class _Lane:
    __slots__ = ("current", "inbox", "key", "queue", "wakeup")

    def __init__(self, key: str) -> None:
        self.key = key
        self.queue: deque[_Item] = deque()
        self.current: list[_Item] = []  # the turn in progress
        self.inbox: TurnInbox | None = None  # ... and what it may take in while it runs
        self.wakeup = anyio.Event()


@dataclass
class _Counters:
    accepted: int = 0
    duplicates: int = 0
    denied: int = 0
    ignored: int = 0
    access_errors: int = 0
    dropped_full: int = 0
    rejected_draining: int = 0
    turns_started: int = 0
    turns_finished: int = 0
    turn_failures: int = 0
    merged_messages: int = 0
    steered_messages: int = 0
    interrupted_turns: int = 0
    delivery_failures: int = 0
    dedupe_errors: int = 0
    not_taken: int = 0
    kept_in_journal: int = 0
    in_flight: int = 0


def _fenced_out(key: str, when: str) -> None:
    with logger.contextualize(session=key):
        logger.warning(
            "the session's lease moved on to another replica {}: nothing more is stored "
            "or sent for this turn here; its new holder answers the message",
            when,
        )


class Dispatcher:
    """Runs turns for inbound messages: per-session FIFO lanes under a global cap.

    Start `run` in the daemon's task group (`await tg.start(dispatcher.run)`), then
    `submit` messages; on shutdown `drain`. `deliver` is called for every reply,
    including those of messages submitted by an API that awaits its ticket: a reply
    router skips channels that have no adapter. `deliver` should not raise; if it
    does, the failure is logged and counted and the lane goes on. A lane waits for
    its reply to be delivered (so replies of one session go out in order), at most
    `deliver_timeout` seconds.

    With `access`, a message the policy refuses never reaches the handler: the sender
    gets the policy's reply (a refusal or a pairing code; status `denied`) or nothing
    (status `ignored`). A failing access check lets nothing through; a failing dedupe
    store lets everything through (both are logged and counted).

    `mode` is every session's queue mode, unless `mode_for` says a message's session's
    (`AgentLoop.queue_mode`); `joinable` says which messages may join another's turn at
    all (`AgentLoop.may_join`: not a command, not a file). The handler's turn finds its
    `TurnInbox` with `gateway.dispatch.queue_modes.current_inbox`.
    """

    def __init__(
        self,
        handler: Handler,
        deliver: Deliver,
        *,
        max_concurrent_turns: int = 8,
        max_queue_per_lane: int = 50,
        max_queued_total: int = 10_000,
        mode: QueueMode = "followup",
        mode_for: Callable[[InboundMessage], QueueMode] | None = None,
        joinable: Accept | None = None,
        dedupe: DedupeStore | None = None,
        access: AccessCheck | None = None,
        idle_lane_ttl: float = 300,
        on_turn_done: TurnDoneCallback | None = None,
        deliver_timeout: float = 60.0,
        redeliver_window: float = 3600.0,
        urgent: Callable[[InboundMessage], bool] | None = None,
        redelivers: Callable[[str], bool] | None = None,
    ) -> None:
        if max_concurrent_turns < 1:
            raise ValueError("max_concurrent_turns must be at least 1")
        if max_queue_per_lane < 1:
            raise ValueError("max_queue_per_lane must be at least 1")
        if max_queued_total < 1:
            raise ValueError("max_queued_total must be at least 1")
        if mode not in QUEUE_MODES:
            raise ValueError(f"mode must be one of {', '.join(QUEUE_MODES)}, not {mode!r}")
        if idle_lane_ttl < 0:
            raise ValueError("idle_lane_ttl must not be negative")
        self._handler = handler
        self._deliver = deliver
        self.max_concurrent_turns = max_concurrent_turns
        self.max_queue_per_lane = max_queue_per_lane
        self.max_queued_total = max_queued_total
        self.mode: QueueMode = mode
        self._mode_for = mode_for
        self._joinable = joinable
        self.idle_lane_ttl = idle_lane_ttl
        self.deliver_timeout = deliver_timeout
        self.redeliver_window = redeliver_window
        self._stopping = anyio.Event()  # set when the drain begins
        self._dedupe = dedupe
        self._access = access
        self._on_turn_done = on_turn_done
        self._urgent = urgent
        self._redelivers = redelivers
        self._limiter = anyio.CapacityLimiter(max_concurrent_turns)
        self._lanes: dict[str, _Lane] = {}
        self._counters = _Counters()
        self._tg: anyio.abc.TaskGroup | None = None
        self._run_done = anyio.Event()
        self._stopped = False
        self._draining = False
        self._outstanding = 0  # accepted messages not answered yet
        self._idle: anyio.Event | None = None  # set when draining and nothing is left
        self._grace: anyio.CancelScope | None = None  # the drain's grace period, running
        self._grace_ended = False
        self._resent: set[str] = set()  # recorded replies the replay has sent again
        # Replies of replayed turns sent, by session entry (bounded: a replay's own).
        self._resent_entries: deque[str] = deque(maxlen=RESENT_REMEMBERED)
        # Messages journaled past `max_queued_total` (session key, journal key), oldest
        # first, and how many of each session's: its newer messages queue behind them.
        self._spill: deque[tuple[str, str]] = deque()
        self._spilled: dict[str, int] = {}
        self._refilling = False
        # Platform messages claimed here whose journal write has not finished (file mode).
        self._admitting: dict[str, _Admission] = {}
        #: In the shared mode (`gateway.dispatch.router`): journaled messages are handed to the
        #: router, which feeds each session's messages, in journal order, to the one
        #: replica holding that session's lease.
        self.router: Router | None = None

    # ------------------------------------------------------------------ service

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until `drain` finishes (or the surrounding task group is cancelled)."""
        if self._tg is not None or self._stopped:
            raise RuntimeError("a Dispatcher runs once")
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tg = None
            self._stopped = True
            self._run_done.set()

    @property
    def draining(self) -> bool:
        return self._draining or self._stopped

    async def submit(self, msg: InboundMessage) -> Ticket:
        """Take `msg` in; returns once it is queued, never waiting for its turn.

        The ticket's status says what happened; a refused message was told why
        (through `deliver`) and `ticket.reply()` gives that notice at once.
        """
        return await self._enqueue(msg, None)

    async def replay(self) -> int:
        """Queue what a crash left unanswered (the journal's `unanswered`), oldest first,
        before any channel submits: each stays ahead of the newer messages of its
        session. A message with a recorded reply gets that reply again and its turn does
        not run; the others run, marked `META_REPLAYED` so the handler does not store
        what the session holds already. Returns how many were queued."""
        if self._dedupe is None:
            return 0
        pending = await self._dedupe.unanswered()
        if pending:
            resend = sum(entry.reply is not None for entry in pending)
            logger.warning(
                "replaying {} messages left unanswered by a crash ({} with a reply to re-send)",
                len(pending),
                resend,
            )
        for entry in pending:
            await self.feed(entry)
        return len(pending)

    async def feed(
        self,
        entry: Unanswered,
        *,
        current: bool = False,
        fence: Fence | None = None,
        claimed: bool = False,
    ) -> Ticket:
        """Queue a journaled message (a crash's leftover, or in the shared mode one the
        router hands over): marked `META_REPLAYED`, never refused by the queue bounds.
        `current`: the router knows it is new to the session, and the session cached
        here is current (`META_SESSION_CURRENT` instead of `META_REPLAYED`). `fence`: the
        session's lease its turn runs under (the shared mode's router). `claimed`: this
        process claimed its key already (a message journaled past the bound)."""
        flag = META_SESSION_CURRENT if current else META_REPLAYED
        metadata = {**entry.message.metadata, flag: True}
        message = replace(entry.message, metadata=metadata)
        return await self._enqueue(message, replace(entry, message=message), fence, claimed)

    async def _enqueue(
        self,
        msg: InboundMessage,
        recorded: Unanswered | None,
        fence: Fence | None = None,
        claimed: bool = False,
    ) -> Ticket:
        tracing = telemetry()
        if tracing.enabled and META_TRACEPARENT not in msg.metadata:
            msg = _traced_intake(tracing, msg, self._replica())
        ticket = Ticket(msg)
        key = msg.session_key
        if self._tg is None and not self._stopped:
            raise RuntimeError("Dispatcher.run is not running; start it first")
        if recorded is None and self._access is not None:
            # Addressing is judged before anything else: a message the bot never answers
            # (a busy room's chatter) takes no place in a queue, costs no journal write
            # and is never told anything, whatever the gateway is doing.
            ignored = self._access.screen(msg)
            if ignored is not None:
                self._counters.ignored += 1
                ticket.status = SubmitStatus.IGNORED
                ticket._resolve(None)
                ticket._done.set()
                return ticket
        # A platform's message is never refused for want of room, only left with the
        # platform, which hands it over again (see `_leave`).
        redelivered = recorded is None and not self._sender_holds(msg)
        # ... unless the platform never hands it over again: then only we can keep it.
        only_here = (
            redelivered and self._redelivers is not None and not self._redelivers(msg.channel)
        )
        if self._draining or self._tg is None:
            if only_here:
                await self._keep_in_journal(ticket)
                return ticket
            if redelivered:
                self._leave(ticket, "the gateway is stopping")
                return ticket
            self._counters.rejected_draining += 1
            with logger.contextualize(session=key):
                logger.info("message refused: draining")
            await self._refuse(ticket, SubmitStatus.REJECTED_DRAINING, DRAINING_TEXT)
            return ticket
        if recorded is None and self._urgent is not None and self._urgent(msg):
            self._counters.accepted += 1
            self._outstanding += 1
            self._tg.start_soon(self._run_urgent, ticket, name=f"urgent {key}")
            return ticket
        # A replayed message was taken before the crash: the bounds never refuse it.
        bounded = recorded is None
        # Past the bound, or behind its session's messages waiting there: into the
        # journal only, fed to its lane when there is room (`_refill`).
        spills = self._spilled.get(key) or self._outstanding >= self.max_queued_total
        if spills and redelivered and self.router is None and self._dedupe is not None:
            await self._keep_in_journal(ticket, spill=True)
            return ticket
        # In the shared mode, a message no platform would hand over again is taken past
        # the bound (the platform's pace bounds these, and the journal holds them).
        if bounded and only_here:
            bounded = False
        if bounded and self._outstanding >= self.max_queued_total:
            # Bounded memory however many sessions write at once.
            if redelivered:
                self._leave(ticket, f"the gateway is full ({self._outstanding} waiting)")
                return ticket
            self._counters.dropped_full += 1
            with logger.contextualize(session=key):
                logger.warning(
                    "gateway full ({} messages waiting): message refused, sender told to wait",
                    self._outstanding,
                )
            await self._refuse(ticket, SubmitStatus.REJECTED_FULL, BUSY_TEXT)
            return ticket
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(key)
            self._tg.start_soon(self._run_lane, lane, name=f"lane {key}")
        # The lane bound refuses only what its sender still holds (the chat API, the
        # terminal, a scheduled run): a platform's message, journaled, waits its turn
        # however long the conversation's backlog (memory: `max_queued_total`).
        if bounded and not redelivered and len(lane.queue) >= self.max_queue_per_lane:
            self._counters.dropped_full += 1
            with logger.contextualize(session=key):
                logger.warning(
                    "lane full ({} queued): message refused, sender told to wait",
                    len(lane.queue),
                )
            await self._refuse(ticket, SubmitStatus.REJECTED_FULL, BUSY_TEXT)
            return ticket
        # The position in the lane is taken now, before any await: arrival order is
        # the order of `submit` calls whatever the access check's or dedupe's timing.
        item = _Item(
            ticket,
            dedupe_key(msg) if self._dedupe is not None else None,
            checked=self._access is not None,
            recorded=recorded,
            fence=fence,
            claimed=claimed,
        )
        lane.queue.append(item)
        lane.wakeup.set()
        self._outstanding += 1
        if item.ready is not None:
            await self._admit(item)
        if ticket.status is SubmitStatus.ACCEPTED:
            self._counters.accepted += 1
            self._interrupt_for(lane, item)
        return ticket

    def _sender_holds(self, msg: InboundMessage) -> bool:
        """Does the sender still hold `msg`, so that refusing it loses nothing? True for
        one without a platform id (the terminal, a scheduled run) or whose sender waits
        on its request (the chat APIs: a 429 or 503 asks them to send it again). False
        for a platform's message, which is journaled: from the moment the channel
        confirms it, only we hold it."""
        return (
            self._dedupe is None
            or msg.message_id is None
            or bool(msg.metadata.get(META_REPLY_WANTED))
        )

    def _leave(self, ticket: Ticket, why: str) -> None:
        """Not taken: the message stays with its platform, which hands it over again
        (`Ticket.taken` is False, so the channel does not confirm it). Nobody is told
        anything: its sender gets the answer once the gateway can take it in."""
        ticket.status = SubmitStatus.RETRY_LATER
        self._counters.not_taken += 1
        ticket._resolve(None)
        ticket._done.set()
        with logger.contextualize(session=ticket.message.session_key):
            logger.info("message left with the platform for now: {}", why)

    async def _keep_in_journal(self, ticket: Ticket, *, spill: bool = False) -> None:
        """Journal a platform's message without holding it in memory (`KEPT`, taken):
        while draining, one its platform would never hand over again, for the next
        start's replay (or, in the shared mode, another replica); with `spill`, one past
        `max_queued_total`, for `_refill` to feed to its lane. A duplicate is settled as
        one. Not taken (`RETRY_LATER`) only when the journal fails: the platform, not
        told we have it, may still hand it over again."""
        msg = ticket.message
        store = self._dedupe
        assert store is not None  # `_sender_holds` is True without a journal
        key = dedupe_key(msg)
        assert key is not None  # a platform's message has its id
        take_in = getattr(store, "take_in", None)
        try:
            if take_in is not None:
                duplicate = await take_in(key, msg, None)
            else:
                duplicate = await self._is_duplicate(key, store)
                if duplicate:
                    fate = await self._duplicate_fate(key, store)
                    if fate is None:
                        self._leave(ticket, "its first copy could not be journaled")
                        return
                    duplicate = fate
                if not duplicate and not await self._journal_claimed(key, store, msg):
                    self._leave(ticket, "the journal failed")
                    return
        except ClaimBusy as exc:
            self._leave(ticket, str(exc))
            return
        except Exception as exc:
            self._counters.dedupe_errors += 1
            self._leave(ticket, f"the journal failed ({exc})")
            return
        if duplicate:
            ticket.status = SubmitStatus.DUPLICATE
            self._counters.duplicates += 1
        else:
            ticket.status = SubmitStatus.KEPT
            self._counters.kept_in_journal += 1
            if spill:
                session = msg.session_key
                self._spill.append((session, key))
                self._spilled[session] = self._spilled.get(session, 0) + 1
                self._refill_if_room()
            else:
                with logger.contextualize(session=msg.session_key):
                    logger.info(
                        "message {} kept for the next start (its platform would not send it again)",
                        msg.message_id,
                    )
        ticket._resolve(None)
        ticket._done.set()

    def _refill_if_room(self) -> None:
        """Start feeding journaled messages to their lanes once the gateway is down to
        half its bound (hysteresis: one journal read feeds many)."""
        if (
            self._spill
            and not self._refilling
            and self._tg is not None
            and not self._draining
            and self._outstanding <= self.max_queued_total // 2
        ):
            self._refilling = True
            self._tg.start_soon(self._refill, name="refill from the journal")

    async def _refill(self) -> None:
        """Feed messages journaled past the bound to their lanes, oldest first, as many
        as there is room for, reading the journal once per batch. A message answered
        meanwhile (its platform's redelivery, say) is gone from the journal and skipped.
        Whatever is still waiting at a drain stays journaled for the next start."""
        store = self._dedupe
        assert store is not None
        try:
            while self._spill and not self._draining:
                room = self.max_queued_total - self._outstanding
                if room <= 0:
                    return
                await failpoints.reach("dispatch.before_refill", self._spill[0][0])
                try:
                    waiting = {
                        dedupe_key(entry.message): entry for entry in await store.unanswered()
                    }
                except Exception as exc:
                    self._counters.dedupe_errors += 1
                    logger.error("journal unreadable ({}); its waiting messages wait", exc)
                    return
                logger.info(
                    "feeding {} of {} messages waiting in the journal",
                    min(room, len(self._spill)),
                    len(self._spill),
                )
                for _ in range(min(room, len(self._spill))):
                    if self._draining:
                        return
                    # Room is taken meanwhile too: a conversation with nothing in the
                    # journal is let in directly while a feed awaits.
                    if self._outstanding >= self.max_queued_total:
                        break
                    session, key = self._spill.popleft()
                    entry = waiting.get(key)
                    if entry is not None:
                        await self.feed(entry, claimed=True)
                    left = self._spilled.get(session, 0) - 1
                    if left > 0:
                        self._spilled[session] = left
                    else:
                        self._spilled.pop(session, None)
        finally:
            self._refilling = False

    def _replica(self) -> str:
        """This replica's id in traces ("" in the file mode: one process)."""
        return self.router.replica_id if self.router is not None else ""

    async def _admit(self, item: _Item) -> None:
        """Dedupe, then access, while the item keeps its place in the lane. Dedupe goes
        first so that a platform's redelivery of a refused message is a duplicate, not a
        second refusal (or a second pairing code)."""
        assert item.ready is not None
        allowed = self._access is None
        admission: _Admission | None = None
        try:
            key, store = item.dedupe_key, self._dedupe
            # A journaled message fed by the router is claimed already (by its journal row).
            fed = item.recorded is not None and (self.router is not None or item.claimed)
            take_in = getattr(store, "take_in", None)
            if key is not None and item.recorded is None and take_in is not None:
                allowed = await self._admit_shared(item, key, take_in)
                return
            if key is not None and store is not None and not fed:
                try:
                    duplicate = await self._is_duplicate(key, store)
                except ClaimBusy as exc:
                    with logger.contextualize(session=item.message.session_key):
                        logger.info("message not taken now: {}", exc)
                    self._skip(item, None, status=SubmitStatus.RETRY_LATER)
                    return
                if duplicate:
                    fate = await self._duplicate_fate(key, store)
                    if fate is not False:
                        self._skip_duplicate(item, fate is True)
                        return
                if item.recorded is None:
                    admission = self._admitting[key] = _Admission()
            if self._access is not None:
                decision = await self._check_access(item.message)
                if not isinstance(decision, Allow):
                    self._skip(item, decision)
                    if admission is not None:
                        admission.kept = True  # settled: its sender was told, or nobody is
                    if key is not None and store is not None and item.recorded is not None:
                        # Replayed, and no longer allowed: out of the journal, or it
                        # would come back at every start.
                        await self._mark_done(store, key)
                    return
                allowed = True
            if key is None or store is None or item.recorded is not None:
                return  # nothing to journal, or on file already (a replay)
            if not await self._journal(key, store, item.message):
                self._skip(item, None, status=SubmitStatus.RETRY_LATER)
                return
            if admission is not None:
                admission.kept = True
            if self.router is not None:
                self._forward(item, key, self.router)
        finally:
            if not allowed and not item.skip:
                # `submit` was cancelled before the access check answered: nothing
                # unchecked may reach the handler.
                self._skip(item, Ignore("submit cancelled during the access check"))
            if admission is not None:
                assert key is not None
                # `_journal` gives back a claim it failed to write.
                given_back = item.ticket.status is SubmitStatus.RETRY_LATER
                if not admission.kept and not item.skip:
                    # Cancelled before the journal held it: nobody confirmed it, and
                    # its platform's next copy is the one to answer.
                    self._skip(item, None, status=SubmitStatus.RETRY_LATER)
                await self._admitted(key, admission, given_back=given_back)
            item.ready.set()  # also when cancelled: the lane must not wait forever

    async def _first_admission_kept(self, key: str) -> bool:
        """A duplicate's key was claimed here: may its platform forget the message? Yes
        when it is on file (journaled or answered, or being replayed from the journal).
        A claim whose journal write has not finished holds the message in memory only,
        and a confirmation now would lose it to a crash (or a failed write) before the
        write: such a duplicate waits for that first admission and is taken only when it
        kept the message (a platform that retries after a few seconds, as Slack's and
        Feishu's do, can hand a message over again while its first copy is still being
        journaled)."""
        first = self._admitting.get(key)
        return True if first is None else await first.wait()

    async def _duplicate_fate(self, key: str, store: DedupeStore) -> bool | None:
        """What becomes of a copy of a message whose key is claimed: True, settle it as
        a duplicate (its first copy is on file); False, take it in as the first (the
        first copy's intake ended without keeping it: cancelled, its request aborted,
        or its journal write failed; the claim was given back and this copy claimed the
        key again); None, leave it with its platform (claimed again by a copy that was
        not kept either, or the store is busy). The copy that waited is very often the
        platform's own retry of the aborted request: leaving it too would spend one of
        the platform's few retries (Slack makes three).

        Claimed again with no copy being taken in is a claim the store failed to give
        back, not a message on file: left, not settled (settling it would lose it)."""
        if await self._first_admission_kept(key):
            return True
        try:
            if not await self._is_duplicate(key, store):
                return False
        except ClaimBusy:
            return None
        other = self._admitting.get(key)
        return True if other is not None and await other.wait() else None

    async def _journal_claimed(self, key: str, store: DedupeStore, msg: InboundMessage) -> bool:
        """`_journal` for a message claimed here just now, its copies waiting meanwhile
        (`_first_admission_kept`)."""
        admission = self._admitting[key] = _Admission()
        journaled: bool | None = None  # None: cancelled, the claim still held
        try:
            journaled = admission.kept = await self._journal(key, store, msg)
        finally:
            await self._admitted(key, admission, given_back=journaled is False)
        return journaled

    def _skip_duplicate(self, item: _Item, kept: bool) -> None:
        if kept:
            self._skip(item, None)
            return
        with logger.contextualize(session=item.message.session_key):
            logger.info("message not taken now: its first copy could not be journaled")
        self._skip(item, None, status=SubmitStatus.RETRY_LATER)

    async def _admitted(self, key: str, admission: _Admission, *, given_back: bool) -> None:
        """The end of a first admission: its duplicates waiting on it are told whether
        the message was kept; a claim that kept nothing (cancelled before the journal
        wrote it) is given back, or the platform's next copy would be a duplicate of a
        message nobody holds."""
        if self._admitting.get(key) is admission:
            del self._admitting[key]
        if not admission.kept and not given_back:
            store = self._dedupe
            if store is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await store.release(key)
                    except Exception as exc:
                        logger.error("dedupe store failed to give a claim back: {}", exc)
        admission.end()

    async def _admit_shared(
        self,
        item: _Item,
        key: str,
        take_in: Callable[..., Awaitable[bool]],
    ) -> bool:
        """`_admit` on a shared journal (PostgreSQL), one round trip for an allowed
        message: access first, then claimed and journaled in one statement. A refused
        message is claimed and marked answered, so its redelivery, to any replica, is a
        duplicate (no second notice), as in `_admit`. True once the message passed the
        access check."""
        store = self._dedupe
        assert store is not None
        if self._access is not None:
            decision = await self._check_access(item.message)
            if not isinstance(decision, Allow):
                try:
                    duplicate = await self._is_duplicate(key, store)
                except ClaimBusy:
                    self._skip(item, None, status=SubmitStatus.RETRY_LATER)
                    return False
                if not duplicate:
                    # Settled, not left claimed: a claim would hold the redelivery to
                    # another replica off (503) until it expired.
                    await self._mark_done(store, key)
                self._skip(item, None if duplicate else decision)
                return False
        ask = self.router.lease_ask(item.message.session_key) if self.router else None
        await failpoints.reach("dispatch.before_journal", item.message.session_key)
        try:
            # The claim and the journal row in one statement: the journal's span.
            with telemetry().span(
                "gateway.journal", parent=item.message.metadata.get(META_TRACEPARENT)
            ):
                duplicate = await take_in(key, item.message, ask)
        except ClaimBusy as exc:
            with logger.contextualize(session=item.message.session_key):
                logger.info("message not taken now: {}", exc)
            self._skip(item, None, status=SubmitStatus.RETRY_LATER)
            return True
        except Exception as exc:
            self._counters.dedupe_errors += 1
            with logger.contextualize(session=item.message.session_key):
                logger.error("inbound journal failed ({}); message left with the platform", exc)
            self._skip(item, None, status=SubmitStatus.RETRY_LATER)
            return True
        if duplicate:
            self._skip(item, None)
        elif self.router is not None:
            self._forward(item, key, self.router, ask)
        return True

    def withdraw(self, session_key: str, tickets: Sequence[Ticket]) -> int:
        """Take back fed messages of `session_key` whose turns have not begun (the shared
        mode's router, when another replica took the session over): the lane drops them,
        their rows stay journaled for the new holder. Returns how many."""
        lane = self._lanes.get(session_key)
        if lane is None:
            return 0
        wanted = {id(t) for t in tickets}
        taken = 0
        for item in lane.queue:
            if id(item.ticket) in wanted and not item.skip:
                item.skip = True
                self._settled(1)
                item.ticket._resolve(None)
                item.ticket._done.set()
                taken += 1
        return taken

    def _forward(self, item: _Item, key: str, router: Router, ask: LeaseAsk | None = None) -> None:
        """Shared mode: the journal is the queue. The lane drops the item; the router
        feeds it, in journal order, to whichever replica holds the session's lease
        (`ask`: what the journal's round trip found about that lease and the session)."""
        item.skip = True
        self._settled(1)
        ticket = item.ticket
        ticket._done.set()
        if item.message.metadata.get(META_REPLY_WANTED) and self._tg is not None:
            self._tg.start_soon(self._await_remote_reply, ticket, key, router)
        else:
            ticket._resolve(None)
        router.journaled_here(item.message.session_key, key, ask)

    async def _await_remote_reply(self, ticket: Ticket, key: str, router: Router) -> None:
        try:
            ticket._resolve(await router.wait_reply(key, fresh=True))
        finally:
            ticket._resolve(None)

    async def _check_access(self, msg: InboundMessage) -> Decision:
        assert self._access is not None
        try:
            return await self._access.check(msg)
        except Exception:
            # Fail closed: a broken access check lets nobody through.
            self._counters.access_errors += 1
            with logger.contextualize(session=msg.session_key):
                logger.exception("access check failed; message ignored")
            return Ignore("the access check failed")

    async def _is_duplicate(self, key: str, store: DedupeStore) -> bool:
        try:
            return await store.seen_or_add(key)
        except ClaimBusy:
            raise
        except Exception as exc:
            # Fail open: answering a redelivery twice beats never answering.
            self._counters.dedupe_errors += 1
            logger.error("dedupe store failed ({}); taking the message", exc)
            return False

    async def _journal(self, key: str, store: DedupeStore, msg: InboundMessage) -> bool:
        """Journal `msg`; False when that failed: the message is then not taken (its claim
        is given back), so the platform, which was not told we have it, sends it again."""
        await failpoints.reach("dispatch.before_journal", msg.session_key)
        try:
            with telemetry().span("gateway.journal", parent=msg.metadata.get(META_TRACEPARENT)):
                await store.journal(key, msg)
            return True
        except Exception as exc:
            self._counters.dedupe_errors += 1
            with logger.contextualize(session=msg.session_key):
                logger.error("inbound journal failed ({}); message left with the platform", exc)
        try:
            await store.release(key)
        except Exception as exc:
            logger.error("dedupe store failed to give a claim back: {}", exc)
        return False

    def _skip(
        self,
        item: _Item,
        decision: Decision | None,
        *,
        status: SubmitStatus = SubmitStatus.DUPLICATE,
    ) -> None:
        """Take `item` out of the running (the lane drops it when it reaches it)."""
        item.skip = True
        self._settled(1)
        ticket = item.ticket
        ticket._done.set()
        if status is SubmitStatus.RETRY_LATER:
            ticket.status = status
            self._counters.not_taken += 1
            ticket._resolve(None)
        elif decision is None:
            ticket.status = SubmitStatus.DUPLICATE
            self._counters.duplicates += 1
            with logger.contextualize(session=item.message.session_key):
                logger.info("duplicate of message {} ignored", item.message.message_id)
            ticket._resolve(None)
        elif isinstance(decision, Deny | Challenge):
            ticket.status = SubmitStatus.DENIED
            self._counters.denied += 1
            notice = reply_for(item.message, decision.reply, is_error=isinstance(decision, Deny))
            ticket._resolve(notice)
            self._send_notice(notice)
        else:
            ticket.status = SubmitStatus.IGNORED
            self._counters.ignored += 1
            ticket._resolve(None)

    async def _refuse(self, ticket: Ticket, status: SubmitStatus, text: str) -> None:
        ticket.status = status
        ticket._done.set()
        notice = reply_for(ticket.message, text, is_error=True)
        ticket._resolve(notice)
        if self._tg is None:  # stopped: nothing runs in the background any more
            await self._deliver_safely(notice)
        else:
            self._send_notice(notice)

    def _send_notice(self, notice: OutboundMessage) -> None:
        if self._tg is None:
            logger.warning("a notice could not be sent: the dispatcher has stopped")
            return
        # Counted as outstanding work so that a drain lets the notice go out.
        self._outstanding += 1
        self._tg.start_soon(self._deliver_notice, notice)

    async def _deliver_notice(self, notice: OutboundMessage) -> None:
        try:
            await self._deliver_safely(notice)
        finally:
            self._settled(1)

    async def _run_urgent(self, ticket: Ticket) -> None:
        """An urgent message, beside its lane: checked, handled and answered at once."""
        msg = ticket.message
        try:
            if self._access is not None:
                decision = await self._check_access(msg)
                if not isinstance(decision, Allow):
                    ticket.status = (
                        SubmitStatus.DENIED
                        if isinstance(decision, Deny | Challenge)
                        else SubmitStatus.IGNORED
                    )
                    notice = None
                    if isinstance(decision, Deny | Challenge):
                        self._counters.denied += 1
                        notice = reply_for(msg, decision.reply, is_error=isinstance(decision, Deny))
                        await self._deliver_safely(notice)
                    else:
                        self._counters.ignored += 1
                    ticket._resolve(notice)
                    return
            with logger.contextualize(session=msg.session_key):
                try:
                    reply = await self._handler(msg)
                except Exception:
                    logger.exception("urgent message failed; the sender gets an error reply")
                    reply = reply_for(msg, ERROR_TEXT, is_error=True)
            ticket._resolve(reply)
            await self._deliver_safely(reply)
        finally:
            ticket._resolve(None)
            ticket._done.set()
            self._settled(1)

    # ------------------------------------------------------------------ lanes

    async def _run_lane(self, lane: _Lane) -> None:
        while True:
            if not lane.queue:
                lane.wakeup = anyio.Event()
                with anyio.move_on_after(self.idle_lane_ttl):
                    await lane.wakeup.wait()
                if not lane.queue:
                    # No await between the check and the removal: a submit either saw
                    # this lane with an empty queue before, or makes a new lane after.
                    del self._lanes[lane.key]
                    return
                continue
            head = lane.queue[0]
            if head.ready is not None and not head.ready.is_set():
                await head.ready.wait()
            if head.skip:
                lane.queue.popleft()
                continue
            try:
                self._limiter.acquire_nowait()  # fair: fails while others wait
            except anyio.WouldBlock:
                await self._limiter.acquire()
            if lane.queue[0].skip:  # withdrawn while it waited for the slot
                self._limiter.release()
                continue
            try:
                # Taken after the slot is ours, so collect mode merges what arrived
                # while waiting for it.
                lane.current = self._take(lane)
                lane.inbox = TurnInbox(lane.key, functools.partial(self._join, lane))
                reply = await self._run_turn(lane.key, lane.current, lane.inbox)
            finally:
                self._limiter.release()
                lane.inbox = None
            await self._finish(lane.current, reply)
            lane.current = []

    # ------------------------------------------------------------------ queue modes

    def _mode(self, msg: InboundMessage, inbox: TurnInbox | None = None) -> QueueMode:
        """The queue mode of `msg`'s session: as its running turn read it from the
        session (`inbox`), else as `mode_for` says, else `mode`."""
        if inbox is not None and inbox.mode is not None:
            return inbox.mode
        return self._mode_for(msg) if self._mode_for is not None else self.mode

    def _may_join(self, item: _Item, head: _Item) -> bool:
        """May `item` join the turn of `head`: new to the session, checked, under the
        same lease, and a message that may join turns at all (`joinable`)?"""
        return (
            item.is_ready
            and item.is_new
            and item.fence is head.fence
            and (self._joinable is None or self._joinable(item.message))
        )

    def _take(self, lane: _Lane) -> list[_Item]:
        """The next turn's messages: the head of the lane, and in the collect and
        interrupt modes the messages waiting behind it that may join it (a replayed
        message is never merged: its turn is its own, or ran already)."""
        head = lane.queue.popleft()
        batch = [head]
        if not lane.queue or self._mode(head.message) not in ("collect", "interrupt"):
            return batch
        if not self._may_join(head, head):
            return batch
        while lane.queue:
            item = lane.queue[0]
            if item.skip:
                lane.queue.popleft()
                continue
            if not self._may_join(item, head):
                break  # it, and everything after it, keeps its place
            batch.append(lane.queue.popleft())
        return batch

    def _join(self, lane: _Lane, accept: Accept) -> list[InboundMessage]:
        """`TurnInbox.take` (steer): the messages waiting behind the running turn, oldest
        first, while they may join it and `accept` takes them; each is the turn's from
        now on (its reply answers it, and marks it answered)."""
        batch = lane.current
        if not batch:
            return []
        taken: list[InboundMessage] = []
        while lane.queue:
            item = lane.queue[0]
            if item.skip:
                lane.queue.popleft()
                continue
            if not self._may_join(item, batch[0]) or not accept(item.message):
                break
            batch.append(lane.queue.popleft())
            taken.append(item.message)
        self._counters.steered_messages += len(taken)
        return taken

    def _interrupt_for(self, lane: _Lane, item: _Item) -> None:
        """Interrupt mode: `item` was taken in while its session's turn runs, and may
        join the next one: the running turn stops as /stop stops it, and `item` starts
        the next turn (with whatever else waits and may join it)."""
        inbox = lane.inbox
        if inbox is None or not lane.current or item.skip or item not in lane.queue:
            return
        # The mode first: a dict read, where `joinable` parses the text (a command?), and
        # most sessions are not in the interrupt mode.
        if self._mode(item.message, inbox) != "interrupt" or not self._may_join(item, item):
            return
        if inbox.stop():
            self._counters.interrupted_turns += 1
            with logger.contextualize(session=lane.key):
                logger.info("turn stopped: a new message came in (queue mode interrupt)")

    async def _run_turn(
        self, key: str, batch: list[_Item], inbox: TurnInbox | None = None
    ) -> OutboundMessage | None:
        """The turn's reply; None when its lease moved on to another replica before or
        during the turn (fenced out: nothing more is stored or sent for it here).
        `batch` grows while the turn runs when the turn takes messages from `inbox`."""
        fence = batch[0].fence
        if fence is not None and not await self._holds(fence):
            _fenced_out(key, "before its turn began")
            return None
        recorded = batch[0].recorded
        if recorded is not None and recorded.reply is not None:
            # The turn ran before the crash and its reply may not have gone out: send
            # that reply again rather than run the turn twice.
            return recorded.reply
        msg = merge_messages([item.message for item in batch])
        if len(batch) > 1:
            self._counters.merged_messages += len(batch)
        counters = self._counters
        counters.turns_started += 1
        counters.in_flight += 1
        started = time.perf_counter()
        tracing = telemetry()
        parent = msg.metadata.get(META_TRACEPARENT) if tracing.enabled else None
        if parent is not None:
            with tracing.span("gateway.queue_wait", parent=parent, start_ns=batch[0].enqueued_ns):
                pass
        traced = (
            logger.contextualize(trace_id=trace_id_of(parent))
            if parent is not None
            else contextlib.nullcontext()
        )
        with (
            logger.contextualize(session=key),
            traced,
            tracing.span(
                "gateway.turn",
                {"gateway.messages": len(batch), "gateway.replica": self._replica()},
                parent=parent,
            ),
            fenced(fence),
            receiving(inbox),
        ):
            try:
                reply: OutboundMessage | None = await self._handler(msg)
            except FencedOut:
                reply = None
            except Exception:
                counters.turn_failures += 1
                logger.exception("turn failed; the sender gets an error reply")
                reply = reply_for(msg, ERROR_TEXT, is_error=True)
            finally:
                counters.in_flight -= 1
                if inbox is not None:
                    inbox.close()  # what comes from now on waits for the next turn
        if fence is not None and fence.lost:
            # Also when the handler caught the refusal itself (a tool's write): whatever
            # it answered was not stored.
            _fenced_out(key, "during its turn")
            return None
        if reply is None:
            return None
        seconds = time.perf_counter() - started
        counters.turns_finished += 1
        if self._on_turn_done is not None:
            try:
                self._on_turn_done(reply, seconds)
            except Exception:
                logger.exception("on_turn_done callback failed")
        return reply

    async def _holds(self, fence: Fence) -> bool:
        """Is the lease behind `fence` still this replica's? (`SessionRouter.confirm`:
        the local clock while it is surely held, else one round trip.) False when that
        cannot be told: nothing is sent, and the message stays journaled for whoever
        holds the lease next."""
        if fence.fresh():
            return True
        if fence.lost or self.router is None:
            return False
        try:
            return await self.router.confirm(fence)
        except Exception as exc:
            logger.warning("the lease of {} could not be confirmed ({})", fence.key, exc)
            return False

    def _fenced_out_settle(self, batch: list[_Item]) -> None:
        """A batch whose lease moved on: nothing sent or marked, its rows stay journaled
        for the lease's new holder."""
        for item in batch:
            item.ticket._resolve(None)
            item.ticket._done.set()
        self._settled(len(batch))

    async def _finish(self, batch: list[_Item], reply: OutboundMessage | None) -> None:
        """Deliver the reply of a turn: recorded in the outbox first, marked answered
        after (see the module docstring); behind the turn's fence, if it has one."""
        if reply is None:
            self._fenced_out_settle(batch)
            return
        fence = batch[0].fence
        stage = ["before its reply was recorded"]
        parent = batch[0].message.metadata.get(META_TRACEPARENT)
        try:
            with (
                telemetry().span(
                    "gateway.delivery",
                    {"messaging.system": reply.channel, "gateway.reply.error": reply.is_error},
                    parent=parent,
                ) as span,
                fenced(fence),
            ):
                await self._finish_fenced(batch, reply, fence, stage, span)
        except FencedOut:
            _fenced_out(reply.session_key, stage[0])
            self._fenced_out_settle(batch)

    async def _finish_fenced(
        self,
        batch: list[_Item],
        reply: OutboundMessage,
        fence: Fence | None,
        stage: list[str],
        span: SpanLike | None = None,
    ) -> None:
        for item in batch:
            item.ticket._resolve(reply)
        store = self._dedupe
        keys = [item.dedupe_key for item in batch if item.dedupe_key is not None]
        recorded = batch[0].recorded
        # A reply the session holds as the answer to its message is found there by the
        # replay; any other (errors, commands, a merged turn's) is recorded here.
        in_session = reply.metadata.get(META_IN_SESSION) is True and len(batch) == 1
        needs_record = recorded is None or recorded.reply is None
        if store is not None and keys and needs_record and not in_session:
            await failpoints.reach("dispatch.before_outbox", reply.session_key)
            try:
                await store.record_reply(keys, reply)
            except FencedOut:
                raise
            except Exception as exc:
                # Delivered all the same: after a crash the turn would run again.
                self._counters.dedupe_errors += 1
                logger.error("outbox failed to record a reply: {}", exc)
        send = True
        entry = reply.metadata.get(META_REPLY_ENTRY)
        if recorded is not None and recorded.reply_id is not None:
            # A merged turn's reply is re-sent once for all its messages.
            send = recorded.reply_id not in self._resent
            self._resent.add(recorded.reply_id)
            if send:
                with logger.contextualize(session=reply.session_key):
                    logger.warning("re-sending a reply a crash may have kept from going out")
        elif isinstance(entry, str) and entry in self._resent_entries:
            # The replay of a message that joined an earlier one's turn: that turn's
            # reply went out (again) for the earlier message already.
            send = False
            with logger.contextualize(session=reply.session_key):
                logger.info("replayed message answered by the turn it joined: not sent again")
        if send:
            stage[0] = "before its reply went out"
            await failpoints.reach("dispatch.before_send", reply.session_key)
        if send and fence is not None and not await self._holds(fence):
            raise fence.refused()
        if span is not None:  # what the platform made of it, on the delivery span
            span.set_attribute("gateway.delivery.sent", send)
        if send:
            failure = await self._deliver_until_taken(reply, fence)
            if span is not None and failure is not None:
                span.set_attribute("error.type", type(failure).__name__)
            if isinstance(entry, str):
                self._resent_entries.append(entry)
            if isinstance(failure, DeliveryFailed):
                # Not sent, and the gateway is stopping: the message stays journaled, and
                # the next start (or the replica that holds the session next) sends it.
                for item in batch:
                    item.ticket._done.set()
                self._settled(len(batch))
                return
        stage[0] = "before its message was marked answered"
        await failpoints.reach("dispatch.before_mark", reply.session_key)
        # Shared mode: a reply someone waits for (`/api/chat`, perhaps on another
        # replica) is kept on its message's row as the row is marked answered. If that
        # fails the row stays journaled, never answered without its reply: the session's
        # pump marks it again with the reply (`SessionRouter._mark_finished`).
        wanted = set()
        if self.router is not None:
            for item in batch:
                key = item.dedupe_key
                if key is not None and item.message.metadata.get(META_REPLY_WANTED):
                    wanted.add(key)
                    try:
                        await self.router.publish(key, reply)
                    except FencedOut:
                        raise
                    except Exception as exc:
                        logger.error("a reply could not be handed to the waiting replica: {}", exc)
                    else:
                        item.ticket.marked = True
        if store is not None:
            for item in batch:
                key = item.dedupe_key
                if key is not None and key not in wanted and await self._mark_done(store, key):
                    item.ticket.marked = True
        for item in batch:
            item.ticket._done.set()
        self._settled(len(batch))

    async def _mark_done(self, store: DedupeStore, key: str) -> bool:
        """Mark `key` answered: False (logged, counted) when the store failed; raises
        `FencedOut` when the turn's lease moved on."""
        try:
            await store.mark_done(key)
        except FencedOut:
            raise
        except Exception as exc:
            self._counters.dedupe_errors += 1
            logger.error("dedupe store failed to record an answer: {}", exc)
            return False
        return True

    async def _deliver_safely(self, reply: OutboundMessage) -> Exception | None:
        """Send `reply`; None when the platform took it, else the failure (logged and
        counted, never raised)."""
        try:
            with anyio.fail_after(self.deliver_timeout):
                await self._deliver(reply)
        except DeliveryFailed as exc:
            self._counters.delivery_failures += 1
            with logger.contextualize(session=reply.session_key):
                logger.warning("reply not delivered, to be sent again: {}", exc)
            return exc
        except Exception as exc:
            self._counters.delivery_failures += 1
            with logger.contextualize(session=reply.session_key):
                logger.error("reply could not be delivered: {!r}", exc)
            return exc
        return None

    async def _deliver_until_taken(
        self, reply: OutboundMessage, fence: Fence | None
    ) -> Exception | None:
        """Send `reply`; while its channel says it certainly did not go out and may later
        (`DeliveryFailed`: the platform or the network is down), send it again, with
        backoff, for up to `redeliver_window` seconds: its conversation's next replies
        wait behind it, in order. None when it went out; the `DeliveryFailed` when the
        gateway began to stop meanwhile (the message stays journaled for the next start);
        any other failure when it never will go out, or the window ran out (the message
        is then marked answered, as the log says)."""
        failure = await self._deliver_safely(reply)
        started = time.monotonic()
        pause = REDELIVER_FIRST_PAUSE
        while isinstance(failure, DeliveryFailed):
            if time.monotonic() - started >= self.redeliver_window:
                with logger.contextualize(session=reply.session_key):
                    logger.error(
                        "reply given up after {:.0f} s of failed deliveries: {}",
                        time.monotonic() - started,
                        failure,
                    )
                return RuntimeError(f"undelivered for {self.redeliver_window:g} s")
            with anyio.move_on_after(pause):
                await self._stopping.wait()
            if self._draining:
                return failure
            pause = min(pause * 2, REDELIVER_MAX_PAUSE)
            if fence is not None and not await self._holds(fence):
                raise fence.refused()
            failure = await self._deliver_safely(reply)
        return failure

    def _settled(self, count: int) -> None:
        self._outstanding -= count
        if self._idle is not None and self._outstanding <= 0:
            self._idle.set()
        if self._spill:
            self._refill_if_room()

    # ------------------------------------------------------------------ drain

    async def drain(self, grace: float) -> DrainReport:
        """Stop intake, let queued and in-flight turns finish for up to `grace` seconds,
        then stop every lane and tell the senders of what was left to send it again.
        Returns when `run` has ended; a second call waits for the first one's end.
        """
        started = time.monotonic()
        if self._draining or self._tg is None:  # drained already, or never ran
            self._draining = True
            self._stopping.set()
            if self._tg is not None:
                await self._run_done.wait()
            return DrainReport(time.monotonic() - started, 0, 0, 0, ())
        finished_before = self._counters.turns_finished
        self._draining = True
        self._stopping.set()
        self._idle = anyio.Event()
        if self._outstanding <= 0:
            self._idle.set()
        logger.info(
            "draining: {} in flight, {} queued, up to {:.0f} s",
            self._counters.in_flight,
            self._queued_total(),
            grace,
        )
        with anyio.move_on_after(0 if self._grace_ended else grace) as self._grace:
            await self._idle.wait()
        self._grace = None
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
            await self._run_done.wait()
        in_flight, queued, left = self._unanswered()
        if left:
            # A message with a platform id is in the journal (answered by the replay at
            # the next start) or was never confirmed (the platform sends it again): its
            # sender is told nothing, or they would send it twice. Only senders who hold
            # their message themselves (the chat API, the terminal) are told to resend.
            holds = self._sender_holds
            kept = {k: [i for i in v if not holds(i.message)] for k, v in left.items()}
            told = {k: [i for i in v if holds(i.message)] for k, v in left.items()}
            logger.warning(
                "drain deadline: {} turns in flight and {} queued messages left in {} "
                "sessions; {} kept for the next start, the senders of {} told to send again",
                in_flight,
                queued,
                len(left),
                sum(map(len, kept.values())),
                sum(map(len, told.values())),
            )
            for items in kept.values():
                for item in items:
                    item.ticket._resolve(None)
                    item.ticket._done.set()
            with anyio.move_on_after(min(self.deliver_timeout, 5.0)):
                async with anyio.create_task_group() as tg:
                    for items in told.values():
                        if not items:
                            continue
                        notice = reply_for(items[-1].message, RESTART_TEXT, is_error=True)
                        for item in items:
                            item.ticket._resolve(notice)
                            item.ticket._done.set()
                        tg.start_soon(self._deliver_safely, notice)
        self._lanes.clear()
        report = DrainReport(
            seconds=time.monotonic() - started,
            finished=self._counters.turns_finished - finished_before,
            unfinished_in_flight=in_flight,
            unfinished_queued=queued,
            sessions_left=tuple(sorted(left)),
        )
        logger.info("drained in {:.1f} s: {} turns finished", report.seconds, report.finished)
        return report

    def end_grace(self) -> None:
        """End the drain's grace period now (what a second Ctrl-C asks for): the turns
        still in flight are stopped and their senders told to send again, as when the
        grace runs out. Before a drain starts, that drain gets no grace at all."""
        self._grace_ended = True
        if self._grace is not None:
            self._grace.cancel()

    def _unanswered(self) -> tuple[int, int, dict[str, list[_Item]]]:
        in_flight = queued = 0
        left: dict[str, list[_Item]] = {}
        for key, lane in self._lanes.items():
            current = [i for i in lane.current if not i.ticket.answered]
            waiting = [i for i in lane.queue if not i.skip and not i.ticket.answered]
            in_flight += bool(current)
            queued += len(waiting)
            if current or waiting:
                left[key] = current + waiting
        return in_flight, queued, left

    # ------------------------------------------------------------------ stats

    def _queued_total(self) -> int:
        return sum(len(lane.queue) for lane in self._lanes.values())

    def stats(self) -> DispatcherStats:
        c = self._counters
        depths = {key: len(lane.queue) for key, lane in self._lanes.items() if lane.queue}
        return DispatcherStats(
            accepted=c.accepted,
            duplicates=c.duplicates,
            denied=c.denied,
            ignored=c.ignored,
            access_errors=c.access_errors,
            dropped_full=c.dropped_full,
            rejected_draining=c.rejected_draining,
            turns_started=c.turns_started,
            turns_finished=c.turns_finished,
            turn_failures=c.turn_failures,
            merged_messages=c.merged_messages,
            steered_messages=c.steered_messages,
            interrupted_turns=c.interrupted_turns,
            delivery_failures=c.delivery_failures,
            dedupe_errors=c.dedupe_errors,
            not_taken=c.not_taken,
            kept_in_journal=c.kept_in_journal,
            waiting_in_journal=len(self._spill),
            in_flight=c.in_flight,
            lanes=len(self._lanes),
            queued_total=sum(depths.values()),
            max_queue_depth=max(depths.values(), default=0),
            queue_depths=depths,
        )


def _traced_intake(tracing: Telemetry, msg: InboundMessage, replica: str) -> InboundMessage:
    """The root span of a message's trace; its traceparent rides in the message's
    metadata (and so in the journal) for every later span of the message."""
    attributes: dict[str, str | bool | int | float] = {
        "messaging.system": msg.channel,
        "gateway.replica": replica,
    }
    if msg.message_id:
        attributes["messaging.message.id"] = msg.message_id
    with tracing.span("gateway.intake", attributes):
        traceparent = tracing.traceparent()
    if traceparent is None:
        return msg
    return replace(msg, metadata={**msg.metadata, META_TRACEPARENT: traceparent})
