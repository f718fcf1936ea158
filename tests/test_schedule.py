"""Schedules: intervals, cron, time zones, active hours and the missed-runs-once rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.schedule import Schedule, cron_next, parse_cron, parse_interval

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


@pytest.mark.parametrize("bad", ["* * * *", "60 * * * *", "* 24 * * *", "a * * * *", "*/0 * * * *"])
def test_cron_rejects_bad_expressions(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_cron(bad)


@given(
    st.sampled_from(["*/7 * * * *", "0 9 * * 1-5", "30 */3 * * *", "0 0 1,15 * *", "5 4 * * 0"]),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
)
def test_cron_next_is_after_and_matches(expr: str, naive: datetime) -> None:
    spec = parse_cron(expr)
    after = naive.replace(tzinfo=UTC)
    nxt = cron_next(spec, after)
    assert nxt > after and nxt.second == 0
    assert nxt.minute in spec.minutes and nxt.hour in spec.hours and spec.day_matches(nxt)
    # Nothing matches strictly between `after` and `nxt`.
    probe = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while probe < nxt and probe < after + timedelta(days=2):
        assert not (
            probe.minute in spec.minutes and probe.hour in spec.hours and spec.day_matches(probe)
        )
        probe += timedelta(minutes=1)


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
