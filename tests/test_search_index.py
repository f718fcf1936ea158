"""The tokenizer and the incremental BM25 index: ranking, exactness of pruning, cost."""

from __future__ import annotations

import math
import random
import re
import unicodedata
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.memory.index import IndexFileError, SearchIndex
from gateway.memory.text import _WORD_RE as WORD_RE
from gateway.memory.text import STOPWORDS, normalize_text, one_line, stem, tokenize, words

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


def _reference_words(text: str) -> list[str]:
    """`words` as its docstring defines it, on any text (no ASCII fast path)."""
    out: list[str] = []
    for word in WORD_RE.findall(unicodedata.normalize("NFKC", text).casefold()):
        if "'" in word or "\u2019" in word:
            word = word.replace("\u2019", "'")
            if word.endswith("n't"):
                out += [*{"can't": ["can"], "won't": ["will"]}.get(word, []), "not"]
                continue
            word = word.split("'", 1)[0]
        out.append(word)
    return out


def _reference_tokens(text: str) -> list[str]:
    """`tokenize` as its docstring defines it, word by word (no fast path)."""
    return [stem(w) for w in _reference_words(text) if w not in STOPWORDS]


_TEXTS = st.text(
    alphabet=st.sampled_from(list("abcXYZ019 '\u2019\n\t_-.!éßİ東京ﬁ\uff21")) | st.characters(),
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(_TEXTS)
def test_words_and_tokenize_agree_with_their_definition_on_any_text(text: str) -> None:
    """The ASCII fast path changes the cost, never the words or the tokens."""
    assert words(text) == _reference_words(text)
    expected = _reference_tokens(text)
    assert tokenize(text) == expected


@settings(max_examples=400, deadline=None)
@given(_TEXTS)
def test_one_line_and_normalize_text_agree_with_their_definition_on_any_text(
    text: str,
) -> None:
    """Their fast path (a text already folded is returned as it is) changes nothing."""
    assert one_line(text) == re.sub(r"\s+", " ", text).strip()
    nfkc = unicodedata.normalize("NFKC", text)
    assert normalize_text(text) == re.sub(r"\s+", " ", nfkc.casefold()).strip()


def test_a_contraction_gives_one_token_at_most() -> None:
    """The auxiliaries "n't" contractions expand to are stopwords: a contraction is
    searched as its negation."""
    assert tokenize("can't won't doesn't user's") == ["not", "not", "not", "user"]
    assert {"can", "will"} <= STOPWORDS


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


def _random_index(
    rng: random.Random, words: int, longest: int, count: int, *, undated: bool = False
) -> tuple[SearchIndex, dict[int, tuple[str, str | None, float | None, Counter[str]]]]:
    """An index with a merged segment, a tail and removals in both, plus what it holds."""
    vocabulary = [f"w{i}" for i in range(words)]
    weights = [1 / (i + 1) for i in range(len(vocabulary))]
    now = 2_000_000_000.0
    index = SearchIndex()
    docs: dict[int, tuple[str, str | None, float | None, Counter[str]]] = {}
    for i in range(count):
        if i == count * 2 // 3:
            index.merge()  # the rest stays in the tail
        text = " ".join(rng.choices(vocabulary, weights, k=rng.randint(1, longest)))
        tag = rng.choice(["a", "b", None])
        # Mostly chronological with some disorder (and maybe lines without a timestamp).
        ts: float | None = now - (count - i) * 3600.0 + rng.uniform(-20, 20) * 3600
        if undated and i % 97 == 0:
            ts = None
        docs[index.add(text, tag=tag, timestamp=ts)] = (text, tag, ts, Counter(tokenize(text)))
    for doc_id in rng.sample(sorted(docs), count // 15):
        index.remove(doc_id)
        del docs[doc_id]
    return index, docs


@pytest.mark.parametrize(
    ("words", "longest", "undated"),
    [(40, 12, False), (40, 12, True), (6, 40, False)],
    ids=["zipf-short", "zipf-short-undated", "few-words-long"],
)
def test_pruned_search_equals_brute_force(words: int, longest: int, undated: bool) -> None:
    rng = random.Random(7)
    index, docs = _random_index(rng, words, longest, 3000, undated=undated)
    vocabulary = [f"w{i}" for i in range(words)]
    now = 2_000_000_000.0
    for _ in range(60):
        query = " ".join(rng.choices(vocabulary, k=rng.randint(1, 6)))
        configs = [(10, None, 0.0), (1, None, 0.0), (3, "a", 0.0), (10, None, 0.01), (5, "b", 0.5)]
        for k, tag, rate in configs:
            got = [h.score for h in index.search(query, k, tag=tag, decay_rate=rate, now=now)]
            want = _reference(index, docs, query, k, tag, rate, now)
            assert got == pytest.approx(want, rel=1e-6), (query, k, tag, rate)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    words=st.integers(2, 30),
    longest=st.integers(1, 15),
    count=st.integers(1, 700),
    k=st.integers(1, 25),
    tag=st.sampled_from([None, "a"]),
    rate=st.sampled_from([0.0, 0.001, 0.3]),
)
def test_top_k_equals_exhaustive_scoring(
    seed: int, words: int, longest: int, count: int, k: int, tag: str | None, rate: float
) -> None:
    """Property: whatever the corpus, block-max pruning returns the exhaustive top k."""
    rng = random.Random(seed)
    index, docs = _random_index(rng, words, longest, count)
    now = 2_000_000_000.0
    for _ in range(5):
        query = " ".join(f"w{rng.randrange(words + 1)}" for _ in range(rng.randint(1, 5)))
        got = [h.score for h in index.search(query, k, tag=tag, decay_rate=rate, now=now)]
        assert got == pytest.approx(_reference(index, docs, query, k, tag, rate, now), rel=1e-6)


def test_impacts_follow_the_average_length_as_documents_are_added() -> None:
    index = SearchIndex()
    index.add("short")
    for i in range(200):
        index.add(" ".join(f"long{i}x{j}" for j in range(20)) + " short")
    assert index.reference_length == pytest.approx(
        sum(len(tokenize(index.text(d))) for d in range(201)) / 201, rel=0.2
    )


# -- cost and ranking on common words ----------------------------------------------


def _common_word_corpus(lines: int, rng: random.Random) -> tuple[list[str], list[str]]:
    """Lines of 8-10 words from a 30-word vocabulary (each word in ~27% of lines)."""
    common = [f"c{i:02d}" for i in range(30)]
    return common, [" ".join(rng.choices(common, k=rng.randint(8, 10))) for _ in range(lines)]


@pytest.mark.parametrize("decay", [0.0, 0.001])
def test_rare_word_line_comes_first_among_common_words(decay: float) -> None:
    """3 common words + 1 rare one: the rare word's line is first (>= 19 of 20), with
    and without recency decay, and pruning skips most postings of the common words.

    The lines span the last 7 days (decay weights 0.86-1 at 0.001/hour). Over a year
    a 300-day-old rare line (weight 0.12) loses to fresh common-word lines: that is
    the decay doing what it is asked, and exhaustive scoring ranks it the same."""
    rng = random.Random(11)
    common, texts = _common_word_corpus(20_000, rng)
    now = 2_000_000_000.0
    step = 7 * 86400 / len(texts)
    rare_at = {rng.randrange(len(texts)): f"rare{q}" for q in range(20)}
    index = SearchIndex()
    for i, text in enumerate(texts):
        word = rare_at.get(i)
        index.add(f"{text} {word}" if word else text, timestamp=now - (len(texts) - i) * step)
    postings = sum(len(p) for p in index._tail_post.values()) + len(index._seg.p_doc)
    first = 0
    scored: list[int] = []
    for doc, word in rare_at.items():
        query = " ".join([*rng.sample(common, 3), word])
        hits = index.search(query, 20, decay_rate=decay, now=now)
        first += hits[0].doc_id == doc
        scored.append(index.scored_postings)
    assert first >= 19
    assert sorted(scored)[10] < postings * 0.3 * 3 / 2  # median: well below 3 lists' worth


def test_search_touches_only_the_postings_of_its_terms() -> None:
    index = SearchIndex()
    for i in range(3000):
        index.add(f"common filler{i % 50} topic{i % 7}", timestamp=float(i))
    index.add("the rare needle sits here", timestamp=3000.0)
    index.merge()
    hits = index.search("needle common", 1)
    assert hits[0].text == "the rare needle sits here"
    assert index.scored_postings < 3001 / 2  # not every posting of "common"
    assert index.search("needle common", decay_rate=0.1, now=4000.0)[0].text.startswith("the")


# -- persistence -------------------------------------------------------------------


def test_saved_index_loads_with_the_same_results(tmp_path: Path) -> None:
    rng = random.Random(3)
    index, _ = _random_index(rng, 30, 10, 2500)
    index.add("a tail document after the merge", tag="a", timestamp=5.0)
    path = tmp_path / "x.index"
    index.save(path, {"covers": 42})
    loaded, meta = SearchIndex.load(path)
    assert meta == {"covers": 42}
    assert len(loaded) == len(index)
    for query in ("w1 w2", "w3", "tail document", "w0 w5 w9"):
        for kwargs in ({}, {"tag": "a"}, {"decay_rate": 0.01, "now": 2e9}):
            want = [(h.doc_id, h.text) for h in index.search(query, 7, **kwargs)]  # type: ignore[arg-type]
            assert [(h.doc_id, h.text) for h in loaded.search(query, 7, **kwargs)] == want  # type: ignore[arg-type]
    assert loaded.latest(3, tag="a")[0].text == "a tail document after the merge"
    new = loaded.add("added after loading")
    assert loaded.search("loading")[0].doc_id == new == index.doc_count


@pytest.mark.parametrize("cut", [0, 10, 100, -1])
def test_damaged_index_file_is_refused(tmp_path: Path, cut: int) -> None:
    index = SearchIndex()
    index.add("some text here")
    path = tmp_path / "x.index"
    index.save(path, {})
    data = path.read_bytes()
    flipped = data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
    damaged = flipped if cut == -1 else data[:cut]
    path.write_bytes(damaged)
    with pytest.raises(IndexFileError):
        SearchIndex.load(path)
    with pytest.raises(IndexFileError, match="no index"):
        SearchIndex.load(tmp_path / "missing.index")


# -- bulk building, one-batch scoring, what a saved file holds ---------------------------


@pytest.mark.parametrize("one_batch_docs", [0, 1 << 30], ids=["pruned", "one-batch"])
def test_both_ways_of_scoring_a_segment_equal_brute_force(
    one_batch_docs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small segment is scored in one batch, a large one block by block: both exact
    (pinned to each way here, whatever the segment's size)."""
    import gateway.memory.index as index_module

    monkeypatch.setattr(index_module, "_ONE_BATCH_DOCS", one_batch_docs)
    rng = random.Random(17)
    index, docs = _random_index(rng, 25, 12, 1500)
    vocabulary = [f"w{i}" for i in range(25)]
    now = 2_000_000_000.0
    for _ in range(40):
        query = " ".join(rng.choices(vocabulary, k=rng.randint(1, 6)))
        for k, tag, rate in [(10, None, 0.0), (1, None, 0.0), (3, "a", 0.0), (5, None, 0.01)]:
            got = [h.score for h in index.search(query, k, tag=tag, decay_rate=rate, now=now)]
            want = _reference(index, docs, query, k, tag, rate, now)
            assert got == pytest.approx(want, rel=1e-6), (query, k, tag, rate)


def test_a_bulk_batch_indexes_exactly_as_documents_added_one_by_one() -> None:
    """`add_many` of a batch past the merge threshold builds the segment at once (flat
    term lists, one merge): the same ids, texts, scores and order as `add` one by one
    and a merge (impacts are against the average length at the last merge)."""
    rng = random.Random(5)
    vocabulary = [f"w{i}" for i in range(40)]
    docs = [
        (
            # Multi-line documents repeat lines, as a message indexed with the one before.
            "\n".join(" ".join(rng.choices(vocabulary, k=rng.randint(1, 8))) for _ in range(2)),
            rng.choice(["a", "b", None]),
            float(i) if i % 13 else None,
        )
        for i in range(3000)
    ]
    for i in range(1, len(docs)):  # each document's second line is the next one's first
        text, tag, ts = docs[i]
        docs[i] = (docs[i - 1][0].split("\n")[1] + "\n" + text.split("\n")[1], tag, ts)
    one = SearchIndex()
    for text, tag, ts in docs:
        one.add(text, tag=tag, timestamp=ts)
    one.merge()
    bulk = SearchIndex()
    assert bulk.add_many(iter(docs)) == list(range(len(docs)))
    assert bulk.unmerged == 0 and len(bulk) == len(one) == len(docs)
    assert bulk.reference_length == pytest.approx(one.reference_length)
    for doc in (0, 1, 1234, 2999):
        assert bulk.text(doc) == one.text(doc)
        assert bulk.timestamp(doc) == one.timestamp(doc)
    for doc in rng.sample(range(len(docs)), 100):
        bulk.remove(doc)
        one.remove(doc)
    for _ in range(50):
        query = " ".join(rng.choices(vocabulary, k=rng.randint(1, 5)))
        for kwargs in ({}, {"tag": "a"}, {"decay_rate": 0.5, "now": 4000.0}):
            want = [(h.doc_id, h.score) for h in one.search(query, 9, **kwargs)]  # type: ignore[arg-type]
            got = [(h.doc_id, h.score) for h in bulk.search(query, 9, **kwargs)]  # type: ignore[arg-type]
            assert [d for d, _ in got] == [d for d, _ in want]
            assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6)


@settings(max_examples=200, deadline=None)
@given(
    first=st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=40),
    second=st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=40),
)
def test_tokens_never_span_a_line(first: str, second: str) -> None:
    """What the bulk build relies on to tokenize a document line by line (a line it
    tokenized for the document before is not tokenized again)."""
    assert tokenize(f"{first}\n{second}") == tokenize(first) + tokenize(second)


def test_an_index_saved_by_another_tokenizer_is_refused_as_out_of_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.memory.index as index_module

    index = SearchIndex()
    index.add("deploying databases")
    path = tmp_path / "x.index"
    index.save(path, {})
    monkeypatch.setattr(index_module, "TOKENIZER", "another")
    with pytest.raises(IndexFileError, match="out of date"):
        SearchIndex.load(path)


def test_a_saved_index_holds_no_word_of_a_removed_document(tmp_path: Path) -> None:
    index = SearchIndex()
    index.add_many((f"ordinary line {i}", None, None) for i in range(2000))
    secret = index.add("the vault combination is quokkaseven")
    kept = index.add("another ordinary line")
    index.merge()
    index.remove(secret)
    path = tmp_path / "x.index"
    index.save(path, {})
    assert b"quokkaseven" not in path.read_bytes()
    loaded, _ = SearchIndex.load(path)
    assert loaded.search("quokkaseven") == []
    assert loaded.search("another")[0].doc_id == kept
    assert loaded.doc_count == index.doc_count  # ids are never reused
