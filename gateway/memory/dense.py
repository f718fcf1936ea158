"""Dense similarity from static embeddings, for fusing with BM25 (the message index).

wordllama's token vectors (the `cache-neardup` extra: its package ships the weights, it
runs on the CPU without torch and without a download) averaged per text, tokenized one
text at a time: ~60 us a query, where the package's batch `embed` takes ~600 us.

Each document keeps only the signs of its vector, 256 bits (32 bytes): a search is the
Hamming distance to every document (XOR and a popcount over four 64-bit words each), so
100,000 messages cost 3.2 MB and one pass over them, with no float matrix held
(bench/recall.py times it at 100,000 messages).

Invariants: document ids are the caller's (the BM25 index's), added in increasing order;
a removed document is never returned. Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

_WORDS = 4  # 256 bits as uint64 words
_REMOVED = 512  # beyond any distance of 256 bits


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


def sign_codes(vectors: npt.NDArray[np.float32]) -> npt.NDArray[np.uint64]:
    """Each row's signs as 256 bits (4 uint64 words); vectors wider are cut to 256."""
    bits = np.packbits(vectors[:, : 64 * _WORDS] > 0, axis=1)
    padded = np.zeros((len(vectors), 8 * _WORDS), np.uint8)
    padded[:, : bits.shape[1]] = bits
    return padded.view(np.uint64)


class DenseIndex:
    """Sign codes of documents' embeddings, searched by Hamming distance.

    The codes are kept word-major (four contiguous arrays of 64-bit words), so a search
    is four vectorized XOR-popcounts; the k nearest are picked by counting distances
    (at most 257 values), not by sorting them."""

    def __init__(self, embedder: StaticEmbedder) -> None:
        self._embedder = embedder
        self._codes = np.zeros((_WORDS, 0), np.uint64)
        self._ids = np.zeros(0, np.int64)
        self._dead = np.zeros(0, np.int16)  # added to a removed row's distance
        self._count = 0
        self._row: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._row)

    def memory_bytes(self) -> int:
        arrays = self._codes.nbytes + self._ids.nbytes + self._dead.nbytes
        return int(arrays) + 60 * len(self._row)

    def add(self, doc_ids: Sequence[int], texts: Sequence[str]) -> None:
        """Embed and add documents (ids increasing)."""
        if not doc_ids:
            return
        codes = sign_codes(self._embedder.embed(texts))
        need = self._count + len(doc_ids)
        if need > self._codes.shape[1]:
            size = max(need, 2 * self._codes.shape[1], 1024)
            grown = np.zeros((_WORDS, size), np.uint64)
            grown[:, : self._count] = self._codes[:, : self._count]
            self._codes = grown
            self._ids = np.resize(self._ids, size)
            self._dead = np.resize(self._dead, size)
        rows = slice(self._count, need)
        self._codes[:, rows] = codes.T
        self._ids[rows] = doc_ids
        self._dead[rows] = 0
        for offset, doc in enumerate(doc_ids):
            self._row[doc] = self._count + offset
        self._count = need

    def remove(self, doc_id: int) -> None:
        row = self._row.pop(doc_id, None)
        if row is not None:
            self._dead[row] = _REMOVED

    def search(self, query: str, k: int) -> list[int]:
        """The ids of the `k` documents nearest to `query`, nearest first (newer first on
        ties)."""
        if k <= 0 or not self._row:
            return []
        code = sign_codes(self._embedder.embed([query]))[0]
        n = self._count
        distance = self._dead[:n].copy()
        for word in range(_WORDS):
            distance += np.bitwise_count(self._codes[word, :n] ^ code[word])
        # The smallest distance that k documents reach, by counting (no sort of n).
        counts = np.bincount(distance, minlength=_REMOVED + 1)
        limit = int(np.searchsorted(np.cumsum(counts), min(k, len(self._row))))
        rows = np.flatnonzero(distance <= min(limit, _REMOVED - 1))
        order = np.lexsort((-rows, distance[rows]))[:k]
        return [int(self._ids[r]) for r in rows[order]]
