"""The fake DingTalk keeps the semantics the delivery promise depends on (its docstring cites
DingTalk's pages and SDK): a callback not acked in time is pushed again with the same
messageId and msgId, and an acked one is not; a callback finding no connection open is
pushed again once one is; only a frame with code 200 is an ack; a connection needs the
app's secret and a ticket good for one connection; a session webhook expires and limits
its pace; the robot API refuses an expired token by name; a group message that does not
@ the robot never reaches it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.fakes.dingtalk_server import SEND_TOO_FAST, WEBHOOK_EXPIRED, FakeDingTalk

pytestmark = pytest.mark.anyio

FAST = (0.3, 0.3, 0.3)


@pytest.fixture
async def fake() -> AsyncIterator[FakeDingTalk]:
    async with FakeDingTalk(retry_delays=FAST, ack_timeout=0.4) as server:
        yield server


class Client:
    """A bare stream client: acks each callback with `code` (None: never)."""

    def __init__(self, fake: FakeDingTalk, code: int | None = 200) -> None:
        self.fake, self.code = fake, code
        self.frames: list[dict[str, Any]] = []
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def ticket(
        self, session: aiohttp.ClientSession, secret: str | None = None
    ) -> tuple[int, Any]:
        body = {
            "clientId": self.fake.client_id,
            "clientSecret": self.fake.client_secret if secret is None else secret,
            "subscriptions": [{"type": "CALLBACK", "topic": "/v1.0/im/bot/messages/get"}],
        }
        async with session.post(f"{self.fake.url}/v1.0/gateway/connections/open", json=body) as r:
            return r.status, await r.json()

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            _, answer = await self.ticket(session)
            url = f"{answer['endpoint']}?ticket={answer['ticket']}"
            async with session.ws_connect(url) as ws:
                self._ready.set()
                async for message in ws:
                    frame = json.loads(message.data)
                    self.frames.append(frame)
                    if self.code is None:
                        continue
                    ack = {
                        "code": self.code,
                        "headers": {"messageId": frame["headers"]["messageId"]},
                        "message": "OK",
                        "data": frame["data"],
                    }
                    await ws.send_str(json.dumps(ack))

    async def __aenter__(self) -> Client:
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self._ready.wait(), 5)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def test_an_acked_callback_is_pushed_once(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    data = fake.user_message(fake.dm(user), user, "hello")
    assert data is not None
    async with Client(fake) as client:
        delivery = await fake.deliver(data)
    assert delivery.delivered and len(delivery.attempts) == 1
    assert [json.loads(f["data"])["msgId"] for f in client.frames] == [data["msgId"]]


async def test_an_unacked_callback_is_pushed_again_with_the_same_ids(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    data = fake.user_message(fake.dm(user), user, "hello")
    assert data is not None
    async with Client(fake, code=None) as client:
        delivery = await fake.deliver(data)
    assert not delivery.delivered
    assert len(delivery.attempts) == len(FAST) + 1
    assert {f["headers"]["messageId"] for f in client.frames} == {delivery.message_id}
    assert {json.loads(f["data"])["msgId"] for f in client.frames} == {data["msgId"]}


async def test_only_code_200_is_an_ack(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    data = fake.user_message(fake.dm(user), user, "hello")
    assert data is not None
    async with Client(fake, code=500):
        delivery = await fake.deliver(data)
    assert not delivery.delivered and len(delivery.attempts) == len(FAST) + 1


async def test_a_callback_written_with_no_connection_arrives_once_one_opens(
    fake: FakeDingTalk,
) -> None:
    user = fake.add_person("Ann")
    data = fake.user_message(fake.dm(user), user, "written while down")
    assert data is not None
    pushing = asyncio.create_task(fake.deliver(data))
    await asyncio.sleep(0.1)
    async with Client(fake) as client:
        delivery = await pushing
    assert delivery.attempts[0].outcome == "no connection open"
    assert delivery.delivered
    assert len(client.frames) == 1


async def test_a_connection_needs_the_secret_and_a_fresh_ticket(fake: FakeDingTalk) -> None:
    client = Client(fake)
    async with aiohttp.ClientSession() as session:
        status, answer = await client.ticket(session, secret="wrong")
        assert status == 401 and answer["code"] == "InvalidClient"
        status, answer = await client.ticket(session)
        assert status == 200
        url = f"{answer['endpoint']}?ticket={answer['ticket']}"
        async with session.ws_connect(url):
            pass
        with pytest.raises(aiohttp.WSServerHandshakeError):
            async with session.ws_connect(url):
                pass


async def test_a_group_message_without_the_robots_mention_never_reaches_it(
    fake: FakeDingTalk,
) -> None:
    user, group = fake.add_person("Ann"), fake.group("team")
    assert fake.user_message(group, user, "chatter", mention=False) is None
    data = fake.user_message(group, user, "question")
    assert data is not None and data["conversationType"] == "2" and data["isInAtList"]


async def _post(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_a_session_webhook_expires_and_limits_its_pace(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    data = fake.user_message(fake.dm(user), user, "hello")
    assert data is not None
    body = {"msgtype": "markdown", "markdown": {"title": "t", "text": "hi"}}
    fake.webhook_per_minute = 2
    assert (await _post(data["sessionWebhook"], body))[1]["errcode"] == 0
    assert (await _post(data["sessionWebhook"], body))[1]["errcode"] == 0
    assert (await _post(data["sessionWebhook"], body))[1]["errcode"] == SEND_TOO_FAST
    newer = fake.user_message(fake.dm(user), user, "again")
    assert newer is not None  # a newer message's webhook: the same conversation's pace
    assert (await _post(newer["sessionWebhook"], body))[1]["errcode"] == SEND_TOO_FAST
    assert len(fake.bot_messages()) == 2
    fake.expire_webhooks()
    fake.webhook_per_minute = 20
    assert (await _post(data["sessionWebhook"], body))[1]["errcode"] == WEBHOOK_EXPIRED
    assert len(fake.bot_messages()) == 2


async def test_the_robot_api_refuses_an_expired_token_by_name(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    status, answer = await _post(
        f"{fake.url}/v1.0/oauth2/accessToken",
        {"appKey": fake.client_id, "appSecret": fake.client_secret},
    )
    assert status == 200 and answer["expireIn"] == 7200
    headers = {"x-acs-dingtalk-access-token": answer["accessToken"]}
    body = {
        "robotCode": fake.client_id,
        "userIds": [user],
        "msgKey": "sampleMarkdown",
        "msgParam": json.dumps({"title": "t", "text": "hi"}),
    }
    url = f"{fake.url}/v1.0/robot/oToMessages/batchSend"
    assert (await _post(url, body, headers))[0] == 200
    fake.expire_tokens()
    status, answer = await _post(url, body, headers)
    assert (status, answer["code"]) == (401, "InvalidAuthentication")
    fake.fail_next(429, "Throttling.Api")
    status, answer = await _post(url, body, {"x-acs-dingtalk-access-token": "unknown"})
    assert status == 401  # the token is checked first
    assert [m.text for m in fake.bot_messages()] == ["hi"]


async def test_a_ping_is_acked_with_its_own_data(fake: FakeDingTalk) -> None:
    async with Client(fake):
        acks = await fake.system("ping")
    assert len(acks) == 1 and acks[0]["code"] == 200
    assert json.loads(acks[0]["data"])["opaque"] == acks[0]["headers"]["messageId"]


async def test_each_callback_goes_to_one_of_the_apps_connections(fake: FakeDingTalk) -> None:
    user = fake.add_person("Ann")
    async with Client(fake) as first, Client(fake) as second:
        for n in range(8):
            data = fake.user_message(fake.dm(user), user, f"m{n}")
            assert data is not None
            assert (await fake.deliver(data)).delivered
    assert len(first.frames) + len(second.frames) == 8
