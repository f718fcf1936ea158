"""The near-duplicate layer: embeddings find a similar shared question, the guard
decides whether it really is the same question, and the entry's threshold (kept under
the operator's error bound by labels, gateway/cache/verified.py) whether to serve it.

On by default with all-MiniLM-L6-v2 (the `embedding` extra, gateway/embedding.py);
wordllama (the `cache-neardup` extra) can be chosen instead. Without the model's extra
the cache says so once at start and matches exact questions only. Only shared entries
(standalone questions) are ever indexed or matched, and only within one partition (same
model, system prompt and tools), so this layer can never widen who sees an answer: it
can only map one standalone question onto another, and `guard_conflict` vetoes every
pair whose negations, numbers, times, entities, persons, antonyms or word order differ.

The index lives in this process: it is loaded from the backend per partition (with the
entries' labels) on first use, refreshed when older than `refresh_seconds` (entries and
labels written by other replicas show up then), and a candidate is always re-read from
the backend before it is served, so an evicted, expired or invalidated entry is never
returned.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio.to_thread
from loguru import logger

from gateway.cache.guard import guard_conflict, load_dictionary
from gateway.cache.policy import DEFAULT_NEAR_DUPLICATE_THRESHOLD, normalize_query
from gateway.cache.verified import (
    DEFAULT_MAX_ERROR,
    MAX_OBSERVATIONS,
    Observation,
    entry_threshold,
    shared_threshold,
)

if TYPE_CHECKING:
    import numpy as np

EXTRA_NAME = "cache-neardup"
# Near misses score up to 1.0 with wordllama l2_supercat-256, so the threshold only finds
# candidates and the guard decides; 0.70 lets through the typo'd repeats that 0.80 cut
# off on the tuning part of the public pairs (tests/public_pairs.py), with no false hit.
DEFAULT_THRESHOLD = DEFAULT_NEAR_DUPLICATE_THRESHOLD


class NearDuplicateUnavailable(RuntimeError):
    """The near-duplicate layer was turned on but its extra is not installed."""


class Embedder(Protocol):
    """Turns texts into L2-normalized vectors (one row per text). May be slow: it is
    always called from a worker thread."""

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def near_duplicates_available() -> bool:
    """True when the default embedder's package is importable."""
    return (
        importlib.util.find_spec("wordllama") is not None
        and importlib.util.find_spec("numpy") is not None
    )


def load_wordllama() -> Any:
    """The wordllama model from the weights its package ships, never from the network.
    wordllama configures the root `logging` logger on import; that is undone here."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        import wordllama
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    package_dir = Path(wordllama.__file__).parent
    # The package ships weights/ and tokenizers/ folders laid out like its download
    # cache; pointing the cache there keeps loading offline.
    return wordllama.WordLlama.load(cache_dir=package_dir, disable_download=True)


class WordLlamaEmbedder:
    """Static token embeddings (wordllama l2_supercat, 256 dims) averaged per text.

    Loads the weights the package ships, never from the network. wordllama configures
    the root `logging` logger on import; that is undone here.
    """

    def __init__(self) -> None:
        if not near_duplicates_available():
            raise NearDuplicateUnavailable(
                "near-duplicate cache matching needs the optional extra: "
                f"pip install 'chat-gateway[{EXTRA_NAME}]' (or turn near_duplicates off)"
            )
        self._model: Any = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        import numpy as np

        if self._model is None:
            self._model = load_wordllama()
        vectors = self._model.embed(list(texts), norm=True)
        return np.nan_to_num(np.asarray(vectors, dtype=np.float32))


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 (gateway/embedding.py, the `embedding` extra) for this layer;
    built lazily, so a missing extra is reported when the layer is turned on."""

    def __init__(self) -> None:
        from gateway.embedding import embedding_unavailable, shared_sentence_embedder

        reason = embedding_unavailable()
        if reason is not None:
            raise NearDuplicateUnavailable(f"near-duplicate cache matching is off: {reason}")
        self._model = shared_sentence_embedder()

    @property
    def loaded(self) -> bool:
        return self._model.loaded

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self._model.embed(texts)


def near_duplicate_embedder(model: str) -> Embedder:
    """The embedder `cache.near_duplicate_model` names."""
    return MiniLMEmbedder() if model == "minilm" else WordLlamaEmbedder()


@dataclass(frozen=True, slots=True)
class NearMatch:
    """A stored shared question the guard accepts as asking the same as the new one,
    and the threshold its entry holds now (`verified.entry_threshold`)."""

    key: str
    query: str
    similarity: float
    threshold: float = 0.0


@dataclass(slots=True)
class _Partition:
    keys: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    matrix: Any = None  # np.ndarray with capacity >= len(keys)
    loaded_at: float = -math.inf
    #: key -> its labels, newest last (at most `verified.MAX_OBSERVATIONS`).
    observations: dict[str, list[Observation]] = field(default_factory=dict)
    shared_threshold: float = 0.0


ObservationLoader = Callable[[], Awaitable[dict[str, list[tuple[float, bool]]]]]


class NearDuplicateIndex:
    """Shared questions per partition, their vectors and labels, and the guarded nearest
    match.

    `threshold` is the candidate floor: a stored question less similar than that is no
    candidate at all. `prior` (default: `threshold`) is the similarity a candidate must
    reach to be served until the partition's labels certify another under `max_error`
    (gateway/cache/verified.py)."""

    def __init__(
        self,
        embedder: Embedder,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        prior: float | None = None,
        max_error: float = DEFAULT_MAX_ERROR,
        refresh_seconds: float = 60.0,
        candidates: int = 5,
        clock: Callable[[], float] = time.monotonic,
        use_guard: bool = True,
    ) -> None:
        """`use_guard=False` exists only to measure what the guard prevents."""
        self._embedder = embedder
        self.threshold = threshold
        self.prior = threshold if prior is None else max(prior, threshold)
        self.max_error = max_error
        self._refresh_seconds = refresh_seconds
        self._candidates = candidates
        self._clock = clock
        self._use_guard = use_guard
        self._partitions: dict[str, _Partition] = {}
        self._vectors: dict[str, Any] = {}  # key -> vector, so a refresh re-embeds only new keys
        self._dead: set[str] = set()
        self._loader: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        """Whether the model is loaded. A turn never waits for it: until it is, the
        cache looks up exact questions only (`load_in_background` starts the load).
        An embedder without a `loaded` attribute has nothing to load."""
        return bool(getattr(self._embedder, "loaded", True))

    def load_in_background(self) -> None:
        """Load the model in a thread of its own, once (the daemon's `warm_up` usually
        has; this covers a cache used without it). Returns at once."""
        if self.ready or self._loader is not None:
            return

        def load() -> None:
            try:
                self._warm()
            except Exception as exc:
                logger.warning(
                    "cache: near-duplicate model not loaded: {}: {}", type(exc).__name__, exc
                )

        self._loader = threading.Thread(target=load, name="near-duplicate model", daemon=True)
        self._loader.start()

    def _warm(self) -> None:
        self._embedder.embed(["warm up"])
        if self._use_guard:
            load_dictionary()

    async def _embed(self, texts: Sequence[str]) -> np.ndarray:
        return await anyio.to_thread.run_sync(self._embedder.embed, list(texts))

    async def warm_up(self) -> None:
        """Load the model (MiniLM builds its fast file once, about 3 s of CPU) and the
        guard's word list now, in a worker thread, so no turn pays for them."""

        await anyio.to_thread.run_sync(self._warm, abandon_on_cancel=True)  # a stop never waits

    async def embed_query(self, query: str) -> np.ndarray:
        """The unit vector of one (normalized) question, computed in a worker thread."""
        vector: np.ndarray = (await self._embed([query]))[0]
        return vector

    async def _ensure(
        self,
        partition: str,
        load: Callable[[], Awaitable[list[tuple[str, str]]]],
        load_observations: ObservationLoader | None = None,
    ) -> _Partition:
        import numpy as np

        part = self._partitions.get(partition)
        if part is not None and self._clock() - part.loaded_at < self._refresh_seconds:
            return part
        if self._use_guard:
            await anyio.to_thread.run_sync(load_dictionary)  # off the event loop, once
        rows = await load()
        labels = await load_observations() if load_observations is not None else {}
        missing = [(k, q) for k, q in rows if k not in self._vectors]
        if missing:
            vectors = await self._embed([q for _, q in missing])
            for (key, _), vector in zip(missing, vectors, strict=True):
                self._vectors[key] = vector
        part = _Partition(loaded_at=self._clock())
        part.keys = [k for k, _ in rows]
        part.queries = [q for _, q in rows]
        if rows:
            part.matrix = np.stack([self._vectors[k] for k in part.keys])
        part.observations = {
            key: [Observation(s, c) for s, c in obs[-MAX_OBSERVATIONS:]]
            for key, obs in labels.items()
        }
        self._recalibrate(part)
        live = set(part.keys)
        for other in self._partitions.values():
            live.update(other.keys)
        self._vectors = {k: v for k, v in self._vectors.items() if k in live}
        self._dead -= set(part.keys)
        self._partitions[partition] = part
        return part

    def _recalibrate(self, part: _Partition) -> None:
        part.shared_threshold = shared_threshold(
            (o for obs in part.observations.values() for o in obs),
            max_error=self.max_error,
            prior=self.prior,
        )

    def observe(self, partition: str, key: str, observation: Observation) -> None:
        """Add a label to `key`'s entry here (the backend keeps it for the replicas)."""
        part = self._partitions.get(partition)
        if part is None:
            return  # read from the backend with the partition
        obs = part.observations.setdefault(key, [])
        obs.append(observation)
        del obs[:-MAX_OBSERVATIONS]
        self._recalibrate(part)

    def shared_threshold(self, partition: str) -> float:
        """The serving threshold the partition's labels give (the prior until loaded)."""
        part = self._partitions.get(partition)
        return self.prior if part is None else part.shared_threshold

    def entry_threshold(self, partition: str, key: str) -> float:
        part = self._partitions.get(partition)
        if part is None:
            return self.prior
        return entry_threshold(part.shared_threshold, part.observations.get(key, ()))

    async def add(self, partition: str, key: str, query: str, *, vector: Any = None) -> None:
        """Index a freshly stored shared question (if its partition is loaded here);
        `vector`: its embedding when the turn has it already."""
        import numpy as np

        part = self._partitions.get(partition)
        if part is None:
            return  # loaded from the backend, with this entry, on first lookup
        self._dead.discard(key)
        if key in part.keys:
            return
        if vector is None:
            vector = (await self._embed([query]))[0]
        self._vectors[key] = vector
        n = len(part.keys)
        if part.matrix is None or part.matrix.shape[0] == n:
            capacity = max(16, 2 * n)
            grown = np.zeros((capacity, vector.shape[0]), dtype=np.float32)
            if part.matrix is not None:
                grown[:n] = part.matrix[:n]
            part.matrix = grown
        part.matrix[n] = vector
        part.keys.append(key)
        part.queries.append(query)

    def discard(self, key: str) -> None:
        """Never propose `key` again (until a refresh finds it stored again)."""
        self._dead.add(key)

    def reset(self) -> None:
        self._partitions.clear()
        self._vectors.clear()
        self._dead.clear()

    async def answers_agree(self, fresh: str, stored: str, *, agreement: float) -> bool:
        """Whether the model's fresh answer says what a candidate's stored one says:
        the same text once normalized, or answer vectors at least `agreement` alike."""
        if normalize_query(fresh) == normalize_query(stored):
            return True
        vectors = await self._embed([fresh, stored])
        return float(vectors[0] @ vectors[1]) >= agreement

    async def find(
        self,
        partition: str,
        query: str,
        load: Callable[[], Awaitable[list[tuple[str, str]]]],
        *,
        vector: Any = None,
        load_observations: ObservationLoader | None = None,
    ) -> NearMatch | None:
        """The most similar stored question at or above the candidate floor that the
        guard accepts as the same question as `query`; None otherwise. `vector`: the
        query's own, when the turn has computed it already (one embedding a turn)."""
        import numpy as np

        part = await self._ensure(partition, load, load_observations)
        n = len(part.keys)
        if n == 0:
            return None
        if vector is None:
            vector = await self.embed_query(query)
        scores = part.matrix[:n] @ vector
        k = min(self._candidates, n)
        top = np.argpartition(-scores, k - 1)[:k]
        for i in sorted(top.tolist(), key=lambda j: -float(scores[j])):
            score = float(scores[i])
            if score < self.threshold:
                break
            key, candidate = part.keys[i], part.queries[i]
            if key in self._dead:
                continue
            conflict = guard_conflict(query, candidate) if self._use_guard else None
            if conflict is not None:
                logger.debug("near-duplicate {:.8} vetoed ({}), score {:.3f}", key, conflict, score)
                continue
            threshold = entry_threshold(part.shared_threshold, part.observations.get(key, ()))
            return NearMatch(key=key, query=candidate, similarity=score, threshold=threshold)
        return None


@dataclass(frozen=True, slots=True)
class PairScores:
    """How the near-duplicate layer did on a labelled set of question pairs.

    Every distinct `a` is indexed in one partition and every `b` looked up against all of
    them, so a `b` can also hit the wrong `a`. `false_hits` counts hits that were not the
    pair's own paraphrase (nor an identical stored text); `near_miss_false_hits` those
    among pairs labelled different; `false_hit_rate` is false hits per lookup;
    `lookup_ms`, `lookup_p50_ms` and `lookup_p99_ms` the mean, median and 99th percentile
    time of one near-duplicate lookup (embedding, search, guard).
    """

    pairs: int
    positives: int
    true_hits: int
    false_hits: int
    near_miss_false_hits: int
    precision: float
    recall: float
    false_hit_rate: float
    lookup_ms: float
    lookup_p50_ms: float
    lookup_p99_ms: float
    false_hit_examples: tuple[tuple[str, str], ...]


async def score_pairs(
    index: NearDuplicateIndex, pairs: Sequence[tuple[str, str, bool]]
) -> PairScores:
    """Score `index` (fresh, with its embedder) on `(a, b, same)` pairs."""
    stored = {
        normalize_query(a): f"k{i}" for i, a in enumerate(dict.fromkeys(a for a, _, _ in pairs))
    }
    rows = [(key, query) for query, key in stored.items()]

    async def load() -> list[tuple[str, str]]:
        return rows

    await index._ensure("labelled", load)
    lookup_seconds: list[float] = []
    true_hits = false_hits = near_miss_false = 0
    examples: list[tuple[str, str]] = []
    for a, b, same in pairs:
        t0 = time.perf_counter()
        match = await index.find("labelled", normalize_query(b), load)
        lookup_seconds.append(time.perf_counter() - t0)
        if match is None or match.similarity < match.threshold:
            continue
        if match.query == normalize_query(b) or (same and match.query == normalize_query(a)):
            true_hits += int(same)
            continue
        false_hits += 1
        near_miss_false += int(not same)
        examples.append((b, match.query))
    positives = sum(1 for _, _, same in pairs if same)
    hits = true_hits + false_hits
    ms = sorted(1000 * t for t in lookup_seconds) or [0.0]
    return PairScores(
        pairs=len(pairs),
        positives=positives,
        true_hits=true_hits,
        false_hits=false_hits,
        near_miss_false_hits=near_miss_false,
        precision=true_hits / hits if hits else 1.0,
        recall=true_hits / positives if positives else 0.0,
        false_hit_rate=false_hits / len(pairs) if pairs else 0.0,
        lookup_ms=sum(ms) / len(ms),
        lookup_p50_ms=ms[len(ms) // 2],
        lookup_p99_ms=ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        false_hit_examples=tuple(examples),
    )
