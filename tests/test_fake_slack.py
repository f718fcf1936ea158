"""The fake Slack is faithful: the real slack-sdk and slack-bolt run against it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.app.async_app import AsyncApp
from slack_bolt.context.say.async_say import AsyncSay
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_async_handlers import AsyncRateLimitErrorRetryHandler
from slack_sdk.signature import SignatureVerifier
from slack_sdk.web.async_client import AsyncWebClient

from tests.fakes._serving import free_port
from tests.fakes.slack_server import FakeSlack, sign_request

pytestmark = pytest.mark.anyio

CHANNEL = "C0GENERAL01"
ALICE = "U0ALICE001"


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as server:
        yield server


@pytest.fixture
def client(fake: FakeSlack) -> AsyncWebClient:
    return AsyncWebClient(token=fake.bot_token, base_url=fake.api_url)


def bolt_app(fake: FakeSlack) -> AsyncApp:
    """A bolt app wired to the fake the way the Slack channel builds one: the client
    carries the token and the fake's base URL (passing token= as well only logs a
    warning that it is ignored)."""
    client = AsyncWebClient(token=fake.bot_token, base_url=fake.api_url)
    return AsyncApp(client=client, signing_secret=fake.signing_secret)


@contextlib.asynccontextmanager
async def socket_mode(app: AsyncApp, fake: FakeSlack) -> AsyncIterator[AsyncSocketModeHandler]:
    # The handler must be built inside a running loop: its client starts tasks at once.
    handler = AsyncSocketModeHandler(app, fake.app_token)
    await handler.connect_async()  # type: ignore[no-untyped-call]
    try:
        async with asyncio.timeout(5):
            await fake.wait_for_socket()
        yield handler
    finally:
        await handler.close_async()  # type: ignore[no-untyped-call]


async def test_web_api_speaks_slack(fake: FakeSlack, client: AsyncWebClient) -> None:
    auth = await client.auth_test()
    assert auth["user_id"] == fake.bot_user_id and auth["bot_id"] == fake.bot_id
    assert auth["team_id"] == fake.team_id

    first = await client.chat_postMessage(channel=CHANNEL, text="hello")
    reply = await client.chat_postMessage(
        channel=CHANNEL, text="in thread", thread_ts=first["ts"], blocks=[{"type": "divider"}]
    )
    assert re.fullmatch(r"\d{10}\.\d{6}", first["ts"])
    assert float(reply["ts"]) > float(first["ts"])
    assert reply["message"]["thread_ts"] == first["ts"]
    assert reply["message"]["bot_id"] == fake.bot_id

    updated = await client.chat_update(channel=CHANNEL, ts=first["ts"], text="hello again")
    assert updated["message"]["edited"]["user"] == fake.bot_user_id
    assert [m["text"] for m in fake.posted_messages(CHANNEL)] == [
        "hello",
        "in thread",
        "hello again",
    ]
    [post, _] = fake.calls_to("chat.postMessage")
    assert post.token == fake.bot_token and post.params == {"channel": CHANNEL, "text": "hello"}

    info = await client.conversations_info(channel="D0ALICE001")
    assert info["channel"]["is_im"] is True
    user = await client.users_info(user=ALICE)
    assert user["user"]["id"] == ALICE


@pytest.mark.filterwarnings("ignore:The top-level `text` argument is missing")
@pytest.mark.parametrize(
    ("call", "error"),
    [
        ({"channel": "general", "text": "x"}, "channel_not_found"),
        ({"channel": CHANNEL, "text": "x" * 40_001}, "msg_too_long"),
        ({"channel": CHANNEL}, "no_text"),
        ({"channel": CHANNEL, "text": "x", "blocks": [{"no": "type"}]}, "invalid_blocks"),
    ],
)
async def test_post_message_errors_are_slacks(
    client: AsyncWebClient, call: dict[str, Any], error: str
) -> None:
    with pytest.raises(SlackApiError) as caught:
        await client.chat_postMessage(**call)
    assert caught.value.response.status_code == 200
    assert caught.value.response["error"] == error


async def test_tokens_are_checked(fake: FakeSlack) -> None:
    wrong = AsyncWebClient(token="xoxb-not-the-token", base_url=fake.api_url)
    with pytest.raises(SlackApiError, match="invalid_auth"):
        await wrong.auth_test()
    app_token = AsyncWebClient(token=fake.app_token, base_url=fake.api_url)
    with pytest.raises(SlackApiError, match="not_allowed_token_type"):
        await app_token.chat_postMessage(channel=CHANNEL, text="x")
    bot = AsyncWebClient(token=fake.bot_token, base_url=fake.api_url)
    with pytest.raises(SlackApiError, match="not_allowed_token_type"):
        await bot.apps_connections_open(app_token=fake.bot_token)
    with pytest.raises(SlackApiError, match="unknown_method"):
        await bot.api_call("chat.telepathy")
    # slack-sdk 3.47 appends the slash urljoin needs when the base URL lacks it.
    no_slash = AsyncWebClient(token=fake.bot_token, base_url=fake.api_url.rstrip("/"))
    assert (await no_slash.auth_test())["ok"]


async def test_rate_limit_surfaces_or_is_retried(fake: FakeSlack, client: AsyncWebClient) -> None:
    fake.fail_next("chat.postMessage", retry_after=30)
    with pytest.raises(SlackApiError) as caught:
        await client.chat_postMessage(channel=CHANNEL, text="too fast")
    response = caught.value.response
    assert response.status_code == 429 and response["error"] == "ratelimited"
    assert response.headers["Retry-After"] == "30"

    fake.fail_next("chat.postMessage", retry_after=0)
    patient = AsyncWebClient(
        token=fake.bot_token,
        base_url=fake.api_url,
        retry_handlers=[AsyncRateLimitErrorRetryHandler(max_retry_count=1)],
    )
    posted = await patient.chat_postMessage(channel=CHANNEL, text="eventually")
    assert posted["ok"]
    assert [c.status for c in fake.calls_to("chat.postMessage")] == [429, 429, 200]


async def test_socket_mode_mention_gets_a_threaded_reply_and_an_ack(fake: FakeSlack) -> None:
    app = bolt_app(fake)
    deliveries: list[tuple[str, Sequence[str] | None]] = []

    @app.event("app_mention")
    async def on_mention(
        event: dict[str, Any], say: AsyncSay, body: dict[str, Any], request: AsyncBoltRequest
    ) -> None:
        deliveries.append((body["event_id"], request.headers.get("x-slack-retry-num")))
        await say(
            text=f"you said: {event['text']}", thread_ts=event.get("thread_ts") or event["ts"]
        )

    async with socket_mode(app, fake):
        mention = fake.app_mention(CHANNEL, ALICE, "what's up?")
        envelope = await fake.socket_event(mention)
        async with asyncio.timeout(5):
            ack = await fake.wait_for_ack(envelope["envelope_id"])
            [reply] = await fake.wait_for_calls_async("chat.postMessage")

        assert ack.latency is not None and ack.latency < 3  # Slack retries after 3 s
        assert reply.params["thread_ts"] == mention["event"]["ts"]
        assert reply.params["text"] == f"you said: <@{fake.bot_user_id}> what's up?"
        assert [c.method for c in fake.calls] == [
            "apps.connections.open",
            "auth.test",  # bolt's single-team authorization, once, lazily
            "chat.postMessage",
        ]

        retry = await fake.redeliver(envelope)  # Slack's retry: same event_id
        async with asyncio.timeout(5):
            await fake.wait_for_ack(retry["envelope_id"])
            await fake.wait_for_calls_async("chat.postMessage", 2)

    assert retry["envelope_id"] != envelope["envelope_id"]
    assert retry["retry_attempt"] == 1 and retry["retry_reason"] == "timeout"
    # Gotcha: first deliveries carry retry_attempt 0, so bolt shows "0", not no header;
    # bolt does not deduplicate: the channel must drop retries by event_id itself.
    assert deliveries == [(mention["event_id"], ["0"]), (mention["event_id"], ["1"])]


async def test_bolt_ignores_its_own_messages(fake: FakeSlack) -> None:
    app = bolt_app(fake)
    seen: list[dict[str, Any]] = []
    two_seen = asyncio.Event()

    @app.event("message")
    async def on_message(event: dict[str, Any]) -> None:
        seen.append(event)
        if len(seen) == 2:
            two_seen.set()

    async with socket_mode(app, fake):
        own = await fake.socket_event(fake.bot_message(CHANNEL, "my own reply"))
        other = await fake.socket_event(fake.bot_message(CHANNEL, "hi", bot_id="B0OTHER001"))
        dm = await fake.socket_event(fake.dm_message(ALICE, "hello bot"))
        async with asyncio.timeout(5):
            for envelope in (own, other, dm):
                await fake.wait_for_ack(envelope["envelope_id"])
            await two_seen.wait()

    assert sorted(e["text"] for e in seen) == ["hello bot", "hi"]
    dm_event = next(e for e in seen if e["text"] == "hello bot")
    assert dm_event["channel_type"] == "im" and dm_event["channel"] == "D0ALICE001"


async def test_socket_disconnect_makes_the_client_reconnect(fake: FakeSlack) -> None:
    app = bolt_app(fake)
    handled = asyncio.Event()

    @app.event("app_mention")
    async def on_mention() -> None:
        handled.set()

    async with socket_mode(app, fake):
        await fake.socket_disconnect("refresh_requested")
        async with asyncio.timeout(5):
            await fake.wait_for_socket(2)
        envelope = await fake.socket_event(fake.app_mention(CHANNEL, ALICE, "still there?"))
        async with asyncio.timeout(5):
            ack = await fake.wait_for_ack(envelope["envelope_id"])
            await handled.wait()

    assert ack.connection == 2
    assert len(fake.calls_to("apps.connections.open")) == 2  # tickets are single-use


@contextlib.asynccontextmanager
async def http_endpoint(app: AsyncApp) -> AsyncIterator[str]:
    """Serve a bolt app's Events API endpoint with bolt's aiohttp adapter."""

    async def events(request: web.Request) -> web.Response:
        return await to_aiohttp_response(await app.async_dispatch(await to_bolt_request(request)))

    server = web.Application()
    server.router.add_post("/slack/events", events)
    runner = web.AppRunner(server, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/slack/events"
    finally:
        await runner.cleanup()


async def test_http_events_are_signed_and_verified(fake: FakeSlack) -> None:
    app = bolt_app(fake)

    @app.event("app_mention")
    async def on_mention(event: dict[str, Any], say: AsyncSay) -> None:
        await say(text="over http", thread_ts=event["ts"])

    async with http_endpoint(app) as url:
        challenge = await fake.url_verification(url, challenge="abc123")
        assert challenge.status == 200 and challenge.json() == {"challenge": "abc123"}

        forged = await fake.post_event(
            url, fake.app_mention(CHANNEL, ALICE, "x"), bad_signature=True
        )
        stale = await fake.post_event(
            url, fake.app_mention(CHANNEL, ALICE, "x"), timestamp=time.time() - 600
        )
        assert (forged.status, stale.status) == (401, 401)
        assert forged.json() == {"error": "invalid request"}

        accepted = await fake.post_event(url, fake.app_mention(CHANNEL, ALICE, "hi"), retry_num=1)
        assert accepted.status == 200
        async with asyncio.timeout(5):
            [reply] = await fake.wait_for_calls_async("chat.postMessage")
    assert reply.params["text"] == "over http"


# -- deliver_event: the Events API's acks and retries, against a tiny local app -------


@dataclass
class Receiver:
    """A minimal Events API endpoint: checks Slack's signature like bolt does, logs what
    it got, and answers whatever `answer` says for the n-th request (0-based)."""

    fake: FakeSlack
    answer: Callable[[int], Awaitable[web.StreamResponse]]
    requests: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = dict(request.headers)
        verifier = SignatureVerifier(signing_secret=self.fake.signing_secret)
        assert verifier.is_valid(
            body, headers["X-Slack-Request-Timestamp"], headers["X-Slack-Signature"]
        )
        self.requests.append((headers, json.loads(body)))
        return await self.answer(len(self.requests) - 1)

    def retry_headers(self) -> list[tuple[str | None, str | None]]:
        return [
            (h.get("X-Slack-Retry-Num"), h.get("X-Slack-Retry-Reason")) for h, _ in self.requests
        ]


@contextlib.asynccontextmanager
async def receiver_app(receiver: Receiver, port: int = 0) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/slack/events", receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/slack/events"
    finally:
        await runner.cleanup()


def answering(*statuses: int, delay: float = 0.0, headers: dict[str, str] | None = None) -> Any:
    """Answer the n-th request with statuses[n] (the last one from then on), the first
    one after `delay` seconds."""

    async def answer(n: int) -> web.Response:
        if n == 0 and delay:
            await asyncio.sleep(delay)
        return web.Response(status=statuses[min(n, len(statuses) - 1)], headers=headers)

    return answer


FAST = (0.05, 0.1, 0.2)  # a compressed "nearly immediately, 1 minute, 5 minutes"


async def test_delivery_acked_with_a_2xx_is_sent_once(fake: FakeSlack) -> None:
    receiver = Receiver(fake, answering(200))
    event = fake.dm_message(ALICE, "hello")
    async with receiver_app(receiver) as url:
        delivery = await fake.deliver_event(url, event, retry_delays=FAST)
    assert delivery.acked and not delivery.gave_up and delivery.event_id == event["event_id"]
    [attempt] = delivery.attempts
    assert (attempt.retry_num, attempt.status, attempt.failure) == (0, 200, None)
    assert receiver.retry_headers() == [(None, None)]  # a first delivery has none
    assert receiver.requests[0][1] == event
    assert fake.event_deliveries == [delivery]


async def test_no_answer_within_the_ack_timeout_is_retried_as_http_timeout(
    fake: FakeSlack,
) -> None:
    receiver = Receiver(fake, answering(200, delay=1.0))  # the first answer comes late
    event = fake.dm_message(ALICE, "slow")
    async with receiver_app(receiver) as url:
        delivery = await fake.deliver_event(url, event, retry_delays=FAST, ack_timeout=0.3)
    first, retry = delivery.attempts
    assert (first.failure, first.status) == ("http_timeout", 0)
    assert 0.3 <= first.answered_at - first.sent_at < 0.9  # Slack did not wait for it
    assert retry.acked and retry.retry_num == 1
    assert retry.sent_at - first.answered_at >= FAST[0]
    assert receiver.retry_headers() == [(None, None), ("1", "http_timeout")]
    assert [body["event_id"] for _, body in receiver.requests] == [event["event_id"]] * 2


async def test_an_error_status_is_retried_three_times_then_slack_gives_up(
    fake: FakeSlack,
) -> None:
    receiver = Receiver(fake, answering(500))
    async with receiver_app(receiver) as url:
        delivery = await fake.deliver_event(url, fake.dm_message(ALICE, "boom"), retry_delays=FAST)
    assert delivery.gave_up and not delivery.acked
    assert [(a.retry_num, a.status, a.failure) for a in delivery.attempts] == [
        (n, 500, "http_error") for n in range(4)
    ]
    assert receiver.retry_headers() == [
        (None, None),
        ("1", "http_error"),
        ("2", "http_error"),
        ("3", "http_error"),
    ]
    gaps = [b.sent_at - a.answered_at for a, b in itertools.pairwise(delivery.attempts)]
    assert all(gap >= wanted for gap, wanted in zip(gaps, FAST, strict=True))


async def test_x_slack_no_retry_turns_the_retries_off(fake: FakeSlack) -> None:
    receiver = Receiver(fake, answering(503, headers={"X-Slack-No-Retry": "1"}))
    async with receiver_app(receiver) as url:
        delivery = await fake.deliver_event(url, fake.dm_message(ALICE, "no"), retry_delays=FAST)
    [attempt] = delivery.attempts
    assert attempt.no_retry and attempt.failure == "http_error" and delivery.gave_up


async def test_retries_span_an_app_that_is_down_and_comes_back(fake: FakeSlack) -> None:
    """Connection refused while the app is down; the retry after it is back is acked:
    the compressed schedule is long enough to span a restart."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/slack/events"
    event = fake.dm_message(ALICE, "are you there?")
    delivery = asyncio.create_task(fake.deliver_event(url, event, retry_delays=(0.05, 0.05, 1.5)))
    async with asyncio.timeout(5):
        while [len(d.attempts) for d in fake.event_deliveries] != [3]:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert fake.event_deliveries[0].in_progress
    receiver = Receiver(fake, answering(200))
    async with receiver_app(receiver, port):
        async with asyncio.timeout(5):
            done = await delivery
    assert [a.failure for a in done.attempts] == [
        "connection_failed",
        "connection_failed",
        "connection_failed",
        None,
    ]
    assert done.acked_at == done.attempts[-1].answered_at
    assert receiver.retry_headers() == [("3", "connection_failed")]


def test_deliver_event_soon_runs_in_the_fakes_thread() -> None:
    with FakeSlack.in_thread() as fake:

        async def serve_and_deliver() -> None:
            receiver = Receiver(fake, answering(200))
            async with receiver_app(receiver) as url:
                future = fake.deliver_event_soon(url, fake.dm_message(ALICE, "hi"))
                delivery = await asyncio.wrap_future(future)
                assert delivery.acked

        asyncio.run(serve_and_deliver())
        [delivery] = fake.event_deliveries
        assert delivery.acked and not delivery.in_progress


def test_event_builders_and_signatures_match_slack() -> None:
    fake = FakeSlack()
    mention = fake.app_mention(CHANNEL, ALICE, "hi", thread_ts="1712345678.000100")
    assert mention["type"] == "event_callback" and mention["api_app_id"] == fake.app_id
    assert mention["event"]["text"] == f"<@{fake.bot_user_id}> hi"
    assert mention["event"]["thread_ts"] == "1712345678.000100"
    dm = fake.dm_message(ALICE, "yo")
    assert dm["event_id"] != mention["event_id"]
    assert float(dm["event"]["ts"]) > float(mention["event"]["ts"])
    other_bot = fake.bot_message(CHANNEL, "beep", bot_id="B0OTHER001")
    assert other_bot["event"]["subtype"] == "bot_message"
    # An edited mention comes again as an app_mention: same ts, `edited`, a new event_id.
    edited = fake.edited_mention(mention, "hi again")
    assert edited["event"]["type"] == "app_mention" and edited["event_id"] != mention["event_id"]
    assert edited["event"]["text"] == f"<@{fake.bot_user_id}> hi again"
    assert edited["event"]["ts"] == mention["event"]["ts"]
    assert float(edited["event"]["edited"]["ts"]) > float(dm["event"]["ts"])

    body, stamp = b'{"type":"event_callback"}', str(int(time.time()))
    verifier = SignatureVerifier(signing_secret=fake.signing_secret)
    assert verifier.is_valid(body, stamp, sign_request(fake.signing_secret, stamp, body))


def test_in_thread_mode_serves_sync_and_other_loops() -> None:
    with FakeSlack.in_thread() as fake:
        sync_client = WebClient(token=fake.bot_token, base_url=fake.api_url)
        assert sync_client.chat_postMessage(channel=CHANNEL, text="from sync")["ok"]
        fake.wait_for_calls("chat.postMessage", 1, timeout=5)

        async def mention_round_trip() -> float | None:
            app = bolt_app(fake)

            @app.event("app_mention")
            async def on_mention(say: AsyncSay) -> None:
                await say("from another loop")

            async with socket_mode(app, fake):
                envelope = await fake.socket_event(fake.app_mention(CHANNEL, ALICE, "hi"))
                async with asyncio.timeout(5):
                    ack = await fake.wait_for_ack(envelope["envelope_id"])
                    await fake.wait_for_calls_async("chat.postMessage", 2)
            return ack.latency

        assert asyncio.run(mention_round_trip()) is not None
        assert [m["text"] for m in fake.posted_messages()] == ["from sync", "from another loop"]


async def test_with_two_connections_each_envelope_goes_to_one_and_a_retry_to_either(
    fake: FakeSlack,
) -> None:
    """Slack sends each event to one of an app's open connections (one per replica), and
    its retry may go to another one: the fake lets a test pick which."""
    seen: list[tuple[str, str]] = []
    apps = {"first": bolt_app(fake), "second": bolt_app(fake)}

    def record(name: str) -> Callable[[dict[str, Any]], Awaitable[None]]:
        async def on_mention(body: dict[str, Any]) -> None:  # bolt passes by parameter name
            seen.append((name, body["event_id"]))

        return on_mention

    for name, app in apps.items():
        app.event("app_mention")(record(name))

    async with socket_mode(apps["first"], fake), socket_mode(apps["second"], fake):
        async with asyncio.timeout(5):
            await fake.wait_for_socket(2)
        first, second = fake.socket_numbers
        mention = fake.app_mention(CHANNEL, ALICE, "anyone?")
        envelope = await fake.socket_event(mention, connection=first)
        retry = await fake.redeliver(envelope, connection=second)
        async with asyncio.timeout(5):
            acks = [await fake.wait_for_ack(e["envelope_id"]) for e in (envelope, retry)]
        with pytest.raises(RuntimeError, match="no connection 99"):
            await fake.socket_event(mention, connection=99, connect_timeout=0.2)

    assert [a.connection for a in acks] == [first, second]
    assert sorted(seen) == [("first", mention["event_id"]), ("second", mention["event_id"])]
