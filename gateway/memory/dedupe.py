"""The near-duplicate rule for memory facts, and a sub-quadratic way to apply it.

The rule (documented promise): a fact is removed only when another kept fact of the
same category says everything it says. Concretely, with a fact's *signature* being its
words casefolded, punctuation dropped and the articles "a", "an", "the" removed (no
stemming, no other stopwords dropped, so tense, negation and numbers all count):

1. Equal: two facts with the same signature are duplicates; the first one is kept.
   ("Prefers TypeScript over JavaScript." == "prefers typescript over javascript")
2. Contained: fact S is implied by a longer fact L when S's signature is a subsequence
   of L's, |set(S)| / |set(L)| >= threshold (that is their Jaccard similarity), and
   none of L's extra words is a negation or contrast word ("not", "never", "except",
   "instead", "anymore", ...). S is removed, L kept.

So "decided to drop cron" and "decided to drop Terraform" are never merged (each has a
content word the other lacks), nor are "Alice manages Bob" and "Bob manages Alice"
(order differs), nor "likes Rust" and "likes Rust no longer".

Cost: one pass to build signatures and an inverted index per (category, number of
distinct words); the candidates for rule 2 are the facts of an admissible size in the
shortest posting list among the fact's own words, never all pairs.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.memory.text import NEGATIONS, words

ARTICLES: frozenset[str] = frozenset({"a", "an", "the"})
CONTRAST_WORDS: frozenset[str] = NEGATIONS | frozenset(
    {"except", "instead", "anymore", "longer", "formerly", "previously", "former", "unless"}
)


def fact_signature(text: str) -> tuple[str, ...]:
    """The words that carry what a fact says, in order (see the module docstring)."""
    return tuple(w for w in words(text) if w not in ARTICLES)


def _is_subsequence(short: tuple[str, ...], long: tuple[str, ...]) -> bool:
    remaining = iter(long)
    return all(word in remaining for word in short)


def redundant_facts(facts: Sequence[tuple[str, str]], threshold: float = 0.85) -> set[int]:
    """Indices of the facts `(category, text)` that another kept fact implies.

    Removing exactly these indices loses no statement: every removed fact is equal to,
    or contained in, a fact that stays (dominance strictly increases the length or
    decreases the position, so it has no cycles and always ends at a kept fact).
    `threshold` >= 1 disables rule 2.
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError("similarity_threshold must be in (0, 1]")
    signatures = [fact_signature(text) for _, text in facts]
    categories = [category.lower() for category, _ in facts]

    removed: set[int] = set()
    first_seen: dict[tuple[str, tuple[str, ...]], int] = {}
    for i, sig in enumerate(signatures):
        if not sig:
            continue
        key = (categories[i], sig)
        if key in first_seen:
            removed.add(i)
        else:
            first_seen[key] = i
    if threshold >= 1.0:
        return removed

    survivors = list(first_seen.values())
    word_sets = {i: frozenset(signatures[i]) for i in survivors}
    # (category, number of distinct words) -> word -> facts holding it
    postings: dict[tuple[str, int], dict[str, list[int]]] = {}
    for i in survivors:
        bucket = postings.setdefault((categories[i], len(word_sets[i])), {})
        for word in word_sets[i]:
            bucket.setdefault(word, []).append(i)

    for i in survivors:
        short = word_sets[i]
        max_size = int(len(short) / threshold + 1e-9)
        for long_size in range(len(short) + 1, max_size + 1):
            same_size = postings.get((categories[i], long_size))
            if same_size and _has_container(i, short, same_size, signatures, word_sets):
                removed.add(i)
                break
    return removed


def _has_container(
    i: int,
    short: frozenset[str],
    bucket: dict[str, list[int]],
    signatures: list[tuple[str, ...]],
    word_sets: dict[int, frozenset[str]],
) -> bool:
    """Is there a fact in `bucket` (one size, one category) that implies fact `i`?"""
    # Every container holds all of `short`'s words: scan the shortest posting list.
    smallest: list[int] | None = None
    for word in short:
        posting = bucket.get(word)
        if posting is None:
            return False
        if smallest is None or len(posting) < len(smallest):
            smallest = posting
    for j in smallest or ():
        longer = word_sets[j]
        if (
            short <= longer
            and not (longer - short) & CONTRAST_WORDS
            and _is_subsequence(signatures[i], signatures[j])
        ):
            return True
    return False
