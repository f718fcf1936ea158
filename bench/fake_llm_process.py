"""The fake OpenAI-compatible server (tests/fakes/openai_server.py, request checks off)
in a process of its own, for benchmarks that count only the client's or the gateway's
CPU: `with fake_openai_process() as base_url: ...`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = """
import asyncio, sys
sys.path.insert(0, {root!r})
from tests.fakes.openai_server import FakeOpenAI

async def main():
    fake = FakeOpenAI(api_key=None, validate=False)
    await fake.start()
    print(fake.base_url, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@contextmanager
def fake_openai_process() -> Iterator[str]:
    """The server's base URL (``http://127.0.0.1:PORT/v1``) while it runs."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        yield server.stdout.readline().strip()
    finally:
        server.terminate()
        server.wait()
