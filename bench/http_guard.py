"""Benchmark of the HTTP port under slow and guessing clients: how long slow, silent and
idle connections stay open, what happens past the connection bound, and what 300 wrong
tokens and a locked-out neighbour get.

    .venv/bin/python bench/http_guard.py              # the settings' defaults
    .venv/bin/python bench/http_guard.py --observe 30 # stop watching a connection at 30 s

The real `HttpServer` with the admin page mounted, on 127.0.0.1 with the default
settings of `[http]`; the clients are raw sockets (asyncio streams) and, for the token
guesses, aiohttp's client. The operator's address is 127.0.0.2 (on Linux all of 127/8
is this machine). A connection still open when the watch ends shows as "open at N s".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import anyio
import anyio.lowlevel
from loguru import logger
from pydantic import SecretStr

from gateway.access.store import PairingStore
from gateway.config import HTTPSettings
from gateway.http import HealthState, HttpServer
from gateway.http.admin import AdminPage, AdminSources
from gateway.http.metrics import Metrics
from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions import SessionManager

TOKEN = "bench-token-0123456789abcdef"
OPERATOR = "127.0.0.2"
HEADER_LINES = [b"POST /api/chat HTTP/1.1\r\n", b"Host: x\r\n"] + [
    f"X-Slow-{n}: {'v' * 20}\r\n".encode() for n in range(400)
]


async def echo(inbound: InboundMessage) -> OutboundMessage:
    return OutboundMessage(
        channel=inbound.channel,
        chat_id=inbound.chat_id,
        text=inbound.text,
        session_key=inbound.session_key,
    )


async def _closed_after(reader: asyncio.StreamReader, start: float, observe: float) -> float | None:
    """Seconds from `start` until the server closes (EOF or reset), None past `observe`."""
    try:
        with anyio.move_on_after(observe - (time.monotonic() - start)):
            while await reader.read(65536):
                pass
            return time.monotonic() - start
    except (ConnectionError, OSError):
        return time.monotonic() - start
    return None


async def slow_header(port: int, observe: float) -> float | None:
    """One header line every 0.5 s, never the blank line that ends the header."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def trickle() -> None:
        for line in HEADER_LINES:
            try:
                writer.write(line)
                await writer.drain()
            except (ConnectionError, OSError):
                return
            await anyio.sleep(0.5)

    async with anyio.create_task_group() as tg:
        tg.start_soon(trickle)
        closed = await _closed_after(reader, start, observe)
        tg.cancel_scope.cancel()
    writer.close()
    return closed


async def silent(port: int, observe: float) -> float | None:
    """Connects and sends nothing."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    closed = await _closed_after(reader, start, observe)
    writer.close()
    return closed


async def idle_after_a_request(port: int, observe: float) -> float | None:
    """One request answered, then the kept-alive connection idles."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await reader.readuntil(b"ok\n")
    closed = await _closed_after(reader, time.monotonic(), observe)
    writer.close()
    return closed


async def slow_body(port: int, observe: float) -> tuple[float | None, str]:
    """A complete header announcing 1000 bytes, then one byte every 0.5 s."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /api/chat HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode()
    )
    answer = bytearray()

    async def trickle() -> None:
        for _ in range(1000):
            try:
                writer.write(b" ")
                await writer.drain()
            except (ConnectionError, OSError):
                return
            await anyio.sleep(0.5)

    closed: float | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(trickle)
        try:
            with anyio.move_on_after(observe):
                while chunk := await reader.read(65536):
                    answer.extend(chunk)
                closed = time.monotonic() - start
        except (ConnectionError, OSError):
            closed = time.monotonic() - start
        tg.cancel_scope.cancel()
    writer.close()
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "no answer"
    return closed, status


async def past_the_bound(port: int, bound: int, extra: int) -> tuple[int, int]:
    """`bound + extra` connections that each start a header and stall: how many are still
    open after a second, and how many were answered 503 at once."""
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    for _ in range(bound + extra):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        opened.append((reader, writer))
        await anyio.lowlevel.checkpoint()
    await anyio.sleep(1.0)
    still_open = refused = 0
    for reader, writer in opened:
        data = b""
        with anyio.move_on_after(0.01):
            data = await reader.read(200)
        if data.startswith(b"HTTP/1.1 503"):
            refused += 1
        elif not reader.at_eof():
            still_open += 1
        writer.close()
    return still_open, refused


async def guesses(base: str, count: int) -> tuple[dict[int, int], float, str]:
    """`count` wrong bearer tokens on /api/chat from 127.0.0.1, then the right one from
    the operator's address."""
    statuses: dict[int, int] = {}
    retry_after = "-"
    start = time.perf_counter()
    async with aiohttp.ClientSession() as http:
        for n in range(count):
            async with http.post(
                f"{base}/api/chat",
                json={"session": "s", "text": "hi"},
                headers={"Authorization": f"Bearer wrong-{n}"},
            ) as response:
                statuses[response.status] = statuses.get(response.status, 0) + 1
                retry_after = response.headers.get("Retry-After", retry_after)
    seconds = time.perf_counter() - start
    return statuses, seconds, retry_after


async def status_from(address: str, method: str, url: str, **kw: object) -> int:
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.request(method, url, allow_redirects=False, **kw) as response,  # type: ignore[arg-type]
    ):
        return response.status


async def main(observe: float) -> None:
    logger.remove()
    settings = HTTPSettings(host="127.0.0.1", port=0, token=SecretStr(TOKEN))
    bound = getattr(settings, "max_connections", 512)
    rows: list[tuple[str, str]] = []

    def seconds(value: float | None) -> str:
        return f"open at {observe:.0f} s" if value is None else f"closed at {value:.1f} s"

    with tempfile.TemporaryDirectory() as folder:
        sessions = SessionManager(Path(folder) / "sessions", fsync="never")
        server = HttpServer(settings, health=HealthState(), metrics=Metrics(), chat=echo)
        server.health.set_ready()
        pairing = PairingStore(Path(folder) / "pairing.json")
        AdminPage(TOKEN, AdminSources(server.health, sessions, pairing)).mount(server)
        async with anyio.create_task_group() as tg:
            port = await tg.start(server.run)
            base = f"http://127.0.0.1:{port}"
            slow: list[float | None] = [None] * 6
            watched: dict[str, float | None] = {}
            body: list[tuple[float | None, str]] = []

            async def one_slow(n: int) -> None:
                slow[n] = await slow_header(port, observe)

            async def watch(name: str, probe: object) -> None:
                watched[name] = await probe(port, observe)  # type: ignore[operator]

            async def watch_body() -> None:
                body.append(await slow_body(port, observe))

            async with anyio.create_task_group() as watchers:
                for n in range(6):
                    watchers.start_soon(one_slow, n)
                watchers.start_soon(watch, "silent", silent)
                watchers.start_soon(watch, "idle", idle_after_a_request)
                watchers.start_soon(watch_body)
            worst = None if None in slow else max(s for s in slow if s is not None)
            rows.append(("6 slow header clients (a line / 0.5 s), the last", seconds(worst)))
            rows.append(("a connection that sends nothing", seconds(watched["silent"])))
            rows.append(("a kept-alive connection after one request", seconds(watched["idle"])))
            closed, status = body[0]
            rows.append(("a body of 1000 bytes at 2 bytes/s", f"{seconds(closed)}, {status}"))
            still_open, refused = await past_the_bound(port, bound, 20)
            rows.append(
                (
                    f"{bound + 20} stalled connections (bound {bound}) after 1 s",
                    f"{still_open} open, {refused} answered 503",
                )
            )
            statuses, spent, retry_after = await guesses(base, 300)
            counts = ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items()))
            rows.append(
                (
                    f"300 wrong bearer tokens in {spent:.1f} s",
                    f"{counts}; Retry-After {retry_after}",
                )
            )
            chat = await status_from(
                OPERATOR,
                "POST",
                f"{base}/api/chat",
                json={"session": "s", "text": "hi"},
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            rows.append(("then the right token from another address", str(chat)))
            for n in range(20):
                await status_from(
                    "127.0.0.1", "POST", f"{base}/admin/login", data={"token": f"no-{n}"}
                )
            login = await status_from(
                OPERATOR, "POST", f"{base}/admin/login", data={"token": TOKEN}
            )
            rows.append(
                ("admin login: 20 wrong from one address, right one from another", str(login))
            )
            tg.cancel_scope.cancel()
        sessions.close()
    width = max(len(name) for name, _ in rows)
    print(f"{'client':<{width}}  result")
    for name, result in rows:
        print(f"{name:<{width}}  {result}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--observe", type=float, default=90.0, help="seconds to watch at most")
    anyio.run(main, parser.parse_args().observe)
