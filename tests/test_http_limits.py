"""The HTTP port under slow, idle, surplus and guessing clients: the real server on
127.0.0.1, driven with raw sockets (asyncio streams) so a client can stall wherever it
likes, on asyncio's loop and on uvloop (the daemon's)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web
from pydantic import SecretStr

from gateway.config import ConfigError, HTTPSettings, load_settings
from gateway.http import HealthState, HttpServer
from gateway.http.metrics import Metrics
from gateway.messages import InboundMessage, OutboundMessage
from tests.test_metrics import parse_exposition

pytestmark = pytest.mark.anyio

TOKEN = "limits-token-0123456789abcdef"
OTHER = "127.0.0.2"  # all of 127/8 is this machine: a second client address


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def echo(inbound: InboundMessage) -> OutboundMessage:
    if inbound.text == "think long":
        await anyio.sleep(1.5)
    return OutboundMessage(
        channel=inbound.channel,
        chat_id=inbound.chat_id,
        text=f"echo: {inbound.text}",
        session_key=inbound.session_key,
    )


@asynccontextmanager
async def serving(**http: Any) -> AsyncIterator[tuple[HttpServer, int]]:
    settings = HTTPSettings(host="127.0.0.1", port=0, token=SecretStr(TOKEN), **http)
    server = HttpServer(settings, health=HealthState(), metrics=Metrics(), chat=echo)
    server.health.set_ready()

    async def webhook(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"bytes": len(body)})

    server.mount("POST", "/telegram/webhook", webhook)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        try:
            yield server, port
        finally:
            tg.cancel_scope.cancel()


Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(port: int, source: str = "127.0.0.1") -> Stream:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def seconds_until_closed(reader: asyncio.StreamReader, limit: float) -> float:
    """How long until the server closes the connection (EOF or reset); fails past `limit`."""
    start = time.monotonic()
    with anyio.fail_after(limit):
        try:
            while await reader.read(65536):
                pass
        except ConnectionError:
            pass
    return time.monotonic() - start


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length: status, headers, body."""
    with anyio.fail_after(5):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def request_bytes(
    method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gateway"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chat(token: str = TOKEN, forwarded_for: str | None = None, text: str = "hi") -> bytes:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return request_bytes(
        "POST", "/api/chat", json.dumps({"session": "s", "text": text}).encode(), headers
    )


async def ask(port: int, raw: bytes, source: str = "127.0.0.1") -> tuple[int, dict[str, str]]:
    reader, writer = await connect(port, source)
    try:
        writer.write(raw)
        status, headers, _ = await read_response(reader)
        return status, headers
    finally:
        writer.close()


async def dropped(server: HttpServer, reason: str) -> float:
    body, _ = await server.metrics.collect()
    family = parse_exposition(body.decode())["gateway_http_connections_dropped_total"]
    return float(family.value(reason=reason))


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[http]\nbody_timeout_seconds = 0\n", "body_timeout_seconds"),
        ("[http]\nheader_timeout_seconds = 0\n", "header_timeout_seconds"),
        ("[http]\nkeepalive_timeout_seconds = -1\n", "keepalive_timeout_seconds"),
        ("[http]\nmax_connections = 0\n", "max_connections"),
    ],
)
def test_bad_limits_stop_start_up_with_the_key_named(
    tmp_path: Path, toml: str, message: str
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_settings(config, environ={})


# --------------------------------------------------------------------------- header


async def test_slow_header_clients_are_closed_at_the_header_timeout() -> None:
    """Six clients sending one header line every 0.1 s, never the blank line: each is
    closed about `header_timeout` after it connected, while it is still sending."""
    async with serving(header_timeout_seconds=0.6, keepalive_timeout_seconds=30) as (server, port):

        async def slowloris() -> float:
            reader, writer = await connect(port)

            async def trickle() -> None:
                writer.write(b"POST /api/chat HTTP/1.1\r\n")
                for n in range(100):  # 10 s of lines if nobody stops it
                    await anyio.sleep(0.1)
                    try:
                        writer.write(f"X-Line-{n}: {'v' * 20}\r\n".encode())
                        await writer.drain()
                    except ConnectionError:
                        return

            async with anyio.create_task_group() as tg:
                tg.start_soon(trickle)
                closed = await seconds_until_closed(reader, limit=5)
                tg.cancel_scope.cancel()
            writer.close()
            return closed

        times: list[float] = []

        async def one() -> None:
            times.append(await slowloris())

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(one)
        assert len(times) == 6
        assert all(0.4 <= t <= 2.5 for t in times), times
        assert await dropped(server, "header_timeout") == 6
        # The server still serves everyone else.
        assert (await ask(port, request_bytes("GET", "/healthz")))[0] == 200


async def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout() -> None:
    async with serving(header_timeout_seconds=0.5, keepalive_timeout_seconds=30) as (_, port):
        reader, writer = await connect(port)
        assert 0.3 <= await seconds_until_closed(reader, limit=5) <= 2.5
        writer.close()


async def test_a_header_in_pieces_within_the_timeout_is_served() -> None:
    async with serving(header_timeout_seconds=1.5) as (_, port):
        reader, writer = await connect(port)
        raw = chat()
        for piece in (raw[:10], raw[10:40], raw[40:]):
            writer.write(piece)
            await anyio.sleep(0.2)
        status, _, body = await read_response(reader)
        assert (status, json.loads(body)["reply"]) == (200, "echo: hi")
        writer.close()


async def test_the_header_timeout_counts_from_a_later_requests_first_byte() -> None:
    """On a kept-alive connection, time spent idle is the keep-alive timeout's, not the
    header's: a request after an idle spell longer than the header timeout is served,
    and a slow one is closed a header timeout after its first byte."""
    async with serving(header_timeout_seconds=0.5, keepalive_timeout_seconds=30) as (_, port):
        reader, writer = await connect(port)
        writer.write(request_bytes("GET", "/healthz"))
        assert (await read_response(reader))[0] == 200
        await anyio.sleep(1.0)  # idle, twice the header timeout
        writer.write(request_bytes("GET", "/healthz"))
        assert (await read_response(reader))[0] == 200
        await anyio.sleep(1.0)
        writer.write(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
        assert 0.3 <= await seconds_until_closed(reader, limit=5) <= 2.0
        writer.close()


# --------------------------------------------------------------------------- keep-alive


async def test_an_idle_kept_alive_connection_is_closed_at_the_keepalive_timeout() -> None:
    async with serving(keepalive_timeout_seconds=0.8, header_timeout_seconds=10) as (_, port):
        reader, writer = await connect(port)
        for _ in range(2):  # kept alive: two requests, one connection
            writer.write(request_bytes("GET", "/healthz"))
            assert (await read_response(reader))[0] == 200
            await anyio.sleep(0.3)
        assert await seconds_until_closed(reader, limit=5) <= 2.5
        writer.close()


# --------------------------------------------------------------------------- body


async def test_a_turn_longer_than_every_timeout_is_answered_on_a_kept_alive_connection() -> None:
    quick = {
        "header_timeout_seconds": 0.5,
        "body_timeout_seconds": 0.5,
        "keepalive_timeout_seconds": 0.5,
    }
    async with serving(**quick) as (_, port):
        reader, writer = await connect(port)
        for _ in range(2):
            writer.write(chat(text="think long"))
            status, _, body = await read_response(reader)
            assert (status, json.loads(body)["reply"]) == (200, "echo: think long")
        writer.close()


async def test_a_slow_body_gets_408_and_its_connection_is_closed() -> None:
    async with serving(body_timeout_seconds=0.6) as (server, port):
        reader, writer = await connect(port)
        writer.write(
            b"POST /api/chat HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {TOKEN}\r\nContent-Length: 1000\r\n\r\n".encode()
        )
        start = time.monotonic()

        async def trickle() -> None:
            for _ in range(100):
                try:
                    writer.write(b" ")
                    await writer.drain()
                except ConnectionError:
                    return
                await anyio.sleep(0.1)

        async with anyio.create_task_group() as tg:
            tg.start_soon(trickle)
            status, headers, body = await read_response(reader)
            assert 0.4 <= time.monotonic() - start <= 2.5
            assert status == 408 and headers["connection"] == "close"
            assert "did not arrive within 0.6s" in json.loads(body)["error"]
            assert await seconds_until_closed(reader, limit=3) <= 2.5
            tg.cancel_scope.cancel()
        writer.close()
        assert await dropped(server, "body_timeout") == 1


async def test_bodies_in_pieces_within_the_timeout_reach_the_api_and_webhooks() -> None:
    """A 60 KB chat request and a webhook delivery, each sent in pieces over about 0.6 s,
    with a 2 s body timeout: both are served."""
    async with serving(body_timeout_seconds=2.0) as (_, port):
        text = "x" * 60_000
        for raw, check in (
            (chat(text=text), lambda body: json.loads(body)["reply"] == f"echo: {text}"),
            (
                request_bytes("POST", "/telegram/webhook", b"{" + b" " * 50_000 + b"}"),
                lambda body: json.loads(body) == {"bytes": 50_002},
            ),
        ):
            reader, writer = await connect(port)
            step = len(raw) // 6 + 1
            for start in range(0, len(raw), step):
                writer.write(raw[start : start + step])
                await writer.drain()
                await anyio.sleep(0.1)
            status, _, body = await read_response(reader)
            assert status == 200 and check(body)
            writer.close()


# --------------------------------------------------------------------------- bound


async def test_past_the_connection_bound_a_new_connection_gets_503() -> None:
    async with serving(max_connections=3, header_timeout_seconds=30) as (server, port):
        stalled = [await connect(port) for _ in range(3)]
        for _, writer in stalled:
            writer.write(b"GET /healthz HTTP/1.1\r\n")  # busy: a header on its way
        await anyio.sleep(0.2)
        reader, writer = await connect(port)
        status, headers, body = await read_response(reader)
        assert status == 503 and headers["retry-after"] == "5"
        assert "too many open connections" in json.loads(body)["error"]
        await seconds_until_closed(reader, limit=3)
        writer.close()
        assert await dropped(server, "over_limit") == 1
        # One stalled client goes away: its place is free again.
        stalled[0][1].close()
        await anyio.sleep(0.2)
        assert (await ask(port, request_bytes("GET", "/healthz")))[0] == 200
        for _, writer in stalled[1:]:
            writer.close()


async def test_at_the_bound_the_longest_idle_connection_makes_room() -> None:
    async with serving(max_connections=3, keepalive_timeout_seconds=30) as (server, port):
        idle = []
        for _ in range(3):
            reader, writer = await connect(port)
            writer.write(request_bytes("GET", "/healthz"))
            assert (await read_response(reader))[0] == 200
            idle.append((reader, writer))
            await anyio.sleep(0.05)
        assert (await ask(port, request_bytes("GET", "/healthz")))[0] == 200
        assert await seconds_until_closed(idle[0][0], limit=2) < 2  # the oldest idle one
        writer = idle[1][1]
        writer.write(request_bytes("GET", "/healthz"))  # the others are still served
        assert (await read_response(idle[1][0]))[0] == 200
        assert await dropped(server, "idle_evicted") == 1
        for _, writer in idle:
            writer.close()


# --------------------------------------------------------------------------- guesses


async def test_wrong_tokens_get_429_with_retry_after_and_another_address_is_served() -> None:
    async with serving(auth_max_failures=3, auth_failure_window_seconds=60) as (_, port):
        for n in range(3):
            assert (await ask(port, chat(token=f"guess-{n}")))[0] == 401
        status, headers = await ask(port, chat(token="guess-4"))
        assert status == 429 and 55 <= int(headers["retry-after"]) <= 60
        # The locked-out address is not told whether the right token is right.
        assert (await ask(port, chat()))[0] == 429
        # Someone else is not locked out.
        assert (await ask(port, chat(), source=OTHER))[0] == 200


async def test_behind_a_trusted_proxy_the_forwarded_address_is_the_one_counted() -> None:
    proxy = {"trusted_proxies": ["127.0.0.1"], "auth_max_failures": 3}
    async with serving(**proxy) as (_, port):
        for n in range(3):
            # nginx appends the address it saw: a client's own header comes first.
            forwarded = f"198.51.100.{n}, 203.0.113.7"
            assert (await ask(port, chat(token=f"guess-{n}", forwarded_for=forwarded)))[0] == 401
        assert (await ask(port, chat(forwarded_for="203.0.113.7")))[0] == 429
        # Another client behind the same proxy, and the proxy's own requests, are served.
        assert (await ask(port, chat(forwarded_for="203.0.113.8")))[0] == 200
        assert (await ask(port, chat()))[0] == 200


async def test_an_untrusted_peer_cannot_dodge_the_count_with_x_forwarded_for() -> None:
    proxy = {"trusted_proxies": ["127.0.0.1"], "auth_max_failures": 3}
    async with serving(**proxy) as (_, port):
        for n in range(3):
            raw = chat(token=f"guess-{n}", forwarded_for=f"198.51.100.{n}")
            assert (await ask(port, raw, source=OTHER))[0] == 401
        raw = chat(token="guess-4", forwarded_for="198.51.100.99")
        assert (await ask(port, raw, source=OTHER))[0] == 429
        assert (await ask(port, chat(forwarded_for="198.51.100.99")))[0] == 200
