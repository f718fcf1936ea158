"""The near-duplicate layer as shipped (MiniLM, the guard, thresholds kept under
`near_duplicate_max_error`): its false hits on paraphrase data it was not tuned on, its
hit rate on an FAQ-like stream, and the CPU it adds to a turn.

    .venv/bin/python bench/cache_verified.py            # the tables
    .venv/bin/python bench/cache_verified.py --json     # the same as JSON

1. Held-out pairs: the held-out part of tests/public_pairs.py (302 pairs; the guard and
   MiniLM's prior threshold were chosen on the other part) plus the hard negatives
   bench/embeddings.py generates from its positives (word order, a number, a name, a
   negation). Every distinct cached question is stored; the new questions come in a
   shuffled order (5 orders), each looked up once. A candidate not served is labelled
   with the truth (the pair's label; a candidate that is not the pair's own question is
   wrong), as the model's answer would label it in the gateway. Rows: the static
   threshold (the layer before this change) and the verified thresholds at 1%.
2. FAQ-like stream: no public FAQ log with paraphrases is in the data folder, so one is
   built from the same held-out pairs: each pair labelled same is one FAQ with two
   wordings, each other question its own FAQ; 5,000 requests pick an FAQ by Zipf
   popularity (s = 1.1) and one of its wordings at random. It runs through
   `SemanticCache` itself (SQLite, MiniLM, one embedding per turn shared with the
   lookup) with a stand-in model that answers every wording of one FAQ with the same
   text, so the labels come from the gateway's own comparison of answers; a served
   near-duplicate is judged wrong when it is another FAQ's answer.
3. CPU: process CPU time (all threads) per request of the stream: the turn's one
   embedding, the lookup, both (`cpu_turn`), against the exact layer alone; and the
   label (two answers compared) on a turn that explored.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loguru import logger  # noqa: E402

from bench.embeddings import hard_negatives  # noqa: E402
from gateway.cache import CacheContext, CacheSettings, SemanticCache  # noqa: E402
from gateway.cache.neardup import MiniLMEmbedder, NearDuplicateIndex  # noqa: E402
from gateway.cache.policy import (  # noqa: E402
    MINILM_CANDIDATE_FLOOR,
    MINILM_NEAR_DUPLICATE_THRESHOLD,
    normalize_query,
)
from gateway.cache.sqlite_backend import SqliteCacheBackend  # noqa: E402
from gateway.cache.verified import (  # noqa: E402
    Observation,
    Verdict,
    verdict,
    wrong_rate_bound,
)
from tests.public_pairs import public_pairs  # noqa: E402

MAX_ERROR = 0.01
ORDERS = 5
STREAM_REQUESTS = 5_000
ZIPF_S = 1.1


class Memo:
    """The embedder with a memory, so five orders embed each text once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seen: dict[str, Any] = {}

    def embed(self, texts: list[str]) -> Any:
        import numpy as np

        missing = [t for t in texts if t not in self.seen]
        if missing:
            for text, vector in zip(missing, self.inner.embed(missing), strict=True):
                self.seen[text] = vector
        return np.stack([self.seen[t] for t in texts])


@dataclass
class PairsRow:
    policy: str
    lookups: int
    positives: int
    served: int
    wrong: int
    false_hit_rate: float  # wrong / served
    bound_95: float  # Wilson's one-sided 95% upper bound on it
    recall: float  # right hits / positives
    labels: int


def held_out_pairs() -> list[tuple[str, str, bool]]:
    held = public_pairs("held-out")
    return held + list(hard_negatives(held))


async def pairs_row(embedder: Any, verified: bool) -> PairsRow:
    pairs = held_out_pairs()
    stored = list(dict.fromkeys(normalize_query(a) for a, _, _ in pairs))
    rows = [(f"k{i}", q) for i, q in enumerate(stored)]
    own = {normalize_query(b): set() for _, b, _ in pairs}
    for a, b, same in pairs:
        if same:
            own[normalize_query(b)].add(normalize_query(a))
    served = wrong = right = labels = 0
    positives = sum(1 for *_, same in pairs if same)

    async def load() -> list[tuple[str, str]]:
        return rows

    for order in range(ORDERS):
        index = NearDuplicateIndex(
            embedder,
            threshold=MINILM_CANDIDATE_FLOOR if verified else MINILM_NEAR_DUPLICATE_THRESHOLD,
            prior=MINILM_NEAR_DUPLICATE_THRESHOLD,
            max_error=MAX_ERROR,
            refresh_seconds=math.inf,
        )
        queries = [normalize_query(b) for _, b, _ in pairs]
        random.Random(order).shuffle(queries)
        seen = 0
        for query in queries:
            match = await index.find("p", query, load)
            if match is None or match.query == query:
                continue  # a miss, or the very text stored (the exact layer's)
            correct = match.query in own[query]
            seen += match.similarity >= match.threshold
            chosen = (
                verdict(match.similarity, match.threshold, servable_seen=seen, audit_rate=0.05)
                if verified
                else (Verdict.SERVE if match.similarity >= match.threshold else Verdict.EXPLORE)
            )
            if chosen is Verdict.SERVE:
                served += 1
                wrong += not correct
                right += correct
            elif verified:
                labels += 1
                index.observe("p", match.key, Observation(match.similarity, correct))
    return PairsRow(
        policy=f"verified, max_error {MAX_ERROR:.0%}" if verified else "static 0.985",
        lookups=len(pairs) * ORDERS,
        positives=positives * ORDERS,
        served=served,
        wrong=wrong,
        false_hit_rate=round(wrong / served, 4) if served else 0.0,
        bound_95=round(wrong_rate_bound(wrong, served), 4),
        recall=round(right / (positives * ORDERS), 3),
        labels=labels,
    )


@dataclass
class StreamRow:
    layer: str
    requests: int
    faqs: int
    exact_hits: int
    near_hits: int
    near_wrong: int
    hit_rate: float
    near_hit_rate: float
    explorations: int
    audits: int
    labels_correct: int
    labels_wrong: int
    cpu_embed_p50_ms: float
    cpu_lookup_p50_ms: float
    cpu_turn_p50_ms: float
    cpu_turn_p99_ms: float
    cpu_label_p50_ms: float


def faqs() -> list[list[str]]:
    """Each FAQ's wordings: a pair labelled same is one FAQ; every other text its own."""
    groups: list[list[str]] = []
    placed: set[str] = set()
    for a, b, same in held_out_pairs():
        if same and a not in placed and b not in placed:
            groups.append([a, b])
            placed.update((a, b))
    for a, b, _ in held_out_pairs():
        for text in (a, b):
            if text not in placed:
                groups.append([text])
                placed.add(text)
    return groups


async def stream_row(near_duplicates: bool) -> StreamRow:
    groups = faqs()
    rng = random.Random(41)
    order = list(range(len(groups)))
    rng.shuffle(order)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(len(order))]
    group_of = {normalize_query(t): g for g, texts in enumerate(groups) for t in texts}
    answers = {g: f"Answer {g}: {texts[0]}" for g, texts in enumerate(groups)}
    with tempfile.TemporaryDirectory() as tmp:
        cache = SemanticCache(
            SqliteCacheBackend(Path(tmp) / "c.sqlite3"),
            CacheSettings(near_duplicates=near_duplicates, near_duplicate_model="minilm"),
        )
        await cache.warm_up()
        exact = near = near_wrong = 0
        embed_cpu: list[float] = []
        lookup_cpu: list[float] = []
        turn_cpu: list[float] = []
        label_cpu: list[float] = []
        for i in range(STREAM_REQUESTS):
            g = order[rng.choices(range(len(order)), weights)[0]]
            text = rng.choice(groups[g])
            ctx = CacheContext(query=text, model="m", temperature=0.0, session_key=f"s:{i % 50}")
            t0 = time.process_time()
            vector = await cache.embed_query(text)
            t1 = time.process_time()
            hit = await cache.lookup(ctx, query_vector=vector)
            t2 = time.process_time()
            embed_cpu.append(t1 - t0)
            lookup_cpu.append(t2 - t1)
            turn_cpu.append(t2 - t0)
            if hit is not None:
                if hit.match == "exact":
                    exact += 1
                else:
                    near += 1
                    near_wrong += hit.response != answers[g]
                continue
            before = cache.near_counts.labels_correct + cache.near_counts.labels_wrong
            t0 = time.process_time()
            await cache.store(ctx, answers[group_of[normalize_query(text)]])
            spent = time.process_time() - t0
            if cache.near_counts.labels_correct + cache.near_counts.labels_wrong > before:
                label_cpu.append(spent)  # this turn's store compared two answers
        counts = cache.near_counts
        await cache.aclose()
    ms = sorted(1000 * s for s in turn_cpu)
    return StreamRow(
        layer="exact + near" if near_duplicates else "exact only",
        requests=STREAM_REQUESTS,
        faqs=len(groups),
        exact_hits=exact,
        near_hits=near,
        near_wrong=near_wrong,
        hit_rate=round((exact + near) / STREAM_REQUESTS, 3),
        near_hit_rate=round(near / STREAM_REQUESTS, 3),
        explorations=counts.explorations,
        audits=counts.audits,
        labels_correct=counts.labels_correct,
        labels_wrong=counts.labels_wrong,
        cpu_embed_p50_ms=round(1000 * statistics.median(embed_cpu), 2),
        cpu_lookup_p50_ms=round(1000 * statistics.median(lookup_cpu), 2),
        cpu_turn_p50_ms=round(statistics.median(ms), 2),
        cpu_turn_p99_ms=round(ms[int(len(ms) * 0.99)], 2),
        cpu_label_p50_ms=round(1000 * statistics.median(label_cpu), 2) if label_cpu else 0.0,
    )


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "|".join(" --- " for _ in keys) + "|"]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


async def run(only_stream: bool) -> dict[str, Any]:
    pairs = []
    if not only_stream:
        embedder = Memo(MiniLMEmbedder())
        pairs = [asdict(await pairs_row(embedder, verified)) for verified in (False, True)]
    stream = [asdict(await stream_row(near)) for near in (False, True)]
    return {"pairs": pairs, "stream": stream}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only-stream", action="store_true", help="the FAQ stream alone")
    args = parser.parse_args(argv)
    logger.remove()
    result = anyio.run(run, args.only_stream)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if result["pairs"]:
        print("Held-out pairs + generated hard negatives, 5 orders:\n")
        print(table(result["pairs"]))
    print("\nFAQ-like stream (Zipf 1.1 over the held-out FAQs), through SemanticCache:\n")
    print(table(result["stream"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
