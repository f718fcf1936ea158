"""Benchmark of the admin page: how long the sessions list and one session's page take
to answer over HTTP, and how large the page is, as sessions and sessions' lengths grow.

    .venv/bin/python bench/admin.py

Everything runs against a temporary workspace (file sessions), the real `HttpServer`
and `AdminPage`, requested with the bearer header; each row is the median of 5 requests.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import anyio
from loguru import logger
from pydantic import SecretStr

from gateway.access.store import PairingStore
from gateway.config import HTTPSettings
from gateway.http import HealthState, HttpServer
from gateway.http.admin import AdminPage, AdminSources
from gateway.http.metrics import Metrics
from gateway.llm import LLMMessage
from gateway.sessions import SessionManager

TOKEN = "bench-token-0123456789"
USER = LLMMessage(role="user", content="u" * 80)
ASSISTANT = LLMMessage(role="assistant", content="a" * 240)


async def _median(http: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    times: list[float] = []
    size = 0
    for _ in range(5):
        start = time.perf_counter()
        async with http.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            body = await response.read()
            assert response.status == 200, response.status
        times.append(time.perf_counter() - start)
        size = len(body)
    return statistics.median(times), size


async def main() -> None:
    logger.remove()
    rows: list[tuple[str, float, int]] = []
    with tempfile.TemporaryDirectory() as folder:
        sessions = SessionManager(Path(folder) / "sessions", fsync="never")
        for n in range(2000):
            session = sessions.get_or_create(f"telegram:{n}")
            session.add_message(USER)
            session.add_message(ASSISTANT)
        for turns in (100, 1000, 5000):
            session = sessions.get_or_create(f"api:long-{turns}")
            for _ in range(turns):
                session.add_message(USER)
                session.add_message(ASSISTANT)
        server = HttpServer(
            HTTPSettings(host="127.0.0.1", port=0, token=SecretStr(TOKEN)),
            health=HealthState(),
            metrics=Metrics(),
        )
        sources = AdminSources(
            health=server.health, sessions=sessions, pairing=PairingStore(Path(folder) / "p.json")
        )
        AdminPage(TOKEN, sources).mount(server)
        async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
            port = await tg.start(server.run)
            base = f"http://127.0.0.1:{port}"
            seconds, size = await _median(http, f"{base}/admin/sessions")
            rows.append(("sessions list, 2003 sessions", seconds, size))
            seconds, size = await _median(http, f"{base}/admin/sessions?q=long")
            rows.append(("sessions search, 3 of 2003 match", seconds, size))
            for turns in (100, 1000, 5000):
                seconds, size = await _median(http, f"{base}/admin/session?key=api:long-{turns}")
                rows.append((f"one session, {turns * 2} entries", seconds, size))
            tg.cancel_scope.cancel()
        sessions.close()
    print(f"{'page':<36} {'median ms':>10} {'HTML KiB':>10}")
    for name, seconds, size in rows:
        print(f"{name:<36} {seconds * 1000:>10.1f} {size / 1024:>10.0f}")


if __name__ == "__main__":
    anyio.run(main)
