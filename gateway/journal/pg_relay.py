"""Work for the replica holding a role, asked for by the others (shared mode).

Some work can be done only where a role is held: a reply to an end-to-end encrypted
Matrix room must be encrypted with the device's keys, which only the replica holding the
"matrix sync" role has loaded (two processes using one device's keys at once would fork
its Olm sessions). Another replica asks that one through PostgreSQL: a row in
``gw_relay`` per request and a NOTIFY to wake the holder; the holder does the work, keeps
the answer on the row and NOTIFYs the asker.

Promises kept here:
- A request is identified by its key: asking again with the same key (a retry, or after
  the asker's deadline passed) never does the work twice once it is done; it returns the
  answer kept on the row. Work that was interrupted (the holder died) is done again by the
  next holder, so the work itself must be idempotent (a Matrix send carries its
  transaction id: the homeserver keeps one event per transaction).
- Nothing waits forever: `call` raises `RelayUnanswered` at its deadline (no holder, or a
  slow one) and the row stays for the next holder; `RelayRefused` when the holder could
  not do it and says why.
- A lost notification costs latency, never an answer: both sides also poll every `poll`
  seconds.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import anyio
from loguru import logger

from gateway.journal.protocol import Handler, RelayRefused, RelayUnanswered

if TYPE_CHECKING:
    from gateway.journal.pg_store import PostgresDedupeStore

#: Notification channels, per schema (NOTIFY is database-wide): `<name>.<schema>`.
ASK_CHANNEL = "gw_relay"
ANSWER_CHANNEL = "gw_relayed"
#: How long an answered request is kept (a late retry with its key gets the answer).
KEEP_SECONDS = 3600.0

_ASK = """
WITH asked AS (
    INSERT INTO gw_relay (role, key, request, state, created_at)
    VALUES (%(role)s, %(key)s, %(request)s::json, 'waiting', %(now)s)
    ON CONFLICT (role, key) DO UPDATE
        SET state = 'waiting', request = EXCLUDED.request, answer = NULL,
            created_at = EXCLUDED.created_at
        WHERE gw_relay.state = 'failed'
    RETURNING key)
SELECT pg_notify(%(channel)s || '.' || current_schema(), %(role)s) FROM asked
"""

_ANSWER = """
WITH answered AS (
    UPDATE gw_relay SET state = %(state)s, answer = %(answer)s::json
    WHERE role = %(role)s AND key = %(key)s AND state = 'waiting'
    RETURNING key)
SELECT pg_notify(%(channel)s || '.' || current_schema(), %(role)s || E'\\n' || key)
FROM answered
"""


class PostgresRelay:
    """Requests to the holder of `role`, through `gw_relay` (see the module docstring).

    Every replica runs `listen` (one LISTEN connection); the holder of the role runs
    `serve` while it holds it; any replica calls `call`.
    """

    def __init__(
        self,
        store: PostgresDedupeStore,
        role: str,
        *,
        poll: float = 1.0,
        retry_after: float = 2.0,
        concurrency: int = 8,
    ) -> None:
        self.store = store
        self.role = role
        self.poll = poll
        self.retry_after = retry_after
        self.concurrency = concurrency
        self._waiters: dict[str, anyio.Event] = {}
        self._asked = anyio.Event()  # a request was NOTIFYed (for `serve`)
        self.listening = anyio.Event()  # set once LISTEN is in place (tests)
        self.served = 0  # requests this replica did as the holder (tests, metrics)

    # ------------------------------------------------------------------ asking

    async def call(self, key: str, request: dict[str, Any], *, deadline: float) -> dict[str, Any]:
        """Ask the holder to do `request`, once per `key`; its answer. `deadline` is a
        `time.monotonic()` instant. Raises RelayRefused or RelayUnanswered."""
        waiter = self._waiters.setdefault(key, anyio.Event())
        try:
            async with self.store.connection() as conn:
                await conn.execute(
                    _ASK,
                    {
                        "role": self.role,
                        "key": key,
                        "request": json.dumps(request),
                        "now": time.time(),
                        "channel": ASK_CHANNEL,
                    },
                )
            while True:
                async with self.store.connection() as conn:
                    cur = await conn.execute(
                        "SELECT state, answer::text FROM gw_relay WHERE role = %s AND key = %s",
                        (self.role, key),
                    )
                    row = await cur.fetchone()
                if row is None:  # swept meanwhile: a long wait; ask again next time
                    raise RelayUnanswered(f"{self.role}: request {key} was dropped")
                state, answer = str(row[0]), json.loads(row[1]) if row[1] else {}
                if state == "done":
                    return dict(answer)
                if state == "failed":
                    raise RelayRefused(str(answer.get("error") or "refused"))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RelayUnanswered(f"no answer from the {self.role} in time")
                with anyio.move_on_after(min(self.poll, left)):
                    await waiter.wait()
                waiter = self._waiters[key] = anyio.Event()
        finally:
            self._waiters.pop(key, None)

    # ------------------------------------------------------------------ listening

    async def listen(self) -> None:
        """LISTEN for requests (wakes `serve`) and answers (wakes `call`) until cancelled;
        reconnects after a failure."""
        import psycopg
        from psycopg import sql

        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self.store.url, autocommit=True)
                async with conn:
                    cur = await conn.execute("SELECT current_schema()")
                    row = await cur.fetchone()
                    schema = str(row[0]) if row is not None else "public"
                    asks, answers = f"{ASK_CHANNEL}.{schema}", f"{ANSWER_CHANNEL}.{schema}"
                    for channel in (asks, answers):
                        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    self.listening.set()
                    async for note in conn.notifies():
                        if note.channel == asks:
                            if note.payload == self.role:
                                self._asked.set()
                            continue
                        role, _, key = note.payload.partition("\n")
                        waiter = self._waiters.get(key) if role == self.role else None
                        if waiter is not None:
                            waiter.set()
            except Exception as exc:
                logger.warning("relay: the {} listener failed ({}); reconnecting", self.role, exc)
                await anyio.sleep(1.0)

    # ------------------------------------------------------------------ serving

    async def serve(self, handle: Handler) -> None:
        """Do the requests asked of the role holder, until cancelled (call it only while
        holding the role). `handle` raises RelayRefused for a request that cannot be
        done; any other failure leaves it asked, tried again after `retry_after`."""
        working: set[str] = set()
        not_before: dict[str, float] = {}
        limit = anyio.Semaphore(self.concurrency)
        swept = 0.0
        async with anyio.create_task_group() as tg:
            while True:
                self._asked = anyio.Event()
                now = time.monotonic()
                try:
                    rows = await self._waiting()
                    if now - swept > 60:
                        await self._sweep()
                        swept = now
                        for key in [k for k, until in not_before.items() if until <= now]:
                            del not_before[key]  # done elsewhere, or swept
                except Exception as exc:  # the database is away: try again shortly
                    logger.warning("relay: cannot read the {} requests ({})", self.role, exc)
                    rows = []
                for key, request in rows:
                    if key in working or not_before.get(key, 0.0) > now:
                        continue
                    working.add(key)
                    tg.start_soon(self._work, key, request, handle, working, not_before, limit)
                with anyio.move_on_after(self.poll):
                    await self._asked.wait()

    async def _waiting(self) -> list[tuple[str, dict[str, Any]]]:
        async with self.store.connection() as conn:
            cur = await conn.execute(
                "SELECT key, request::text FROM gw_relay WHERE role = %s AND state = 'waiting' "
                "ORDER BY created_at LIMIT 100",
                (self.role,),
            )
            return [(str(key), json.loads(request)) for key, request in await cur.fetchall()]

    async def _sweep(self) -> None:
        async with self.store.connection() as conn:
            await conn.execute(
                "DELETE FROM gw_relay WHERE role = %s AND created_at < %s",
                (self.role, time.time() - KEEP_SECONDS),
            )

    async def _work(
        self,
        key: str,
        request: dict[str, Any],
        handle: Handler,
        working: set[str],
        not_before: dict[str, float],
        limit: anyio.Semaphore,
    ) -> None:
        try:
            async with limit:
                try:
                    answer, state = await handle(request), "done"
                except RelayRefused as exc:
                    answer, state = {"error": str(exc)}, "failed"
                async with self.store.connection() as conn:
                    await conn.execute(
                        _ANSWER,
                        {
                            "state": state,
                            "answer": json.dumps(answer),
                            "role": self.role,
                            "key": key,
                            "channel": ANSWER_CHANNEL,
                        },
                    )
                self.served += 1
                not_before.pop(key, None)
        except Exception as exc:
            logger.warning("relay: {} request {} failed ({}); trying again", self.role, key, exc)
            not_before[key] = time.monotonic() + self.retry_after
        finally:
            working.discard(key)
