"""The README's promises a new user acts on: its first commands, the Python it needs,
and the `curl` example of the chat API, run as written against a running gateway."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_readme_starts_with_the_run_and_the_test_command() -> None:
    first_block = README.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert README.startswith("# chat-gateway\n\n```sh\n")
    assert first_block == [
        "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/gateway run",
        "python3 -m venv .venv && .venv/bin/pip install -q -e '.[dev,cache-neardup]' "
        "&& .venv/bin/python -m pytest",
    ]


def test_the_readme_names_the_python_version_pyproject_requires() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    minimum = pyproject["project"]["requires-python"].removeprefix(">=")
    assert f"Python {minimum} or newer" in README


def curl_example() -> str:
    blocks = re.findall(r"```sh\n(curl .*?)```", README, re.DOTALL)
    assert len(blocks) == 1, "the README has one curl example of /api/chat"
    return str(blocks[0])


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl program")
def test_the_curl_example_works_against_a_running_gateway(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    token = "readme-t0ken-1234567890"
    (tmp_path / "token").write_text(token + "\n")
    env = base_env(tmp_path / "ws", fake_openai_thread) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_HTTP__TOKEN_FILE": str(tmp_path / "token"),  # the README's *_file form
    }
    gateway = GatewayProcess(env, tmp_path)
    try:
        port = gateway.wait_ready()
        command = curl_example().replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        out = subprocess.run(
            ["bash", "-c", command],
            env=os.environ | {"GATEWAY_HTTP__TOKEN": token},
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        assert gateway.terminate() == 0
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    documented = json.loads(re.search(r"answers `(\{.*?\})`", README).group(1))  # type: ignore[union-attr]
    assert answer.keys() == documented.keys()
    assert answer == documented | {"reply": "echo: Hello!"}
    assert fake_openai_thread.last_request.last_user_text == "Hello!"
