"""Schedules: intervals, cron, time zones, active hours and the missed-runs-once rule."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import anyio.lowlevel
import pytest
from cronsim import CronSim
from hypothesis import given
from hypothesis import strategies as st

from channels.heartbeat import HeartbeatChannel, HeartbeatJob
from gateway.dispatch.lanes import Ticket
from gateway.messages import InboundMessage, OutboundMessage
from gateway.schedules.schedule import (
    CronRhythm,
    Schedule,
    cron_next,
    cron_rhythm,
    parse_cron,
    parse_interval,
)

T0 = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)  # a Monday


def test_parse_interval() -> None:
    assert parse_interval("30m") == timedelta(minutes=30)
    assert parse_interval("1h30m") == timedelta(minutes=90)
    assert parse_interval(" 2d ") == timedelta(days=2)
    for bad in ("", "10", "5 minutes", "0s", "1x", "-5m"):
        with pytest.raises(ValueError):
            parse_interval(bad)


def test_cron_next_basic() -> None:
    weekdays_9am = parse_cron("0 9 * * 1-5")
    assert cron_next(weekdays_9am, T0) == datetime(2026, 3, 3, 9, 0, tzinfo=UTC)
    friday = datetime(2026, 3, 6, 9, 30, tzinfo=UTC)
    assert cron_next(weekdays_9am, friday) == datetime(2026, 3, 9, 9, 0, tzinfo=UTC)
    every_15 = parse_cron("*/15 * * * *")
    assert cron_next(every_15, T0) == T0 + timedelta(minutes=15)
    new_year = parse_cron("0 0 1 1 *")
    assert cron_next(new_year, T0) == datetime(2027, 1, 1, tzinfo=UTC)
    sunday_as_7 = parse_cron("0 12 * * 7")
    assert cron_next(sunday_as_7, T0).weekday() == 6


@pytest.mark.parametrize(
    "bad",
    ["* * * *", "60 * * * *", "* 24 * * *", "a * * * *", "*/0 * * * *", "0 0 30 2 *", "@daily"],
)
def test_cron_rejects_bad_expressions_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^cron .*e\.g\. '0 9 \* \* (1-5|mon-fri)'$"):
        parse_cron(bad)


MINUTE, HOUR, DAY = timedelta(minutes=1), timedelta(hours=1), timedelta(days=1)


@pytest.mark.parametrize(
    ("expr", "gap", "runs"),
    [
        ("* * * * *", MINUTE, 1440),
        ("*/5 * * * *", 5 * MINUTE, 288),
        ("0,1 * * * *", MINUTE, 48),
        ("* 3 * * *", MINUTE, 60),
        ("*/15 8-19 * * *", 15 * MINUTE, 48),
        ("0 */2 * * *", 2 * HOUR, 12),
        ("0 9 * * mon-fri", DAY, 1),
        ("0 0,23 * * 1", 23 * HOUR, 2),  # Mondays only: no midnight after the 23:00
        ("0 0,23 * * 1,2", HOUR, 2),  # Monday 23:00, Tuesday 00:00
        ("0,59 0,23 1,31 1,12 *", MINUTE, 4),  # 31 December 23:59, 1 January 00:00
        ("5,55 0,23 31 12 *", 50 * MINUTE, 4),  # once a year: never two days in a row
        ("0,59 0,23 1,29 2,3 *", MINUTE, 4),  # 29 February 23:59, 1 March (leap years)
        ("0,59 0,23 L * *", 59 * MINUTE, 4),  # the last day, then the 1st: not run
    ],
)
def test_the_rhythm_of_a_cron_is_its_least_gap_anywhere_and_its_runs_a_day(
    expr: str, gap: timedelta, runs: int
) -> None:
    assert cron_rhythm(parse_cron(expr)) == CronRhythm(gap, runs)


@given(
    st.sampled_from(["*/7 * * * *", "0 9 * * 1-5", "10,50 */3 * * *", "0,45 0,23 1,15 * *"]),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
)
def test_no_two_runs_in_a_row_are_closer_than_the_rhythm_says(expr: str, naive: datetime) -> None:
    rhythm = cron_rhythm(expr)
    runs = list(itertools.islice(CronSim(expr, naive.replace(tzinfo=UTC)), 60))
    assert all(b - a >= rhythm.min_gap for a, b in itertools.pairwise(runs))


@given(
    st.sampled_from(["*/7 * * * *", "0 9 * * 1-5", "30 */3 * * *", "0 0 1,15 * *", "5 4 * * 0"]),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
)
def test_cron_next_is_strictly_after_on_a_minute(expr: str, naive: datetime) -> None:
    after = naive.replace(tzinfo=UTC)
    nxt = cron_next(parse_cron(expr), after)
    assert nxt > after and nxt.second == 0 and nxt.microsecond == 0
    assert cron_next(parse_cron(expr), nxt - timedelta(microseconds=1)) == nxt


BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def runs(expr: str, start: datetime, count: int) -> list[datetime]:
    out, when = [], start
    for _ in range(count):
        when = cron_next(parse_cron(expr), when)
        out.append(when)
    return out


def test_cron_names_last_day_and_nth_weekday() -> None:
    assert cron_next(parse_cron("0 9 * * mon-fri"), T0) == datetime(2026, 3, 3, 9, tzinfo=UTC)
    assert cron_next(parse_cron("0 9 L * *"), T0) == datetime(2026, 3, 31, 9, tzinfo=UTC)
    assert cron_next(parse_cron("0 9 * * 5L"), T0) == datetime(2026, 3, 27, 9, tzinfo=UTC)
    assert cron_next(parse_cron("0 9 * * 1#2"), T0) == datetime(2026, 3, 9, 9, tzinfo=UTC)
    assert cron_next(parse_cron("0 9 1 jan *"), T0) == datetime(2027, 1, 1, 9, tzinfo=UTC)
    assert Schedule.build(cron="0  9 * *  mon-fri").cron == "0 9 * * mon-fri"


@pytest.mark.parametrize("tz", [BERLIN, NEW_YORK])
def test_spring_forward_runs_a_skipped_time_right_after_the_gap(tz: ZoneInfo) -> None:
    day = datetime(2026, 3, 29 if tz is BERLIN else 8, tzinfo=tz)
    first, second = runs("30 2 * * *", day - timedelta(hours=12), 2)
    # 02:30 does not exist that day: the job runs once, at 03:00 (real time), and the
    # next day at 02:30 again.
    assert first.astimezone(UTC) == datetime(2026, 3, day.day, 1 if tz is BERLIN else 7, tzinfo=UTC)
    assert first.astimezone(UTC).astimezone(tz).hour == 3
    assert (second.day, second.hour, second.minute) == (day.day + 1, 2, 30)


@pytest.mark.parametrize("tz", [BERLIN, NEW_YORK])
def test_fall_back_runs_a_fixed_time_once_and_a_step_in_both_passes(tz: ZoneInfo) -> None:
    repeated = 2 if tz is BERLIN else 1  # the wall-clock hour that happens twice
    day = datetime(2026, 10, 25, tzinfo=tz) if tz is BERLIN else datetime(2026, 11, 1, tzinfo=tz)
    daily = runs(f"30 {repeated} * * *", day - timedelta(hours=12), 2)
    assert [d.astimezone(tz).date() for d in daily] == [
        day.date(),
        (day + timedelta(days=1)).date(),
    ]
    start = day.replace(hour=repeated - 1, minute=59)
    half_hourly = runs("*/30 * * * *", start, 5)
    in_utc = [d.astimezone(UTC) for d in half_hourly]
    # Every 30 minutes of real time, through both passes of the repeated hour.
    assert [b - a for a, b in itertools.pairwise(in_utc)] == [timedelta(minutes=30)] * 4
    assert [d.fold for d in half_hourly[:4]] == [0, 0, 1, 1]


def test_a_schedule_in_a_dst_zone_is_due_at_real_times() -> None:
    sched = Schedule.build(cron="30 2 * * *", timezone="Europe/Berlin")
    last = datetime(2026, 3, 28, 1, 30, tzinfo=UTC)  # 02:30 Berlin, the day before
    due = sched.next_run(last, last + timedelta(minutes=1))
    assert due.astimezone(UTC) == datetime(2026, 3, 29, 1, 0, tzinfo=UTC)  # 03:00 CEST
    # Fall-back: a run in the first 02:30 is not followed by the second one.
    last = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST
    due = sched.next_run(last, last + timedelta(minutes=1))
    assert due.astimezone(UTC) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


def test_active_hours_starting_in_a_gap_start_after_it() -> None:
    sched = Schedule.build(every="1h", timezone="Europe/Berlin", active_hours="02:30-05:00")
    now = datetime(2026, 3, 28, 23, 0, tzinfo=UTC)  # 00:00 Berlin on spring-forward day
    due = sched.next_run(now - timedelta(minutes=30), now)
    assert due.astimezone(UTC) == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert (due.hour, due.minute) == (3, 30)  # a wall time that exists, not 02:30


def test_missed_runs_are_due_once_now() -> None:
    sched = Schedule.build(every="1h")
    last = T0 - timedelta(days=3)  # 72 runs missed
    assert sched.next_run(last, T0) == T0
    # After that one run, back to the normal period.
    assert sched.next_run(T0, T0 + timedelta(seconds=5)) == T0 + timedelta(hours=1)
    assert sched.next_run(None, T0) == T0 + timedelta(hours=1)


def test_active_hours_and_time_zone() -> None:
    sched = Schedule.build(every="1h", timezone="Europe/Berlin", active_hours="08:00-20:00")
    late = datetime(2026, 3, 2, 19, 30, tzinfo=UTC)  # 20:30 in Berlin
    due = sched.next_run(late - timedelta(minutes=30), late)
    assert due == datetime(2026, 3, 3, 8, 0, tzinfo=ZoneInfo("Europe/Berlin"))
    night = Schedule.build(every="1h", active_hours="22:00-06:00")
    noon = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    assert night.next_run(noon, noon).hour == 22


def test_interval_is_elapsed_time_across_dst() -> None:
    sched = Schedule.build(every="1h", timezone="Europe/Berlin")
    before = datetime(2026, 3, 29, 0, 30, tzinfo=UTC)  # DST starts at 01:00 UTC
    nxt = sched.next_run(before, before)
    assert nxt - before == timedelta(hours=1)


def test_schedule_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError):
        Schedule.build()
    with pytest.raises(ValueError):
        Schedule.build(every="1h", cron="0 * * * *")
    with pytest.raises(ValueError, match="time zone"):
        Schedule.build(every="1h", timezone="Mars/Olympus")


@pytest.mark.anyio
async def test_a_timer_firing_just_before_the_due_minute_never_runs_a_job_twice(
    tmp_path: Path,
) -> None:
    """The clock is virtual; every sleep wakes 2 ms early, as timer slack or an NTP step
    can make it. Over ten minutes an every-minute job runs ten times, once a minute."""
    clock = [datetime(2026, 3, 2, 8, 59, 30, tzinfo=UTC)]
    end = clock[0] + timedelta(minutes=10)
    ran: list[datetime] = []

    async def early_sleep(seconds: float) -> None:
        early = 0.002 if seconds > 0.002 else 0.0
        clock[0] += timedelta(seconds=seconds - early)
        await anyio.lowlevel.checkpoint()

    async def submit(message: InboundMessage) -> Ticket:
        ran.append(clock[0])
        if clock[0] >= end or len(ran) > 20:
            raise _Done
        ticket = Ticket(message)
        ticket._resolve(None)
        return ticket

    job = HeartbeatJob(name="tick", schedule=Schedule.build(cron="* * * * *"), prompt="tick?")
    channel = HeartbeatChannel(
        {"tick": job},
        state_path=tmp_path / "state.json",
        route=_no_route,
        clock=lambda: clock[0],
        sleep=early_sleep,
    )
    with pytest.raises(_Done):
        await channel._job_loop(job, submit)
    minutes = [when.replace(second=0, microsecond=0) for when in ran]
    assert len(minutes) == len(set(minutes)) == 11
    assert all(when.second == 0 for when in ran)


class _Done(Exception):
    pass


async def _no_route(message: OutboundMessage) -> None:
    raise AssertionError("nothing is delivered")
