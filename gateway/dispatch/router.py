"""Replicas: which gateway runs a session's turns when several share one PostgreSQL.

Any replica may take a message in (a webhook, a Slack retry, `/api/chat`): it claims and
journals it in ``gw_inbound`` (`gateway.journal.pg_store`) before the platform is told, exactly
as one gateway does. The journal is then the queue. One replica at a time holds a
session's lease (``gw_session_leases``) and works through that session's journaled
messages in journal order (``seq``, the order they were taken in, whichever replica took
them), handing each to its own `Dispatcher` as a replayed message (`Dispatcher.feed`).

Promises kept here:
- One replica at a time runs a session's turns, in journal order: a pump holds the lease
  while it feeds, and gives it up only in a statement that finds none of the session's
  messages left in the journal. A replica that journals a message for a session leased
  elsewhere therefore leaves it to the holder, who sees it before it can let go (and is
  told at once: the failed acquire NOTIFYs ``gw_kicks`` in the same statement).
- A lease outlives its last message by `linger` seconds, so a conversation's next turn
  costs no lease round trips; one statement every third of `lease_ttl` renews every
  lease this replica holds, however many.
- A message journaled on the replica whose pump runs its session (or whose journal
  statement took the lease) costs no journal read either: that statement also lists
  the session's other journaled messages, and when the pump knows them all the message
  is next in journal order and is handed over as a read would give it
  (`journaled_here`). Anything the pump does not know sends it back to the journal.
- A dead replica's sessions are resumed within `lease_ttl` + `sweep_interval` seconds:
  every replica sweeps for sessions with journaled messages and no live lease. What the
  dead one had in flight is replayed like a crash's leftovers: a recorded reply is sent
  again, a turn whose message is in the session is not stored twice.
- A draining replica stops feeding and withdraws its leases, so the others go on.
- `/api/chat` answers synchronously wherever the turn runs: the replica that ran it
  marks the message answered and keeps the reply on its journal row in one statement, and
  NOTIFYs ``gw_replies``; the waiting replica LISTENs (and asks every `REPLY_POLL`
  seconds, should a notification be lost). The reply stays until the row expires
  (`dedupe_ttl`): a client that sends the request again with the same ``id`` (its answer
  lost with a dead replica, or its own time-out) gets the same reply, not a second turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from loguru import logger

from gateway.journal.pg_store import LEASE_TAKE
from gateway.journal.protocol import LeaseAsk, Unanswered
from gateway.messages import META_REPLY_WANTED, OutboundMessage
from gateway.plumbing import fence as fencing
from gateway.plumbing.fence import Fence

if TYPE_CHECKING:
    from gateway.dispatch.lanes import Lanes, Ticket
    from gateway.journal.pg_store import PostgresDedupeStore


#: Notification channels, one pair per schema (NOTIFY is database-wide; two deployments
#: on one database in two schemas must not wake each other): `<name>.<schema>`.
NOTIFY_CHANNEL = "gw_replies"

KICK_CHANNEL = "gw_kicks"

STOP_CHANNEL = "gw_stops"

#: How often a waiting `/api/chat` request asks the database for its reply, in case the
#: NOTIFY was lost (a reconnect): rarely, since each ask is a round trip per request.
REPLY_POLL = 5.0

# Taken (its epoch), or held elsewhere (NULL): then the holder is told in the same round
# trip.
_ACQUIRE = (
    "WITH taken AS (\n    "
    + LEASE_TAKE.format(
        source="VALUES (%(key)s, %(me)s, extract(epoch FROM clock_timestamp()) + %(ttl)s)"
    )
    + """)
SELECT epoch FROM taken
UNION ALL
SELECT NULL FROM (SELECT pg_notify(%(kicks)s || '.' || current_schema(), %(key)s)) n
WHERE NOT EXISTS (SELECT FROM taken)
"""
)

# Only a lease still at the epoch this replica holds it under: a renewal never brings
# back a lease another replica took meanwhile (and perhaps released again).
_RENEW = """
UPDATE gw_session_leases l SET expires_at = extract(epoch FROM clock_timestamp()) + %(ttl)s
FROM unnest(%(keys)s::text[], %(epochs)s::bigint[]) AS held(key, epoch)
WHERE l.session_key = held.key AND l.epoch = held.epoch AND l.owner = %(me)s
RETURNING l.session_key
"""

# Released: expired at once, the row and its epoch kept (`gateway.plumbing.fence`).
_RELEASE_IF_EMPTY = """
UPDATE gw_session_leases l SET expires_at = 0
WHERE l.session_key = %(key)s AND l.owner = %(me)s AND l.epoch = %(epoch)s AND NOT EXISTS (
    SELECT 1 FROM gw_inbound i WHERE i.session_key = %(key)s AND i.state = 'journaled')
"""

_OWED = """
SELECT dedupe_key, message::text, reply_id, reply::text FROM gw_inbound
WHERE session_key = %s AND state = 'journaled' ORDER BY seq LIMIT %s
"""

#: Replies up to this many bytes ride in their notification (NOTIFY's payload must stay
#: under 8000 bytes): the waiting replica needs no round trip to read them.
NOTE_REPLY_MAX = 7000

# Answered, with the reply kept for a client's retry, and the waiter told: one statement,
# behind the turn's fence. The notification says `<length of key>:<key><reply>`, the reply
# left out when large.
_PUBLISH = """
WITH done AS (
    UPDATE gw_inbound SET state = 'done', expires_at = %(expires)s, session_key = NULL,
        received_at = NULL, message = NULL, reply = %(reply)s::json, reply_id = NULL
    WHERE dedupe_key = %(key)s AND gw_fence(%(fence_key)s, %(epoch)s)
    RETURNING dedupe_key)
SELECT pg_notify(%(channel)s || '.' || current_schema(),
    length(dedupe_key)::text || ':' || dedupe_key || %(carried)s) FROM done
"""


def reply_note(payload: str) -> tuple[str, str]:
    """The dedupe key and the reply's JSON ('' when not carried) of a reply
    notification (`_PUBLISH`)."""
    length, sep, rest = payload.partition(":")
    if not sep or not length.isdigit():
        return payload, ""  # not ours: no waiter has such a key
    size = int(length)
    return rest[:size], rest[size:]


# /stop for a session another live replica holds: that replica told (NOTIFY), in the same
# round trip that finds it.
_STOP_ELSEWHERE = """
SELECT pg_notify(%(stops)s || '.' || current_schema(), session_key) FROM gw_session_leases
WHERE session_key = %(key)s AND owner <> %(me)s
  AND expires_at > extract(epoch FROM clock_timestamp())
"""

_UNLEASED = """
SELECT DISTINCT i.session_key FROM gw_inbound i
WHERE i.state = 'journaled' AND i.session_key IS NOT NULL AND NOT EXISTS (
    SELECT 1 FROM gw_session_leases l
    WHERE l.session_key = i.session_key
      AND l.expires_at > extract(epoch FROM clock_timestamp()))
LIMIT 1000
"""


class SessionRouter:
    """This replica's share of the sessions (see the module docstring)."""

    def __init__(
        self,
        store: PostgresDedupeStore,
        dispatcher: Lanes,
        *,
        lease_ttl: float = 10.0,
        sweep_interval: float = 2.0,
        batch: int = 100,
        linger: float = 3.0,
    ) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.lease_ttl = lease_ttl
        self.sweep_interval = sweep_interval
        self.batch = batch
        self.linger = linger
        self._tg: anyio.abc.TaskGroup | None = None
        # Running pumps, each with the event that wakes it (a kick: something journaled).
        self._pumps: dict[str, anyio.Event] = {}
        # What each running pump has fed (dedupe key: ticket), and the sessions whose
        # pump must read the journal when it wakes (a kick), and the messages journaled
        # here that are handed to the pump without that read (`journaled_here`).
        self._fed: dict[str, dict[str, Ticket]] = {}
        self._wanted: set[str] = set()
        self._handoffs: dict[str, list[tuple[str, Unanswered]]] = {}
        self.handed = 0  # messages handed to a pump without a journal read (tests, metrics)
        self.reads = 0  # journal reads of the pumps (tests, metrics)
        #: The leases this replica holds, each as the fence its turns write behind.
        self._leases: dict[str, Fence] = {}
        self._lost: set[str] = set()  # ... and lost while a pump ran (another may write)
        self._waiters: dict[str, tuple[anyio.Event, list[OutboundMessage | None]]] = {}
        self._stopping = False
        #: Stops the running turn of a session here (`AgentLoop.stop`), for a /stop
        #: another replica took in (`stop_elsewhere`).
        self.on_stop: Callable[[str], object] | None = None
        self.fed = 0  # messages handed to the dispatcher (for tests and metrics)
        self.takeovers = 0  # sessions resumed by the sweep

    @property
    def replica_id(self) -> str:
        return self.store.replica_id

    # ------------------------------------------------------------------ service

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Sweep for unleased sessions and listen for replies until cancelled; the first
        sweep runs before start-up is reported done."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._listen)
            tg.start_soon(self._renew_forever)
            await self.sweep()
            task_status.started()
            try:
                while True:
                    await anyio.sleep(self.sweep_interval)
                    try:
                        await self.sweep()
                    except Exception as exc:
                        logger.warning("replicas: sweep failed ({}); retrying", exc)
            finally:
                self._tg = None

    async def sweep(self) -> int:
        """Start a pump for every session with journaled messages and no live lease."""
        if self._stopping:
            return 0
        async with self.store.connection() as conn:
            cur = await conn.execute(_UNLEASED)
            keys = [str(k) for (k,) in await cur.fetchall()]
        started = 0
        for key in keys:
            if key not in self._pumps:
                started += 1
                self.kick(key)
        if started:
            self.takeovers += started
            logger.info("replicas: {} sessions without a live lease taken up", started)
        return started

    def lease_ask(self, session_key: str) -> LeaseAsk | None:
        """What to ask `take_in` for a message of `session_key` taken in here: the
        session's lease, in the same round trip, when no pump of this replica runs the
        session; and either way a look at the session's other journaled messages
        (`journaled_here`)."""
        if self._tg is None or self._stopping:
            return None
        return LeaseAsk(ttl=self.lease_ttl, kicks=KICK_CHANNEL, take=session_key not in self._pumps)

    def journaled_here(self, session_key: str, dedupe_key: str, ask: LeaseAsk | None) -> None:
        """A message of `session_key` was just journaled here by `take_in` with `ask`.
        When that statement saw no other journaled message of the session that this
        replica's pump does not know, the message is next in journal order: it is handed
        to the pump (started, if the same statement took the lease) without the round
        trip of a journal read. Otherwise it is left to the journal, as `kick` does."""
        if self._tg is None or self._stopping or ask is None:
            if self._stopping and self._tg is not None and ask is not None and ask.taken:
                # Taken by a claim on its way while `stop` withdrew the leases: withdrawn
                # too, so another replica's sweep runs the message now, not after the
                # lease's time.
                self._tg.start_soon(self._withdraw, session_key)
            self.kick(session_key)
            return
        lease = self._taken(session_key, ask)
        if ask.entry is None or ask.others is None:
            self.kick(session_key, leased=lease if ask.taken else ask.taken)
            return
        wake = self._pumps.get(session_key)
        if wake is not None:
            handed = self._handoffs.get(session_key, [])
            known = self._fed.get(session_key, {}).keys() | {d for d, _ in handed}
            if known.issuperset(ask.others):
                self._handoffs[session_key] = [*handed, (dedupe_key, ask.entry)]
                self.handed += 1
                wake.set()  # no read wanted: the pump takes the message as handed
            else:
                self.kick(session_key)
            return
        if lease is not None and not ask.others:
            self.handed += 1
            self._start_pump(session_key, leased=lease, handoff=(dedupe_key, ask.entry))
            return
        self.kick(session_key, leased=lease if ask.taken else ask.taken)

    def _taken(self, session_key: str, ask: LeaseAsk) -> Fence | None:
        """The lease `take_in` took with `ask`, as a fence (None: not taken)."""
        if not ask.taken or ask.epoch is None:
            return None
        return Fence(session_key, ask.epoch, self._surely_until(ask.sent))

    def _surely_until(self, sent: float) -> float:
        """Until when (`time.monotonic()`) a lease taken or renewed by a statement sent at
        `sent` is surely held: PostgreSQL set its expiry `lease_ttl` from a moment after
        `sent`, by the clock the other replicas judge it by; less a margin for clock
        rates."""
        return sent + self.lease_ttl - min(1.0, self.lease_ttl / 10)

    def kick(self, session_key: str, *, leased: Fence | bool | None = None) -> None:
        """Make sure the session's journaled messages get run: here, when this replica
        gets (or holds) the lease; else by the holder, who sees them before letting go.
        `leased`: what `take_in` did with a `lease_ask` (a fence: the lease is ours now;
        False: its holder was kicked by the database)."""
        if self._tg is None or self._stopping:
            return
        wake = self._pumps.get(session_key)
        if wake is not None:
            self._wanted.add(session_key)
            wake.set()
            return
        if leased is False:
            return  # held elsewhere, and the holder told in the same round trip
        self._start_pump(session_key, leased=leased if isinstance(leased, Fence) else None)

    def _start_pump(
        self, key: str, *, leased: Fence | None, handoff: tuple[str, Unanswered] | None = None
    ) -> None:
        """A pump for `key` (none runs), under `leased` when the lease is ours already:
        with `handoff`, it starts from that message instead of a journal read."""
        assert self._tg is not None
        self._pumps[key] = anyio.Event()
        if handoff is not None:
            self._handoffs[key] = [handoff]
        self._tg.start_soon(self._pump, key, leased, handoff is None, name=f"pump {key}")

    async def stop(self) -> None:
        """Stop feeding (the drain lets what was fed finish) and withdraw every lease
        this replica holds, so the others take its sessions at once."""
        self._stopping = True
        try:
            async with self.store.connection() as conn:
                await conn.execute(
                    "UPDATE gw_session_leases SET expires_at = 0 WHERE owner = %s",
                    (self.replica_id,),
                )
        except Exception as exc:
            logger.warning("replicas: could not withdraw leases ({})", exc)

    # ------------------------------------------------------------------ leases

    async def _withdraw(self, key: str) -> None:
        try:
            async with self.store.connection() as conn:
                await conn.execute(
                    "UPDATE gw_session_leases SET expires_at = 0 "
                    "WHERE session_key = %s AND owner = %s",
                    (key, self.replica_id),
                )
        except Exception as exc:
            logger.warning("replicas: could not withdraw the lease of {} ({})", key, exc)

    async def _acquire(self, key: str) -> Fence | None:
        """The session's lease as a fence, or None (held elsewhere: its holder kicked)."""
        params = {"key": key, "me": self.replica_id, "ttl": self.lease_ttl, "kicks": KICK_CHANNEL}
        async with self.store.connection() as conn:
            sent = time.monotonic()
            cur = await conn.execute(_ACQUIRE, params)
            row = await cur.fetchone()
        if row is None or row[0] is None:
            return None
        return Fence(key, int(row[0]), self._surely_until(sent))

    async def _release_if_empty(self, lease: Fence) -> bool:
        params = {"key": lease.key, "me": self.replica_id, "epoch": lease.epoch}
        async with self.store.connection() as conn:
            cur = await conn.execute(_RELEASE_IF_EMPTY, params)
            return bool(cur.rowcount == 1)

    async def renew(self) -> None:
        """Renew every lease this replica holds, in one statement; one found gone is
        lost (its fence refuses its turn's writes from now on, without a round trip)."""
        held = [self._leases[key] for key in sorted(self._leases)]
        if not held:
            return
        params = {
            "keys": [lease.key for lease in held],
            "epochs": [lease.epoch for lease in held],
            "me": self.replica_id,
            "ttl": self.lease_ttl,
        }
        async with self.store.connection() as conn:
            sent = time.monotonic()
            cur = await conn.execute(_RENEW, params)
            kept = {str(k) for (k,) in await cur.fetchall()}
        for lease in held:
            if lease.key in kept:
                lease.deadline = max(lease.deadline, self._surely_until(sent))
            else:
                self._lose(lease)

    def _lose(self, lease: Fence) -> None:
        """`lease` went to another replica (this one could not renew it in time)."""
        lease.lost = True
        key = lease.key
        if self._leases.get(key) is lease and key not in self._lost:
            logger.error("replicas: lost the lease of {} to another replica mid-turn", key)
            self._lost.add(key)
            wake = self._pumps.get(key)
            if wake is not None:
                wake.set()  # the pump stops feeding at once

    async def confirm(self, lease: Fence) -> bool:
        """Is `lease` still this replica's? From the local clock while it is surely held
        (`Fence.fresh`); past that one round trip, which renews it if so. Asked before a
        reply goes out, so a replica that was paused past its lease sends nothing."""
        if lease.fresh():
            return True
        if lease.lost:
            return False
        params = {
            "keys": [lease.key],
            "epochs": [lease.epoch],
            "me": self.replica_id,
            "ttl": self.lease_ttl,
        }
        async with self.store.connection() as conn:
            sent = time.monotonic()
            cur = await conn.execute(_RENEW, params)
            kept = await cur.fetchone() is not None
        if kept:
            lease.deadline = max(lease.deadline, self._surely_until(sent))
        else:
            self._lose(lease)
        return kept

    async def _renew_forever(self) -> None:
        pause = self.lease_ttl / 3
        while True:
            await anyio.sleep(pause)
            try:
                await self.renew()
                pause = self.lease_ttl / 3
            except Exception as exc:
                # Soon again, not a third of the lease later: two misses would lose it.
                logger.warning("replicas: lease renewal failed ({}); retrying", exc)
                pause = min(0.5, self.lease_ttl / 10)

    async def _owed(self, key: str) -> list[tuple[str, Unanswered]]:
        self.reads += 1
        async with self.store.connection() as conn:
            cur = await conn.execute(_OWED, (key, self.batch))
            rows = await cur.fetchall()
        owed, unreadable = [], []
        for dedupe, raw, reply_id, raw_reply in rows:
            entry = Unanswered.from_stored(raw, reply_id, raw_reply)
            if entry is None:
                unreadable.append(str(dedupe))
            else:
                owed.append((str(dedupe), entry))
        if unreadable:
            # Out of the queue, or the session would wait for it forever; the row and
            # its text stay for `dedupe_ttl` for whoever wants to look.
            async with self.store.connection() as conn:
                await conn.execute(
                    "UPDATE gw_inbound SET state = 'done', expires_at = %s "
                    "WHERE dedupe_key = ANY(%s) AND state = 'journaled'",
                    (time.time() + self.store.ttl, unreadable),
                )
        return owed

    async def _pump(self, key: str, leased: Fence | None = None, read_first: bool = True) -> None:
        try:
            lease = leased or await self._acquire(key)
            if lease is None:
                return  # leased elsewhere: the holder sees our message before letting go
            self._leases[key] = lease
            await self._feed_until_empty(lease, read_first)
        except Exception as exc:
            # The lease runs out; the sweep (here or elsewhere) takes the session up.
            logger.error("replicas: pump of {} failed ({}); the sweep will retry", key, exc)
        finally:
            self._leases.pop(key, None)
            self._lost.discard(key)
            self._fed.pop(key, None)
            self._wanted.discard(key)
            # Not fed: still journaled, for the next pump's read (here or elsewhere).
            self._handoffs.pop(key, None)
            wake = self._pumps.pop(key, None)
            if wake is not None and wake.is_set():
                self.kick(key)  # kicked while letting go: that message is not left behind

    def _rearm(self, key: str) -> anyio.Event:
        """A fresh wake event for the pump of `key` (a kick sets it)."""
        wake = self._pumps[key] = anyio.Event()
        return wake

    async def _feed_until_empty(self, lease: Fence, read_first: bool = True) -> None:
        """Feed the session's journaled messages to the dispatcher, in journal order and
        behind `lease` (its turns' writes carry it), until none is left to run here."""
        key = lease.key
        fed: dict[str, Ticket] = {}
        self._fed[key] = fed
        # Ask the journal (else take what is handed over, and wait for a kick, a
        # finished turn or the linger).
        check = read_first
        # What the first look finds may have been handed over before (by a replica that
        # died, or to this one's pump before): its turns look in the session first, and
        # the session is read afresh. What comes after, under the lease held since, is
        # new to the session, and the session as cached here is current.
        first = True
        failures = 0
        while True:
            if self._stopping or self.dispatcher.draining:
                return  # `stop` withdraws the lease; what was fed finishes in the drain
            if lease.lost or key in self._lost:
                # Lost to another replica: a renewal or one of its turns' writes found
                # the lease at another epoch.
                await self._let_go(lease, fed)
                return
            wake = self._rearm(key)  # before the query: a kick during it is not missed
            if key in self._wanted:
                self._wanted.discard(key)
                check = True
            # Marked answered (committed): no read from now on finds them journaled.
            for done in [d for d, t in fed.items() if t.marked]:
                del fed[done]
            try:
                # Handed over by `journaled_here`: next in journal order when handed.
                for dedupe, entry in self._handoffs.pop(key, ()):
                    if dedupe not in fed:
                        fed[dedupe] = await self.dispatcher.feed(
                            entry, current=not first, fence=lease
                        )
                        self.fed += 1
                        first = False
                if check:
                    # Only a turn that had finished before the query can be stuck: one
                    # finishing during it may have been read just before its mark.
                    settled = {d for d, t in fed.items() if t.finished}
                    owed = await self._owed(key)
                    for dedupe, entry in owed:
                        if dedupe not in fed:
                            fed[dedupe] = await self.dispatcher.feed(
                                entry, current=not first, fence=lease
                            )
                            self.fed += 1
                    first = False
                    journaled = {d for d, _ in owed}
                    for done in [d for d, t in fed.items() if d not in journaled and t.finished]:
                        del fed[done]
                    stuck = [d for d in fed if d in settled]
                    if stuck and all(t.finished for t in fed.values()) and not lease.lost:
                        # Finished here, yet still journaled: its mark failed (a busy or
                        # lost database). Marked again here; the lease is ours meanwhile.
                        with fencing.fenced(lease):
                            await self._mark_finished(stuck, fed)
                        failures += 1
                        await anyio.sleep(min(0.2 * 2**failures, 2.0))
                        continue
                failures = 0
                waiting = [t for t in fed.values() if not t.finished]
                if waiting:
                    # The last fed finishes last (one lane per session); a kick comes
                    # first when another message is journaled meanwhile.
                    await _first_of(waiting[-1].wait_finished, wake.wait, self.lease_ttl / 3)
                    check = False  # unless a kick wants it (above)
                    continue
                # Nothing owed that we know of: linger with the lease, then let go unless
                # something was journaled meanwhile (the release's own check).
                with anyio.move_on_after(self.linger):
                    await wake.wait()
                if wake.is_set():
                    continue  # a kick (its read is wanted) or a message handed over
                if await self._release_if_empty(lease):
                    return
                check = True
            except Exception as exc:
                # A busy or lost database mid-feed. Giving up now would leave what was
                # fed running here while the lease runs out and another replica runs
                # the same messages: keep the lease (renewed) and try again.
                failures += 1
                if failures == 1:
                    logger.warning("replicas: feeding {} failed ({}); retrying", key, exc)
                await anyio.sleep(min(0.2 * 2**failures, 2.0))
                check = True

    async def _let_go(self, lease: Fence, fed: dict[str, Ticket]) -> None:
        """`lease` went to another replica (this one could not renew it in time, paused
        or starved): stop feeding, take back what has not begun (its holder runs it),
        and let the turn in progress end. That turn's next write is refused by its fence
        (`gateway.plumbing.fence`): it stores and sends nothing more; its new holder
        runs the message."""
        key = lease.key
        lease.lost = True
        pending = [t for t in fed.values() if not t.finished]
        taken = self.dispatcher.withdraw(key, pending)
        logger.warning("replicas: {} handed to its new holder ({} messages taken back)", key, taken)
        for ticket in pending:
            if not ticket.finished:
                with anyio.move_on_after(self.lease_ttl * 3):
                    await ticket.wait_finished()

    async def _mark_finished(self, keys: list[str], fed: dict[str, Ticket]) -> None:
        """Mark answered the messages whose turns finished here but whose rows are still
        journaled (the mark failed): with the reply for a waiting `/api/chat` request."""
        for dedupe in keys:
            ticket = fed[dedupe]
            reply = await ticket.reply()  # resolved: the ticket is finished
            if reply is not None and ticket.message.metadata.get(META_REPLY_WANTED):
                await self.publish(dedupe, reply)
            else:
                await self.store.mark_done(dedupe)

    async def stop_elsewhere(self, session_key: str) -> bool:
        """Pass a /stop on to the replica that holds `session_key` (it stops the turn it
        runs, if any): True when another live replica holds the session."""
        async with self.store.connection() as conn:
            cur = await conn.execute(
                _STOP_ELSEWHERE, {"key": session_key, "me": self.replica_id, "stops": STOP_CHANNEL}
            )
            return await cur.fetchone() is not None

    # ------------------------------------------------------------------ API replies

    async def publish(self, dedupe_key: str, reply: OutboundMessage) -> None:
        """A turn for a waiting `/api/chat` request ended here: mark its message answered
        and keep the reply on its journal row, in one statement (so no crash between the
        two can leave an answered message without its reply), and tell the waiter."""
        waiter = self._waiters.get(dedupe_key)
        if waiter is not None and not waiter[1]:
            # The request waits on this replica: answered first (its NOTIFY, heard below,
            # then finds the box full rather than asking the database).
            waiter[1].append(reply)
            waiter[0].set()
        raw = json.dumps(reply.to_dict(), default=str)
        carried = raw if len(raw.encode()) + len(dedupe_key.encode()) <= NOTE_REPLY_MAX else ""
        fence_key, epoch = fencing.params()
        async with self.store.connection() as conn:
            with fencing.refusals():
                await conn.execute(
                    _PUBLISH,
                    {
                        "key": dedupe_key,
                        "reply": raw,
                        "carried": carried,
                        "expires": time.time() + self.store.ttl,
                        "channel": NOTIFY_CHANNEL,
                        "fence_key": fence_key,
                        "epoch": epoch,
                    },
                )

    async def wait_reply(self, dedupe_key: str, *, fresh: bool = False) -> OutboundMessage | None:
        """The reply to a message this replica forwarded, wherever its turn runs. The
        reply stays on the message's row until the row expires, so a client that sends
        the request again (its answer lost with a replica, or its own time-out) gets
        the same reply and the turn does not run twice. `fresh`: the message was just
        forwarded, so the first look at the database waits for a notification."""
        box: list[OutboundMessage | None] = []
        try:
            while not box:
                # Armed before the read: a notification during it is not missed.
                event = anyio.Event()
                self._waiters[dedupe_key] = (event, box)
                if fresh:  # just forwarded: no reply can be there yet, wait for word
                    fresh = False
                    with anyio.move_on_after(REPLY_POLL):
                        await event.wait()
                    if box:
                        break
                try:
                    reply = await self.published(dedupe_key)
                except Exception as exc:  # a busy or lost database: ask again later
                    logger.debug("replicas: reply poll failed ({})", exc)
                    reply = None
                if reply is not None and not box:
                    box.append(reply)
                    break
                with anyio.move_on_after(REPLY_POLL):
                    await event.wait()
            return box[0]
        finally:
            self._waiters.pop(dedupe_key, None)

    async def published(self, dedupe_key: str) -> OutboundMessage | None:
        """The reply kept on an answered message's row, if there is one."""
        async with self.store.connection() as conn:
            cur = await conn.execute(
                "SELECT reply::text FROM gw_inbound WHERE dedupe_key = %s AND state = 'done' "
                "AND reply IS NOT NULL",
                (dedupe_key,),
            )
            row = await cur.fetchone()
        if row is None:
            return None
        return OutboundMessage.from_dict(json.loads(row[0]))

    async def _listen(self) -> None:
        """LISTEN for published replies and kicks; reconnects after a failure."""
        import psycopg
        from psycopg import sql

        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self.store.url, autocommit=True)
                async with conn:
                    cur = await conn.execute("SELECT current_schema()")
                    row = await cur.fetchone()
                    schema = str(row[0]) if row is not None else "public"
                    replies, kicks = f"{NOTIFY_CHANNEL}.{schema}", f"{KICK_CHANNEL}.{schema}"
                    stops = f"{STOP_CHANNEL}.{schema}"
                    for channel in (replies, kicks, stops):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    async for note in conn.notifies():
                        if note.channel == kicks:
                            if note.payload in self._pumps:
                                self.kick(note.payload)  # the pump reads the journal
                            continue
                        if note.channel == stops:
                            if self.on_stop is not None and note.payload in self._leases:
                                self.on_stop(note.payload)
                            continue
                        key, carried = reply_note(note.payload)
                        waiter = self._waiters.get(key)
                        if waiter is not None and not waiter[1]:
                            reply = _carried_reply(carried)
                            if reply is not None:
                                waiter[1].append(reply)
                            waiter[0].set()  # else the waiter reads the reply itself
            except Exception as exc:
                logger.warning("replicas: reply listener failed ({}); reconnecting", exc)
                await anyio.sleep(1.0)


def _carried_reply(carried: str) -> OutboundMessage | None:
    """The reply a notification carried; None (read from its row) when none or unreadable."""
    if not carried:
        return None
    try:
        return OutboundMessage.from_dict(json.loads(carried))
    except (ValueError, TypeError, KeyError) as exc:
        logger.warning("replicas: a reply notification could not be read ({})", exc)
        return None


async def _first_of(
    a: Callable[[], Awaitable[object]], b: Callable[[], Awaitable[object]], within: float
) -> None:
    """Return when `a` or `b` returns, or after `within` seconds."""
    with anyio.move_on_after(within):
        async with anyio.create_task_group() as tg:
            for wait in (a, b):

                async def one(wait: Callable[[], Awaitable[object]] = wait) -> None:
                    await wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(one)
