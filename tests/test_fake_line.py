"""The fake LINE Platform keeps the semantics the delivery promise depends on: what LINE
signs (x-line-signature over the exact body), when it delivers again (only with webhook
redelivery on, the same event ids, `isRedelivery`), what a reply token allows (once,
within its minute), what a retry key guarantees (a push executed once, 409 after), and
what it refuses without processing (429s: a rate limit, the monthly limit)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.fakes.line_server import (
    INVALID_REPLY_TOKEN,
    MONTHLY_LIMIT,
    RATE_LIMITED,
    RETRY_KEY_ACCEPTED,
    FakeLine,
)

pytestmark = pytest.mark.anyio


class Receiver:
    """A webhook endpoint that answers with scripted statuses (then 200)."""

    def __init__(self) -> None:
        self.answers: list[int] = []
        self.requests: list[tuple[bytes, dict[str, str]]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((await request.read(), dict(request.headers)))
        return web.Response(status=self.answers.pop(0) if self.answers else 200)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/hook", found.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    try:
        yield found
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake(receiver: Receiver) -> AsyncIterator[FakeLine]:
    async with FakeLine(retry_delays=(0.05, 0.1), ack_timeout=0.5) as server:
        server.webhook_url = receiver.url
        yield server


async def api(
    fake: FakeLine,
    method: str,
    path: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    sent = {"Authorization": f"Bearer {fake.token}", **(headers or {})}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{fake.url}{path}", json=body, headers=sent) as r,
    ):
        return r.status, await r.json(content_type=None), dict(r.headers)


def text(value: str, **extra: Any) -> dict[str, Any]:
    return {"type": "text", "text": value, **extra}


async def test_a_delivery_is_signed_over_its_exact_body(fake: FakeLine, receiver: Receiver) -> None:
    user = fake.add_user("Ann")
    delivery = await fake.deliver(fake.text_message(user, "hello"))
    assert delivery.delivered
    [(body, headers)] = receiver.requests
    expected = base64.b64encode(
        hmac.new(fake.channel_secret.encode(), body, hashlib.sha256).digest()
    ).decode()
    assert headers["x-line-signature"] == expected
    [event] = json.loads(body)["events"]
    assert event["source"] == {"type": "user", "userId": user}
    assert event["message"]["text"] == "hello" and event["replyToken"] and event["webhookEventId"]


async def test_an_unanswered_request_comes_again_with_the_same_event_only_with_redelivery(
    fake: FakeLine, receiver: Receiver
) -> None:
    user = fake.add_user("Ann")
    receiver.answers = [500, 503]
    delivery = await fake.deliver(fake.text_message(user, "again"))
    assert [a.status for a in delivery.attempts] == [500, 503, 200]
    events = [json.loads(body)["events"][0] for body, _ in receiver.requests]
    assert len({e["webhookEventId"] for e in events}) == 1
    assert len({e["message"]["id"] for e in events}) == 1
    assert len({e["replyToken"] for e in events}) == 1
    assert [e["deliveryContext"]["isRedelivery"] for e in events] == [False, True, True]
    # Each attempt is signed over its own body.
    for body, headers in receiver.requests:
        digest = hmac.new(fake.channel_secret.encode(), body, hashlib.sha256).digest()
        assert headers["x-line-signature"] == base64.b64encode(digest).decode()

    fake.redelivery = False  # LINE's default
    receiver.answers = [500]
    delivery = await fake.deliver(fake.text_message(user, "lost"))
    assert [a.status for a in delivery.attempts] == [500]


async def test_a_reply_token_is_single_use_and_expires(fake: FakeLine) -> None:
    user = fake.add_user("Ann")
    token = fake.text_message(user, "hi")["events"][0]["replyToken"]
    status, answer, _ = await api(
        fake, "POST", "/v2/bot/message/reply", {"replyToken": token, "messages": [text("one")]}
    )
    assert status == 200 and len(answer["sentMessages"]) == 1
    status, answer, _ = await api(
        fake, "POST", "/v2/bot/message/reply", {"replyToken": token, "messages": [text("two")]}
    )
    assert (status, answer["message"]) == (400, INVALID_REPLY_TOKEN)
    assert fake.texts_to(user) == ["one"]

    late = fake.text_message(user, "hi")["events"][0]["replyToken"]
    fake.clock_offset = fake.reply_token_ttl + 1
    status, answer, _ = await api(
        fake, "POST", "/v2/bot/message/reply", {"replyToken": late, "messages": [text("late")]}
    )
    assert (status, answer["message"]) == (400, INVALID_REPLY_TOKEN)
    # A reply is never a push: no retry key.
    fresh = fake.text_message(user, "hi")["events"][0]["replyToken"]
    status, _, _ = await api(
        fake,
        "POST",
        "/v2/bot/message/reply",
        {"replyToken": fresh, "messages": [text("x")]},
        headers={"X-Line-Retry-Key": str(uuid.uuid4())},
    )
    assert status == 400 and fake.texts_to(user) == ["one"]


async def test_a_retry_key_executes_a_push_once(fake: FakeLine) -> None:
    user = fake.add_user("Ann")
    key = str(uuid.uuid4())
    body = {"to": user, "messages": [text("pushed")]}
    first = await api(fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": key})
    second = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": key}
    )
    assert first[0] == 200
    assert (second[0], second[1]["message"]) == (409, RETRY_KEY_ACCEPTED)
    assert second[2]["x-line-accepted-request-id"] == first[2]["x-line-request-id"]
    assert second[1]["sentMessages"] == first[1]["sentMessages"]
    assert fake.texts_to(user) == ["pushed"] and fake.usage == 1
    # A 5xx that took effect accepted its key: the retry is a 409, shown once.
    fake.fail_next(500, "Internal server error", processed=True)
    other = str(uuid.uuid4())
    failed = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": other}
    )
    again = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": other}
    )
    assert (failed[0], again[0]) == (500, 409)
    assert fake.texts_to(user) == ["pushed", "pushed"]
    # A 5xx that did not take effect leaves the key free.
    fake.fail_next(500, "Internal server error")
    third = str(uuid.uuid4())
    failed = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": third}
    )
    again = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": third}
    )
    assert (failed[0], again[0]) == (500, 200)
    assert len(fake.texts_to(user)) == 3
    bad = await api(
        fake, "POST", "/v2/bot/message/push", body, headers={"X-Line-Retry-Key": "not-a-uuid"}
    )
    assert bad[0] == 400


async def test_the_monthly_limit_refuses_pushes_not_replies(fake: FakeLine) -> None:
    ann, bob = fake.add_user("Ann"), fake.add_user("Bob")
    group = fake.add_group([ann, bob, fake.add_user("Cy")])
    fake.quota = 4
    status, _, _ = await api(
        fake, "POST", "/v2/bot/message/push", {"to": ann, "messages": [text("a"), text("b")]}
    )
    assert status == 200 and fake.usage == 1  # one recipient, however many bubbles
    status, _, _ = await api(
        fake, "POST", "/v2/bot/message/push", {"to": group, "messages": [text("all")]}
    )
    assert status == 200 and fake.usage == 4  # every member counts
    status, answer, _ = await api(
        fake, "POST", "/v2/bot/message/push", {"to": bob, "messages": [text("no")]}
    )
    assert (status, answer["message"]) == (429, MONTHLY_LIMIT)
    assert fake.texts_to(bob) == [] and fake.usage == 4  # not processed
    token = fake.text_message(bob, "hi")["events"][0]["replyToken"]
    status, _, _ = await api(
        fake, "POST", "/v2/bot/message/reply", {"replyToken": token, "messages": [text("free")]}
    )
    assert status == 200 and fake.texts_to(bob) == ["free"] and fake.usage == 4
    status, quota, _ = await api(fake, "GET", "/v2/bot/message/quota")
    assert quota == {"type": "limited", "value": 4}
    # A delivery in progress holds quota back (LINE's FAQ): the same 429, for a while.
    fake.quota, fake.reserved = 10, 6
    status, answer, _ = await api(
        fake, "POST", "/v2/bot/message/push", {"to": bob, "messages": [text("x")]}
    )
    assert (status, answer["message"]) == (429, MONTHLY_LIMIT)


async def test_a_rate_limited_push_is_not_processed(fake: FakeLine) -> None:
    user = fake.add_user("Ann")
    fake.push_rate = 1
    first = await api(fake, "POST", "/v2/bot/message/push", {"to": user, "messages": [text("1")]})
    second = await api(fake, "POST", "/v2/bot/message/push", {"to": user, "messages": [text("2")]})
    assert first[0] == 200 and (second[0], second[1]["message"]) == (429, RATE_LIMITED)
    assert fake.texts_to(user) == ["1"]


async def test_limits_of_a_request(fake: FakeLine) -> None:
    user = fake.add_user("Ann")
    six = {"to": user, "messages": [text(str(n)) for n in range(6)]}
    assert (await api(fake, "POST", "/v2/bot/message/push", six))[0] == 400
    long = {"to": user, "messages": [text("x" * 5001)]}
    assert (await api(fake, "POST", "/v2/bot/message/push", long))[0] == 400
    exact = {"to": user, "messages": [text("x" * 5000)]}
    assert (await api(fake, "POST", "/v2/bot/message/push", exact))[0] == 200
    stranger = {"to": "U" + "0" * 32, "messages": [text("?")]}
    assert (await api(fake, "POST", "/v2/bot/message/push", stranger))[0] == 400
    status, _, _ = await api(fake, "GET", "/v2/bot/info", headers={"Authorization": "Bearer nope"})
    assert status == 401


async def test_a_quote_token_names_its_message_in_its_chat(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    event = fake.text_message(ann, "quote me", group=group, mention=True)["events"][0]
    message = event["message"]
    assert message["mention"]["mentionees"][0]["isSelf"] is True
    assert message["text"].startswith(f"@{fake.display_name} ")
    body = {
        "replyToken": event["replyToken"],
        "messages": [text("answer", quoteToken=message["quoteToken"])],
    }
    status, _, _ = await api(fake, "POST", "/v2/bot/message/reply", body)
    assert status == 200
    [sent] = fake.sent
    assert sent.quoted == message["id"] and sent.chat == group
    wrong = {"to": ann, "messages": [text("elsewhere", quoteToken=message["quoteToken"])]}
    assert (await api(fake, "POST", "/v2/bot/message/push", wrong))[0] == 400


async def test_the_loading_animation_is_for_one_on_one_chats(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    ok = await api(
        fake, "POST", "/v2/bot/chat/loading/start", {"chatId": ann, "loadingSeconds": 20}
    )
    assert ok[0] == 202
    for body in (
        {"chatId": group, "loadingSeconds": 20},
        {"chatId": ann, "loadingSeconds": 7},
        {"chatId": ann, "loadingSeconds": 65},
    ):
        assert (await api(fake, "POST", "/v2/bot/chat/loading/start", body))[0] == 400
    assert fake.loading == [{"chatId": ann, "loadingSeconds": 20}]


async def test_content_and_profiles(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    message_id = fake.add_content(b"\x89PNG...", "image/png")
    async with aiohttp.ClientSession() as session:
        async with session.get(
            f"{fake.url}/v2/bot/message/{message_id}/content",
            headers={"Authorization": f"Bearer {fake.token}"},
        ) as r:
            assert r.status == 200 and await r.read() == b"\x89PNG..."
        async with session.get(f"{fake.url}/v2/bot/message/{message_id}/content") as r:
            assert r.status == 401
    assert (await api(fake, "GET", f"/v2/bot/profile/{ann}"))[1]["displayName"] == "Ann"
    assert (await api(fake, "GET", f"/v2/bot/group/{group}/member/{ann}"))[1][
        "displayName"
    ] == "Ann"
    await asyncio.sleep(0)


async def test_only_a_text_v2_mention_notifies(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    typed = {"to": group, "messages": [text("@All look")]}
    everyone = {
        "to": group,
        "messages": [
            {
                "type": "textV2",
                "text": "{all} look, {ann}",
                "substitution": {
                    "all": {"type": "mention", "mentionee": {"type": "all"}},
                    "ann": {"type": "mention", "mentionee": {"type": "user", "userId": ann}},
                },
            }
        ],
    }
    assert (await api(fake, "POST", "/v2/bot/message/push", typed))[0] == 200
    assert (await api(fake, "POST", "/v2/bot/message/push", everyone))[0] == 200
    plain, v2 = fake.sent
    assert (plain.text, plain.pings_everyone, plain.mentions) == ("@All look", False, frozenset())
    assert (v2.text, v2.pings_everyone, v2.mentions) == ("@All look, @Ann", True, {ann})
