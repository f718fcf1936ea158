"""Remembered facts as things a person can see, correct and forget (pure functions).

A fact is a MEMORY.md bullet. Each one has a short id and, when we wrote it, where it
came from, kept in an HTML comment at the end of its line (hidden when the Markdown is
rendered, plain words when it is read raw):

    - [user_preference] Drinks green tea <!-- fact 3f9a2c1b from telegram:42 entry 0a1b2c3d4e5f -->

A correction adds `corrected <UTC time> by <who>` to the comment; the id never changes.
A line without the comment (an older MEMORY.md, a hand edit) has an id derived from its
heading's day, category and text, so old workspaces keep working unchanged and the
same line always has the same id. One id may name several identical lines (the same
fact written twice on one day): forgetting it removes all of them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime
from typing import Literal
from urllib.parse import quote, unquote

from gateway.memory.format import (
    FACT_COMMENT_RE,
    heading_day,
    is_heading,
    normalize_category,
    parse_bullet,
    without_fact_comment,
)
from gateway.memory.knowledge import KnowledgeEntry
from gateway.memory.text import normalize_text, one_line

ID_CHARS = 8
_ID_RE = re.compile(r"[0-9a-f]{4,16}")
# Characters a session key or a name may keep unescaped in the comment (no space, no
# `%`, no `<` or `>`: the comment can never be closed early or split).
_SAFE = ":/@._~!$&'()*+,;=#[]"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a fact came from: the session key and the id of the session entry."""

    session_key: str
    entry_id: str

    def describe(self) -> str:
        return f"{self.session_key} entry {self.entry_id}"


@dataclass(frozen=True, slots=True)
class Correction:
    """When (ISO UTC, seconds) and by whom (a sender id, `operator`) a fact was corrected."""

    at: str
    by: str


@dataclass(frozen=True, slots=True)
class NewFact:
    """A fact to write, with where it came from when that is known."""

    category: str
    text: str
    origin: Origin | None = None


FactInput = tuple[str, str] | NewFact


@dataclass(frozen=True, slots=True)
class Fact:
    """A remembered fact. `kind` is `memory` for a MEMORY.md line and `knowledge` for a
    knowledge entry no line carries (stored by an earlier version's `remember`)."""

    id: str
    category: str  # '' for a plain `- text` bullet
    text: str
    day: date | None = None
    origin: Origin | None = None
    correction: Correction | None = None
    kind: Literal["memory", "knowledge"] = "memory"

    def line(self) -> str:
        """The MEMORY.md bullet, with its comment."""
        return format_fact_line(self)

    def describe(self) -> str:
        """One line for people: id, category, text and where it came from."""
        label = f"[{self.category}] " if self.category else ""
        where = f"from {self.origin.describe()}" if self.origin else _no_origin(self)
        if self.correction is not None:
            where += f"; corrected {self.correction.at} by {self.correction.by}"
        return f"{self.id}  {label}{self.text}  ({where})"


def _no_origin(fact: Fact) -> str:
    if fact.kind == "knowledge":
        return "a knowledge entry, source not recorded"
    return f"written {fact.day.isoformat()}, source not recorded" if fact.day else "written by hand"


def fact_id(day: date | None, category: str, text: str) -> str:
    """The id of a fact first written on `day` (None: no heading) with this text."""
    basis = f"{day.isoformat() if day else '-'}\n{category.lower()}\n{normalize_text(text)}"
    return hashlib.sha256(basis.encode()).hexdigest()[:ID_CHARS]


def same_text(text: str) -> str:
    """What two facts share when they say the same thing (as knowledge dedupes it)."""
    return normalize_text(text).rstrip(" .!;,")


def _quote(value: str) -> str:
    return quote(value, safe=_SAFE)


def format_fact_line(fact: Fact) -> str:
    """`- [category] text <!-- fact ID [from KEY entry ID] [corrected AT by WHO] -->`;
    a fact whose id its line derives and that has no origin or correction is written
    as a plain bullet, as earlier versions wrote every fact."""
    head = f"- [{fact.category}] " if fact.category else "- "
    text = one_line(fact.text)
    plain = fact.origin is None and fact.correction is None
    if plain and fact.id == fact_id(fact.day, fact.category, text):
        return f"{head}{text}"
    words = ["fact", fact.id]
    if fact.origin is not None:
        words += ["from", _quote(fact.origin.session_key), "entry", _quote(fact.origin.entry_id)]
    if fact.correction is not None:
        words += ["corrected", _quote(fact.correction.at), "by", _quote(fact.correction.by)]
    return f"{head}{text} <!-- {' '.join(words)} -->"


def split_meta(text: str) -> tuple[str, str | None]:
    """A line without its fact comment, and the comment's words (None: none)."""
    match = FACT_COMMENT_RE.search(text)
    if match is None:
        return text, None
    return text[: match.start()].rstrip(), match.group(1)


def parse_fact_line(line: str, day: date | None) -> Fact | None:
    """The fact of a bullet line under a heading of `day`, or None for other lines."""
    if is_heading(line):
        return None
    bare, meta = split_meta(line.strip())
    bullet = parse_bullet(bare)
    if bullet is None:
        return None
    text = bullet.text
    derived = fact_id(day, bullet.category, text)
    if meta is None:
        return Fact(derived, bullet.category, text, day)
    words = meta.split()
    ident = words[0].lower() if words and _ID_RE.fullmatch(words[0].lower()) else derived
    fields = dict(zip(words[1::2], (unquote(w) for w in words[2::2]), strict=False))
    origin = None
    if fields.get("from") and fields.get("entry"):
        origin = Origin(fields["from"], fields["entry"])
    correction = None
    if fields.get("corrected"):
        correction = Correction(fields["corrected"], fields.get("by", "?"))
    return Fact(ident, bullet.category, text, day, origin, correction)


def memory_facts(content: str) -> list[Fact]:
    """Every fact of a MEMORY.md text in file order (the day is the last heading's)."""
    facts: list[Fact] = []
    day: date | None = None
    for raw in content.splitlines():
        if is_heading(raw):
            day = heading_day(raw)
            continue
        fact = parse_fact_line(raw, day)
        if fact is not None:
            facts.append(fact)
    return facts


def origin_marker(entry_id: str) -> str:
    """What the comment of every fact line that came from session entry `entry_id` holds
    (a space either side), to find those lines by substring."""
    return f" entry {_quote(entry_id)} "


def facts_by_origin(content: str) -> dict[str, list[str]]:
    """A MEMORY.md text's fact lines by the entry id of the message each came from, as
    search finds them (`- [category] text`, without the comment); a fact without an
    origin is not in it."""
    out: dict[str, list[str]] = {}
    for raw in content.splitlines():
        if "<!--" not in raw:  # no comment, no origin
            continue
        fact = parse_fact_line(raw, None)
        if fact is not None and fact.origin is not None:
            out.setdefault(fact.origin.entry_id, []).append(without_fact_comment(raw.strip()))
    return out


def rewrite_memory(
    content: str, ident: str, change: Callable[[Fact], Fact | None]
) -> tuple[str, list[Fact]]:
    """MEMORY.md text with each line of fact `ident` replaced by `change(fact)`'s line
    (None: the line is removed), every other byte as it was; and the facts changed."""
    out: list[str] = []
    found: list[Fact] = []
    day: date | None = None
    for raw in content.splitlines(keepends=True):
        if is_heading(raw):
            day = heading_day(raw)
            out.append(raw)
            continue
        fact = parse_fact_line(raw, day)
        if fact is None or fact.id != ident:
            out.append(raw)
            continue
        found.append(fact)
        new = change(fact)
        if new is not None:
            out.append(new.line() + "\n")
    return "".join(out), found


def scrub_lines(content: str, texts: set[str]) -> str:
    """`content` without the bullets that say one of `texts` (`same_text`), e.g. a
    backup of MEMORY.md after a fact was forgotten."""
    kept: list[str] = []
    for raw in content.splitlines(keepends=True):
        bullet = None if is_heading(raw) else parse_bullet(raw)
        if bullet is not None and same_text(bullet.text) in texts:
            continue
        kept.append(raw)
    return "".join(kept)


def new_facts(facts: Iterable[FactInput]) -> list[NewFact]:
    """Facts to write: known categories, one-line texts, empty ones dropped."""
    out: list[NewFact] = []
    for item in facts:
        fact = item if isinstance(item, NewFact) else NewFact(item[0], item[1])
        text = one_line(fact.text)
        if text:
            out.append(replace(fact, category=normalize_category(fact.category), text=text))
    return out


def written_fact(fact: NewFact, day: date) -> Fact:
    """The fact a `NewFact` becomes when written under `day`'s heading."""
    return Fact(fact_id(day, fact.category, fact.text), fact.category, fact.text, day, fact.origin)


def corrected(fact: Fact, text: str, correction: Correction) -> Fact:
    return replace(fact, text=one_line(text), correction=correction, kind="memory")


def normalize_id(text: str) -> str | None:
    """`text` as a fact id (lower-case hex), or None when it cannot be one."""
    candidate = text.strip().lower()
    return candidate if _ID_RE.fullmatch(candidate) else None


def knowledge_fact(entry: KnowledgeEntry) -> Fact:
    """A knowledge entry listed as a fact: its id is its entry id's first characters."""
    day = datetime.fromtimestamp(entry.created_at, UTC).date() if entry.created_at else None
    return Fact(entry.id[:ID_CHARS], entry.category, entry.content, day, kind="knowledge")


def all_facts(memory: list[Fact], entries: Iterable[KnowledgeEntry]) -> list[Fact]:
    """The facts of a scope: its MEMORY.md facts, then (oldest first) the knowledge
    entries none of them says (an earlier version's `remember` stored only those)."""
    said = {same_text(f.text) for f in memory}
    extra = [
        knowledge_fact(entry)
        for entry in sorted(entries, key=lambda e: (e.created_at, e.id))
        if same_text(entry.content) not in said
    ]
    return memory + extra


def correction_now(now: datetime, by: str) -> Correction:
    return Correction(now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), by)


def find_facts(facts: Iterable[Fact], ref: str) -> list[Fact]:
    """The facts `ref` names: the one with that id, else those whose text holds every
    word of `ref` (several: the caller asks which one). Each id once."""
    pool = list(facts)
    ident = normalize_id(ref)
    if ident is not None:
        exact = [f for f in pool if f.id == ident]
        if exact:
            return exact[:1]
    words = normalize_text(ref).split()
    if not words:
        return []
    out: dict[str, Fact] = {}
    for fact in pool:
        haystack = normalize_text(fact.text)
        if all(word in haystack for word in words):
            out.setdefault(fact.id, fact)
    return list(out.values())
