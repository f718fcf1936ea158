"""Dense similarity from static embeddings, for fusing with BM25 (the message index).

wordllama's token vectors (the `cache-neardup` extra: its package ships the weights, it
runs on the CPU without torch and without a download) averaged per text, tokenized one
text at a time: ~60 us a query, where the package's batch `embed` takes ~600 us.

Each document keeps only the signs of its vector, 256 bits (32 bytes): a search is the
Hamming distance to every document (XOR and a popcount over four 64-bit words each), so
100,000 messages cost 3.2 MB and one pass over them, with no float matrix held.

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
    """Sign codes of documents' embeddings, searched by Hamming distance."""

    def __init__(self, embedder: StaticEmbedder) -> None:
        self._embedder = embedder
        self._codes = np.zeros((0, _WORDS), np.uint64)
        self._ids = np.zeros(0, np.int64)
        self._live = np.zeros(0, np.bool_)
        self._count = 0
        self._row: dict[int, int] = {}

    def __len__(self) -> int:
        return int(self._live[: self._count].sum())

    def memory_bytes(self) -> int:
        return int(self._codes.nbytes + self._ids.nbytes + self._live.nbytes) + 60 * len(self._row)

    def add(self, doc_ids: Sequence[int], texts: Sequence[str]) -> None:
        """Embed and add documents (ids increasing)."""
        if not doc_ids:
            return
        codes = sign_codes(self._embedder.embed(texts))
        need = self._count + len(doc_ids)
        if need > len(self._codes):
            size = max(need, 2 * len(self._codes), 1024)
            self._codes = np.resize(self._codes, (size, _WORDS))
            self._ids = np.resize(self._ids, size)
            self._live = np.resize(self._live, size)
        rows = slice(self._count, need)
        self._codes[rows] = codes
        self._ids[rows] = doc_ids
        self._live[rows] = True
        for offset, doc in enumerate(doc_ids):
            self._row[doc] = self._count + offset
        self._count = need

    def remove(self, doc_id: int) -> None:
        row = self._row.pop(doc_id, None)
        if row is not None:
            self._live[row] = False

    def search(self, query: str, k: int) -> list[int]:
        """The ids of the `k` documents nearest to `query`, nearest first (newer first on
        ties)."""
        if k <= 0 or not self._count:
            return []
        code = sign_codes(self._embedder.embed([query]))[0]
        codes = self._codes[: self._count]
        distance = np.bitwise_count(codes ^ code).sum(axis=1, dtype=np.int32)
        distance[~self._live[: self._count]] = 1 << 20
        k = min(k, self._count)
        # Newest first on ties: search the reversed rows with a stable order.
        reversed_distance = distance[::-1]
        top = np.argpartition(reversed_distance, k - 1)[:k]
        top = top[np.lexsort((top, reversed_distance[top]))]
        rows = self._count - 1 - top
        return [int(self._ids[r]) for r in rows if self._live[r]]
