"""The real HTTP server on 127.0.0.1, port 0, inside an anyio task group, called with
aiohttp.ClientSession: probes, metrics, the chat API and its errors, mounts, shutdown."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from loguru import logger
from pydantic import SecretStr

from channels.slack.channel import SLACK_EVENTS_PATH
from channels.telegram.channel import TELEGRAM_WEBHOOK_PATH
from gateway.config import HTTPSettings
from gateway.http import (
    HealthState,
    HttpBindError,
    HttpConfigError,
    HttpServer,
)
from gateway.http.metrics import Metrics
from gateway.messages import InboundMessage, OutboundMessage
from tests.test_metrics import check_histogram, parse_exposition

pytestmark = pytest.mark.anyio

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def echo_chat(inbound: InboundMessage) -> OutboundMessage:
    return OutboundMessage(
        channel=inbound.channel,
        chat_id=inbound.chat_id,
        text=f"echo: {inbound.text}",
        session_key=inbound.session_key,
    )


def make_server(
    *,
    token: str | None = TOKEN,
    chat: Callable[[InboundMessage], Any] | None = echo_chat,
    ready: bool = True,
    **kwargs: Any,
) -> HttpServer:
    health = HealthState()
    if ready:
        health.set_ready()
    settings = HTTPSettings(host="127.0.0.1", port=0, token=SecretStr(token) if token else None)
    return HttpServer(settings, health=health, metrics=Metrics(), chat=chat, **kwargs)


@asynccontextmanager
async def serving(server: HttpServer) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        try:
            async with aiohttp.ClientSession() as client:
                yield f"http://127.0.0.1:{port}", client
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def captured_logs() -> AsyncIterator[list[str]]:
    lines: list[str] = []
    handler = logger.add(lambda message: lines.append(str(message)), level="DEBUG")
    try:
        yield lines
    finally:
        logger.remove(handler)


# --------------------------------------------------------------------------- probes


async def test_healthz_answers_ok_in_every_phase() -> None:
    server = make_server(ready=False)
    async with serving(server) as (url, client):
        for move in (
            server.health.set_starting,
            server.health.set_ready,
            server.health.set_draining,
        ):
            move()
            async with client.get(f"{url}/healthz") as response:
                assert response.status == 200
                assert await response.text() == "ok\n"


async def test_readyz_follows_phase_and_components() -> None:
    server = make_server(ready=False)
    health = server.health
    async with serving(server) as (url, client):

        async def readyz() -> tuple[int, dict[str, Any]]:
            async with client.get(f"{url}/readyz") as response:
                assert response.content_type == "application/json"
                return response.status, await response.json()

        status, body = await readyz()
        assert (status, body["status"], body["reasons"]) == (503, "starting", ["starting"])
        health.set_ready()
        status, body = await readyz()
        assert (status, body["status"], body["reasons"]) == (200, "ready", [])
        slack = health.component("slack")
        status, body = await readyz()
        assert status == 503 and body["reasons"] == ["slack: not reported yet"]
        slack.healthy(False, "socket closed")
        status, body = await readyz()
        assert status == 503 and body["status"] == "unhealthy"
        assert body["components"] == {"slack": {"healthy": False, "detail": "socket closed"}}
        slack.healthy(True, "connected")
        assert (await readyz())[0] == 200
        health.set_draining()
        status, body = await readyz()
        assert (status, body["status"], body["reasons"]) == (503, "draining", ["draining"])


async def test_metrics_scrape_is_valid_exposition_and_counts_requests() -> None:
    server = make_server()
    answer = OutboundMessage(channel="api", chat_id="x", text="hi", session_key="api:x")
    server.metrics.observe_turn(answer, 0.2)
    async with serving(server) as (url, client):
        async with client.get(f"{url}/healthz"):
            pass
        async with client.get(f"{url}/no/such/thing"):
            pass
        async with client.get(f"{url}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            families = parse_exposition(await response.text())
    requests = families["gateway_http_requests_total"]
    assert requests.value(method="GET", route="/healthz", status="200") == 1
    assert requests.value(method="GET", route="unmatched", status="404") == 1
    check_histogram(families["gateway_http_request_seconds"])
    check_histogram(families["gateway_turn_seconds"])
    assert families["process_resident_memory_bytes"].type == "gauge"


# --------------------------------------------------------------------------- chat API


async def test_chat_happy_path() -> None:
    seen: list[InboundMessage] = []

    async def chat(inbound: InboundMessage) -> OutboundMessage:
        seen.append(inbound)
        return await echo_chat(inbound)

    async with serving(make_server(chat=chat)) as (url, client):
        for session in ("xyz", "api:xyz"):
            async with client.post(
                f"{url}/api/chat", json={"session": session, "text": "hello"}, headers=AUTH
            ) as response:
                assert response.status == 200
                assert await response.json() == {
                    "session": "api:xyz",
                    "reply": "echo: hello",
                    "error": False,
                }
    assert [m.session_key for m in seen] == ["api:xyz", "api:xyz"]
    assert seen[0].channel == "api" and seen[0].text == "hello"


async def test_chat_error_reply_and_no_reply() -> None:
    async def failing_turn(inbound: InboundMessage) -> OutboundMessage:
        return OutboundMessage(
            "api", inbound.chat_id, "the model is down", inbound.session_key, is_error=True
        )

    async def silent(inbound: InboundMessage) -> None:
        return None

    for chat, expected in ((failing_turn, ("the model is down", True)), (silent, (None, False))):
        async with (
            serving(make_server(chat=chat)) as (url, client),
            client.post(
                f"{url}/api/chat", json={"session": "s", "text": "hi"}, headers=AUTH
            ) as response,
        ):
            body = await response.json()
        assert response.status == 200
        assert (body["session"], body["reply"], body["error"]) == ("api:s", *expected)


async def test_missing_and_wrong_token_are_401() -> None:
    async with serving(make_server()) as (url, client):
        for headers, challenge in (
            ({}, 'Bearer realm="gateway"'),
            ({"Authorization": "Basic Zm9vOmJhcg=="}, 'Bearer realm="gateway"'),
            (
                {"Authorization": "Bearer wrong-token"},
                'Bearer realm="gateway", error="invalid_token"',
            ),
        ):
            async with client.post(
                f"{url}/api/chat", json={"text": "hi"}, headers=headers
            ) as response:
                assert response.status == 401
                assert response.headers["WWW-Authenticate"] == challenge
                assert "token" in (await response.json())["error"]


async def test_no_token_configured_turns_the_api_off() -> None:
    async with (
        serving(make_server(token=None)) as (url, client),
        client.post(
            f"{url}/api/chat", json={"session": "s", "text": "hi"}, headers=AUTH
        ) as response,
    ):
        assert response.status == 503
        assert "GATEWAY_HTTP__TOKEN" in (await response.json())["error"]


async def test_no_chat_attached_is_503() -> None:
    async with (
        serving(make_server(chat=None)) as (url, client),
        client.post(
            f"{url}/api/chat", json={"session": "s", "text": "hi"}, headers=AUTH
        ) as response,
    ):
        assert response.status == 503
        assert "no agent" in (await response.json())["error"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"session": "x"}', "text: required"),
        (b'{"session": "x", "text": ""}', "text: is empty"),
        (b'{"session": "x", "text": ["a"]}', "text: must be a string"),
        (json.dumps({"session": "x" * 201, "text": "hi"}).encode(), "session:"),
        (json.dumps({"session": "a\nb", "text": "hi"}).encode(), "session:"),
        (json.dumps({"session": "telegram:42", "text": "hi"}).encode(), "session:"),
    ],
)
async def test_bad_requests_are_400_json(body: bytes, fragment: str) -> None:
    calls: list[InboundMessage] = []

    async def chat(inbound: InboundMessage) -> OutboundMessage:
        calls.append(inbound)
        return await echo_chat(inbound)

    async with (
        serving(make_server(chat=chat)) as (url, client),
        client.post(
            f"{url}/api/chat",
            data=body,
            headers={**AUTH, "Content-Type": "application/json"},
        ) as response,
    ):
        assert response.status == 400
        assert fragment in (await response.json())["error"]
    assert calls == []


async def test_body_over_the_limit_is_413_with_and_without_content_length() -> None:
    limit = 1024
    async with serving(make_server(max_body_bytes=limit)) as (url, client):
        big = json.dumps({"session": "s", "text": "x" * (limit * 4)}).encode()
        headers = {**AUTH, "Content-Type": "application/json"}
        async with client.post(f"{url}/api/chat", data=big, headers=headers) as response:
            assert response.status == 413
            assert "1024-byte limit" in (await response.json())["error"]

        async def chunks() -> AsyncIterator[bytes]:  # chunked: no Content-Length to check
            for _ in range(8):
                yield b" " * 512

        async with client.post(f"{url}/api/chat", data=chunks(), headers=headers) as response:
            assert response.status == 413
            assert "limit" in (await response.json())["error"]
        exact = (
            json.dumps({"session": "s", "text": "y"}).encode().ljust(limit)
        )  # at the limit is fine
        async with client.post(f"{url}/api/chat", data=exact, headers=headers) as response:
            assert response.status == 200


async def test_wrong_content_type_is_415() -> None:
    async with serving(make_server()) as (url, client):
        for content_type in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/json; charset=latin-1",
        ):
            async with client.post(
                f"{url}/api/chat",
                data=b'{"session": "s", "text": "hi"}',
                headers={**AUTH, "Content-Type": content_type},
            ) as response:
                assert response.status == 415, content_type
                assert "application/json" in (await response.json())["error"]


async def test_wrong_method_is_405_and_unknown_path_404_both_json() -> None:
    async with serving(make_server()) as (url, client):
        async with client.get(f"{url}/api/chat", headers=AUTH) as response:
            assert response.status == 405
            assert response.headers["Allow"] == "POST"
            assert "not allowed" in (await response.json())["error"]
        async with client.post(f"{url}/healthz") as response:
            assert response.status == 405
        async with client.get(f"{url}/nope") as response:
            assert response.status == 404
            assert "no such endpoint" in (await response.json())["error"]


async def test_chat_is_refused_while_starting_or_draining() -> None:
    server = make_server(ready=False)
    async with serving(server) as (url, client):
        for move, word in (
            (server.health.set_starting, "starting"),
            (server.health.set_draining, "shutting down"),
        ):
            move()
            async with client.post(
                f"{url}/api/chat", json={"session": "s", "text": "hi"}, headers=AUTH
            ) as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "5"
                assert word in (await response.json())["error"]


async def test_a_crashing_chat_is_500_and_logged_without_secrets() -> None:
    async def broken(inbound: InboundMessage) -> OutboundMessage:
        raise RuntimeError("agent bug")

    async with (
        captured_logs() as lines,
        serving(make_server(chat=broken)) as (url, client),
        client.post(
            f"{url}/api/chat?token={TOKEN}", json={"session": "s", "text": "hi"}, headers=AUTH
        ) as response,
    ):
        assert response.status == 500
        body = await response.json()
    assert body == {"error": "internal error; the gateway log has the details"}
    log = "\n".join(lines)
    assert "RuntimeError: agent bug" in log and "Traceback" in log
    assert "http POST /api/chat 500" in log
    assert TOKEN not in log and "Bearer" not in log and "Authorization" not in log


async def test_access_log_has_no_secrets_or_query_strings() -> None:
    async with captured_logs() as lines, serving(make_server()) as (url, client):
        async with client.post(
            f"{url}/api/chat?key=hidden-query-value",
            json={"session": "s", "text": "hi"},
            headers=AUTH,
        ) as response:
            assert response.status == 200
        async with client.get(f"{url}/%0Aforged%20line") as response:
            assert response.status == 404
    log = "\n".join(lines)
    assert "http POST /api/chat 200" in log
    assert TOKEN not in log and "hidden-query-value" not in log
    assert "\nforged" not in log


# --------------------------------------------------------------------------- lifecycle


def test_non_loopback_bind_without_token_is_refused() -> None:
    settings = HTTPSettings(host="0.0.0.0", port=0)
    with pytest.raises(HttpConfigError, match="GATEWAY_HTTP__TOKEN"):
        HttpServer(settings, health=HealthState(), metrics=Metrics(), chat=None)
    with_token = HTTPSettings(host="0.0.0.0", port=0, token=SecretStr(TOKEN))
    HttpServer(with_token, health=HealthState(), metrics=Metrics(), chat=None)


async def test_mounted_routes_are_reachable_and_gated_on_readiness() -> None:
    server = make_server(ready=False)
    received: list[bytes] = []

    async def telegram(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"ok": True})

    async def slack(request: web.Request) -> web.Response:
        return web.Response(text="challenge-accepted")

    server.mount("POST", TELEGRAM_WEBHOOK_PATH, telegram)
    server.mount("post", SLACK_EVENTS_PATH, slack, require_ready=False)
    with pytest.raises(ValueError):
        server.mount("POST", TELEGRAM_WEBHOOK_PATH, telegram)
    with pytest.raises(ValueError):
        server.mount("GET", "/healthz", telegram)
    with pytest.raises(ValueError):
        server.mount("TRACE", "/x", telegram)

    async with serving(server) as (url, client):
        async with client.post(
            f"{url}{TELEGRAM_WEBHOOK_PATH}", data=b'{"update_id": 1}'
        ) as response:
            assert response.status == 503  # starting: Telegram will redeliver
        async with client.post(f"{url}{SLACK_EVENTS_PATH}", data=b"{}") as response:
            assert response.status == 200 and await response.text() == "challenge-accepted"
        server.health.set_ready()
        async with client.post(
            f"{url}{TELEGRAM_WEBHOOK_PATH}", data=b'{"update_id": 2}'
        ) as response:
            assert response.status == 200 and await response.json() == {"ok": True}
        async with client.get(f"{url}{TELEGRAM_WEBHOOK_PATH}") as response:
            assert response.status == 405
        with pytest.raises(RuntimeError, match="before run"):
            server.mount("POST", "/late", telegram)
    assert received == [b'{"update_id": 2}']


async def test_the_port_is_released_on_cancellation() -> None:
    server = make_server()
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        assert port == server.bound_port and port > 0
        tg.cancel_scope.cancel()
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))
    with pytest.raises(RuntimeError, match="once"):
        await server.run()


async def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        settings = HTTPSettings(host="127.0.0.1", port=port, token=SecretStr(TOKEN))
        server = HttpServer(settings, health=HealthState(), metrics=Metrics(), chat=None)
        with pytest.raises(HttpBindError, match="GATEWAY_HTTP__PORT"):
            await server.run()
