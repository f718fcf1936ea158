"""The inbound journal in PostgreSQL: one dedupe and one journal for every replica.

The same `DedupeStore` protocol and promises as `gateway.journal` (read its docstring), kept
across processes and machines by one table, ``gw_inbound``, whose primary key is the
platform message's dedupe key:
- `seen_or_add` is an ``INSERT ... ON CONFLICT``: of any number of replicas claiming one
  key at once, exactly one gets False. A claim held by a replica that stopped beating
  (``gw_replicas``), or an answered key past its ``ttl``, is taken over in that statement.
  A claim another live replica holds but has not journaled yet (a few milliseconds) is
  waited for: a redelivery must not be called a duplicate of a message that might still
  fail to be journaled, because the platform would then be told we have it.
- `journal`, `record_reply` and `mark_done` return after PostgreSQL committed them.
- `unanswered` returns the journaled messages owned by this replica or by replicas that
  stopped beating, and makes them this replica's, so a dead replica's work is replayed
  exactly once by whichever replica asks first (row locks decide).

Each replica beats (`beat`, every `BEAT_INTERVAL` seconds while the daemon runs) so the
others know it is alive; `aclose` after a drain withdraws its row and its unjournaled
claims, so its leftovers are taken over at once instead of after `replica_ttl`.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from loguru import logger

from gateway.journal.protocol import DEFAULT_TTL, ClaimBusy, LeaseAsk, Unanswered
from gateway.messages import InboundMessage, OutboundMessage
from gateway.plumbing import fence

if TYPE_CHECKING:
    from psycopg import AsyncConnection
    from psycopg_pool import AsyncConnectionPool

BEAT_INTERVAL = 5.0
#: A replica silent for this long is taken for dead: its claims and journal go to others.
REPLICA_TTL = 15.0
#: Seconds a released or expired lease's row is kept: a write of a turn that started
#: under it is refused by its epoch until then, and by the missing row after.
LEASE_KEPT = 86400.0
#: How long `aclose` waits for the pool's workers to finish what they run (see there).
POOL_CLOSE_WAIT = 30.0


def new_replica_id() -> str:
    """An id unique to this process: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# A claim (state 'claimed', no message yet) or, for `take_in`, a claim and its journal at
# once (state 'journaled', with the message). A row is taken when it is new, answered
# and expired, or claimed and never journaled by a replica that expired or stopped beating.
_CLAIM = """
INSERT INTO gw_inbound AS row
    (dedupe_key, state, claimed_by, claimed_at, session_key, received_at, message)
VALUES (%(key)s, %(state)s, %(me)s, %(now)s, %(session)s, %(received)s, %(message)s::json)
ON CONFLICT (dedupe_key) DO UPDATE
    SET state = EXCLUDED.state, claimed_by = EXCLUDED.claimed_by,
        claimed_at = EXCLUDED.claimed_at, session_key = EXCLUDED.session_key,
        received_at = EXCLUDED.received_at, message = EXCLUDED.message, reply = NULL,
        reply_id = NULL, expires_at = NULL
    WHERE (row.state = 'done' AND row.expires_at <= %(now)s)
       OR (row.state = 'claimed' AND row.claimed_at <= %(expired)s)
       OR (row.state = 'claimed' AND row.claimed_by <> %(me)s AND NOT EXISTS (
            SELECT 1 FROM gw_replicas r
            WHERE r.replica_id = row.claimed_by AND r.seen_at > %(live_since)s))
RETURNING dedupe_key
"""

# The session's other journaled messages as the claim found them (the statement's own
# snapshot: without the message it journals), at most `look` of them.
_OTHERS = """ARRAY(SELECT i.dedupe_key FROM gw_inbound i
    WHERE i.session_key = c.session_key AND i.state = 'journaled' LIMIT %(look)s)"""

# `take_in` with a `LeaseAsk`: the claim and journal of `_CLAIM`, and in the same round
# trip the session's lease taken for this replica (as `gateway.dispatch.router` takes it), or,
# when another live replica holds it, that replica kicked (NOTIFY) to run the message;
# and the look at the session's other journaled messages.
#: A session's lease taken for replica ``%(me)s`` for ``%(ttl)s`` seconds when it is free
#: (no row, or expired: a released lease keeps its row, expired) or this replica's
#: already, rows from `source`. Its epoch (the fencing token, `gateway.plumbing.fence`)
#: is new when the owner changes and stays when the same replica takes it back, so that
#: replica's writes under it stay valid while nobody else held the session in between.
LEASE_TAKE = """INSERT INTO gw_session_leases AS l (session_key, owner, expires_at)
    {source}
    ON CONFLICT (session_key) DO UPDATE
        SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at,
            epoch = CASE WHEN l.owner = EXCLUDED.owner THEN l.epoch ELSE EXCLUDED.epoch END
    WHERE l.owner = EXCLUDED.owner OR l.expires_at < extract(epoch FROM clock_timestamp())
    RETURNING owner, epoch"""

_CLAIM_AND_LEASE = (
    "WITH claimed AS ("
    + _CLAIM.strip().removesuffix("RETURNING dedupe_key")
    + "RETURNING dedupe_key, session_key),\nleased AS (\n    "
    + LEASE_TAKE.format(
        source="SELECT session_key, %(me)s, extract(epoch FROM clock_timestamp()) + %(ttl)s "
        "FROM claimed"
    )
    + """)
SELECT c.dedupe_key, EXISTS (SELECT FROM leased),
    (SELECT pg_notify(%(kicks)s || '.' || current_schema(), c.session_key)
     WHERE NOT EXISTS (SELECT FROM leased)),
    """
    + _OTHERS
    + ",\n    (SELECT epoch FROM leased)\nFROM claimed c\n"
)

# `take_in` with a `LeaseAsk` whose session this replica's pump runs (`take` False):
# the claim and journal, and the look at the session's other journaled messages.
_CLAIM_AND_LOOK = (
    "WITH claimed AS ("
    + _CLAIM.strip().removesuffix("RETURNING dedupe_key")
    + "RETURNING dedupe_key, session_key)\nSELECT c.dedupe_key, NULL, NULL, "
    + _OTHERS
    + ", NULL\nFROM claimed c\n"
)

_TAKE_OVER = """
UPDATE gw_inbound AS row SET claimed_by = %(me)s
WHERE row.state = 'journaled' AND (row.claimed_by = %(me)s OR NOT EXISTS (
    SELECT 1 FROM gw_replicas r
    WHERE r.replica_id = row.claimed_by AND r.seen_at > %(live_since)s))
RETURNING received_at, seq, message::text, reply_id, reply::text
"""


class PostgresDedupeStore:
    """Dedupe, journal and outbox in PostgreSQL, shared by replicas (see the module)."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 4,
        replica_id: str | None = None,
        ttl: float = DEFAULT_TTL,
        replica_ttl: float = REPLICA_TTL,
        claim_wait: float = 2.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from gateway.plumbing.postgres import async_pool

        self.url = url
        self._pool: AsyncConnectionPool = async_pool(url, max_size=pool_size)
        self._opened = False
        self._opening: anyio.Lock | None = None
        self._beating: anyio.Lock | None = None
        self.replica_id = replica_id or new_replica_id()
        self.ttl = ttl
        self.replica_ttl = replica_ttl
        self.claim_wait = claim_wait
        self._clock = clock
        self._beaten = False

    def _params(self, **extra: Any) -> dict[str, Any]:
        now = self._clock()
        return {
            "me": self.replica_id,
            "now": now,
            "live_since": now - self.replica_ttl,
            "expired": now - self.ttl,
            **extra,
        }

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        """A connection of this store's pool (opened on first use), for the code that
        shares its tables: the replicas' leases and the heartbeat runs."""
        if not self._opened:
            if self._opening is None:
                self._opening = anyio.Lock()
            async with self._opening:  # the first caller opens, the others wait
                if not self._opened:
                    await self._pool.open(wait=True, timeout=10.0)
                    self._opened = True
        async with self._pool.connection() as conn:
            yield conn

    async def beat(self) -> None:
        """Tell the other replicas this one is alive (and drop long-gone replicas' rows
        and expired answered keys)."""
        now = self._clock()
        async with self.connection() as conn:
            await conn.execute(
                "INSERT INTO gw_replicas (replica_id, started_at, seen_at) VALUES (%s, %s, %s) "
                "ON CONFLICT (replica_id) DO UPDATE SET seen_at = EXCLUDED.seen_at",
                (self.replica_id, now, now),
            )
            await conn.execute(
                "DELETE FROM gw_replicas WHERE seen_at < %s AND replica_id NOT IN "
                "(SELECT claimed_by FROM gw_inbound WHERE state <> 'done')",
                (now - 86400,),
            )
            await conn.execute(
                "DELETE FROM gw_inbound WHERE state = 'done' AND expires_at <= %s", (now,)
            )
            # Released and expired leases keep their rows (their epochs fence late
            # writes); a day later nothing can still write under them.
            await conn.execute(
                "DELETE FROM gw_session_leases WHERE expires_at < %s", (now - LEASE_KEPT,)
            )
        self._beaten = True

    async def run_beats(self, interval: float = BEAT_INTERVAL) -> None:
        """Beat forever (a daemon task); a failed beat is logged and retried."""
        while True:
            try:
                await self.beat()
            except Exception as exc:
                logger.warning("storage: replica heartbeat failed ({}); retrying", exc)
            await anyio.sleep(interval)

    # -- the DedupeStore protocol ---------------------------------------------------

    async def _first_beat(self) -> None:
        """Our claims and takeovers must count as a live replica's: beat before them."""
        if self._beaten:
            return
        if self._beating is None:
            self._beating = anyio.Lock()
        async with self._beating:
            if not self._beaten:
                await self.beat()

    async def seen_or_add(self, key: str) -> bool:
        return await self._claim(key, "claimed", None, None, None)

    async def take_in(self, key: str, msg: InboundMessage, lease: LeaseAsk | None = None) -> bool:
        """`seen_or_add` and `journal` in one round trip, for a message already allowed
        in: True for a duplicate (nothing written), False once `msg` is journaled.
        With `lease`, the session's lease is asked for in the same round trip (see
        `LeaseAsk`). Raises `ClaimBusy` as `seen_or_add` does."""
        raw = json.dumps(msg.to_dict(), default=str)
        duplicate = await self._claim(
            key, "journaled", msg.session_key, msg.received_at, raw, lease
        )
        if lease is not None and lease.others is not None:
            lease.entry = Unanswered.from_stored(raw, None, None)
        return duplicate

    async def _claim(
        self,
        key: str,
        state: str,
        session: str | None,
        received: float | None,
        message: str | None,
        lease: LeaseAsk | None = None,
    ) -> bool:
        """Take the row of `key` in `state` (_CLAIM, or _CLAIM_AND_LEASE with `lease`):
        False when taken, True for a duplicate; waits up to `claim_wait` for another
        live replica's claim that is not journaled yet, then raises `ClaimBusy`."""
        await self._first_beat()
        deadline = time.monotonic() + self.claim_wait  # real time, whatever `clock` says
        extra: dict[str, Any] = {
            "state": state,
            "session": session,
            "received": received,
            "message": message,
        }
        sql = _CLAIM
        if lease is not None:
            sql = _CLAIM_AND_LEASE if lease.take else _CLAIM_AND_LOOK
            extra |= {"ttl": lease.ttl, "kicks": lease.kicks, "look": lease.look + 1}
        while True:
            async with self.connection() as conn:
                if lease is not None:
                    lease.sent = time.monotonic()
                cur = await conn.execute(sql, self._params(key=key, **extra))
                taken = await cur.fetchone()
                if taken is not None:
                    if lease is not None:
                        lease.taken = bool(taken[1]) if lease.take else None
                        others = [str(k) for k in taken[3]]
                        lease.others = others if len(others) <= lease.look else None
                        lease.epoch = None if taken[4] is None else int(taken[4])
                    return False
                cur = await conn.execute(
                    "SELECT state, claimed_by FROM gw_inbound WHERE dedupe_key = %s", (key,)
                )
                row = await cur.fetchone()
            if row is None:
                continue  # released meanwhile: claim it
            state, owner = row
            if state != "claimed" or owner == self.replica_id:
                return True  # journaled, answered, or in flight here
            if time.monotonic() >= deadline:
                raise ClaimBusy(f"message {key!r} is claimed by replica {owner} (not journaled)")
            await anyio.sleep(0.05)

    async def release(self, key: str) -> None:
        async with self.connection() as conn:
            await conn.execute(
                "DELETE FROM gw_inbound WHERE dedupe_key = %s AND state = 'claimed' "
                "AND claimed_by = %s",
                (key, self.replica_id),
            )

    async def journal(self, key: str, msg: InboundMessage) -> None:
        raw = json.dumps(msg.to_dict(), default=str)
        async with self.connection() as conn:
            cur = await conn.execute(
                "UPDATE gw_inbound SET state = 'journaled', session_key = %s, received_at = %s, "
                "message = %s::json WHERE dedupe_key = %s AND claimed_by = %s "
                "AND state = 'claimed'",
                (msg.session_key, msg.received_at, raw, key, self.replica_id),
            )
            if cur.rowcount != 1:
                raise ClaimBusy(f"message {key!r}: this replica's claim was taken over")

    async def record_reply(self, keys: Sequence[str], reply: OutboundMessage) -> None:
        """The outbox, behind the current turn's fence (`gateway.plumbing.fence`): raises
        `FencedOut` when the session's lease moved on, and nothing is recorded."""
        if not keys:
            return
        raw = json.dumps(reply.to_dict(), default=str)
        fence_key, epoch = fence.params()
        async with self.connection() as conn:
            with fence.refusals():
                await conn.execute(
                    "UPDATE gw_inbound SET reply = %s::json, reply_id = %s "
                    "WHERE dedupe_key = ANY(%s) AND state = 'journaled' AND gw_fence(%s, %s)",
                    (raw, uuid.uuid4().hex, list(keys), fence_key, epoch),
                )

    async def mark_done(self, key: str) -> None:
        """Answered, behind the current turn's fence (`FencedOut` when it moved on)."""
        fence_key, epoch = fence.params()
        async with self.connection() as conn:
            with fence.refusals():
                await conn.execute(
                    "UPDATE gw_inbound SET state = 'done', expires_at = %s, session_key = NULL, "
                    "received_at = NULL, message = NULL, reply = NULL, reply_id = NULL "
                    "WHERE dedupe_key = %s AND gw_fence(%s, %s)",
                    (self._clock() + self.ttl, key, fence_key, epoch),
                )

    async def unanswered(self) -> list[Unanswered]:
        await self._first_beat()
        async with self.connection() as conn:
            cur = await conn.execute(_TAKE_OVER, self._params())
            rows = await cur.fetchall()
        rows.sort(key=lambda r: (r[0] if r[0] is not None else 0.0, r[1]))
        found = [Unanswered.from_stored(raw, r_id, reply) for _, _, raw, r_id, reply in rows]
        return [entry for entry in found if entry is not None]

    async def aclose(self) -> None:
        """Withdraw this replica: its unjournaled claims go (the platforms still hold
        those messages) and its row, so its journal is taken over without waiting."""
        try:
            async with self.connection() as conn:
                await conn.execute(
                    "DELETE FROM gw_inbound WHERE state = 'claimed' AND claimed_by = %s",
                    (self.replica_id,),
                )
                await conn.execute(
                    "DELETE FROM gw_replicas WHERE replica_id = %s", (self.replica_id,)
                )
        except Exception as exc:
            logger.warning("storage: could not withdraw replica {}: {}", self.replica_id, exc)
        finally:
            # psycopg_pool's async workers swallow a cancellation that comes while they run
            # a maintenance task (CancelledError is among its CLIENT_EXCEPTIONS): one left
            # running past `close`'s wait (5 s by default) would keep its event loop from
            # ever closing, as a CI run once hung after a test of two replicas. Wait for
            # the workers to finish their task and stop; it takes milliseconds normally.
            await self._pool.close(timeout=POOL_CLOSE_WAIT)
