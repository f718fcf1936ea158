"""compact_memory and its near-duplicate rule: merge only what another fact already says."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.memory import MemoryManager
from gateway.memory.dedupe import fact_signature, redundant_facts


def removed(*facts: tuple[str, str], threshold: float = 0.85) -> set[int]:
    return redundant_facts(list(facts), threshold)


def test_facts_that_say_different_things_are_kept() -> None:
    d = "project_decision"
    assert removed((d, "Decided to drop cron"), (d, "Decided to drop Terraform")) == set()
    assert removed((d, "Alice manages Bob"), (d, "Bob manages Alice")) == set()
    assert removed((d, "Alice is the team lead"), (d, "Alice was the team lead")) == set()
    assert removed((d, "API listens on port 8080"), (d, "API listens on port 8081")) == set()
    assert removed((d, "User likes Rust"), (d, "User doesn't like Rust")) == set()


def test_equal_up_to_case_punctuation_and_articles() -> None:
    p = "user_preference"
    assert removed(
        (p, "Prefers TypeScript over JavaScript"),
        (p, "prefers typescript over javascript."),
        (p, "Prefers  the TypeScript over JavaScript!"),
    ) == {1, 2}


def test_same_text_in_another_category_is_kept() -> None:
    assert removed(("user_preference", "Uses vim"), ("learned_fact", "Uses vim")) == set()


def test_contained_fact_is_dropped_for_the_longer_one() -> None:
    f = "learned_fact"
    short = "staging cluster runs on three arm nodes in frankfurt"
    longer = short + " region"
    assert removed((f, short), (f, longer)) == {0}
    assert removed((f, longer), (f, short)) == {1}
    # Too different in size for the threshold: both stay.
    assert removed((f, "staging runs arm"), (f, "staging runs arm nodes")) == set()
    assert removed((f, "staging runs arm"), (f, "staging runs arm nodes"), threshold=0.7) == {0}
    # Threshold 1 only merges equal facts.
    assert removed((f, short), (f, longer), threshold=1.0) == set()


def test_contained_fact_with_a_negation_added_is_kept() -> None:
    f = "user_preference"
    base = "user wants replies in german for all work related questions"
    assert removed((f, base), (f, base + " anymore")) == set()
    assert removed((f, base), (f, "never " + base)) == set()
    assert removed((f, base), (f, base + " except weekends")) == set()


def test_chains_keep_the_most_complete_fact() -> None:
    f = "learned_fact"
    a = "one two three four five six seven"
    assert removed((f, a), (f, a + " eight"), (f, a + " eight nine"), threshold=0.75) == {0, 1}


def test_invalid_threshold_is_rejected() -> None:
    with pytest.raises(ValueError):
        redundant_facts([], 0.0)
    with pytest.raises(ValueError):
        redundant_facts([], 1.5)


def test_signature_keeps_negations_and_drops_articles() -> None:
    assert fact_signature("The user doesn't use a Mac.") == ("user", "not", "use", "mac")


# -- compact_memory ----------------------------------------------------------------

MEMORY = """\
# Notes kept by hand
Some free text that repeats itself.
Some free text that repeats itself.

### Consolidated 2024-02-27
- [project_decision] Decided to drop cron
- [project_decision] Decided to drop Terraform
- [user_preference] Prefers TypeScript over JavaScript

### Consolidated 2024-02-28
- [user_preference] prefers typescript over javascript.
- [project_decision] decided to drop cron
"""


def test_compact_memory_removes_only_redundant_bullets(tmp_path: Path) -> None:
    mm = MemoryManager(tmp_path, "cli:direct")
    mm.write_memory(MEMORY)
    assert mm.search_memory("typescript", max_results=10)  # index loaded before
    assert mm.compact_memory() == 2
    assert (
        mm.read_memory()
        == """\
# Notes kept by hand
Some free text that repeats itself.
Some free text that repeats itself.

### Consolidated 2024-02-27
- [project_decision] Decided to drop cron
- [project_decision] Decided to drop Terraform
- [user_preference] Prefers TypeScript over JavaScript

### Consolidated 2024-02-28
"""
    )
    assert (mm.dir / "MEMORY.md.bak").read_text() == MEMORY
    assert (mm.dir / "MEMORY.md.bak").stat().st_mode & 0o777 == 0o600
    assert mm.search_memory("typescript") == [
        "- [user_preference] Prefers TypeScript over JavaScript"
    ]
    assert mm.compact_memory() == 0  # idempotent
    assert (mm.dir / "MEMORY.md.bak").read_text() == MEMORY  # untouched when nothing removed


def test_compact_memory_on_empty_memory(tmp_path: Path) -> None:
    mm = MemoryManager(tmp_path, "cli:direct")
    assert mm.compact_memory() == 0
    assert not mm.memory_path.exists()


def test_compact_memory_is_not_quadratic(tmp_path: Path) -> None:
    # 12,000 facts sharing most of their words (long posting lists) plus duplicates.
    lines = ["### Consolidated 2024-01-01"]
    for i in range(12_000):
        lines.append(f"- [learned_fact] service item{i} in project alpha uses port {i % 50}")
        if i % 10 == 0:
            lines.append(f"- [learned_fact] Service item{i} in project Alpha uses port {i % 50}.")
    mm = MemoryManager(tmp_path, "cli:direct")
    mm.write_memory("\n".join(lines) + "\n")
    start = time.perf_counter()
    assert mm.compact_memory() == 1200
    assert time.perf_counter() - start < 3.0
