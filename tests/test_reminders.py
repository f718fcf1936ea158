"""Reminders and scheduled tasks set from chat: the tools against the real job file, and
the whole daemon with Telegram (python-telegram-bot against the fake Bot API, the openai
client against the fake OpenAI server), across restarts."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import pytest

from channels.schedules import ScheduleRunner
from gateway.agent.schedule_tools import Reminders, ScheduleLimits
from gateway.agent.tools import ToolContext
from gateway.config import Settings
from gateway.messages import InboundMessage
from gateway.schedules.protocol import ScheduledJob
from gateway.schedules.store import JOBS_FILE, FileJobStore
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply, content_text
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until
from tests.test_cli_e2e import base_env, run_gateway
from tests.test_telegram_e2e import CHAT, gateway, wait_sent

pytestmark = pytest.mark.anyio

KEY = f"telegram:{CHAT}"
SCHEDULES = {"schedules__enabled": True, "schedules__timezone": "Europe/Berlin"}


@pytest.fixture
async def fake_tg() -> Any:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


def store_of(settings: Settings) -> FileJobStore:
    return FileJobStore(settings.workspace_path / JOBS_FILE)


def user_texts(settings: Settings, key: str = KEY) -> list[str]:
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        e["message"]["content"]
        for e in entries
        if e["type"] == "message" and e["message"]["role"] == "user"
    ]


def context(key: str = KEY) -> ToolContext:
    inbound = InboundMessage(channel="telegram", chat_id=str(CHAT), text="x", sender_id="7")
    return ToolContext(session_key=key, sender_id="7", inbound=inbound)


def job(owner: str = KEY, *, next_run: datetime, cron: str | None = None) -> ScheduledJob:
    return ScheduledJob(
        id=f"job{int(next_run.timestamp()) % 1000}",
        owner=owner,
        text="water the plants",
        timezone="UTC",
        next_run=next_run,
        created_at=datetime.now(UTC) - timedelta(days=3),
        address={"channel": "telegram", "chat_id": str(CHAT), "sender_id": str(CHAT)},
        cron=cron,
    )


def due_on_one_day(now: datetime, timezone: str, count: int) -> list[datetime]:
    """`count` due times a minute apart, all past and on one day in `timezone` (the
    daily budget's day), whatever time of day the test runs at."""
    last = now - timedelta(seconds=5)
    first = last - timedelta(minutes=count - 1)
    if first.astimezone(ZoneInfo(timezone)).date() != last.astimezone(ZoneInfo(timezone)).date():
        last = first - timedelta(minutes=1)  # before midnight, all of them
        first = last - timedelta(minutes=count - 1)
    return [first + timedelta(minutes=n) for n in range(count)]


# ---------------------------------------------------------------- the tools


async def test_the_tools_schedule_list_and_cancel_in_the_users_time_zone(tmp_path: Path) -> None:
    now = datetime(2026, 3, 1, 8, 0, tzinfo=UTC)
    store = FileJobStore(tmp_path / JOBS_FILE)
    reminders = Reminders(store, ScheduleLimits(timezone="Europe/Berlin"), clock=lambda: now)
    tools = {t.spec.name: t.handler for t in reminders.tools()}
    once = await tools["schedule"]({"text": "call Ann", "at": "2026-03-01T10:30"}, context())
    assert once.startswith("scheduled ") and "once, next 2026-03-01 10:30 CET: call Ann" in once
    [stored] = store.jobs()
    assert stored.next_run == datetime(2026, 3, 1, 9, 30, tzinfo=UTC)  # 10:30 in Berlin
    assert stored.owner == KEY and stored.address["chat_id"] == str(CHAT)
    cron = await tools["schedule"]({"text": "stand-up", "cron": "0 9 * * mon-fri"}, context())
    assert "cron '0 9 * * mon-fri', next 2026-03-02 09:00 CET" in cron  # Sunday -> Monday
    listed = await tools["list_schedules"]({}, context())
    assert listed.splitlines()[0].endswith("call Ann") and len(listed.splitlines()) == 2
    # Another conversation sees none of them and cannot cancel them.
    assert await tools["list_schedules"]({}, context("telegram:999")) == (
        "no scheduled jobs in this conversation"
    )
    refused = await tools["cancel_schedule"]({"id": stored.id}, context("telegram:999"))
    assert refused.startswith("error: no job") and len(store.jobs()) == 2
    done = await tools["cancel_schedule"]({"id": stored.id}, context())
    assert done.startswith(f"cancelled {stored.id}") and len(store.jobs()) == 1
    # A subagent's session schedules for the conversation it serves.
    sub = await tools["list_schedules"]({}, context(f"{KEY}:sub:abc"))
    assert "stand-up" in sub


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"text": "x"}, "error: give exactly one of 'at'"),
        ({"text": "x", "in": "5m", "cron": "* * * * *"}, "error: give exactly one of 'at'"),
        ({"text": "x", "cron": "61 * * * *"}, "error: cron '61 * * * *'"),
        ({"text": "x", "in": "soon"}, "error: interval 'soon'"),
        ({"text": "x", "at": "tomorrow"}, "error: 'at' 'tomorrow': use a local date"),
        ({"text": "x", "at": "2020-01-01T00:00"}, "error: 'at' '2020-01-01T00:00' is in the past"),
        ({"text": "x", "in": "5m", "timezone": "Mars/Olympus"}, "error: time zone 'Mars/Olympus'"),
        ({"text": " ", "in": "5m"}, "error: schedule needs the 'text'"),
    ],
)
async def test_a_bad_schedule_gets_a_clear_error_and_stores_nothing(
    tmp_path: Path, args: dict[str, Any], error: str
) -> None:
    store = FileJobStore(tmp_path / JOBS_FILE)
    reminders = Reminders(store, ScheduleLimits())
    [schedule] = [t.handler for t in reminders.tools() if t.spec.name == "schedule"]
    assert (await schedule(args, context())).startswith(error)
    assert store.jobs() == []


async def test_a_conversation_holds_at_most_its_limit_of_jobs(tmp_path: Path) -> None:
    store = FileJobStore(tmp_path / JOBS_FILE)
    reminders = Reminders(store, ScheduleLimits(max_per_conversation=2))
    [schedule] = [t.handler for t in reminders.tools() if t.spec.name == "schedule"]
    for _ in range(2):
        assert (await schedule({"text": "x", "in": "1h"}, context())).startswith("scheduled")
    third = await schedule({"text": "x", "in": "1h"}, context())
    assert third.startswith("error: this conversation has 2 scheduled jobs, the most allowed")
    other = await schedule({"text": "x", "in": "1h"}, context("telegram:5"))
    assert other.startswith("scheduled")
    assert len(store.jobs(KEY)) == 2 and len(store.jobs()) == 3


def test_a_damaged_jobs_file_is_moved_aside_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / JOBS_FILE
    path.write_text("{not json")
    store = FileJobStore(path)
    assert store.jobs() == []
    [aside] = tmp_path.glob(f"{JOBS_FILE}.corrupt-*")
    assert aside.read_text() == "{not json"


# ---------------------------------------------------------------- the daemon


async def test_a_reminder_set_in_chat_comes_back_into_that_chat_once(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_tool_call("schedule", {"text": "stretch your legs", "in": "2s"})
    fake_openai.add_reply("I will remind you in two seconds.")
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "remind me in 2s to stretch"))
        sent = await wait_sent(fake_tg, CHAT, 2, seconds=30)
        with anyio.fail_after(20):
            while store_of(gw.settings).jobs():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        status = await gw.daemon.gateway.agent.handle(
            InboundMessage(channel="cli", chat_id="x", text="/status")
        )
        assert "Tools schedules: on (cancel_schedule, list_schedules, schedule)" in status.text
    assert sent[0]["text"] == "I will remind you in two seconds."
    assert sent[1]["text"].startswith("echo: [reminder ")
    assert sent[1]["text"].endswith("] stretch your legs")
    assert len(fake_tg.sent_messages(CHAT)) == 2
    texts = user_texts(gw.settings)
    assert texts[0] == "remind me in 2s to stretch" and texts[1].endswith("stretch your legs")


async def test_a_reminder_due_during_a_restart_fires_exactly_once_after_it(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_tool_call("schedule", {"text": "take the cake out", "in": "3s"})
    fake_openai.add_reply("Noted.")
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "remind me in 3s"))
        await wait_sent(fake_tg, CHAT, 1, seconds=30)
    # Stopped before it was due.
    [pending] = store_of(gw.settings).jobs()
    assert pending.runs == 0 and len(fake_tg.sent_messages(CHAT)) == 1
    with anyio.fail_after(30):
        while datetime.now(UTC) <= pending.next_run:  # noqa: ASYNC110 (the clock passes it)
            await anyio.sleep(0.1)
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        await wait_sent(fake_tg, CHAT, 2, seconds=30)
        with anyio.fail_after(20):
            while store_of(gw.settings).jobs():  # noqa: ASYNC110
                await anyio.sleep(0.05)
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        runner = gw.daemon.channels["schedules"]
        assert isinstance(runner, ScheduleRunner)
        fake_tg.push_update(fake_tg.user_message(CHAT, "anything else?"))
        await wait_sent(fake_tg, CHAT, 3, seconds=30)
        assert runner.fired == 0
    texts = [m["text"] for m in fake_tg.sent_messages(CHAT)]
    assert texts[1].endswith("] take the cake out")
    assert texts[2] == "echo: anything else?"
    assert sum("take the cake out" in t for t in user_texts(gw.settings)) == 1


async def test_a_run_journaled_before_a_crash_is_not_run_again(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    """The crash between queueing a run and advancing its job: the next start submits the
    same run again, the journal knows it, and the job only moves on."""
    settings = make_settings(fake_openai, **SCHEDULES)
    due = job(next_run=datetime.now(UTC) - timedelta(minutes=1))
    store_of(settings).add(due, limit=10)
    reminders = Reminders(store_of(settings), ScheduleLimits())
    async with gateway(make_settings, fake_openai, fake_tg) as gw:  # schedules off
        ticket = await gw.daemon.submit(ScheduleRunner(reminders)._message(due))
        await ticket.reply()
        await wait_sent(fake_tg, CHAT, 1)
    assert store_of(settings).jobs() == [due]  # "crashed" before advancing it
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        with anyio.fail_after(20):
            while store_of(gw.settings).jobs():  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert len(fake_openai.chat_requests) == 1
    assert len(fake_tg.sent_messages(CHAT)) == 1


async def test_a_missed_cron_job_fires_once_and_a_too_old_one_is_skipped(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, **SCHEDULES)
    now = datetime.now(UTC)
    every_minute = job(next_run=now - timedelta(minutes=30), cron="* * * * *")
    ancient = job(next_run=now - timedelta(days=3))
    store = store_of(settings)
    store.add(every_minute, limit=10)
    store.add(ancient, limit=10)
    async with gateway(make_settings, fake_openai, fake_tg, **SCHEDULES) as gw:
        runner = gw.daemon.channels["schedules"]
        assert isinstance(runner, ScheduleRunner)
        await wait_sent(fake_tg, CHAT, 1, seconds=30)
        with anyio.fail_after(20):
            while runner.skipped < 1:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        fired = runner.fired
    [left] = store.jobs()
    assert left.id == every_minute.id and left.runs == 1
    assert left.next_run > now  # moved past the 30 missed minutes, not once per minute
    assert fired == 1 and len(fake_openai.chat_requests) == 1


async def test_runs_past_the_daily_budget_get_one_note_and_no_model_call(
    fake_openai: FakeOpenAI, fake_tg: FakeTelegram, make_settings: Callable[..., Settings]
) -> None:
    budget = {**SCHEDULES, "schedules__max_runs_per_day": 1}
    settings = make_settings(fake_openai, **budget)
    store = store_of(settings)
    jobs = [job(next_run=when) for when in due_on_one_day(datetime.now(UTC), "Europe/Berlin", 3)]
    for one in jobs:
        store.add(one, limit=10)
    async with gateway(make_settings, fake_openai, fake_tg, **budget) as gw:
        runner = gw.daemon.channels["schedules"]
        assert isinstance(runner, ScheduleRunner)
        await wait_sent(fake_tg, CHAT, 2, seconds=30)
        with anyio.fail_after(20):
            while store.jobs() or runner.skipped < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    texts = [m["text"] for m in fake_tg.sent_messages(CHAT)]
    assert texts[0].startswith(f"echo: [reminder {jobs[0].id}, set ")
    assert texts[1] == (
        f"I skipped the scheduled job {jobs[1].id} (water the plants): the scheduled jobs of "
        "this conversation have run 1 time today, the most a day allows here. The rest of "
        "today's runs are skipped too; they go on tomorrow (Europe/Berlin time)."
    )
    assert len(texts) == 2 and len(fake_openai.chat_requests) == 1  # the note cost no call
    assert user_texts(gw.settings)[1].endswith("water the plants")  # stored, with the note


def test_operators_list_and_cancel_jobs(tmp_path: Path) -> None:
    env = base_env(tmp_path)
    store = FileJobStore(tmp_path / "ws" / JOBS_FILE)
    first = job(next_run=datetime(2030, 1, 1, 9, 0, tzinfo=UTC))
    store.add(first, limit=10)
    store.add(job("cli:work", next_run=datetime(2030, 1, 2, 9, 0, tzinfo=UTC)), limit=10)
    listed = run_gateway(["schedules", "list"], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{first.id}: once, next 2030-01-01 09:00 UTC")
    only = run_gateway(["schedules", "list", "--session", "work", "--json"], env, tmp_path)
    assert [j["owner"] for j in json.loads(only.stdout)] == ["cli:work"]
    cancelled = run_gateway(["schedules", "cancel", first.id], env, tmp_path)
    assert cancelled.returncode == 0 and cancelled.stdout.startswith(f"cancelled {first.id}")
    missing = run_gateway(["schedules", "cancel", first.id], env, tmp_path)
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines()[-1].endswith("`gateway schedules list` shows them")
    assert "Traceback" not in missing.stderr
    assert [j.owner for j in store.jobs()] == ["cli:work"]


@pytest.mark.kill
def test_a_reminder_due_while_the_gateway_is_killed_fires_once_after_the_restart(
    tmp_path: Path,
) -> None:
    """`gateway run` as a real process, SIGKILLed before the reminder is due, started
    again after: the reminder comes once, and a later message gets no second one."""

    def script(body: dict[str, Any]) -> Reply | str:
        last = body["messages"][-1]
        text = content_text(last.get("content"))
        if last["role"] == "tool":
            return "Noted."
        if text == "remind me in 8s":
            return Reply(
                tool_calls=(FakeToolCall("schedule", {"text": "feed the cat", "in": "8s"}),)
            )
        return f"echo: {text}"

    workspace = tmp_path / "ws"
    with FakeOpenAI.in_thread(responder=script) as llm, FakeTelegram.in_thread() as tg:
        env = telegram_env(workspace, llm, tg) | {"GATEWAY_SCHEDULES__ENABLED": "true"}
        store = FileJobStore(workspace / JOBS_FILE)
        gw = GatewayProcess(env, tmp_path)
        try:
            gw.wait_for_line("gateway ready: http://", 120)
            tg.push_update(tg.user_message(CHAT, "remind me in 8s"))
            wait_until(lambda: len(tg.sent_messages(CHAT)) >= 1, 60, "the confirmation")
            [pending] = store.jobs()
            gw.kill()
            wait_until(lambda: datetime.now(UTC) > pending.next_run, 30, "the due time")
            gw = GatewayProcess(env, tmp_path)
            gw.wait_for_line("gateway ready: http://", 120)

            def sent() -> list[str]:
                return [m["text"] for m in tg.sent_messages(CHAT)]

            wait_until(lambda: any(t.startswith("echo: [reminder ") for t in sent()), 60, "it")
            wait_until(lambda: not store.jobs(), 30, "the job to be done")
            tg.push_update(tg.user_message(CHAT, "thanks"))
            wait_until(lambda: "echo: thanks" in sent(), 60, "the answer to thanks")
            assert gw.terminate() == 0
        finally:
            gw.stop()
        texts = sent()
    assert texts[0] == "Noted."
    # The delivery promise allows one repeat of the reply the kill may have caught between
    # sending it and recording it sent (docs/delivery.md): the confirmation, here.
    if texts[1] == "Noted.":
        del texts[1]
    assert texts[1].startswith("echo: [reminder ") and texts[1].endswith("] feed the cat")
    assert texts[2] == "echo: thanks"
    assert sum("feed the cat" in t for t in texts) == 1
