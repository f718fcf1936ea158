"""A BM25 index over short documents: exact top-k by block-max pruning, saved to one file.

Layout (an LSM of two levels, as Lucene's segments are):
- a *segment*: immutable NumPy arrays in compressed-sparse-row form. Per term its
  postings in document order (doc id, BM25 impact, term frequency), and per term per
  block of 16 consecutive document ids the largest impact in that block ("block-max",
  Ding & Suel 2011; Lucene keeps per-block maxima of 128 documents in its skip data).
- a *tail*: the documents added since the segment was built, in plain dicts. When the
  tail reaches `max(1024, segment size / 32)` documents it is merged into a new
  segment (vectorized, O(segment) once per that many adds: O(1) amortized per add).

Search (block-max pruning over document-id ranges, as in Mallia, Suel and Tonellotto,
"Faster Learned Sparse Retrieval with Block-Max Pruning", SIGIR 2024): the tail is
scored exhaustively (it is small); for the segment, every block gets an upper bound,
`sum(idf * block-max)` times the best recency weight in the block, and blocks are
scored best bound first, in batches that double, all query terms of a block at once.
Once the next block's bound is below the current k-th score, no document left can
enter the top k and the search stops: the postings of a common word in those blocks
are never scored. A query touches only the posting lists of its own terms.

Invariants:
- Results are exactly the BM25 top-k of the live documents (times the recency weight
  in (0, 1] when asked), ties broken newest first; pruning only skips documents that
  provably cannot reach the top k. Impacts are float32 against a reference average
  length set at each merge (the tail uses the same reference).
- `add` touches only the new document's terms; ids increase and are never reused.
- `save` writes one file (magic, JSON header, CRC-32 of the payload, arrays) through
  temp file + fsync + rename; `load` checks magic, sizes, checksum and the array
  shapes, and raises `IndexFileError` for anything else: a damaged index is rebuilt by
  its owner from the files it indexes, never trusted.
- Memory per indexed line: about 10 bytes per posting and 16 per (term, block) pair,
  plus ~30 bytes and the stored text per document (`memory_bytes`, measured in
  bench/memory.py).

Why our own code: SQLite FTS5 (stdlib) ranks every document matching any query term
with `bm25()` before `LIMIT` applies (no dynamic pruning), which on the common-word
corpus of bench/memory.py is the exhaustive cost this index avoids; tantivy (Rust,
block-max WAND) cannot apply the recency decay inside its top-k collector from Python,
so decayed results would not be exact, and it keeps a writer, lock and threads per
index where a gateway holds one index per memory scope and file. The tokenizer
(stemming, negations) is ours in both cases.

Not thread-safe: the owner (MemoryManager, KnowledgeBase) holds a lock around it.
"""

from __future__ import annotations

import ctypes
import heapq
import json
import math
import mmap
import os
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from gateway.fsutil import atomic_write_chunks
from gateway.memory.text import tokenize

# 16 documents per block. Lucene's 128 proved too coarse here: on the common-word corpus
# of bench/memory.py every 128-document block holds a near-maximal posting of each
# common word, so no block could be skipped; with 16 about 30% of postings are scored,
# in the same time (BMP, cited above, also uses small blocks).
_BLOCK_SHIFT = 4
_MAGIC = b"gateway-search-index v1\n"
# A block whose bound is within this relative margin of the k-th score is still
# scored: float32 impacts summed in another order may differ in the last bits.
_BOUND_SLACK = 1e-6
_FIRST_BATCH = 4  # blocks scored before the first threshold check; doubles after
_ONE_BATCH_DOCS = 2048  # a segment this small is scored in one batch of all its blocks
_BLOCK_OFFSETS = np.arange(1 << _BLOCK_SHIFT, dtype=np.int64)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class IndexFileError(Exception):
    """A saved index could not be used (missing, damaged, or of another version)."""


class _Stale(Exception):
    """A well-formed saved index made by another tokenizer: rebuilt, not reported."""


def _tokenizer_mark() -> str:
    """What `tokenize` makes of a probe text that exercises each of its rules (case,
    Unicode, contractions, stopwords, stems): a saved index whose postings another
    tokenizer made would silently miss matches, so `load` refuses it (rebuilt)."""
    probe = "The Users' DATABASES weren't deploying; she's moved to Zürich (東京) in 2023!"
    digest = zlib.crc32("\x1f".join(tokenize(probe)).encode())
    return f"{digest:08x}"


#: The tokenizer's mark, saved in every index (`_tokenizer_mark`).
TOKENIZER = _tokenizer_mark()
# Names of the owner's attached arrays in the file start with this.
_ATTACHED = "+"


def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None  # not glibc: nothing to do


_MALLOC_TRIM = _libc_trim()


def release_freed_memory() -> None:
    """Hand the heap pages freed by a large build back to the system (glibc's
    `malloc_trim`; a no-op elsewhere); its owner calls it once the build's temporary
    objects are gone. glibc raises its mmap threshold to the largest block freed so
    far, so a build's temporary arrays and lists (tens of MB at 100,000 lines) come
    from the heap and stay in the process's RSS after they are freed: measured in
    bench/memory.py, 236 MB after a 100,000-line history build without this, 111 MB
    with it."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One ranked result: the document id, its score and its text."""

    doc_id: int
    score: float
    text: str


class _Segment:
    """The immutable arrays of a merged segment (documents 0 .. n-1)."""

    __slots__ = (
        "b_blk",
        "b_end",
        "b_max",
        "b_off",
        "b_start",
        "block_newest",
        "d_len",
        "d_off",
        "d_tag",
        "d_ts",
        "n",
        "p_doc",
        "p_imp",
        "p_tf",
        "ref",
        "t_off",
        "term_ids",
        "terms",
        "text_blob",
    )

    def __init__(
        self,
        arrays: dict[str, Any],
        terms: list[str],
        ref: float,
        term_ids: dict[str, int] | None = None,
    ) -> None:
        self.terms = terms
        self.term_ids = term_ids if term_ids is not None else {t: i for i, t in enumerate(terms)}
        self.ref = ref
        self.t_off = arrays["t_off"]
        self.p_doc = arrays["p_doc"]
        self.p_imp = arrays["p_imp"]
        self.p_tf = arrays["p_tf"]
        self.b_off = arrays["b_off"]
        self.b_blk = arrays["b_blk"]
        self.b_max = arrays["b_max"]
        self.b_start = arrays["b_start"]
        self.b_end = arrays["b_end"]
        self.d_len = arrays["d_len"]
        self.d_tag = arrays["d_tag"]
        self.d_ts = arrays["d_ts"]
        self.d_off = arrays["d_off"]
        self.text_blob: npt.NDArray[np.uint8] = arrays["text_blob"]  # no copy of a mapped file
        self.n = len(self.d_len)
        # Newest timestamp per block (no timestamp counts as +inf: weight 1).
        if self.n:
            filled = np.where(np.isnan(self.d_ts), np.inf, self.d_ts)
            self.block_newest = np.maximum.reduceat(filled, np.arange(0, self.n, 1 << _BLOCK_SHIFT))
        else:
            self.block_newest = np.zeros(0)

    def text(self, doc_id: int) -> str:
        start, end = int(self.d_off[doc_id]), int(self.d_off[doc_id + 1])
        return self.text_blob[start:end].tobytes().decode()

    @property
    def blocks(self) -> int:
        return (self.n + (1 << _BLOCK_SHIFT) - 1) >> _BLOCK_SHIFT

    def nbytes(self) -> int:
        arrays = (self.t_off, self.p_doc, self.p_imp, self.p_tf, self.b_off, self.b_blk)
        more = (self.b_max, self.b_start, self.b_end, self.d_len, self.d_tag, self.d_ts)
        total = sum(a.nbytes for a in (*arrays, *more, self.d_off, self.block_newest))
        return total + self.text_blob.nbytes + sum(len(t) + 60 for t in self.terms)


def _empty_segment() -> _Segment:
    arrays: dict[str, Any] = {
        "t_off": np.zeros(1, np.int64),
        "p_doc": np.zeros(0, np.int32),
        "p_imp": np.zeros(0, np.float32),
        "p_tf": np.zeros(0, np.uint16),
        "b_off": np.zeros(1, np.int64),
        "b_blk": np.zeros(0, np.int32),
        "b_max": np.zeros(0, np.float32),
        "b_start": np.zeros(0, np.int32),
        "b_end": np.zeros(0, np.int32),
        "d_len": np.zeros(0, np.int32),
        "d_tag": np.zeros(0, np.int16),
        "d_ts": np.zeros(0, np.float64),
        "d_off": np.zeros(1, np.int64),
        "text_blob": np.zeros(0, np.uint8),
    }
    return _Segment(arrays, [], 0.0)


def _ranges(starts: IntArray, ends: IntArray) -> IntArray:
    """The concatenation of `range(s, e)` for each pair, vectorized."""
    lengths = ends - starts
    total = int(lengths.sum())
    firsts = np.cumsum(lengths) - lengths
    return np.repeat(starts - firsts, lengths) + np.arange(total, dtype=np.int64)


def _weights(stamps: FloatArray, rate: float, clock: float) -> FloatArray:
    """Recency weights `1 / (1 + age * rate)`; no timestamp (NaN) or the future: 1."""
    age = np.nan_to_num(clock - stamps, nan=0.0, posinf=0.0, neginf=0.0)
    return 1.0 / (1.0 + np.maximum(age, 0.0) * rate)


class SearchIndex:
    """BM25 over short documents (a memory fact, a history line, a knowledge entry).

    Each document may carry a `tag` (e.g. a fact's category, filterable at query time)
    and a `timestamp` (epoch seconds, used by the optional recency decay).
    """

    def __init__(self, *, k1: float = 1.2, b: float = 0.75) -> None:
        self.k1 = k1
        self.b = b
        self._seg = _empty_segment()
        self._seg_df = np.zeros(0, np.int64)  # live document frequency per segment term
        self._seg_live = np.zeros(0, np.bool_)
        self._tag_names: list[str] = []
        self._tag_ids: dict[str, int] = {}
        # The tail: documents seg.n .. seg.n + len(tail) - 1.
        self._tail_post: dict[str, dict[int, int]] = {}
        self._tail_text: list[str] = []
        self._tail_tag: list[int] = []
        self._tail_ts: list[float] = []
        self._tail_len: list[int] = []
        self._tail_live: list[bool] = []
        self._live = 0
        self._total_length = 0
        self._dead_texts = 0  # removed documents whose text the segment still holds
        self.scored_postings = 0  # postings scored by the last search (for the benchmark)
        self._payload: memoryview | None = None  # the mapped file's payload, if loaded
        self._payload_crc = 0
        #: The owner's arrays saved with the index (`save(attached=...)`), once loaded:
        #: read-only views of the mapped file.
        self.attached: dict[str, npt.NDArray[Any]] = {}

    def __len__(self) -> int:
        return self._live

    @property
    def doc_count(self) -> int:
        """Ids handed out so far (live and removed documents)."""
        return self._seg.n + len(self._tail_text)

    @property
    def unmerged(self) -> int:
        """Documents in the tail (scored exhaustively until merged into the segment)."""
        return len(self._tail_text)

    @property
    def term_count(self) -> int:
        return len(self._seg.terms) + sum(1 for t in self._tail_post if t not in self._seg.term_ids)

    @property
    def reference_length(self) -> float:
        """The average document length BM25 impacts are computed against."""
        if self._seg.ref > 0:
            return self._seg.ref
        return max(self._total_length / self._live, 1.0) if self._live else 1.0

    def text(self, doc_id: int) -> str:
        if not self._is_live(doc_id):
            raise KeyError(f"document {doc_id} was removed")
        if doc_id < self._seg.n:
            return self._seg.text(doc_id)
        return self._tail_text[doc_id - self._seg.n]

    def timestamp(self, doc_id: int) -> float | None:
        """The document's timestamp, or None."""
        if doc_id < self._seg.n:
            value = float(self._seg.d_ts[doc_id])
        else:
            value = self._tail_ts[doc_id - self._seg.n]
        return None if math.isnan(value) else value

    def memory_bytes(self) -> int:
        """An estimate of the memory the index holds (arrays, texts, tail dicts)."""
        tail = sum(len(t) + 120 for t in self._tail_text)
        tail += sum(100 + 80 * len(p) for p in self._tail_post.values())
        return self._seg.nbytes() + self._seg_df.nbytes + self._seg_live.nbytes + tail

    # -- writing -----------------------------------------------------------------

    def add(self, text: str, *, tag: str | None = None, timestamp: float | None = None) -> int:
        """Index one document and return its id (ids increase in insertion order)."""
        doc_id = self._append(text, tokenize(text), tag, timestamp)
        self._maybe_merge()
        return doc_id

    def add_many(self, docs: Iterable[tuple[str, str | None, float | None]]) -> list[int]:
        """Index `(text, tag, timestamp)` documents and return their ids, in order.

        A batch of at least the merge threshold (a build, a catch-up) is tokenized into
        flat arrays and folded into the segment in one vectorized merge, together with
        the tail: no per-term dicts, and one merge however large the batch. A smaller
        batch goes into the tail, as `add` does."""
        first = self.doc_count
        threshold = self._merge_threshold()
        held: list[tuple[str, list[str], str | None, float | None]] = []
        stream = iter(docs)
        for text, tag, ts in stream:
            held.append((text, tokenize(text), tag, ts))
            if len(held) >= threshold:
                break
        if len(held) < threshold:
            for text, tokens, tag, ts in held:
                self._append(text, tokens, tag, ts)
            self._maybe_merge()
            return list(range(first, self.doc_count))
        batch = _Batch(self._seg.term_ids)
        for text, tokens, tag, ts in held:
            batch.add(text, tokens, self._tag_id(tag), ts)
        del held
        tokens_of = _LineTokens()
        for text, tag, ts in stream:
            batch.add(text, tokens_of(text), self._tag_id(tag), ts)
        self._fold(batch)
        return list(range(first, self.doc_count))

    def remove(self, doc_id: int) -> None:
        """Drop a document; its id is never reused. Removing twice is a no-op."""
        if not self._is_live(doc_id):
            return
        seg = self._seg
        terms = set(tokenize(self.text(doc_id)))
        if doc_id < seg.n:
            self._seg_live[doc_id] = False
            self._dead_texts += 1
            length = int(seg.d_len[doc_id])
            for term in terms:
                tid = seg.term_ids.get(term)
                if tid is not None:
                    self._seg_df[tid] -= 1
        else:
            i = doc_id - seg.n
            self._tail_live[i] = False
            length = self._tail_len[i]
            for term in terms:
                postings = self._tail_post.get(term)
                if postings is not None:
                    postings.pop(doc_id, None)
                    if not postings:
                        del self._tail_post[term]
        self._live -= 1
        self._total_length -= length

    def merge(self) -> None:
        """Fold the tail into the segment now (`save` does; so may a bulk build). The
        texts of removed documents leave the segment then too: a saved index never
        holds the words of a document removed before the save."""
        if self._tail_text or self._dead_texts:
            self._fold(None)

    # -- reading -----------------------------------------------------------------

    def latest(self, max_results: int, *, tag: str | None = None) -> list[SearchHit]:
        """The newest documents (optionally with `tag`), newest first; for empty queries."""
        tag_id = self._tag_ids.get(tag, -2) if tag is not None else None
        hits: list[SearchHit] = []
        base = self._seg.n
        for i in range(len(self._tail_text) - 1, -1, -1):
            if len(hits) >= max_results:
                return hits
            if self._tail_live[i] and (tag_id is None or self._tail_tag[i] == tag_id):
                hits.append(SearchHit(base + i, 0.0, self._tail_text[i]))
        mask = self._seg_live.copy()
        if tag_id is not None:
            mask &= self._seg.d_tag == tag_id
        for doc in np.flatnonzero(mask)[::-1][: max(0, max_results - len(hits))]:
            hits.append(SearchHit(int(doc), 0.0, self._seg.text(int(doc))))
        return hits

    def search(
        self,
        query: str,
        max_results: int = 10,
        *,
        tag: str | None = None,
        decay_rate: float = 0.0,
        now: float | None = None,
        texts: bool = True,
    ) -> list[SearchHit]:
        """The top `max_results` documents by BM25, best first (newer first on ties);
        `texts=False` leaves the hits' texts empty (a caller holding its own: decoding 50
        texts is a third of a fused message search at 10,000 messages).

        With `decay_rate` > 0 each score is multiplied by `1 / (1 + age_hours *
        decay_rate)`, age taken from the document's timestamp (no timestamp: no decay,
        a timestamp in the future counts as age 0). With `tag`, only documents carrying
        that tag are considered. Query terms are deduplicated.
        """
        self.scored_postings = 0
        if max_results <= 0 or self._live == 0:
            return []
        tag_id: int | None = None
        if tag is not None:
            if tag not in self._tag_ids:
                return []
            tag_id = self._tag_ids[tag]
        rate = decay_rate / 3600.0 if decay_rate > 0 else 0.0
        clock = time.time() if now is None else now
        n = self._live
        seg_terms: list[tuple[float, int]] = []
        tail_terms: list[tuple[float, dict[int, int]]] = []
        for term in set(tokenize(query)):
            tid = self._seg.term_ids.get(term, -1)
            seg_df = int(self._seg_df[tid]) if tid >= 0 else 0
            tail = self._tail_post.get(term)
            df = seg_df + (len(tail) if tail else 0)
            if df == 0:
                continue
            idf = math.log(1.0 + (n - df + 0.5) / (df + 0.5))
            if seg_df:
                seg_terms.append((idf, tid))
            if tail:
                tail_terms.append((idf, tail))
        top = self._search_tail(tail_terms, max_results, tag_id, rate, clock)
        if seg_terms:
            top = self._search_segment(seg_terms, max_results, tag_id, rate, clock, top)
        return [SearchHit(d, s, self.text(d) if texts else "") for s, d in top]

    # -- persistence ---------------------------------------------------------------

    def save(
        self,
        path: Path,
        meta: dict[str, Any],
        attached: dict[str, npt.NDArray[Any]] | None = None,
    ) -> None:
        """Merge the tail and write the index with `meta` (the owner's watermark) and
        `attached` arrays (the owner's, kept under the same checksum; `load` gives
        them back as `attached`). The arrays are written as they are, not copied."""
        self.merge()
        seg = self._seg
        arrays: dict[str, npt.NDArray[Any]] = {
            "t_off": seg.t_off,
            "p_doc": seg.p_doc,
            "p_imp": seg.p_imp,
            "p_tf": seg.p_tf,
            "b_off": seg.b_off,
            "b_blk": seg.b_blk,
            "b_max": seg.b_max,
            "b_start": seg.b_start,
            "b_end": seg.b_end,
            "d_len": seg.d_len,
            "d_tag": seg.d_tag,
            "d_ts": seg.d_ts,
            "d_off": seg.d_off,
            "text_blob": seg.text_blob,
            "live": self._seg_live,
            "df": self._seg_df,
            "terms": np.frombuffer("\n".join(seg.terms).encode(), np.uint8),
        }
        for name, array in (attached or {}).items():
            arrays[_ATTACHED + name] = array
        specs: list[list[Any]] = []
        chunks: list[bytes | memoryview] = []
        offset = crc = 0
        for name, array in arrays.items():
            data = np.ascontiguousarray(array).data.cast("B")
            specs.append([name, array.dtype.str, int(array.size), offset])
            pad = b"\0" * (-len(data) % 8)
            crc = zlib.crc32(pad, zlib.crc32(data, crc))
            chunks += (data, pad)
            offset += len(data) + len(pad)
        header = {
            "k1": self.k1,
            "b": self.b,
            "ref": seg.ref,
            "tags": self._tag_names,
            "tokenizer": TOKENIZER,
            "arrays": specs,
            "payload": offset,
            "crc32": crc,
            "meta": meta,
        }
        head = json.dumps(header).encode()
        head += b" " * (-(len(_MAGIC) + 8 + len(head)) % 8)
        atomic_write_chunks(path, [_MAGIC, len(head).to_bytes(8, "little"), head, *chunks])

    @classmethod
    def load(cls, path: Path, *, verify: bool = True) -> tuple[SearchIndex, dict[str, Any]]:
        """An index saved by `save`, and its meta; `IndexFileError` if it is not usable.

        The file is memory-mapped: nothing is copied, and pages are read as searches
        touch them. Sizes and array shapes are always checked; with `verify=False` the
        payload's checksum is left to `verify()` (e.g. in a background thread), so
        a large index is usable at once.
        """
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size == 0:
                    raise IndexFileError(f"{path.name}: damaged (empty)")
                data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise IndexFileError(f"{path.name}: no index saved yet") from None
        except OSError as exc:
            raise IndexFileError(f"{path.name}: cannot be read ({exc.strerror})") from None
        try:
            index, meta = cls._parse(data)
            if verify and not index.verify():
                raise ValueError("checksum mismatch")
        except _Stale as exc:
            raise IndexFileError(f"{path.name}: out of date ({exc})") from None
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise IndexFileError(f"{path.name}: damaged ({exc})") from None
        return index, meta

    def verify(self) -> bool:
        """Does the loaded payload match the checksum it was saved with? (True if the
        index was not loaded from a file.)"""
        if self._payload is None:
            return True
        return zlib.crc32(self._payload) == self._payload_crc

    @classmethod
    def _parse(cls, data: mmap.mmap) -> tuple[SearchIndex, dict[str, Any]]:
        if data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a search index of this version")
        start = len(_MAGIC)
        head_len = int.from_bytes(data[start : start + 8], "little")
        head_end = start + 8 + head_len
        header = json.loads(data[start + 8 : head_end])
        if header.get("tokenizer") != TOKENIZER:
            raise _Stale("made with another tokenizer")
        payload = memoryview(data)[head_end:]
        if len(payload) != header["payload"]:
            raise ValueError("truncated")
        arrays: dict[str, Any] = {}
        for name, dtype, count, offset in header["arrays"]:
            arrays[name] = np.frombuffer(payload, np.dtype(dtype), count, offset)
        terms_text = arrays["terms"].tobytes().decode()
        terms = terms_text.split("\n") if terms_text else []
        seg = _Segment(arrays, terms, float(header["ref"]))
        n, postings, blocks = seg.n, len(seg.p_doc), len(seg.b_blk)
        checks = (
            len(seg.t_off) == len(terms) + 1 == len(seg.b_off) == len(arrays["df"]) + 1,
            int(seg.t_off[-1]) == postings == len(seg.p_imp) == len(seg.p_tf),
            int(seg.b_off[-1]) == blocks == len(seg.b_max) == len(seg.b_end),
            len(seg.d_tag) == len(seg.d_ts) == len(arrays["live"]) == n,
            len(seg.d_off) == n + 1 and int(seg.d_off[-1]) == seg.text_blob.size,
            postings == 0 or (int(seg.p_doc.min()) >= 0 and int(seg.p_doc.max()) < n),
            blocks == 0 or int(seg.b_end.max()) <= postings,
            int(seg.d_tag.max(initial=-1)) < len(header["tags"]),
        )
        if not all(checks):
            raise ValueError("inconsistent arrays")
        index = cls(k1=float(header["k1"]), b=float(header["b"]))
        index._seg = seg
        index._seg_live = arrays["live"].copy()
        index._seg_df = arrays["df"].astype(np.int64)
        index._tag_names = [str(t) for t in header["tags"]]
        index._tag_ids = {t: i for i, t in enumerate(index._tag_names)}
        index._live = int(index._seg_live.sum())
        index._total_length = int(seg.d_len[index._seg_live].sum())
        index._dead_texts = int((np.diff(seg.d_off)[~index._seg_live] > 0).sum())
        index._payload, index._payload_crc = payload, int(header["crc32"])
        index.attached = {
            name[len(_ATTACHED) :]: array
            for name, array in arrays.items()
            if name.startswith(_ATTACHED)
        }
        meta = header["meta"]
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        return index, meta

    # -- internals ---------------------------------------------------------------

    def _is_live(self, doc_id: int) -> bool:
        if doc_id < 0:
            return False
        if doc_id < self._seg.n:
            return bool(self._seg_live[doc_id])
        i = doc_id - self._seg.n
        return i < len(self._tail_live) and self._tail_live[i]

    def _tag_id(self, tag: str | None) -> int:
        if tag is None:
            return -1
        tag_id = self._tag_ids.get(tag)
        if tag_id is None:
            tag_id = self._tag_ids[tag] = len(self._tag_names)
            self._tag_names.append(tag)
        return tag_id

    def _append(self, text: str, tokens: list[str], tag: str | None, ts: float | None) -> int:
        doc_id = self._seg.n + len(self._tail_text)
        self._tail_text.append(text)
        self._tail_tag.append(self._tag_id(tag))
        self._tail_ts.append(math.nan if ts is None else ts)
        self._tail_len.append(len(tokens))
        self._tail_live.append(True)
        postings = self._tail_post
        for token in tokens:
            found = postings.get(token)
            if found is None:
                postings[token] = {doc_id: 1}
            else:
                found[doc_id] = found.get(doc_id, 0) + 1
        self._live += 1
        self._total_length += len(tokens)
        return doc_id

    def _merge_threshold(self) -> int:
        return max(1024, self._seg.n // 32)

    def _maybe_merge(self) -> None:
        if len(self._tail_text) >= self._merge_threshold():
            self._merge()

    def _search_tail(
        self,
        terms: list[tuple[float, dict[int, int]]],
        k: int,
        tag_id: int | None,
        rate: float,
        clock: float,
    ) -> list[tuple[float, int]]:
        """Exhaustive BM25 over the tail; the top k as (score, doc) best first."""
        if not terms:
            return []
        k1, b = self.k1, self.b
        scale = b / self.reference_length
        base = self._seg.n
        lengths, tags, stamps = self._tail_len, self._tail_tag, self._tail_ts
        acc: dict[int, float] = {}
        for idf, postings in terms:
            for doc, tf in postings.items():
                i = doc - base
                if tag_id is not None and tags[i] != tag_id:
                    continue
                norm = k1 * (1.0 - b + scale * lengths[i])
                acc[doc] = acc.get(doc, 0.0) + idf * tf * (k1 + 1.0) / (tf + norm)
            self.scored_postings += len(postings)
        if rate:
            for doc in acc:
                age = clock - stamps[doc - base]
                if age > 0:  # NaN (no timestamp) compares false: no decay
                    acc[doc] /= 1.0 + age * rate
        return heapq.nlargest(k, ((s, d) for d, s in acc.items()))

    def _search_segment(
        self,
        terms: list[tuple[float, int]],
        k: int,
        tag_id: int | None,
        rate: float,
        clock: float,
        top: list[tuple[float, int]],
    ) -> list[tuple[float, int]]:
        """Merge the segment's top k into `top` by block-max pruning (module doc)."""
        seg = self._seg
        # The query's (term, block) entries, term after term, with their term's idf: a
        # batch of blocks is then scored in a few array operations whatever the number
        # of terms (a document's sum still adds its terms in the query's order).
        spans = [(int(seg.b_off[tid]), int(seg.b_off[tid + 1])) for _, tid in terms]
        entries = np.concatenate([np.arange(s, e) for s, e in spans])
        entry_idf = np.repeat([idf for idf, _ in terms], [e - s for s, e in spans])
        entry_blk = seg.b_blk[entries]
        bound: FloatArray = np.bincount(
            entry_blk, entry_idf * seg.b_max[entries].astype(np.float64), minlength=seg.blocks
        ).astype(np.float64, copy=False)
        if rate:
            bound *= _weights(seg.block_newest, rate, clock)
        candidates = np.flatnonzero(bound > 0)
        order = candidates[np.argsort(-bound[candidates], kind="stable")]
        falling = -bound[order] * (1.0 + _BOUND_SLACK)  # ascending: -bounds
        best_s = np.array([s for s, _ in top], np.float64)
        best_d = np.array([d for _, d in top], np.int64)
        acc = np.zeros(seg.n)
        mark = np.zeros(seg.blocks, np.bool_)
        # A small segment is scored in one batch: the rounds of pruning cost more than
        # the postings they would skip (bench/memory.py, messages at 1,000).
        pos, batch = 0, len(order) if seg.n <= _ONE_BATCH_DOCS else _FIRST_BATCH
        while pos < len(order):
            theta = best_s[k - 1] if len(best_s) >= k else -math.inf
            # Blocks are in decreasing bound order: stop at the first that cannot win.
            stop = int(np.searchsorted(falling, -theta, side="right"))
            end = min(pos + batch, stop)
            if end <= pos:
                break
            selected = order[pos:end]
            pos, batch = end, batch * 2
            mark[:] = False
            mark[selected] = True
            hit = np.flatnonzero(mark[entry_blk])
            if len(hit):
                first = seg.b_start[entries[hit]].astype(np.int64)
                last = seg.b_end[entries[hit]].astype(np.int64)
                where = _ranges(first, last)
                weights = np.repeat(entry_idf[hit], last - first)
                np.add.at(acc, seg.p_doc[where], weights * seg.p_imp[where].astype(np.float64))
                self.scored_postings += len(where)
            # Candidates: documents of the selected blocks that scored (blocks are
            # disjoint id ranges, so no sort or dedupe is needed).
            span = (selected[:, None] << _BLOCK_SHIFT) + _BLOCK_OFFSETS
            span = span[span < seg.n]
            docs = span[acc[span] > 0]
            keep = self._seg_live[docs]
            if tag_id is not None:
                keep &= seg.d_tag[docs] == tag_id
            docs = docs[keep].astype(np.int64)
            scores = acc[docs]
            if rate:
                scores = scores * _weights(seg.d_ts[docs], rate, clock)
            if len(scores) > k:  # only what can reach the top k (ties kept) is sorted
                kth = np.partition(scores, len(scores) - k)[len(scores) - k]
                sure = scores >= max(kth, theta)
                docs, scores = docs[sure], scores[sure]
            all_s = np.concatenate((best_s, scores))
            all_d = np.concatenate((best_d, docs))
            # Best score first, newer (larger id) first on ties: as the tail's nlargest.
            order_k = np.lexsort((-all_d, -all_s))[:k]
            best_s, best_d = all_s[order_k], all_d[order_k]
        return [(float(s), int(d)) for s, d in zip(best_s, best_d, strict=True)]

    def _merge(self) -> None:
        """Fold the tail into a new segment (vectorized; see the module docstring)."""
        if self._tail_text:
            self._fold(None)

    def _fold(self, batch: _Batch | None) -> None:
        """A new segment: the old one, the tail, then `batch` (documents in id order).

        Written for a build's peak memory as much as for its time: 32-bit ids, no copy
        where a part is empty, temporaries dropped as soon as they are used."""
        seg = self._seg
        base = seg.n
        vocab = batch.vocab if batch is not None else dict(seg.term_ids)
        t_tids: list[int] = []
        t_docs: list[int] = []
        t_tfs: list[int] = []
        for term, postings in self._tail_post.items():
            tid = vocab.get(term)
            if tid is None:
                tid = vocab[term] = len(vocab)
            t_tids.extend([tid] * len(postings))
            t_docs.extend(postings)
            t_tfs.extend(postings.values())
        parts = [
            (
                np.repeat(np.arange(len(seg.terms), dtype=np.int32), np.diff(seg.t_off)),
                seg.p_doc,
                seg.p_tf,
            ),
            (
                np.array(t_tids, np.int32),
                np.array(t_docs, np.int32),
                np.minimum(np.array(t_tfs, np.int64), 65535).astype(np.uint16),
            ),
        ]
        del t_tids, t_docs, t_tfs
        texts = self._tail_text
        metas = [
            (
                np.array(self._tail_tag, np.int16),
                np.array(self._tail_ts, np.float64),
                np.array(self._tail_len, np.int32),
                np.array(self._tail_live, np.bool_),
            )
        ]
        if batch is not None:
            parts.append(batch.postings(base + len(texts), len(vocab)))
            texts = texts + batch.texts
            metas.append(
                (
                    np.array(batch.tags, np.int16),
                    np.array(batch.stamps, np.float64),
                    np.array(batch.lengths, np.int32),
                    np.ones(len(batch.texts), np.bool_),
                )
            )
        count = len(texts)
        terms = seg.terms + list(vocab)[len(seg.terms) :]
        tags, stamps, lengths, new_live = (_cat([m[i] for m in metas]) for i in range(4))
        live = _cat([self._seg_live, new_live])
        d_len = _cat([seg.d_len, lengths])
        tids, docs, tfs = (_cat([p[i] for p in parts]) for i in range(3))
        del parts
        if not live.all():
            keep = live[docs]  # postings of removed documents go now
            tids, docs, tfs = tids[keep], docs[keep], tfs[keep]
            del keep
        # Old postings are in (term, doc) order, new ones in doc order per term, and
        # every new doc id is larger than every old one: a stable sort by term alone
        # gives (term, doc) order.
        order = np.argsort(tids, kind="stable")
        tids, docs, tfs = tids[order], docs[order], tfs[order]
        del order
        counts = np.bincount(tids, minlength=len(terms))
        if bool((counts == 0).any()):  # terms only removed documents had go too
            kept = counts > 0
            tids = (np.cumsum(kept) - 1)[tids].astype(np.int32)
            terms = [term for term, keep in zip(terms, kept.tolist(), strict=True) if keep]
            vocab = {term: i for i, term in enumerate(terms)}
        del counts
        ref = max(float(d_len[live].sum()) / max(int(live.sum()), 1), 1.0)
        norm = d_len[docs].astype(np.float32)
        norm *= np.float32(self.k1 * self.b / ref)
        norm += np.float32(self.k1 * (1.0 - self.b))
        imp = tfs.astype(np.float32)
        norm += imp
        imp *= np.float32(self.k1 + 1.0)
        imp /= norm
        del norm
        t_off = np.searchsorted(tids, np.arange(len(terms) + 1)).astype(np.int64)
        if len(docs):
            # A (term, block) pair starts where the term or the block changes.
            block = docs >> _BLOCK_SHIFT
            change = np.empty(len(docs), np.bool_)
            change[0] = True
            np.not_equal(block[1:], block[:-1], out=change[1:])
            change[t_off[1:-1][t_off[1:-1] < len(docs)]] = True
            starts = np.flatnonzero(change)
            del change
            b_max = np.maximum.reduceat(imp, starts)
            b_blk = block[starts]
            del block
        else:
            starts = np.zeros(0, np.int64)
            b_max = np.zeros(0, np.float32)
            b_blk = np.zeros(0, np.int32)
        b_end = np.append(starts[1:], len(docs)).astype(np.int32)
        b_off = np.searchsorted(tids[starts], np.arange(len(terms) + 1)).astype(np.int64)
        del tids
        joined = "".join(texts)
        if joined.isascii():  # one byte a character: no text encoded twice
            sizes = np.fromiter((len(t) for t in texts), np.int64, count)
            added = joined.encode()
        else:
            encoded = [t.encode() for t in texts]
            sizes = np.fromiter((len(t) for t in encoded), np.int64, count)
            added = b"".join(encoded)
            del encoded
        del joined
        d_off = _cat([seg.d_off, seg.d_off[-1] + np.cumsum(sizes)])
        blob = _cat([seg.text_blob, np.frombuffer(added, np.uint8)])
        own = np.diff(d_off)
        if bool((own[~live] > 0).any()):  # removed documents' texts go
            blob = blob[np.repeat(live, own)]
            own[~live] = 0
            d_off = np.concatenate(([0], np.cumsum(own))).astype(np.int64)
        del own
        arrays: dict[str, Any] = {
            "t_off": t_off,
            "p_doc": docs,
            "p_imp": imp,
            "p_tf": tfs,
            "b_off": b_off,
            "b_blk": b_blk.astype(np.int32),
            "b_max": b_max.astype(np.float32),
            "b_start": starts.astype(np.int32),
            "b_end": b_end,
            "d_len": d_len,
            "d_tag": _cat([seg.d_tag, tags]),
            "d_ts": _cat([seg.d_ts, stamps]),
            "d_off": d_off,
            "text_blob": blob,
        }
        self._seg = _Segment(arrays, terms, ref, vocab)
        self._seg_live = live if live.flags.writeable else live.copy()
        self._seg_df = np.diff(t_off).astype(np.int64)
        self._tail_post = {}
        self._tail_text, self._tail_tag, self._tail_ts = [], [], []
        self._tail_len, self._tail_live = [], []
        self._dead_texts = 0
        if batch is not None:
            self._live += len(batch.texts)
            self._total_length += int(sum(batch.lengths))


def _cat(arrays: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """`np.concatenate`, without a copy when only one of the arrays holds anything."""
    full = [a for a in arrays if len(a)]
    if len(full) == 1:
        return full[0]
    return np.concatenate(arrays) if full else arrays[0][:0].copy()


class _LineTokens:
    """`tokenize` of a document line by line, a line that the document or the one before
    it already held not tokenized again (a message is indexed with the message before
    it: bench/recall.py). Exact, as tokens never span a line (tests/test_search_index.py
    pins that of `tokenize`)."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, list[str]] = {}

    def __call__(self, text: str) -> list[str]:
        if "\n" not in text:
            return tokenize(text)
        last = self._last
        seen: dict[str, list[str]] = {}
        out: list[str] = []
        for line in text.split("\n"):
            tokens = seen.get(line)
            if tokens is None:
                tokens = last.get(line)
                if tokens is None:
                    tokens = tokenize(line)
                seen[line] = tokens
            out += tokens
        self._last = seen
        return out


class _Batch:
    """Documents added in bulk, tokenized into flat lists (a term id per token), so a
    large batch costs no per-term dict of postings; `SearchIndex._fold` merges them."""

    __slots__ = ("lengths", "stamps", "tags", "texts", "tids", "vocab")

    def __init__(self, term_ids: dict[str, int]) -> None:
        self.vocab = dict(term_ids)  # the segment's terms, then new ones (ids in order)
        self.texts: list[str] = []
        self.tags: list[int] = []
        self.stamps: list[float] = []
        self.lengths: list[int] = []
        self.tids: list[int] = []

    def add(self, text: str, tokens: list[str], tag_id: int, ts: float | None) -> None:
        vocab = self.vocab
        ids = [vocab.get(token) for token in tokens]
        if None in ids:
            for i, token in enumerate(tokens):
                if ids[i] is None:
                    tid = vocab.get(token)
                    if tid is None:
                        tid = vocab[token] = len(vocab)
                    ids[i] = tid
        self.tids.extend(ids)  # type: ignore[arg-type]  # no None is left
        self.texts.append(text)
        self.tags.append(tag_id)
        self.stamps.append(math.nan if ts is None else ts)
        self.lengths.append(len(tokens))

    def postings(
        self, first: int, terms: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.uint16]]:
        """(term id, doc id, term frequency) of the batch, in doc order, its documents
        numbered from `first`."""
        owner = np.repeat(
            np.arange(len(self.texts), dtype=np.int64), np.array(self.lengths, np.int64)
        )
        key = owner  # doc * terms + term, sorted: a posting per run of equal keys
        key *= terms
        key += np.array(self.tids, np.int64)
        key.sort()
        if not len(key):
            empty = np.zeros(0, np.int32)
            return empty, empty, np.zeros(0, np.uint16)
        change = np.empty(len(key), np.bool_)
        change[0] = True
        np.not_equal(key[1:], key[:-1], out=change[1:])
        starts = np.flatnonzero(change)
        del change
        tfs = np.minimum(np.diff(np.append(starts, len(key))), 65535).astype(np.uint16)
        key = key[starts]
        del starts
        tids = (key % terms).astype(np.int32)
        key //= terms
        key += first
        return tids, key.astype(np.int32), tfs
