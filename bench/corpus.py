"""The synthetic corpus and the table rows that bench/memory.py and bench/memory_pg.py share:
a seeded vocabulary drawn with a Zipf law, mixed with English stopwords, and the
common-word corpus of issue 11 (see bench/memory.py)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import accumulate

from gateway.memory.text import STOPWORDS

SEED = 20240228

VOCABULARY_SIZE = 4000

QUERIES = 20

_SYLLABLE_TEXT = (
    "ka lo mi ra te su no vi da pe ri go ba zu le min tor sal ver dan kel pol rin gas tem "
    "dor fin lak mor set bri cla dro fen gri hul jor kip lum nar orb pix"
)

_SYLLABLES = tuple(_SYLLABLE_TEXT.split())


@dataclass(slots=True)
class Row:
    metric: str
    size: int
    value: float
    unit: str
    target: str
    ok: bool | None


def row(metric: str, size: int, value: float, unit: str, limit: float | None = None) -> Row:
    """A result; with `limit`, the goal is `value <= limit`."""
    if limit is None:
        return Row(metric, size, value, unit, "-", None)
    return Row(metric, size, value, unit, f"<= {limit:g}", value <= limit)


def at_least(metric: str, size: int, value: float, unit: str, floor: float) -> Row:
    """A result whose goal is `value >= floor`."""
    return Row(metric, size, value, unit, f">= {floor:g}", value >= floor)


class Corpus:
    """Seeded Zipf-distributed synthetic text."""

    def __init__(self, seed: int = SEED) -> None:
        self.rng = random.Random(seed)
        words: set[str] = set()
        while len(words) < VOCABULARY_SIZE:
            parts = self.rng.randint(2, 4)
            words.add("".join(self.rng.choice(_SYLLABLES) for _ in range(parts)))
        self.words = sorted(words)
        self.rng.shuffle(self.words)
        self.cum = list(accumulate(1.0 / (rank + 1) ** 1.05 for rank in range(len(self.words))))
        self.stopwords = sorted(STOPWORDS - {"s", "t"})

    def sentence(self, low: int = 6, high: int = 16) -> str:
        n = self.rng.randint(low, high)
        content = self.rng.choices(self.words, cum_weights=self.cum, k=n)
        out: list[str] = []
        for word in content:
            if self.rng.random() < 0.5:
                out.append(self.rng.choice(self.stopwords))
            out.append(word)
        return " ".join(out).capitalize()

    def query(self) -> str:
        n = self.rng.randint(2, 4)
        return " ".join(self.rng.choices(self.words, cum_weights=self.cum, k=n))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 4)


def _median_ms(fn: Callable[[str], object], queries: list[str]) -> tuple[float, float]:
    for q in queries[:3]:
        fn(q)  # warm caches (stemmer, allocator)
    times = []
    for q in queries:
        start = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - start)
    times.sort()
    return _ms(statistics.median(times)), _ms(times[int(len(times) * 0.95) - 1])


def history_lines(corpus: Corpus, lines: int) -> list[str]:
    """`lines` timestamped history lines over the last year, oldest first."""
    start = datetime.now(UTC) - timedelta(days=365)
    step = timedelta(days=365) / max(lines, 1)
    out = []
    for i in range(lines):
        stamp = (start + step * i).strftime("%Y-%m-%d %H:%M:%S")
        speaker = "User" if i % 2 == 0 else "Agent"
        out.append(f"[{stamp}] {speaker}: {corpus.sentence()}")
    return out


def common_word_lines(lines: int, rng: random.Random) -> tuple[list[str], list[str]]:
    """History lines over the last 7 days whose words all come from 30 common words."""
    vocabulary = ["".join(rng.choice(_SYLLABLES) for _ in range(3)) for _ in range(30)]
    start = datetime.now(UTC) - timedelta(days=7)
    step = timedelta(days=7) / lines
    out = []
    for i in range(lines):
        stamp = (start + step * i).strftime("%Y-%m-%d %H:%M:%S")
        out.append(f"[{stamp}] " + " ".join(rng.choices(vocabulary, k=rng.randint(8, 10))))
    return vocabulary, out
