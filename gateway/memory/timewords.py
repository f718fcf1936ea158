"""The time range a query names ("in May 2023", "last summer", "3 weeks ago"), for recall.

A question about a time ("What did Joanna watch on 1 May, 2022?", "When did Melanie go
camping in June?") is answered by a message said then, or soon after ("we went camping
last week"). `time_range` turns the words into a range of epoch seconds, resolved
against `now` (the turn's time), and the message index ranks the messages inside it
higher (`MessageIndex._in_time`): time-aware query expansion, as LongMemEval (Wu et al.,
2024) found for temporal questions.

Rules, the first that matches wins:
- a day: "1 May, 2022", "May 3, 2023", "October 13" (year: the latest not after now);
- a month: "in May 2022", "January 2022", "in June" (the latest June not after now);
- a season: "summer 2021", "last summer", "during the summer" (northern: June-August);
- a year: "in 2023", "last year", "this year";
- relative: "yesterday", "last week", "last month", "N days/weeks/months/years ago",
  "recently" (the last 30 days).
A range ends `LATE` after the time it names: people tell of a day in the days after.
Pure functions; a query without time words gives None (no change to the ranking).
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

#: How long after the named time a message still counts as in the range.
LATE = timedelta(days=14)

_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_name) if name}
_MONTHS.update({name.lower(): i for i, name in enumerate(calendar.month_abbr) if name})
del _MONTHS["may"]  # "may" the verb: only as a month name next to a day or a year
_MONTH_NAMES = (*(calendar.month_name[i].lower() for i in range(1, 13)), "sept")
_MONTH = (
    "(" + "|".join((*_MONTH_NAMES, *(calendar.month_abbr[i].lower() for i in range(1, 13)))) + ")"
)
_SEASONS = {"spring": 3, "summer": 6, "autumn": 9, "fall": 9, "winter": 12}
_UNITS = {"day": 1, "week": 7, "month": 30, "year": 365}
_NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}

_DAY_FIRST = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+{_MONTH}\b,?\s*(\d{{4}})?", re.I)
_MONTH_FIRST = re.compile(rf"\b{_MONTH}\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s*(\d{{4}}))?", re.I)
_MONTH_YEAR = re.compile(rf"\b{_MONTH},?\s+(\d{{4}})\b", re.I)
_IN_MONTH = re.compile(rf"\b(?:in|during|of|since)\s+(?:early\s+|late\s+|mid-?)?{_MONTH}\b", re.I)
_SEASON = re.compile(
    r"\b(?:(last|this|the)\s+)?(spring|summer|autumn|fall|winter)\b(?:\s+(?:of\s+)?(\d{4}))?", re.I
)
_YEAR = re.compile(r"\b(?:in|of|during|since)\s+(\d{4})\b", re.I)
_REL_YEAR = re.compile(r"\b(last|this|past)\s+year\b", re.I)
_REL_MONTH = re.compile(r"\b(last|this|past)\s+month\b", re.I)
_REL_WEEK = re.compile(r"\b(last|this|past)\s+(week|weekend)\b", re.I)
_AGO = re.compile(
    r"\b(\d+|a|an|one|two|three|four|five|six)\s+(day|week|month|year)s?\s+ago\b", re.I
)
_YESTERDAY = re.compile(r"\byesterday\b", re.I)
_RECENTLY = re.compile(r"\b(recently|lately)\b", re.I)


def time_range(query: str, now: datetime) -> tuple[float, float] | None:
    """The range (epoch seconds, start inclusive, end exclusive) `query` names, or None."""
    now = now.astimezone(UTC)
    found = _named(query, now)
    if found is None:
        return None
    start, end = found
    return start.timestamp(), (end + LATE).timestamp()


Span = tuple[datetime, datetime]


def _named(query: str, now: datetime) -> Span | None:
    rules: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], Span | None]], ...] = (
        (_DAY_FIRST, lambda m: _day(m.group(2), m.group(1), m.group(3), now)),
        (_MONTH_FIRST, lambda m: _day(m.group(1), m.group(2), m.group(3), now)),
        (_MONTH_YEAR, lambda m: _month(_month_number(m.group(1)), int(m.group(2)))),
        (_SEASON, lambda m: _season(m.group(2), m.group(1), m.group(3), now)),
        (_IN_MONTH, lambda m: _latest_month(_month_number(m.group(1)), now)),
        (_YEAR, lambda m: _year(int(m.group(1)))),
        (_REL_YEAR, lambda m: _year(now.year - (m.group(1).lower() != "this"))),
        (_REL_MONTH, lambda m: _relative_month(m.group(1), now)),
        (_REL_WEEK, lambda m: (now - timedelta(days=14), now)),
        (_AGO, lambda m: _ago(m.group(1), m.group(2), now)),
        (_YESTERDAY, lambda m: (_midnight(now) - timedelta(days=1), _midnight(now))),
        (_RECENTLY, lambda m: (now - timedelta(days=30), now)),
    )
    for pattern, read in rules:
        match = pattern.search(query)
        if match is None:
            continue
        found = read(match)
        if found is not None:
            return found
    return None


def _month_number(name: str) -> int:
    name = name.lower()
    return 5 if name == "may" else _MONTHS.get(name[:3] if name == "sept" else name, 0)


def _midnight(moment: datetime) -> datetime:
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def _day(
    month_name: str, day: str, year: str | None, now: datetime
) -> tuple[datetime, datetime] | None:
    month = _month_number(month_name)
    try:
        if year is not None:
            start = datetime(int(year), month, int(day), tzinfo=UTC)
        else:
            start = datetime(now.year, month, int(day), tzinfo=UTC)
            if start > now:
                start = start.replace(year=now.year - 1)
    except ValueError:  # "31 June", "0 May"
        return None
    return start, start + timedelta(days=1)


def _month(month: int, year: int) -> tuple[datetime, datetime] | None:
    if not 1 <= month <= 12 or not 1 <= year <= 9998:
        return None
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + (month == 12), month % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _latest_month(month: int, now: datetime) -> tuple[datetime, datetime] | None:
    """The latest such month that has begun by `now`."""
    year = now.year if month <= now.month else now.year - 1
    return _month(month, year)


def _season(
    name: str, which: str | None, year: str | None, now: datetime
) -> tuple[datetime, datetime] | None:
    first = _SEASONS[name.lower()]
    if year is not None:
        begin_year = int(year)
    else:
        begin_year = now.year if (now.month, now.day) >= (first, 1) else now.year - 1
        if which is not None and which.lower() == "last":
            begin_year -= 1 if (now.month >= first or first == 12) else 0
    if not 1 <= begin_year <= 9997:
        return None
    start = datetime(begin_year, first, 1, tzinfo=UTC)
    end_month = first + 3
    end = datetime(begin_year + (end_month > 12), (end_month - 1) % 12 + 1, 1, tzinfo=UTC)
    return start, end


def _year(year: int) -> tuple[datetime, datetime] | None:
    if not 1 <= year <= 9998:
        return None
    return datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC)


def _relative_month(which: str, now: datetime) -> tuple[datetime, datetime] | None:
    if which.lower() == "this":
        return _month(now.month, now.year)
    return _month(12 if now.month == 1 else now.month - 1, now.year - (now.month == 1))


def _ago(count: str, unit: str, now: datetime) -> tuple[datetime, datetime]:
    n = int(count) if count.isdigit() else _NUMBERS.get(count.lower(), 1)
    days = _UNITS[unit.lower()]
    centre = now - timedelta(days=n * days)
    half = timedelta(days=max(1, days // 2))
    return centre - half, centre + half
