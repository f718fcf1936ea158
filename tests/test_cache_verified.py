"""The near-duplicate layer's thresholds under an error bound (gateway/cache/verified.py),
labels from compared answers through `SemanticCache`, shared by replicas on SQLite and
Redis, counted in /metrics, and the layer on by default."""

from __future__ import annotations

import random
import threading
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.cache import CacheContext, CacheSettings, SemanticCache
from gateway.cache.neardup import NearDuplicateIndex
from gateway.cache.verified import (
    MARGIN,
    NEVER,
    Observation,
    Verdict,
    entry_threshold,
    shared_threshold,
    verdict,
)
from tests.test_cache import Store, _open_store
from tests.test_metrics import parse_exposition

np = pytest.importorskip("numpy")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the thresholds -------------------------------------------------------------------


def test_the_prior_holds_until_labels_certify_another() -> None:
    assert shared_threshold([], max_error=0.01, prior=0.985) == 0.985
    few = [Observation(0.95 + i / 10_000, True) for i in range(267)]
    assert shared_threshold(few, max_error=0.01, prior=0.985) == 0.985
    # 268 right answers at 0.95 and above: Wilson's 95% bound is just under 1%.
    many = [*few, Observation(0.9499, True)]
    assert shared_threshold(many, max_error=0.01, prior=0.985) == 0.9499


def test_a_wrong_label_at_the_prior_leaves_only_certified_thresholds() -> None:
    labels = [Observation(0.95 + i / 1000_000, True) for i in range(300)]
    below = [*labels, Observation(0.96, False)]
    # A wrong label below the prior does not contradict it; 1 of 301 is not certified
    # (its bound is 1.5%): the prior holds.
    assert shared_threshold(below, max_error=0.01, prior=0.985) == 0.985
    above = [*labels, Observation(0.99, False)]
    # One above it does: nothing is served until labels certify a threshold again ...
    assert shared_threshold(above, max_error=0.01, prior=0.985) == NEVER
    # ... as 200 more right ones do, from 0.93: 1 wrong of 501 is within 1% (0.89%).
    above += [Observation(0.93 + i / 1000_000, True) for i in range(200)]
    assert shared_threshold(above, max_error=0.01, prior=0.985) == pytest.approx(0.93)


def test_an_entry_tightens_on_its_own_wrong_label() -> None:
    assert entry_threshold(0.95, []) == 0.95
    assert entry_threshold(0.95, [Observation(0.97, True)]) == 0.95
    tightened = entry_threshold(0.95, [Observation(0.97, True), Observation(0.98, False)])
    assert tightened == pytest.approx(0.98 + MARGIN)
    assert verdict(0.98, tightened, servable_seen=1, audit_rate=0.05) is Verdict.EXPLORE
    assert verdict(0.99, tightened, servable_seen=1, audit_rate=0.05) is Verdict.SERVE
    assert verdict(0.99, tightened, servable_seen=20, audit_rate=0.05) is Verdict.AUDIT
    assert verdict(0.99, tightened, servable_seen=20, audit_rate=0.0) is Verdict.SERVE


def _stream(seed: int, highest_truth: float) -> tuple[int, int, int, int]:
    """200 entries whose answers are right above a similarity of their own (uniform in
    0.90..`highest_truth`, unknown to the policy) and wrong below it; 20,000 candidates
    at similarities uniform in 0.88..1. Labels come only from candidates not served, as
    in the gateway. Returns (served, wrong) before and after a label first contradicts
    the prior (0.985)."""
    rng = random.Random(seed)
    truth = {e: rng.uniform(0.90, highest_truth) for e in range(200)}
    labels: dict[int, list[Observation]] = {e: [] for e in truth}
    shared = 0.985
    counts = [0, 0, 0, 0]
    seen = 0
    for step in range(20_000):
        entry = rng.randrange(200)
        similarity = rng.uniform(0.88, 1.0)
        correct = similarity >= truth[entry]
        threshold = entry_threshold(shared, labels[entry])
        seen += similarity >= threshold
        chosen = verdict(similarity, threshold, servable_seen=seen, audit_rate=0.05)
        if chosen is Verdict.SERVE:
            phase = 0 if shared == 0.985 else 2
            counts[phase] += 1
            counts[phase + 1] += not correct
            continue
        labels[entry].append(Observation(similarity, correct))
        if step % 100 == 0:
            pooled = [o for obs in labels.values() for o in obs]
            shared = shared_threshold(pooled, max_error=0.01, prior=0.985)
    return counts[0], counts[1], counts[2], counts[3]


@pytest.mark.parametrize("seed", range(3))
def test_served_hits_stay_within_the_bound_on_a_synthetic_stream(seed: int) -> None:
    # A prior that holds for every entry: served at it, none wrong, and labels then
    # certify a lower threshold, within the bound.
    at_prior, wrong_at_prior, certified, wrong_certified = _stream(seed, 0.985)
    served, wrong = at_prior + certified, wrong_at_prior + wrong_certified
    assert served > 2_000 and wrong / served <= 0.01
    # A prior too low for 10% of the entries: wrong hits are served at it until an
    # audit's label contradicts it; from then on only certified thresholds serve,
    # within the bound.
    at_prior, wrong_at_prior, certified, wrong_certified = _stream(seed, 0.995)
    assert wrong_at_prior > 0
    assert certified > 300 and wrong_certified / certified <= 0.01


# -- through the cache, on both backends ------------------------------------------------


class BagOfWords:
    """Hashes words into a small vector: similar wording, similar vector."""

    def embed(self, texts: Sequence[str]) -> Any:
        out = np.zeros((len(texts), 64), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().replace("?", " ").split():
                out[row, zlib.crc32(word.encode()) % 64] += 1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.where(norms == 0, 1, norms)


def ctx(query: str, session: str = "telegram:1") -> CacheContext:
    return CacheContext(query=query, model="m", temperature=0.0, session_key=session)


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async for s in _open_store(str(request.param), tmp_path):
        yield s


class GatedAnswers(BagOfWords):
    """`BagOfWords` whose embedding of an answer (a text with "link") waits for `gate`."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def embed(self, texts: Sequence[str]) -> Any:
        if any("link" in text for text in texts):
            self.gate.wait(10)
        return super().embed(texts)


def replica(
    store: Store, *, prior: float = 0.99, embedder: BagOfWords | None = None
) -> SemanticCache:
    """A cache over `store` whose candidates start at 0.5 and are served from `prior`."""
    index = NearDuplicateIndex(
        embedder or BagOfWords(), threshold=0.5, prior=prior, refresh_seconds=0.0
    )
    return SemanticCache(
        store.backend(),
        CacheSettings(near_duplicates=True, near_duplicate_audit_rate=0.0),
        clock=store.clock,
        near_duplicates=index,
    )


QUESTION = "how do I reset my password"
PARAPHRASE = "how do I reset my password please"  # 0.954 alike
#: 0.913 alike; the stand-in answers to it differ (the label is the point, not the words).
OTHER = "well so how do I reset my password"


@pytest.mark.anyio
async def test_a_candidate_not_served_is_labelled_and_replicas_share_the_label(
    store: Store,
) -> None:
    one, two = replica(store), replica(store)
    await one.store(ctx(QUESTION), "Use the reset link.")
    # Below the prior: not served; the model's answer agrees, a correct label.
    assert await one.lookup(ctx(PARAPHRASE, "slack:C1")) is None
    assert one.near_counts.explorations == 1
    await one.store(ctx(PARAPHRASE, "slack:C1"), "use the reset link.")
    assert one.near_counts.labels_correct == 1
    # The paraphrase is kept for exact repeats but not indexed as a question of its own.
    rows = await two.backend.shared_queries(_partition(), now=store.clock())
    assert [q for _, q in rows] == [QUESTION.lower()]
    labels = await two.backend.partition_observations(_partition(), now=store.clock())
    assert [obs for obs in labels.values()] == [[(pytest.approx(0.9535, abs=1e-3), True)]]
    # The other replica reads the label with the partition.
    assert await two.lookup(ctx(PARAPHRASE + " now", "slack:C2")) is None
    key = next(iter(labels))
    assert two._near is not None and two._near.entry_threshold(_partition(), key) == 0.99


@pytest.mark.anyio
async def test_with_the_labeller_running_a_turn_does_not_wait_for_its_label(
    store: Store,
) -> None:
    """The daemon runs `SemanticCache.run`: `store` hands the comparison of answers
    (two embeddings, ~10 ms with MiniLM) to it and returns; the label is recorded
    afterwards."""
    gate = threading.Event()
    cache = replica(store, embedder=GatedAnswers(gate))
    await cache.store(ctx(QUESTION), "Use the reset link.")
    async with anyio.create_task_group() as tg:
        await tg.start(cache.run)
        assert await cache.lookup(ctx(PARAPHRASE, "slack:C1")) is None
        # Other words than the stored answer: compared by their embeddings, which wait
        # on the gate. `store` returns all the same.
        with anyio.fail_after(10):
            await cache.store(ctx(PARAPHRASE, "slack:C1"), "Follow the link to reset it.")
        counts = cache.near_counts
        assert counts.labels_correct + counts.labels_wrong == 0
        gate.set()
        with anyio.fail_after(10):
            while counts.labels_correct + counts.labels_wrong == 0:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    labels = await cache.backend.partition_observations(_partition(), now=store.clock())
    assert [len(obs) for obs in labels.values()] == [1]
    assert cache.labels_dropped == 0


@pytest.mark.anyio
async def test_a_wrong_label_stops_an_entry_being_served_at_that_similarity(
    store: Store,
) -> None:
    cache = replica(store, prior=0.93)
    await cache.store(ctx(QUESTION), "Use the reset link.")
    hit = await cache.lookup(ctx(PARAPHRASE, "slack:C1"))
    assert hit is not None and hit.match == "near"  # 0.954 >= 0.93: served
    assert cache.near_counts.hits == 1
    # A question less alike, below the prior: explored, and the model's answer
    # contradicts the stored one.
    other = OTHER
    assert await cache.lookup(ctx(other, "slack:C2")) is None
    await cache.store(ctx(other, "slack:C2"), "Settings, Accounts, then Google.")
    assert cache.near_counts.labels_wrong == 1
    # The entry's threshold is now above that label (0.913) ... but still below the
    # paraphrase's similarity, which is served; a replica sees the same threshold.
    later = replica(store, prior=0.93)
    assert await later.lookup(ctx(PARAPHRASE, "slack:C3")) is not None
    assert (await later.backend.partition_observations(_partition(), now=store.clock())) != {}
    # Labels go with their entry.
    assert await cache.invalidate(shared=True) >= 1
    assert await later.backend.partition_observations(_partition(), now=store.clock()) == {}


@pytest.mark.anyio
async def test_a_wrong_label_above_the_prior_stops_serving_there(store: Store) -> None:
    cache = replica(store, prior=0.93)
    key = await cache.store(ctx(QUESTION), "Use the reset link.")
    assert key is not None
    await cache.backend.add_observation(key, 0.96, False, now=store.clock())
    fresh = replica(store, prior=0.93)
    # 0.954 was servable at the prior; a wrong label at 0.96 contradicts the prior, so
    # nothing is served until labels certify a threshold.
    assert await fresh.lookup(ctx(PARAPHRASE, "slack:C1")) is None
    assert fresh.near_counts.explorations == 1 and fresh.near_counts.hits == 0
    assert fresh._near is not None and fresh._near.entry_threshold(_partition(), key) == NEVER


def _partition() -> str:
    from gateway.cache.policy import partition_id

    return partition_id(ctx(QUESTION))


# -- /metrics -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_metrics_count_near_duplicate_hits_and_explorations(tmp_path: Path) -> None:
    from gateway.http.metrics import Metrics

    async for s in _open_store("sqlite", tmp_path):
        cache = replica(s, prior=0.93)
        metrics = Metrics()
        metrics.watch_near_duplicates(cache)
        await cache.store(ctx(QUESTION), "Use the reset link.")
        assert await cache.lookup(ctx(PARAPHRASE, "slack:C1")) is not None
        assert await cache.lookup(ctx(OTHER)) is None
        body, _ = await metrics.collect()
        family = parse_exposition(body.decode())["gateway_cache_near_duplicates_total"]
        assert family.value(outcome="hit") == 1
        assert family.value(outcome="explore") == 1
        assert family.value(outcome="audit") == 0


# -- the default configuration --------------------------------------------------------


@pytest.mark.anyio
async def test_the_default_configuration_matches_paraphrases(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from gateway.config import load_settings
    from gateway.daemon import build_cache

    settings = load_settings(None, environ={"GATEWAY_CACHE__URL": str(tmp_path / "c.sqlite3")})
    assert settings.cache.near_duplicates and settings.cache.near_duplicate_model == "minilm"
    assert settings.cache.near_duplicate_max_error == 0.01
    cache = build_cache(settings)
    assert cache is not None and cache.near_duplicates_on
    await cache.warm_up()  # the daemon's start does this: no turn waits for the model
    vector = await cache.embed_query("How do I renew my car insurance online?")
    assert vector is not None and vector.dtype == np.float32
    assert float(np.linalg.norm(vector)) == pytest.approx(1.0, abs=1e-4)
    await cache.store(ctx("How do I renew my car insurance online?"), "In your account.")
    hit = await cache.lookup(
        ctx("How can I renew my car insurance online?", "slack:C1"),
        query_vector=await cache.embed_query("How can I renew my car insurance online?"),
    )
    assert hit is not None and hit.match == "near"
    await cache.aclose()


@pytest.mark.anyio
async def test_without_the_extra_the_default_gateway_answers_exact_repeats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loguru import logger

    from gateway import embedding
    from gateway.config import load_settings
    from gateway.daemon import build_cache
    from gateway.doctor import check_cache

    monkeypatch.setattr(
        embedding, "embedding_unavailable", lambda: "onnxruntime missing: pip install X"
    )
    settings = load_settings(None, environ={"GATEWAY_CACHE__URL": str(tmp_path / "c.sqlite3")})
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING", format="{message}")
    try:
        cache = build_cache(settings)
    finally:
        logger.remove(sink)
    assert cache is not None and not cache.near_duplicates_on
    assert [w for w in warnings if "onnxruntime missing" in w and "exact questions only" in w]
    assert await cache.embed_query("anything") is None
    await cache.store(ctx("How do I renew my car insurance online?"), "In your account.")
    hit = await cache.lookup(ctx("how do I renew my car insurance online", "slack:C1"))
    assert hit is not None and hit.match == "exact"
    await cache.aclose()
    findings = await check_cache(settings)
    assert any(f.status == "warn" and "onnxruntime missing" in f.what for f in findings)
