"""What every page on the gateway's port gets (gateway/http/pages.py): the strict CSP, the
framing rule, static files served by plain name only, the origin check."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.http.pages import StaticFiles, content_security_policy, page_headers, same_origin

pytestmark = pytest.mark.anyio


def test_a_page_runs_only_its_own_files_and_is_framed_by_nobody() -> None:
    headers = page_headers()
    policy = headers["Content-Security-Policy"]
    for rule in (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self';",
        "connect-src 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ):
        assert rule in policy
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_framing_is_allowed_only_to_the_origins_named() -> None:
    headers = page_headers(["https://shop.example"])
    policy = headers["Content-Security-Policy"]
    assert "frame-ancestors https://shop.example;" in policy
    assert "X-Frame-Options" not in headers  # it would forbid the frame the CSP allows
    assert "frame-ancestors 'none'" in content_security_policy()


@pytest.fixture
async def client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    files = StaticFiles("gateway.http.admin")
    app = web.Application()
    app.router.add_get("/static/{name}", files.handler)

    async def origin(request: web.Request) -> web.Response:
        return web.Response(text=str(same_origin(request)))

    app.router.add_post("/origin", origin)
    async with TestClient(TestServer(app)) as test_client:
        yield test_client


async def test_static_files_are_served_by_name_with_their_type(
    client: TestClient[web.Request, web.Application],
) -> None:
    answer = await client.get("/static/admin.css")
    assert answer.status == 200
    assert answer.headers["Content-Type"].startswith("text/css")
    assert answer.headers["X-Content-Type-Options"] == "nosniff"
    for name in ("nothing.css", "..%2Fpage.py", "%2e%2e%2f__init__.py", "page.py"):
        assert (await client.get(f"/static/{name}")).status == 404


async def test_only_the_pages_own_origin_passes(
    client: TestClient[web.Request, web.Application],
) -> None:
    host = f"{client.host}:{client.port}"
    assert await (await client.post("/origin")).text() == "True"  # no Origin: not a browser
    answer = await client.post("/origin", headers={"Origin": f"http://{host}"})
    assert await answer.text() == "True"
    answer = await client.post("/origin", headers={"Origin": "http://evil.example"})
    assert await answer.text() == "False"
