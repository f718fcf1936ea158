"""The fake WhatsApp Cloud API keeps the semantics the gateway is tested against: signed
webhook deliveries retried until a 2xx, statuses after each send, the 24-hour window
(131047), the named error codes, templates, media behind the bearer token."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from tests.fakes.whatsapp_server import PHONE_NUMBER_ID, FakeWhatsApp

pytestmark = pytest.mark.anyio

PERSON = "4915112345678"
DAY = 24 * 3600


class Receiver:
    """A webhook endpoint that answers with scripted statuses (then 200), or hangs."""

    def __init__(self) -> None:
        self.answers: list[int | str] = []
        self.requests: list[tuple[bytes, dict[str, str], float]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append((body, dict(request.headers), anyio.current_time()))
        answer = self.answers.pop(0) if self.answers else 200
        if answer == "hang":
            await asyncio.sleep(30)
        return web.Response(status=int(answer) if answer != "hang" else 200)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/hook", found.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    try:
        yield found
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake(receiver: Receiver) -> AsyncIterator[FakeWhatsApp]:
    async with FakeWhatsApp(retry_delays=(0.05, 0.1, 0.2), ack_timeout=0.5) as server:
        server.webhook_url = receiver.url
        yield server


async def graph(
    fake: FakeWhatsApp, method: str, path: str, body: Any = None, *, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token if token is not None else fake.token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{fake.url}/v26.0/{path}", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


def text(to: str, body: str) -> dict[str, Any]:
    return {"messaging_product": "whatsapp", "to": to, "type": "text", "text": {"body": body}}


async def test_deliveries_are_signed_and_retried_with_the_same_body_until_a_2xx(
    fake: FakeWhatsApp, receiver: Receiver
) -> None:
    receiver.answers = [500, "hang", 200]
    delivery = await fake.deliver(fake.text_message(PERSON, "hello"))
    assert delivery.delivered and len(delivery.attempts) == 3
    assert [a.failure for a in delivery.attempts] == ["HTTP 500", "timeout", None]
    bodies = {body for body, _, _ in receiver.requests}
    assert len(bodies) == 1  # a retry is the same delivery
    body, headers, _ = receiver.requests[0]
    expected = "sha256=" + hmac.new(fake.app_secret.encode(), body, hashlib.sha256).hexdigest()
    assert headers["X-Hub-Signature-256"] == expected
    message = json.loads(body)["entry"][0]["changes"][0]["value"]["messages"][0]
    assert message["from"] == PERSON and message["text"] == {"body": "hello"}
    # Backoff: each wait is longer than the one before.
    times = [at for _, _, at in receiver.requests]
    assert times[2] - times[1] > times[1] - times[0] - 0.5  # the hang took ack_timeout


async def test_a_delivery_that_never_gets_a_2xx_gives_up_after_its_retries(
    fake: FakeWhatsApp, receiver: Receiver
) -> None:
    receiver.answers = [503] * 10
    delivery = await fake.deliver(fake.text_message(PERSON, "hello"))
    assert not delivery.delivered and len(delivery.attempts) == 1 + len(fake.retry_delays)


async def test_a_send_is_followed_by_its_statuses_in_order(
    fake: FakeWhatsApp, receiver: Receiver
) -> None:
    await fake.deliver(fake.text_message(PERSON, "hi"))
    fake.read_by.add(PERSON)
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", text(PERSON, "yo"))
    assert status == 200 and answer["contacts"] == [{"input": PERSON, "wa_id": PERSON}]
    wamid = answer["messages"][0]["id"]
    with anyio.fail_after(5):
        while len(receiver.requests) < 4:  # noqa: ASYNC110 (the fake's own schedule)
            await anyio.sleep(0.02)
    statuses = [
        json.loads(body)["entry"][0]["changes"][0]["value"]["statuses"][0]
        for body, _, _ in receiver.requests[1:]
    ]
    assert [(s["id"], s["status"]) for s in statuses] == [
        (wamid, "sent"),
        (wamid, "delivered"),
        (wamid, "read"),
    ]
    assert statuses[0]["recipient_id"] == PERSON


async def test_free_text_outside_the_window_fails_with_131047_but_a_template_goes(
    fake: FakeWhatsApp, receiver: Receiver
) -> None:
    fake.templates[("pending_reply", "en")] = 1
    fake.text_message(PERSON, "old", sent_at=fake.now() - DAY - 60)  # wrote 24 h ago
    assert not fake.window_open(PERSON)
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", text(PERSON, "x"))
    assert status == 200  # accepted; the failure comes as a status, as on the real service
    with anyio.fail_after(5):
        while not receiver.requests:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    failed = json.loads(receiver.requests[0][0])["entry"][0]["changes"][0]["value"]["statuses"]
    assert failed[0]["status"] == "failed" and failed[0]["errors"][0]["code"] == 131047
    template = {
        "messaging_product": "whatsapp",
        "to": PERSON,
        "type": "template",
        "template": {
            "name": "pending_reply",
            "language": {"code": "en"},
            "components": [{"type": "body", "parameters": [{"type": "text", "text": "x"}]}],
        },
    }
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", template)
    assert status == 200 and answer["messages"][0]["message_status"] == "accepted"
    template["template"]["components"] = []
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", template)
    assert (status, answer["error"]["code"]) == (400, 132000)
    template["template"]["name"] = "nope"
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", template)
    assert (status, answer["error"]["code"]) == (404, 132001)
    # A new message opens the window again.
    fake.text_message(PERSON, "back")
    assert fake.window_open(PERSON)
    fake.window_errors = "sync"
    fake.text_message("4917000000000", "old", sent_at=fake.now() - 2 * DAY)
    status, answer = await graph(
        fake, "POST", f"{PHONE_NUMBER_ID}/messages", text("4917000000000", "x")
    )
    assert (status, answer["error"]["code"]) == (400, 131047)
    assert answer["error"]["error_data"]["details"].startswith("Message failed to send")


async def test_named_errors_throughput_undeliverable_token_and_length(
    fake: FakeWhatsApp, receiver: Receiver
) -> None:
    fake.text_message(PERSON, "hi")
    fake.throughput = 2
    answers = [
        await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", text(PERSON, str(i)))
        for i in range(3)
    ]
    assert [s for s, _ in answers] == [200, 200, 400]
    assert answers[2][1]["error"]["code"] == 130429
    assert answers[2][1]["error"]["message"] == "(#130429) Rate limit hit"
    await anyio.sleep(1.05)
    fake.throughput = 80
    status, answer = await graph(
        fake, "POST", f"{PHONE_NUMBER_ID}/messages", text(PERSON, "x" * 4097)
    )
    assert (status, answer["error"]["code"]) == (400, 100)
    status, answer = await graph(fake, "GET", PHONE_NUMBER_ID, token="wrong")
    assert (status, answer["error"]["code"]) == (401, 190)
    fake.unreachable.add("4917111111111")
    fake.text_message("4917111111111", "hi")
    receiver.requests.clear()
    status, _ = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", text("4917111111111", "x"))
    assert status == 200
    with anyio.fail_after(5):
        while not any(b"131026" in body for body, _, _ in receiver.requests):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    fake.fail_next(131016, status=503)
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", text(PERSON, "x"))
    assert (status, answer["error"]["code"]) == (503, 131016)


async def test_media_and_read_receipts(fake: FakeWhatsApp) -> None:
    photo = fake.add_media(b"\x89PNG fake", "image/png")
    status, info = await graph(fake, "GET", photo)
    assert status == 200 and info["file_size"] == 9 and info["mime_type"] == "image/png"
    async with aiohttp.ClientSession() as session:
        async with session.get(info["url"]) as r:
            assert r.status == 401  # the URL needs the token
        auth = {"Authorization": f"Bearer {fake.token}"}
        async with session.get(info["url"], headers=auth) as r:
            assert r.status == 200 and await r.read() == b"\x89PNG fake"
        form = aiohttp.FormData()
        form.add_field("messaging_product", "whatsapp")
        form.add_field("type", "text/plain")
        form.add_field("file", b"notes", filename="a.txt", content_type="text/plain")
        url = f"{fake.url}/v26.0/{PHONE_NUMBER_ID}/media"
        async with session.post(url, data=form, headers=auth) as r:
            uploaded = await r.json()
    assert fake.media(uploaded["id"]) == (b"notes", "text/plain")
    incoming = fake.text_message(PERSON, "hi")
    wamid = incoming["entry"][0]["changes"][0]["value"]["messages"][0]["id"]
    read = {
        "messaging_product": "whatsapp",
        "status": "read",
        "message_id": wamid,
        "typing_indicator": {"type": "text"},
    }
    assert await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", read) == (
        200,
        {"success": True},
    )
    read["message_id"] = "wamid.unknown"
    status, answer = await graph(fake, "POST", f"{PHONE_NUMBER_ID}/messages", read)
    assert (status, answer["error"]["code"]) == (400, 100)
    assert fake.reads[0]["typing_indicator"] == {"type": "text"}
