"""Reminders and scheduled tasks in PostgreSQL (`gw_schedules`), shared by every replica.

The same rules as the jobs file (`gateway.schedules.protocol.JobStore`): a conversation holds at
most `limit` jobs (adds for one owner are serialized by a transaction-level advisory
lock, so the count holds across replicas), and `advance` is a compare-and-set on the
job's due time. Each replica's runner sees a due job; all submit its run under the same
message id, the shared journal admits one, and one `advance` wins: the run fires once.
The daily run budget is counted in `gw_schedule_runs`, one row per run by its fire id,
under the same lock: every replica asking for one run gets the same grant.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import psycopg

    from gateway.journal.pg_store import PostgresDedupeStore

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import date, timedelta
from typing import TYPE_CHECKING

from gateway.plumbing import fence
from gateway.plumbing.postgres import StorageUnavailable
from gateway.schedules.protocol import RunGrant, ScheduledJob, grant_run

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

_OWNER_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtext(current_schema() || ':schedules'), hashtext(%s))"
)


def _job(raw: Any) -> ScheduledJob:
    return ScheduledJob.from_dict(raw if isinstance(raw, dict) else json.loads(raw))


class PostgresJobStore:
    """Jobs in `gw_schedules` (`JobStore`)."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool

    @contextmanager
    def _transaction(self) -> Iterator[psycopg.Connection[Any]]:
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            # Inside a turn (a tool adds or cancels a job) behind its fence: refused
            # once another replica holds the conversation (`gateway.plumbing.fence`).
            with self._pool.connection() as conn, fence.refusals(), conn.transaction():
                fence.check(conn)
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise StorageUnavailable(f"PostgreSQL does not answer ({exc})") from None

    def add(self, job: ScheduledJob, *, limit: int) -> bool:
        with self._transaction() as conn:
            conn.execute(_OWNER_LOCK, (job.owner,))
            row = conn.execute(
                "SELECT count(*) FROM gw_schedules WHERE owner = %s", (job.owner,)
            ).fetchone()
            if row is not None and int(row[0]) >= limit:
                return False
            conn.execute(
                "INSERT INTO gw_schedules (id, owner, next_run, job) VALUES (%s, %s, %s, %s)",
                (job.id, job.owner, job.next_run, json.dumps(job.to_dict())),
            )
        return True

    def jobs(self, owner: str | None = None) -> list[ScheduledJob]:
        with self._transaction() as conn:
            if owner is None:
                rows = conn.execute("SELECT job FROM gw_schedules").fetchall()
            else:
                rows = conn.execute(
                    "SELECT job FROM gw_schedules WHERE owner = %s", (owner,)
                ).fetchall()
        return sorted((_job(r[0]) for r in rows), key=lambda j: (j.next_run, j.id))

    def remove(self, job_id: str, *, owner: str | None = None) -> ScheduledJob | None:
        with self._transaction() as conn:
            row = conn.execute(
                "DELETE FROM gw_schedules WHERE id = %s AND (%s::text IS NULL OR owner = %s) "
                "RETURNING job",
                (job_id, owner, owner),
            ).fetchone()
        return None if row is None else _job(row[0])

    def advance(self, job_id: str, expected: datetime, new_next: datetime | None) -> bool:
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT job FROM gw_schedules WHERE id = %s AND next_run = %s FOR UPDATE",
                (job_id, expected),
            ).fetchone()
            if row is None:
                return False
            if new_next is None:
                conn.execute("DELETE FROM gw_schedules WHERE id = %s", (job_id,))
                return True
            job = _job(row[0])
            moved = replace(job, next_run=new_next, runs=job.runs + 1)
            conn.execute(
                "UPDATE gw_schedules SET next_run = %s, job = %s WHERE id = %s",
                (new_next, json.dumps(moved.to_dict()), job_id),
            )
        return True

    def take_run(self, owner: str, day: date, fire_id: str, budget: int) -> RunGrant:
        with self._transaction() as conn:
            conn.execute(_OWNER_LOCK, (owner,))
            rows = conn.execute(
                "SELECT fire_id, noted FROM gw_schedule_runs WHERE owner = %s AND day = %s",
                (owner, day),
            ).fetchall()
            counted = [str(r[0]) for r in rows if not r[1]]
            noted = next((str(r[0]) for r in rows if r[1]), None)
            grant = grant_run(counted, noted, fire_id, budget)
            if grant != "skip":
                conn.execute(
                    "INSERT INTO gw_schedule_runs (owner, day, fire_id, noted) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (owner, day, fire_id, grant == "note"),
                )
            # Two days are kept, as in the jobs file.
            conn.execute(
                "DELETE FROM gw_schedule_runs WHERE owner = %s AND day < %s",
                (owner, day - timedelta(days=1)),
            )
        return grant


class SharedRunState:
    """Heartbeat jobs' last runs in PostgreSQL (``gw_heartbeat_runs``), so that of all the
    replicas due at once exactly one runs each job (`claim` is a compare-and-set)."""

    def __init__(self, store: PostgresDedupeStore) -> None:
        self.store = store

    async def alast_run(self, job: str) -> datetime | None:
        async with self.store.connection() as conn:
            cur = await conn.execute(
                "SELECT last_run FROM gw_heartbeat_runs WHERE job = %s", (job,)
            )
            row = await cur.fetchone()
        return None if row is None else row[0]  # type: ignore[no-any-return]

    async def claim(self, job: str, expected: datetime | None, when: datetime) -> bool:
        async with self.store.connection() as conn:
            if expected is None:
                cur = await conn.execute(
                    "INSERT INTO gw_heartbeat_runs (job, last_run) VALUES (%s, %s) "
                    "ON CONFLICT (job) DO NOTHING RETURNING job",
                    (job, when),
                )
            else:
                cur = await conn.execute(
                    "UPDATE gw_heartbeat_runs SET last_run = %s WHERE job = %s "
                    "AND last_run = %s RETURNING job",
                    (when, job, expected),
                )
            return await cur.fetchone() is not None
