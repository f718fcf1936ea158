"""Line formats of MEMORY.md and HISTORY.md, and the fact categories (pure functions).

MEMORY.md holds `- [category] text` bullets under `### Consolidated YYYY-MM-DD`
headings; people may edit it and add free text. HISTORY.md holds one entry per line,
`[YYYY-MM-DD HH:MM:SS] text` in UTC (the seed's `... UTC]` variant is read too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from datetime import time as time_of_day
from functools import lru_cache

from loguru import logger

from gateway.memory.text import one_line

# In export priority order (most important first).
CATEGORIES: tuple[str, ...] = (
    "user_preference",
    "project_decision",
    "error_pattern",
    "system_behavior",
    "learned_fact",
)
DEFAULT_CATEGORY = "learned_fact"

HISTORY_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_HISTORY_TS_RE = re.compile(r"^\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?: UTC)?\]")
_FACT_RE = re.compile(r"^[-*+]\s+\[([A-Za-z_][A-Za-z0-9_]*)\]\s*(.*)$")
_BULLET_RE = re.compile(r"^[-*+]\s+(.*)$")
_HEADING_PREFIX = "### Consolidated "
_HEADING_RE = re.compile(r"^#+\s*Consolidated\s+(\d{4}-\d{2}-\d{2})\s*$")
# The comment at the end of a fact's line holding its id and origin (`gateway.memory.facts`).
FACT_COMMENT_RE = re.compile(r"\s*<!--\s*fact\s+([^<>]*?)\s*-->\s*$")


@dataclass(frozen=True, slots=True)
class FactLine:
    """A parsed `- [category] text` bullet (category as written, not normalized)."""

    category: str
    text: str


def normalize_category(category: str) -> str:
    """A known category, lowercased; anything else becomes `learned_fact` (with a warning)."""
    cleaned = category.strip().lower()
    if cleaned in CATEGORIES:
        return cleaned
    logger.warning("Unknown memory category {!r}; using {!r}", category, DEFAULT_CATEGORY)
    return DEFAULT_CATEGORY


def clean_facts(facts: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`(category, text)` facts with known categories and one-line texts; empty ones dropped."""
    return [
        (normalize_category(category), one_line(text)) for category, text in facts if one_line(text)
    ]


def format_fact(category: str, text: str) -> str:
    """`- [category] text` on one line (no trailing newline)."""
    return f"- [{category}] {one_line(text)}"


def without_fact_comment(line: str) -> str:
    """A MEMORY.md line as people and searches see it: its fact comment (id, origin)
    taken off."""
    if "<!--" not in line:  # most lines: no regex run from every position of the line
        return line
    match = FACT_COMMENT_RE.search(line)
    return line if match is None else line[: match.start()].rstrip()


def parse_fact(line: str) -> FactLine | None:
    """The bullet's category and text (without its fact comment), or None for any
    other kind of line."""
    match = _FACT_RE.match(without_fact_comment(line.strip()))
    if match is None:
        return None
    return FactLine(match.group(1), match.group(2).strip())


def parse_bullet(line: str) -> FactLine | None:
    """Any bullet: a fact (`- [category] text`) or a plain `- text` (category '')."""
    fact = parse_fact(line)
    if fact is not None:
        return fact
    match = _BULLET_RE.match(without_fact_comment(line.strip()))
    if match is None or not match.group(1).strip():
        return None
    return FactLine("", match.group(1).strip())


def is_heading(line: str) -> bool:
    return line.lstrip().startswith("#")


def consolidated_heading(day: date) -> str:
    return f"{_HEADING_PREFIX}{day.isoformat()}"


def render_memory(rows: Iterable[tuple[date | None, str]]) -> str:
    """MEMORY.md text of `(day, line)` rows in order: a `### Consolidated` heading (after
    a blank line) wherever the day changes to a new day; a row without a day (free text,
    another heading) is written as it is and ends the day before it."""
    out: list[str] = []
    current: date | None = None
    for day, line in rows:
        if day is not None and day != current:
            out.append(("\n" if out else "") + consolidated_heading(day))
        current = day
        out.append(line)
    return "".join(line + "\n" for line in out)


def heading_day(line: str) -> date | None:
    """The day of a `### Consolidated YYYY-MM-DD` heading, or None."""
    match = _HEADING_RE.match(line.strip())
    if match is None:
        return None
    try:
        return date.fromisoformat(match.group(1))
    except ValueError:
        return None


def memory_documents(content: str) -> list[tuple[str, str | None]]:
    """The searchable lines of MEMORY.md: `(stripped line, category or None)`.

    Headings and blank lines are not documents; free text is (without a category). A
    fact's comment (its id and origin) is not searched.
    """
    docs: list[tuple[str, str | None]] = []
    for raw in content.splitlines():
        line = without_fact_comment(raw.strip())
        if not line or is_heading(line):
            continue
        fact = parse_fact(line)
        docs.append((line, fact.category.lower() if fact else None))
    return docs


def format_history_line(text: str, when: datetime) -> str:
    """`[YYYY-MM-DD HH:MM:SS] text` + newline, in UTC; the entry is folded to one line."""
    t = when.astimezone(UTC)  # HISTORY_TIME_FORMAT, without strftime's cost per line
    stamp = f"{t.year:04d}-{t.month:02d}-{t.day:02d} {t.hour:02d}:{t.minute:02d}:{t.second:02d}"
    return f"[{stamp}] {one_line(text)}\n"


def history_timestamp(line: str) -> float | None:
    """Epoch seconds of a history line's `[...]` timestamp (UTC), or None."""
    match = _HISTORY_TS_RE.match(line)
    if match is None:
        return None
    stamp = match.group(1)
    day = _day_start(stamp[:10])
    hour, minute, second = int(stamp[11:13]), int(stamp[14:16]), int(stamp[17:19])
    if day is None or hour > 23 or minute > 59 or second > 61:
        return None
    return day + hour * 3600 + minute * 60 + second


@lru_cache(maxsize=4096)
def _day_start(text: str) -> float | None:
    # strptime per line dominated index building; days repeat a lot, so cache them.
    try:
        return datetime.combine(date.fromisoformat(text), time_of_day(), UTC).timestamp()
    except ValueError:
        return None
