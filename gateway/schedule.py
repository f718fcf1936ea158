"""When scheduled jobs run: intervals, 5-field cron expressions, time zones and active
hours, as pure functions of (schedule, last run, now).

The promise kept here: after downtime a job that missed any number of runs is due once,
now, and then continues on its normal schedule; it is never due once per missed run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

_INTERVAL_PART = re.compile(r"(\d+)\s*([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_interval(text: str) -> timedelta:
    """'90s', '30m', '1h30m', '2d' -> a positive timedelta; ValueError otherwise."""
    compact = text.strip().lower().replace(" ", "")
    parts = _INTERVAL_PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"interval {text!r}: use a number with s, m, h or d, e.g. '30m'")
    seconds = sum(int(n) * _UNITS[u] for n, u in parts)
    if seconds < 1:
        raise ValueError(f"interval {text!r} must be at least one second")
    return timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class CronSpec:
    """A parsed `minute hour day-of-month month day-of-week` expression."""

    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday, as in cron
    any_day: bool  # day-of-month was '*'
    any_weekday: bool  # day-of-week was '*'

    def day_matches(self, when: datetime) -> bool:
        weekday = (when.weekday() + 1) % 7
        dom = when.day in self.days
        dow = weekday in self.weekdays
        # cron's rule: when both are restricted, either one matching is enough.
        if self.any_day or self.any_weekday:
            return dom and dow
        return dom or dow


def _cron_field(text: str, low: int, high: int, name: str) -> tuple[frozenset[int], bool]:
    values: set[int] = set()
    for item in text.split(","):
        step = 1
        if "/" in item:
            item, step_text = item.split("/", 1)
            if not step_text.isdigit() or int(step_text) < 1:
                raise ValueError(f"cron {name}: bad step in {text!r}")
            step = int(step_text)
        if item == "*":
            start, end = low, high
        elif "-" in item:
            a, b = item.split("-", 1)
            if not (a.isdigit() and b.isdigit()):
                raise ValueError(f"cron {name}: bad range in {text!r}")
            start, end = int(a), int(b)
        elif item.isdigit():
            start = end = int(item)
            if step != 1:
                end = high
        else:
            raise ValueError(f"cron {name}: {text!r} is not a number, range, list or '*'")
        if name == "day-of-week" and end == 7:
            end = 6 if start <= 6 else 7
            values.add(0)
        if not (low <= start <= high and low <= end <= high and start <= end):
            raise ValueError(f"cron {name}: {text!r} is outside {low}-{high}")
        values.update(range(start, end + 1, step))
    return frozenset(values), text == "*"


def parse_cron(expr: str) -> CronSpec:
    """Parse a standard 5-field cron expression (numbers, '*', ranges, lists, steps)."""
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron {expr!r}: needs 5 fields (minute hour day month weekday), e.g. '0 9 * * 1-5'"
        )
    minutes, _ = _cron_field(fields[0], 0, 59, "minute")
    hours, _ = _cron_field(fields[1], 0, 23, "hour")
    days, any_day = _cron_field(fields[2], 1, 31, "day-of-month")
    months, _ = _cron_field(fields[3], 1, 12, "month")
    weekdays, any_weekday = _cron_field(fields[4], 0, 7, "day-of-week")
    return CronSpec(minutes, hours, days, months, weekdays, any_day, any_weekday)


def cron_next(spec: CronSpec, after: datetime) -> datetime:
    """The first minute strictly after `after` (an aware datetime, in the schedule's
    zone) that matches `spec`."""
    when = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    limit = when + timedelta(days=366 * 5)
    while when < limit:
        if when.month not in spec.months:
            month = when.month + 1
            year = when.year + (month > 12)
            when = when.replace(year=year, month=(month - 1) % 12 + 1, day=1, hour=0, minute=0)
            continue
        if not spec.day_matches(when):
            when = (when + timedelta(days=1)).replace(hour=0, minute=0)
            continue
        if when.hour not in spec.hours:
            when = (when + timedelta(hours=1)).replace(minute=0)
            continue
        if when.minute not in spec.minutes:
            when += timedelta(minutes=1)
            continue
        return when
    raise ValueError("cron expression never matches (e.g. February 30th)")


def parse_active_hours(text: str) -> tuple[time, time]:
    """'08:00-22:00' (may wrap midnight: '22:00-06:00')."""
    match = re.fullmatch(r"\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*", text)
    if not match:
        raise ValueError(f"active hours {text!r}: use HH:MM-HH:MM, e.g. '08:00-22:00'")
    h1, m1, h2, m2 = (int(g) for g in match.groups())
    if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2):
        raise ValueError(f"active hours {text!r}: not a time of day")
    end = time(23, 59, 59, 999999) if h2 == 24 else time(h2, m2)
    return time(h1, m1), end


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"time zone {name!r} is unknown; use an IANA name like 'Europe/Berlin'"
        ) from None


@dataclass(frozen=True, slots=True)
class Schedule:
    """Exactly one of `every` and `cron`; times are evaluated in `tz`."""

    tz: ZoneInfo
    every: timedelta | None = None
    cron: CronSpec | None = None
    active: tuple[time, time] | None = None

    @classmethod
    def build(
        cls,
        *,
        every: str | None = None,
        cron: str | None = None,
        timezone: str = "UTC",
        active_hours: str | None = None,
    ) -> Schedule:
        if (every is None) == (cron is None):
            raise ValueError("give exactly one of 'every' (e.g. '30m') and 'cron'")
        return cls(
            tz=zone(timezone),
            every=parse_interval(every) if every is not None else None,
            cron=parse_cron(cron) if cron is not None else None,
            active=parse_active_hours(active_hours) if active_hours else None,
        )

    def _in_active(self, when: datetime) -> bool:
        if self.active is None:
            return True
        start, end = self.active
        now = when.timetz().replace(tzinfo=None)
        if start <= end:
            return start <= now <= end
        return now >= start or now <= end

    def _into_active(self, when: datetime) -> datetime:
        """`when`, or the next start of the active window if `when` is outside it."""
        if self._in_active(when):
            return when
        assert self.active is not None
        start = self.active[0]
        candidate = when.replace(hour=start.hour, minute=start.minute, second=0, microsecond=0)
        if candidate <= when:
            candidate += timedelta(days=1)
        return candidate

    def _regular_after(self, moment: datetime) -> datetime:
        if self.every is not None:
            # Intervals are elapsed time: computed in UTC so a DST change does not stretch them.
            return (moment.astimezone(UTC) + self.every).astimezone(self.tz)
        assert self.cron is not None
        return cron_next(self.cron, moment)

    def next_run(self, last_run: datetime | None, now: datetime) -> datetime:
        """When the job is next due. A first run is one period (or the next cron time)
        from now; a run missed during downtime is due now, once."""
        now = now.astimezone(self.tz)
        if last_run is None:
            due = self._regular_after(now)
        else:
            due = self._regular_after(last_run.astimezone(self.tz))
            if due <= now:
                due = now  # missed: run once, now
        return self._into_active(due)
