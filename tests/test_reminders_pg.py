"""The job stores of reminders (the file and real PostgreSQL) keep the same rules, and in
the shared mode a due job fires once among replicas: two runners, each with its own
dispatcher and journal connection, over one PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.schedules import ScheduleRunner
from gateway.agent.schedule_tools import Reminders, ScheduleLimits
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.dispatch.dispatcher import Dispatcher
from gateway.journal.pg_store import PostgresDedupeStore
from gateway.messages import META_NOTICE, InboundMessage, OutboundMessage, reply_for
from gateway.schedules.pg_store import PostgresJobStore
from gateway.schedules.protocol import JobStore
from gateway.schedules.store import JOBS_FILE, FileJobStore
from tests.fakes.openai_server import FakeOpenAI
from tests.test_reminders import KEY, context, due_on_one_day, job

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["file", "postgres"])
def job_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], JobStore]]:
    """Opens stores on one place, as several processes (or replicas) would."""
    if request.param == "file":
        yield lambda: FileJobStore(tmp_path / JOBS_FILE)
        return
    pools = request.getfixturevalue("pg_pools")
    yield lambda: PostgresJobStore(pools())


def test_stores_keep_the_limit_the_owner_and_the_compare_and_set(
    job_store: Callable[[], JobStore],
) -> None:
    one, other = job_store(), job_store()
    due = datetime(2030, 1, 1, 9, 0, tzinfo=UTC)
    first, second = job(next_run=due), job(next_run=due + timedelta(hours=1))
    assert one.add(first, limit=2) and other.add(second, limit=2)
    assert not one.add(job(next_run=due + timedelta(hours=2)), limit=2)  # the owner's limit
    assert other.add(job("cli:else", next_run=due + timedelta(hours=2)), limit=2)
    assert [j.id for j in other.jobs("telegram:4242")] == [first.id, second.id]
    assert one.jobs() == other.jobs() and len(one.jobs()) == 3
    assert one.remove(first.id, owner="cli:else") is None  # not that owner's
    # A compare-and-set on the due time: only the first of two advances wins.
    later = due + timedelta(days=1)
    assert one.advance(first.id, due, later)
    assert not other.advance(first.id, due, later + timedelta(days=1))
    [moved] = [j for j in other.jobs() if j.id == first.id]
    assert moved.next_run == later and moved.runs == 1 and moved.text == first.text
    assert other.advance(first.id, later, None)  # a one-off is done: removed
    assert first.id not in [j.id for j in one.jobs()]
    removed = other.remove(second.id, owner="telegram:4242")
    assert removed == second and len(one.jobs()) == 1


@pytest.mark.parametrize(
    ("cron", "error"),
    [
        ("* * * * *", "runs as often as every 1 minute; a repeating job may run at most every "),
        ("*/5 * * * *", "runs as often as every 5 minutes"),
        ("0,1 * * * *", "runs as often as every 1 minute"),
        ("* 3 * * *", "runs as often as every 1 minute"),
        ("0,59 0,23 1,31 1,12 *", "runs as often as every 1 minute"),  # at New Year only
        ("*/15 * * * *", "runs 96 times a day; the jobs of a conversation may run 48 times"),
        ("*/15 8-19 * * *", None),
        ("0 9 * * mon-fri", None),
    ],
)
async def test_a_repeating_job_too_close_or_too_often_is_refused_with_a_reason(
    job_store: Callable[[], JobStore], cron: str, error: str | None
) -> None:
    store = job_store()
    reminders = Reminders(store, ScheduleLimits())
    [schedule] = [t.handler for t in reminders.tools() if t.spec.name == "schedule"]
    said = await schedule({"text": "check the oven", "cron": cron}, context())
    if error is None:
        assert said.startswith("scheduled ") and [j.cron for j in store.jobs()] == [cron]
    else:
        assert said.startswith(f"error: cron '{cron}' {error}") and store.jobs() == []
        assert said.endswith(("for a single reminder", "(fewer hours, or a longer step)"))


def _runner_turns() -> tuple[list[InboundMessage], Any]:
    """The turns a dispatcher hands its handler, and that handler."""
    turns: list[InboundMessage] = []

    async def handler(message: InboundMessage) -> OutboundMessage:
        turns.append(message)
        return reply_for(message, "ok")

    return turns, handler


async def _deliver(message: OutboundMessage) -> None:
    pass


async def test_runs_past_the_daily_budget_are_skipped_and_the_person_told_once(
    job_store: Callable[[], JobStore],
) -> None:
    now = datetime.now(UTC)
    mine = [job(next_run=when) for when in due_on_one_day(now, "UTC", 4)]
    other = job("cli:else", next_run=mine[0].next_run - timedelta(seconds=1))  # its own id
    store = job_store()
    for one in [*mine, other]:
        store.add(one, limit=10)
    limits = ScheduleLimits(max_runs_per_day=2)
    turns, handler = _runner_turns()
    runner = ScheduleRunner(Reminders(job_store(), limits))
    async with anyio.create_task_group() as tg:
        dispatcher = Dispatcher(handler, _deliver)
        await tg.start(dispatcher.run)
        tg.start_soon(runner.run, dispatcher.submit)
        with anyio.fail_after(30):
            while store.jobs() or len(turns) < 4:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert store.jobs() == []  # a skipped one-off is done with, like a fired one
    runs = [t for t in turns if t.session_key == KEY and META_NOTICE not in t.metadata]
    notes = [t.metadata[META_NOTICE] for t in turns if META_NOTICE in t.metadata]
    assert [t.metadata["schedule"] for t in runs] == [j.id for j in mine[:2]]
    assert notes == [
        f"I skipped the scheduled job {mine[2].id} (water the plants): the scheduled jobs of "
        "this conversation have run 2 times today, the most a day allows here. The rest of "
        "today's runs are skipped too; they go on tomorrow (UTC time)."
    ]
    assert [t.session_key for t in turns].count("cli:else") == 1  # another conversation's
    assert (runner.fired, runner.skipped) == (3, 2)


async def test_the_daily_budget_counts_a_run_once_among_replicas(
    pg_pools: Callable[[], Any], replicas: list[PostgresDedupeStore]
) -> None:
    jobs = [job(next_run=when) for when in due_on_one_day(datetime.now(UTC), "UTC", 3)]
    for one in jobs:
        PostgresJobStore(pg_pools()).add(one, limit=5)
    limits = ScheduleLimits(max_runs_per_day=2)
    turns, handler = _runner_turns()
    async with anyio.create_task_group() as tg:
        for journal in replicas:
            dispatcher = Dispatcher(handler, _deliver, dedupe=journal)
            await tg.start(dispatcher.run)
            runner = ScheduleRunner(Reminders(PostgresJobStore(pg_pools()), limits))
            tg.start_soon(runner.run, dispatcher.submit)
        with anyio.fail_after(30):
            while PostgresJobStore(pg_pools()).jobs():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        await anyio.sleep(0.5)  # a replica that lost a race has nothing more to submit
        tg.cancel_scope.cancel()
    ran = sorted(str(t.metadata["schedule"]) for t in turns if META_NOTICE not in t.metadata)
    assert ran == sorted(j.id for j in jobs[:2])
    assert [t.metadata["schedule"] for t in turns if META_NOTICE in t.metadata] == [jobs[2].id]


@pytest.fixture
async def replicas(migrated_pg_url: str) -> AsyncIterator[list[PostgresDedupeStore]]:
    stores = [PostgresDedupeStore(migrated_pg_url) for _ in range(2)]
    yield stores
    for store in stores:
        await store.aclose()


async def test_a_due_job_fires_once_among_replicas(
    pg_pools: Callable[[], Any], replicas: list[PostgresDedupeStore]
) -> None:
    now = datetime.now(UTC)
    every_minute = job(next_run=now - timedelta(seconds=5), cron="* * * * *")
    once = job("cli:else", next_run=now - timedelta(seconds=1))
    PostgresJobStore(pg_pools()).add(every_minute, limit=5)
    PostgresJobStore(pg_pools()).add(once, limit=5)
    turns: list[str] = []

    async def handler(message: InboundMessage) -> OutboundMessage:
        turns.append(message.text)
        return reply_for(message, "ok")

    async def deliver(message: OutboundMessage) -> None:
        pass

    async with anyio.create_task_group() as tg:
        runners = []
        for journal in replicas:
            dispatcher = Dispatcher(handler, deliver, dedupe=journal)
            await tg.start(dispatcher.run)
            runner = ScheduleRunner(Reminders(PostgresJobStore(pg_pools()), ScheduleLimits()))
            runners.append(runner)
            tg.start_soon(runner.run, dispatcher.submit)
        with anyio.fail_after(30):
            while len(turns) < 2 or PostgresJobStore(pg_pools()).jobs()[0].runs < 1:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert sorted(turns) == sorted(
        f"[{kind} {j.id}, set {j.local(j.created_at)}] water the plants"
        for kind, j in (("scheduled task (* * * * *)", every_minute), ("reminder", once))
    )
    [left] = PostgresJobStore(pg_pools()).jobs()
    assert left.id == every_minute.id and left.runs == 1 and left.next_run > now


async def test_in_the_shared_mode_a_job_set_on_one_replica_is_seen_on_another(
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
    migrated_pg_url: str,
    pg_pools: Callable[[], Any],
    tmp_path: Path,
) -> None:
    fake_openai.add_tool_call("schedule", {"text": "call Ann", "cron": "0 9 * * *"})
    fake_openai.add_reply("Scheduled.")
    fake_openai.add_tool_call("list_schedules", {})
    fake_openai.add_reply("Here they are.")
    shared = {"storage__url": migrated_pg_url, "schedules__enabled": True}
    one = Gateway.build(make_settings(fake_openai, **shared, workspace=str(tmp_path / "a")))
    two = Gateway.build(make_settings(fake_openai, **shared, workspace=str(tmp_path / "b")))
    message = InboundMessage(channel="telegram", chat_id="77", text="daily at 9: call Ann")
    try:
        await one.agent.handle(message)
        await two.agent.handle(InboundMessage(channel="telegram", chat_id="77", text="list"))
    finally:
        await one.aclose()
        await two.aclose()
    listed = fake_openai.chat_requests[-1].messages[-1]
    assert listed["role"] == "tool" and "cron '0 9 * * *'" in listed["content"]
    assert listed["content"].endswith(": call Ann")
    [stored] = PostgresJobStore(pg_pools()).jobs()
    assert stored.owner == "telegram:77" and not (tmp_path / "a" / JOBS_FILE).exists()
