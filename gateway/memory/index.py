"""An incremental in-memory BM25 index with exact top-k search (MaxScore pruning).

Invariants:
- Updated incrementally: `add` and `remove` touch only the posting lists of the
  document's own terms. (Postings hold precomputed BM25 impacts against a reference
  average length; when the live average drifts more than 20% from it, all impacts are
  recomputed once, which is amortized O(1) per add.)
- A query touches only the posting lists of its own terms, never every document.
  Terms are scored rarest first; once no unseen document can beat the current k-th
  score, the remaining (common) terms are only probed for the candidates found. With
  a recency decay, posting lists are walked newest first and the walk stops where even
  a perfect match could no longer outrank the k-th result at that age.
- Results are exactly the BM25 top-k (times the recency weight in (0, 1] when asked);
  pruning only skips documents that provably cannot reach the top k.

Not thread-safe: the owner (MemoryManager, KnowledgeBase) holds a lock around it.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gateway.memory.text import tokenize

# BM25 length normalization uses a reference average document length; postings store
# the precomputed term-frequency part ("impact"). When the live average drifts further
# than this from the reference, every impact is recomputed (amortized O(1) per add:
# moving the average that far takes a number of new documents proportional to N).
_AVGDL_DRIFT = 0.2


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One ranked result: the document id, its score and its text."""

    doc_id: int
    score: float
    text: str


@dataclass(frozen=True, slots=True)
class _Term:
    upper_bound: float
    idf: float
    postings: dict[int, float]


def _kth_largest(scores: dict[int, float], k: int) -> float:
    return heapq.nlargest(k, scores.values())[-1]


class SearchIndex:
    """BM25 over short documents (a memory fact, a history line, a knowledge entry).

    Each document may carry a `tag` (e.g. a fact's category, filterable at query time)
    and a `timestamp` (epoch seconds, used by the optional recency decay).
    """

    def __init__(self, *, k1: float = 1.2, b: float = 0.75) -> None:
        self.k1 = k1
        self.b = b
        self._postings: dict[str, dict[int, float]] = {}
        self._max_impact: dict[str, float] = {}
        self._texts: list[str | None] = []
        self._lengths: list[int] = []
        self._tags: list[str | None] = []
        self._times: list[float | None] = []
        # Newest timestamp among ids <= d (no timestamp counts as +inf): a bound on
        # the recency weight of every document up to d.
        self._newest: list[float] = []
        self._tag_docs: dict[str, list[int]] = {}
        self._live = 0
        self._total_length = 0
        self._ref_avgdl = 0.0
        self._impacts: dict[tuple[int, int], float] = {}

    def __len__(self) -> int:
        return self._live

    @property
    def term_count(self) -> int:
        return len(self._postings)

    @property
    def reference_length(self) -> float:
        """The average document length the stored BM25 impacts were computed with."""
        return self._ref_avgdl

    def text(self, doc_id: int) -> str:
        text = self._texts[doc_id]
        if text is None:
            raise KeyError(f"document {doc_id} was removed")
        return text

    def add(self, text: str, *, tag: str | None = None, timestamp: float | None = None) -> int:
        """Index one document and return its id (ids increase in insertion order)."""
        return self._insert(text, tokenize(text), tag, timestamp)

    def add_many(self, docs: Iterable[tuple[str, str | None, float | None]]) -> list[int]:
        """Index `(text, tag, timestamp)` documents in one pass (used when a scope opens).

        The reference length is set from the whole batch first, so a bulk load never
        triggers a mid-way impact refresh.
        """
        batch = [(text, tokenize(text), tag, ts) for text, tag, ts in docs]
        if not batch:
            return []
        total = self._total_length + sum(len(tokens) for _, tokens, _, _ in batch)
        final_avgdl = max(total / (self._live + len(batch)), 1.0)
        if self._needs_refresh(final_avgdl):
            self._refresh(final_avgdl)
        return [
            self._insert(text, tokens, tag, ts, check_drift=False)
            for text, tokens, tag, ts in batch
        ]

    def remove(self, doc_id: int) -> None:
        """Drop a document; its id is never reused. Removing twice is a no-op."""
        text = self._texts[doc_id]
        if text is None:
            return
        for term in set(tokenize(text)):
            postings = self._postings.get(term)
            if postings is None:
                continue
            postings.pop(doc_id, None)
            if not postings:
                del self._postings[term]
                del self._max_impact[term]
            # A stale max impact is still a valid upper bound: left as it is.
        tag = self._tags[doc_id]
        if tag is not None:
            self._tag_docs[tag].remove(doc_id)
        self._texts[doc_id] = None
        self._live -= 1
        self._total_length -= self._lengths[doc_id]

    def latest(self, max_results: int, *, tag: str | None = None) -> list[SearchHit]:
        """The newest documents (optionally with `tag`), newest first; for empty queries."""
        ids: Sequence[int] = (
            self._tag_docs.get(tag, []) if tag is not None else range(len(self._texts))
        )
        hits: list[SearchHit] = []
        for doc_id in reversed(ids):
            if len(hits) >= max_results:
                break
            text = self._texts[doc_id]
            if text is not None:
                hits.append(SearchHit(doc_id, 0.0, text))
        return hits

    def search(
        self,
        query: str,
        max_results: int = 10,
        *,
        tag: str | None = None,
        decay_rate: float = 0.0,
        now: float | None = None,
    ) -> list[SearchHit]:
        """The top `max_results` documents by BM25, best first (newer first on ties).

        With `decay_rate` > 0 each score is multiplied by `1 / (1 + age_hours *
        decay_rate)`, age taken from the document's timestamp (no timestamp: no decay,
        a timestamp in the future counts as age 0). With `tag`, only documents carrying
        that tag are considered. Query terms are deduplicated.
        """
        if max_results <= 0 or self._live == 0:
            return []
        plan = self._plan(tokenize(query))
        if not plan:
            return []
        remaining = [0.0] * (len(plan) + 1)
        for i in range(len(plan) - 1, -1, -1):
            remaining[i] = remaining[i + 1] + plan[i].upper_bound
        rate = decay_rate / 3600.0 if decay_rate > 0 else 0.0
        clock = time.time() if now is None else now

        acc: dict[int, float] = {}
        cut = -1  # documents with an id <= cut provably cannot reach the top k
        for i, term in enumerate(plan):
            if len(acc) >= max_results:
                theta = _kth_largest(acc, max_results)
                if remaining[i] <= theta:
                    # No unseen document can reach the top k any more: keep only the
                    # candidates that still can and probe the remaining terms for them.
                    acc = {d: s for d, s in acc.items() if d > cut and s + remaining[i] > theta}
                    for rest in plan[i:]:
                        self._probe(acc, rest, rate, clock)
                    break
            if rate:
                cut = self._walk_newest_first(
                    acc, term, tag, rate, clock, cut, remaining[0], max_results
                )
            else:
                self._walk(acc, term, tag)
        if cut >= 0:
            acc = {d: s for d, s in acc.items() if d > cut}

        top = heapq.nlargest(max_results, ((s, d) for d, s in acc.items()))
        texts = self._texts
        return [SearchHit(d, s, texts[d] or "") for s, d in top]

    # -- internals ---------------------------------------------------------------

    def _plan(self, tokens: Iterable[str]) -> list[_Term]:
        n = self._live
        plan: list[_Term] = []
        for token in set(tokens):
            postings = self._postings.get(token)
            if not postings:
                continue
            df = len(postings)
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            plan.append(_Term(idf * self._max_impact[token], idf, postings))
        plan.sort(key=lambda t: t.upper_bound, reverse=True)
        return plan

    def _walk(self, acc: dict[int, float], term: _Term, tag: str | None) -> None:
        """Add `term`'s contribution for every document in its posting list."""
        idf = term.idf
        get = acc.get
        if tag is None:
            if not acc:
                acc.update({d: idf * v for d, v in term.postings.items()})
                return
            for d, v in term.postings.items():
                acc[d] = get(d, 0.0) + idf * v
            return
        tags = self._tags
        for d, v in term.postings.items():
            if tags[d] == tag:
                acc[d] = get(d, 0.0) + idf * v

    def _walk_newest_first(
        self,
        acc: dict[int, float],
        term: _Term,
        tag: str | None,
        rate: float,
        clock: float,
        cut: int,
        total_bound: float,
        k: int,
    ) -> int:
        """Add `term`'s decayed contribution, newest documents first; return the new cut.

        Posting lists are in increasing id order, and `_newest[d]` is the newest
        timestamp among ids <= d, so every document older than the walk's position
        scores at most `total_bound * weight(_newest[d - 1])`. Once that is no more
        than the current k-th score, the walk stops and the older ids are cut for
        every later term too. The check runs after as many steps as there are
        candidates, so its cost stays proportional to the walk.
        """
        idf = term.idf
        get = acc.get
        tags = self._tags
        times = self._times
        newest = self._newest
        budget = max(64, len(acc))
        steps = 0
        for d, v in reversed(term.postings.items()):
            if d <= cut:
                break
            if tag is not None and tags[d] != tag:
                continue
            score = idf * v
            ts = times[d]
            if ts is not None and ts < clock:
                score /= 1.0 + (clock - ts) * rate
            acc[d] = get(d, 0.0) + score
            steps += 1
            if steps >= budget:
                steps = 0
                budget = max(64, len(acc))
                bound_ts = newest[d - 1] if d > 0 else clock
                if len(acc) >= k and bound_ts < clock:
                    bound = total_bound / (1.0 + (clock - bound_ts) * rate)
                    if bound <= _kth_largest(acc, k):
                        return d - 1
        return cut

    def _probe(self, acc: dict[int, float], term: _Term, rate: float, clock: float) -> None:
        """Add `term`'s contribution only for the documents already in `acc`."""
        idf = term.idf
        postings = term.postings
        times = self._times
        for d in list(acc):
            v = postings.get(d)
            if v is None:
                continue
            score = idf * v
            if rate:
                ts = times[d]
                if ts is not None and ts < clock:
                    score /= 1.0 + (clock - ts) * rate
            acc[d] += score

    def _needs_refresh(self, avgdl: float) -> bool:
        if self._ref_avgdl <= 0.0:
            return True
        return abs(avgdl / self._ref_avgdl - 1.0) > _AVGDL_DRIFT

    def _insert(
        self,
        text: str,
        tokens: list[str],
        tag: str | None,
        timestamp: float | None,
        *,
        check_drift: bool = True,
    ) -> int:
        doc_id = len(self._texts)
        self._texts.append(text)
        self._lengths.append(len(tokens))
        self._tags.append(tag)
        self._times.append(timestamp)
        previous = self._newest[-1] if self._newest else -math.inf
        self._newest.append(max(previous, math.inf if timestamp is None else timestamp))
        if tag is not None:
            self._tag_docs.setdefault(tag, []).append(doc_id)
        self._live += 1
        self._total_length += len(tokens)
        avgdl = max(self._total_length / self._live, 1.0)
        if check_drift and self._needs_refresh(avgdl):
            self._refresh(avgdl)  # indexes the new document's terms too
            return doc_id
        self._index_terms(doc_id, tokens)
        return doc_id

    def _index_terms(self, doc_id: int, tokens: list[str]) -> None:
        # Ids only grow, so every posting list stays in increasing id order (the
        # newest-first walk relies on it).
        counts: dict[str, int] = {}
        for token in tokens:
            counts[token] = counts.get(token, 0) + 1
        k1 = self.k1
        length = len(tokens)
        norm = k1 * (1.0 - self.b + self.b * length / self._ref_avgdl)
        postings_of = self._postings
        max_impact = self._max_impact
        shared = self._impacts
        for term, tf in counts.items():
            # One float object per (tf, length) instead of one per posting: it is the
            # same value, and postings are most of the index's memory.
            impact = shared.get((tf, length))
            if impact is None:
                impact = shared[(tf, length)] = tf * (k1 + 1.0) / (tf + norm)
            postings = postings_of.get(term)
            if postings is None:
                postings_of[term] = {doc_id: impact}
                max_impact[term] = impact
            else:
                postings[doc_id] = impact
                if impact > max_impact[term]:
                    max_impact[term] = impact

    def _refresh(self, avgdl: float) -> None:
        """Recompute every impact against a new reference length (rare, see module doc)."""
        self._ref_avgdl = max(avgdl, 1.0)
        self._impacts = {}
        self._postings = {}
        self._max_impact = {}
        for doc_id, text in enumerate(self._texts):
            if text is not None:
                self._index_terms(doc_id, tokenize(text))
