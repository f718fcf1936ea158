"""Heartbeat jobs in the shared mode run once per due time across replicas (real
PostgreSQL, real clocks): three replicas' heartbeat loops share the job's last run."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import anyio
import pytest

from channels.heartbeat import HeartbeatChannel, HeartbeatJob
from gateway.dispatch.lanes import Ticket
from gateway.journal.pg_store import PostgresDedupeStore
from gateway.messages import InboundMessage, OutboundMessage
from gateway.schedules.pg_store import SharedRunState
from gateway.schedules.schedule import Schedule

pytestmark = pytest.mark.anyio


@pytest.fixture
async def stores(migrated_pg_url: str) -> AsyncIterator[list[PostgresDedupeStore]]:
    made = [PostgresDedupeStore(migrated_pg_url) for _ in range(3)]
    yield made
    for store in made:
        await store.aclose()


async def _no_route(message: OutboundMessage) -> None:
    raise AssertionError("nothing is delivered")


async def test_a_job_due_runs_once_with_three_replicas(
    stores: list[PostgresDedupeStore], tmp_path: Path
) -> None:
    runs: list[tuple[int, str | None, datetime]] = []

    def submitter(replica: int):  # type: ignore[no-untyped-def]
        async def submit(message: InboundMessage) -> Ticket:
            runs.append((replica, message.message_id, datetime.now(UTC)))
            ticket = Ticket(message)
            ticket._resolve(None)
            return ticket

        return submit

    job = HeartbeatJob(name="tick", schedule=Schedule.build(every="1s"), prompt="tick?")
    channels = [
        HeartbeatChannel(
            {"tick": job},
            state_path=tmp_path / f"state{i}.json",
            route=_no_route,
            state=SharedRunState(store),
        )
        for i, store in enumerate(stores)
    ]
    with anyio.move_on_after(4.5):
        async with anyio.create_task_group() as tg:
            for i, channel in enumerate(channels):
                tg.start_soon(channel.run, submitter(i))
    # About one run a second in all, not three: each due time is claimed by one replica.
    assert 3 <= len(runs) <= 5, runs
    ids = [message_id for _, message_id, _ in runs]
    assert len(set(ids)) == len(ids)
    times = sorted(at for _, _, at in runs)
    assert all((b - a).total_seconds() > 0.5 for a, b in itertools.pairwise(times))


async def test_of_replicas_claiming_one_run_exactly_one_wins(
    stores: list[PostgresDedupeStore],
) -> None:
    states = [SharedRunState(store) for store in stores]
    first = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
    results = [await s.claim("daily", None, first) for s in states]
    assert results == [True, False, False]
    assert await states[2].alast_run("daily") == first
    later = datetime(2026, 1, 2, 9, 0, tzinfo=UTC)
    got: list[bool] = []

    async def claim(state: SharedRunState) -> None:
        got.append(await state.claim("daily", first, later))

    async with anyio.create_task_group() as tg:
        for state in states:
            tg.start_soon(claim, state)
    assert sorted(got) == [False, False, True]
