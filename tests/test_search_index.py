"""The tokenizer and the incremental BM25 index: ranking, exactness of pruning, cost."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from gateway.memory.index import SearchIndex
from gateway.memory.text import normalize_text, stem, tokenize

# -- tokenizer -------------------------------------------------------------------


def test_tokenize_lowercases_splits_unicode_and_drops_stopwords() -> None:
    assert tokenize("The User moved to Zürich and TOKYO 東京") == [
        "user",
        "mov",
        "zürich",
        "tokyo",
        "東京",
    ]


def test_tokenize_keeps_negations_and_resolves_contractions() -> None:
    assert tokenize("She doesn't like cron") == ["not", "like", "cron"]
    assert tokenize("never deploy on fridays") == ["never", "deploy", "friday"]
    assert tokenize("the user's laptop") == ["user", "laptop"]


def test_stem_joins_common_inflections() -> None:
    assert stem("decisions") == stem("decision")
    assert stem("deploying") == stem("deployed") == stem("deploy")
    assert stem("databases") == stem("database")
    assert stem("dropped") == stem("drop")
    assert stem("東京") == "東京"
    assert stem("bus") == "bus"


def test_normalize_text_folds_case_width_and_spacing() -> None:
    assert normalize_text("  Prefers\tDARK   mode ") == "prefers dark mode"
    assert normalize_text("\uff46\uff55\uff4c\uff4c width") == "full width"  # full-width


# -- ranking ---------------------------------------------------------------------


def test_multi_word_query_ranks_documents_matching_more_and_rarer_terms_first() -> None:
    index = SearchIndex()
    docs = [
        "postgres is the primary database",
        "the database backups run nightly",
        "redis caches sessions",
        "postgres replicas run in two regions",
        "the database is postgres with nightly backups",
    ]
    for doc in docs:
        index.add(doc)
    hits = index.search("postgres nightly backups", 5)
    assert hits[0].text == "the database is postgres with nightly backups"
    assert {h.text for h in hits} == {docs[0], docs[1], docs[3], docs[4]}
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def test_single_word_query_and_unknown_words() -> None:
    index = SearchIndex()
    index.add("alpha beta")
    index.add("gamma")
    assert [h.text for h in index.search("gamma")] == ["gamma"]
    assert index.search("zeta") == []
    assert index.search("the of and") == []  # stopwords only


def test_new_documents_are_searchable_at_once() -> None:
    index = SearchIndex()
    index.add("first note about kubernetes")
    assert index.search("terraform") == []
    index.add("switched to terraform")
    assert [h.text for h in index.search("terraform")] == ["switched to terraform"]


def test_tag_filter_and_latest() -> None:
    index = SearchIndex()
    index.add("uses vim", tag="user_preference")
    index.add("uses vim for config files", tag="learned_fact")
    index.add("uses emacs", tag="user_preference")
    hits = index.search("vim", tag="user_preference")
    assert [h.text for h in hits] == ["uses vim"]
    assert [h.text for h in index.latest(5, tag="user_preference")] == ["uses emacs", "uses vim"]
    assert [h.text for h in index.latest(2)] == ["uses emacs", "uses vim for config files"]


def test_removed_documents_are_never_returned() -> None:
    index = SearchIndex()
    a = index.add("solar panels on the roof")
    index.add("solar inverter model")
    index.remove(a)
    index.remove(a)  # twice is a no-op
    assert len(index) == 1
    assert [h.text for h in index.search("solar roof")] == ["solar inverter model"]
    with pytest.raises(KeyError):
        index.text(a)


def test_recency_decay_ranks_newer_lines_first() -> None:
    index = SearchIndex()
    hour = 3600.0
    now = 1_000 * hour
    index.add("deploy failed on staging cluster", timestamp=now - 900 * hour)
    index.add("deploy failed", timestamp=now - 1 * hour)
    plain = index.search("deploy failed staging cluster", 2, now=now)
    assert plain[0].text == "deploy failed on staging cluster"
    decayed = index.search("deploy failed staging cluster", 2, decay_rate=0.01, now=now)
    assert decayed[0].text == "deploy failed"


# -- exactness of the pruned top-k against a brute-force BM25 ----------------------


def _reference(
    index: SearchIndex,
    docs: dict[int, tuple[str, str | None, float | None, Counter[str]]],
    query: str,
    k: int,
    tag: str | None,
    rate: float,
    now: float,
) -> list[float]:
    """Scores of the top k by a straightforward BM25 over every live document."""
    n = len(docs)
    avgdl = index.reference_length
    terms = set(tokenize(query))
    df = {t: sum(1 for *_, counts in docs.values() if counts[t]) for t in terms}
    scores: list[float] = []
    for _, doc_tag, ts, counts in docs.values():
        if tag is not None and doc_tag != tag:
            continue
        length = sum(counts.values())
        score = 0.0
        for term in terms:
            tf = counts[term]
            if not tf:
                continue
            idf = math.log(1 + (n - df[term] + 0.5) / (df[term] + 0.5))
            norm = index.k1 * (1 - index.b + index.b * length / avgdl)
            score += idf * tf * (index.k1 + 1) / (tf + norm)
        if score > 0 and rate and ts is not None and ts < now:
            score /= 1 + (now - ts) / 3600.0 * rate
        if score > 0:
            scores.append(score)
    return sorted(scores, reverse=True)[:k]


@pytest.mark.parametrize(
    ("words", "longest", "untimestamped"),
    [(40, 12, False), (40, 12, True), (6, 40, False)],
    ids=["zipf-short", "zipf-short-undated", "few-words-long"],
)
def test_pruned_search_equals_brute_force(
    monkeypatch: pytest.MonkeyPatch, words: int, longest: int, untimestamped: bool
) -> None:
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(words)]
    weights = [1 / (i + 1) for i in range(len(vocabulary))]
    now = 2_000_000_000.0
    index = SearchIndex()
    docs: dict[int, tuple[str, str | None, float | None, Counter[str]]] = {}
    for i in range(1500):
        text = " ".join(rng.choices(vocabulary, weights, k=rng.randint(1, longest)))
        tag = rng.choice(["a", "b", None])
        # Mostly chronological with some disorder (and maybe lines without a timestamp).
        ts: float | None = now - (1500 - i) * 3600.0 + rng.uniform(-20, 20) * 3600
        if untimestamped and i % 97 == 0:
            ts = None
        docs[index.add(text, tag=tag, timestamp=ts)] = (text, tag, ts, Counter(tokenize(text)))
    for doc_id in rng.sample(sorted(docs), 100):
        index.remove(doc_id)
        del docs[doc_id]

    cuts: list[int] = []
    original = SearchIndex._walk_newest_first

    def spy(self: SearchIndex, *args: Any) -> int:
        cut = original(self, *args)
        cuts.append(cut)
        return cut

    monkeypatch.setattr(SearchIndex, "_walk_newest_first", spy)
    for _ in range(60):
        query = " ".join(rng.choices(vocabulary, weights, k=rng.randint(1, 6)))
        configs = [(10, None, 0.0), (1, None, 0.0), (3, "a", 0.0), (10, None, 0.01), (5, "b", 0.5)]
        for k, tag, rate in configs:
            got = [h.score for h in index.search(query, k, tag=tag, decay_rate=rate, now=now)]
            want = _reference(index, docs, query, k, tag, rate, now)
            assert got == pytest.approx(want, rel=1e-9), (query, k, tag, rate)
    if not untimestamped:  # an undated document bounds the weight of all later ones by 1
        assert any(cut >= 0 for cut in cuts), "the newest-first cut was never exercised"


def test_impacts_follow_the_average_length_as_documents_are_added() -> None:
    index = SearchIndex()
    index.add("short")
    for i in range(200):
        index.add(" ".join(f"long{i}x{j}" for j in range(20)) + " short")
    assert index.reference_length == pytest.approx(
        sum(len(tokenize(index.text(d))) for d in range(201)) / 201, rel=0.2
    )


# -- cost: a query touches only its own terms --------------------------------------


class _Untouchable(dict[int, float]):
    def _fail(self, *args: object, **kwargs: object) -> Any:
        raise AssertionError("a query touched the posting list of a term it does not use")

    items = keys = values = get = __getitem__ = __iter__ = __contains__ = _fail


def test_query_touches_only_the_posting_lists_of_its_terms() -> None:
    index = SearchIndex()
    for i in range(3000):
        index.add(f"common filler{i % 50} topic{i % 7}", timestamp=float(i))
    index.add("the rare needle sits here", timestamp=3000.0)
    postings = index._postings
    used = set(tokenize("needle common"))
    for term in list(postings):
        if term not in used:
            postings[term] = _Untouchable(postings[term])
    assert index.search("needle common")[0].text == "the rare needle sits here"
    assert index.search("needle common", decay_rate=0.1, now=4000.0)[0].text.startswith("the")
