"""When scheduled jobs run: intervals, 5-field cron expressions, time zones and active
hours, as pure functions of (schedule, last run, now).

Cron parsing and cron times come from `cronsim`; croniter, tried side by side, runs a
daily `30 2 * * *` twice on a fall-back day and refuses `5L` (last Friday).

The promise kept here: after downtime a job that missed any number of runs is due once,
now, and then continues on its normal schedule; it is never due once per missed run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from itertools import pairwise
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

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


def parse_cron(expr: str) -> str:
    """A 5-field cron expression, checked (and normalized to single spaces). Names
    (`mon-fri`, `jan`), `L` (last day of the month, `5L` last Friday) and `#` (`1#2`,
    the second Monday) work as in cron; ValueError with a hint otherwise."""
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(
            f"cron {expr!r}: needs 5 fields (minute hour day month weekday), e.g. '0 9 * * 1-5'"
        )
    normalized = " ".join(fields)
    try:
        CronSim(normalized, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise ValueError(f"cron {expr!r}: {str(exc).lower()}, e.g. '0 9 * * mon-fri'") from None
    return normalized


def cron_next(expr: str, after: datetime) -> datetime:
    """The first cron time strictly after `after` (an aware datetime in the schedule's
    zone). DST as cron does it: a time the spring-forward gap skips runs right after
    the gap; a fixed time in the hour fall-back repeats runs once, while `*` and step
    fields run in both passes of that hour."""
    return next(CronSim(expr, after))


_DAY = timedelta(days=1)
_SECOND = timedelta(seconds=1)  # CronSim gives the times after its start: start before
# 28 years of days: weekdays and leap days line up in every way they can (2001-2028
# holds no century year), so a pair of days a cron runs in a row turns up here if ever.
_CYCLE_START = datetime(2001, 1, 1, tzinfo=UTC)
_CYCLE_END = datetime(2029, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class CronRhythm:
    """How often a cron expression runs by its wall clock: the least time between two
    of its runs in a row (a day at most: runs a day or more apart are reported as a
    day), and its runs on a day it runs."""

    min_gap: timedelta
    runs_per_day: int


def cron_rhythm(expr: str) -> CronRhythm:
    """The rhythm of a checked 5-field cron expression (`parse_cron`). Cron runs at
    every one of its times of day on each day it runs, so the least gap is between two
    times of one day, or overnight from the last to the first when it runs on two days
    in a row (31 December to 1 January, 29 February to 1 March: all are looked at). By
    the wall clock: a daylight-saving change can bring two runs closer on its day."""
    minute, hour, day, month, weekday = expr.split()
    times: list[datetime] = []
    for when in CronSim(f"{minute} {hour} * * *", _CYCLE_START - _SECOND):
        if when >= _CYCLE_START + _DAY:
            break
        times.append(when)
    gaps = [later - earlier for earlier, later in pairwise(times)]
    overnight = times[0] + _DAY - times[-1]  # a day when there is one time of day
    if overnight < min(gaps, default=_DAY) and _runs_two_days_in_a_row(day, month, weekday):
        gaps.append(overnight)
    return CronRhythm(min(gaps, default=_DAY), len(times))


def _runs_two_days_in_a_row(day: str, month: str, weekday: str) -> bool:
    previous = None
    for when in CronSim(f"0 0 {day} {month} {weekday}", _CYCLE_START - _SECOND):
        if when >= _CYCLE_END:
            return False
        if previous is not None and when - previous == _DAY:
            return True
        previous = when
    return False


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
    cron: str | None = None
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
        candidate = when.replace(
            hour=start.hour, minute=start.minute, second=0, microsecond=0, fold=0
        )
        if candidate <= when:
            candidate += timedelta(days=1)
        # A start inside a spring-forward gap does not exist: the round trip through UTC
        # moves it past the gap.
        return candidate.astimezone(UTC).astimezone(self.tz)

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
