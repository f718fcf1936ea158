"""The fake Feishu keeps the semantics the delivery promise depends on (its docstring cites
the open platform's pages): an event not acknowledged within 3 s is pushed again, with
its event_id, on Feishu's schedule, then dropped; a long connection's answer frame with
code 200 is the acknowledgement and nothing else is; each event goes to one connection of
the app; callbacks are encrypted and signed with the Encrypt Key; a send's uuid keeps one
message; the per-chat rate limit, token expiry and the edit limit answer Feishu's codes."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from channels.feishu import crypto
from channels.feishu.frames import Frame
from tests.fakes.feishu_server import (
    EDIT_LIMIT,
    NOT_EDITABLE,
    RATE_LIMITED,
    TOKEN_INVALID,
    FakeFeishu,
    PbFrame,
    frame_headers,
    make_frame,
)

pytestmark = pytest.mark.anyio

FAST = (0.3, 0.6, 0.9, 1.2)


@pytest.fixture
async def fake() -> AsyncIterator[FakeFeishu]:
    async with FakeFeishu(retry_delays=FAST, ack_timeout=0.5) as server:
        yield server


class Client:
    """A bare long-connection client: answers each event frame as told."""

    def __init__(self, fake: FakeFeishu, answer: int | None = 200) -> None:
        self.fake = fake
        self.answer = answer
        self.events: list[dict[str, Any]] = []
        self.frames: list[Any] = []

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                self.fake.url + "/callback/ws/endpoint",
                json={"AppID": self.fake.app_id, "AppSecret": self.fake.app_secret},
            ) as response:
                url = (await response.json())["data"]["URL"]
            async with session.ws_connect(url) as ws:
                task_status.started()
                async for message in ws:
                    frame = PbFrame()
                    frame.ParseFromString(message.data)
                    self.frames.append(frame)
                    if frame.method != 1:
                        continue
                    self.events.append(json.loads(frame.payload))
                    if self.answer is not None:
                        frame.payload = json.dumps({"code": self.answer}).encode()
                        await ws.send_bytes(frame.SerializeToString())


async def test_an_unanswered_event_is_pushed_again_on_the_schedule_then_dropped(
    fake: FakeFeishu,
) -> None:
    person = fake.add_person("ann")
    envelope = fake.user_message(fake.p2p_chat(person), person, "hello")
    client = Client(fake, answer=None)
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        delivery = await fake.deliver(envelope)
        tg.cancel_scope.cancel()
    assert not delivery.delivered
    assert len(delivery.attempts) == 1 + len(FAST)  # the push and four re-pushes
    assert {e["header"]["event_id"] for e in client.events} == {envelope["header"]["event_id"]}
    gaps = [
        b.sent_at - a.answered_at
        for a, b in zip(delivery.attempts, delivery.attempts[1:], strict=False)
    ]
    assert all(abs(gap - want) < 0.25 for gap, want in zip(gaps, FAST, strict=True))


async def test_only_an_answer_with_code_200_acknowledges(fake: FakeFeishu) -> None:
    person = fake.add_person("ann")
    envelope = fake.user_message(fake.p2p_chat(person), person, "hello")
    failing = Client(fake, answer=500)
    async with anyio.create_task_group() as tg:
        await tg.start(failing.run)
        first = fake.deliver_soon(envelope)
        with anyio.fail_after(5):
            while not fake.deliveries or len(fake.deliveries[0].attempts) < 2:  # noqa: ASYNC110 (polling the fake's log)
                await anyio.sleep(0.02)
        failing.answer = 200  # the client now takes it
        delivery = await asyncio.wrap_future(first)
        tg.cancel_scope.cancel()
    assert delivery.delivered
    assert [a.outcome for a in delivery.attempts][:2] == ["answered code 500"] * 2
    assert delivery.attempts[-1].outcome == "acked"


async def test_an_event_written_while_no_connection_is_open_arrives_at_a_re_push(
    fake: FakeFeishu,
) -> None:
    person = fake.add_person("ann")
    envelope = fake.user_message(fake.p2p_chat(person), person, "written while down")
    pending = fake.deliver_soon(envelope)
    await anyio.sleep(0.1)
    client = Client(fake)
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        delivery = await asyncio.wrap_future(pending)
        tg.cancel_scope.cancel()
    assert delivery.attempts[0].outcome == "no connection open"
    assert delivery.delivered and len(client.events) == 1


async def test_each_event_goes_to_one_connection_of_the_app(fake: FakeFeishu) -> None:
    person = fake.add_person("ann")
    chat = fake.p2p_chat(person)
    clients = [Client(fake), Client(fake)]
    async with anyio.create_task_group() as tg:
        for client in clients:
            await tg.start(client.run)
        for n in range(20):
            await fake.deliver(fake.user_message(chat, person, f"m{n}"))
        tg.cancel_scope.cancel()
    counts = [len(c.events) for c in clients]
    assert sum(counts) == 20 and all(counts), counts  # both used, nothing twice


async def test_a_split_payload_arrives_in_numbered_frames(fake: FakeFeishu) -> None:
    fake.frame_parts = 3
    person = fake.add_person("ann")
    envelope = fake.user_message(fake.p2p_chat(person), person, "x" * 300)
    received: list[Any] = []

    async def run(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with aiohttp.ClientSession() as session:
            answer = await session.post(
                fake.url + "/callback/ws/endpoint",
                json={"AppID": fake.app_id, "AppSecret": fake.app_secret},
            )
            url = (await answer.json())["data"]["URL"]
            async with session.ws_connect(url) as ws:
                task_status.started()
                async for message in ws:
                    received.append(Frame.decode(message.data))  # the channel's codec
                    if len(received) == 3:
                        last = received[-1]
                        body = json.dumps({"code": 200}).encode()
                        frame = make_frame(1, last.service, dict(last.headers), body)
                        await ws.send_bytes(frame.SerializeToString())

    async with anyio.create_task_group() as tg:
        await tg.start(run)
        delivery = await fake.deliver(envelope)
        tg.cancel_scope.cancel()
    assert delivery.delivered
    assert [f.header("seq") for f in received] == ["0", "1", "2"]
    assert {f.header("sum") for f in received} == {"3"}
    assert json.loads(b"".join(f.payload for f in received)) == envelope


async def test_a_ping_is_answered_with_a_pong_and_the_client_config(fake: FakeFeishu) -> None:
    async with aiohttp.ClientSession() as session:
        answer = await session.post(
            fake.url + "/callback/ws/endpoint",
            json={"AppID": fake.app_id, "AppSecret": fake.app_secret},
        )
        data = (await answer.json())["data"]
        assert data["ClientConfig"]["PingInterval"] == fake.ping_interval
        async with session.ws_connect(data["URL"]) as ws:
            ping = Frame(service=1, method=0, headers=(("type", "ping"),))
            await ws.send_bytes(ping.encode())
            pong = PbFrame()
            pong.ParseFromString((await ws.receive()).data)
            assert frame_headers(pong)["type"] == "pong"
            assert json.loads(pong.payload)["PingInterval"] == fake.ping_interval


async def test_the_endpoint_refuses_a_wrong_secret_and_a_socket_needs_its_ticket(
    fake: FakeFeishu,
) -> None:
    async with aiohttp.ClientSession() as session:
        answer = await session.post(
            fake.url + "/callback/ws/endpoint",
            json={"AppID": fake.app_id, "AppSecret": "wrong"},
        )
        assert (await answer.json())["code"] != 0
        with pytest.raises(aiohttp.WSServerHandshakeError):
            await session.ws_connect(fake.url.replace("http", "ws") + "/ws?ticket=forged")


# -- callbacks ---------------------------------------------------------------------------


class Receiver:
    def __init__(self) -> None:
        self.answers: list[int] = []
        self.bodies: list[tuple[bytes, dict[str, str]]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append((await request.read(), dict(request.headers)))
        return web.Response(status=self.answers.pop(0) if self.answers else 200)


@pytest.fixture
async def receiver(fake: FakeFeishu) -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/feishu/events", found.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.mode = "webhook"
    fake.webhook_url = f"http://127.0.0.1:{runner.addresses[0][1]}/feishu/events"
    try:
        yield found
    finally:
        await runner.cleanup()


async def test_a_callback_is_encrypted_signed_and_pushed_again_until_a_200(
    fake: FakeFeishu, receiver: Receiver
) -> None:
    receiver.answers = [503, 500]
    person = fake.add_person("ann")
    envelope = fake.user_message(fake.p2p_chat(person), person, "hello")
    delivery = await fake.deliver(envelope)
    assert delivery.delivered and len(delivery.attempts) == 3
    for body, headers in receiver.bodies:
        given = headers["X-Lark-Signature"]
        stamp, nonce = headers["X-Lark-Request-Timestamp"], headers["X-Lark-Request-Nonce"]
        assert crypto.signature_valid(stamp, nonce, given, fake.encrypt_key, body)
        plain = crypto.decrypt(json.loads(body)["encrypt"], fake.encrypt_key)
        assert json.loads(plain) == envelope  # the same event_id every time
    body, headers = receiver.bodies[0]
    stamp, nonce = headers["X-Lark-Request-Timestamp"], headers["X-Lark-Request-Nonce"]
    wanted = hashlib.sha256((stamp + nonce + fake.encrypt_key).encode() + body).hexdigest()
    assert headers["X-Lark-Signature"] == wanted  # Feishu's formula, spelled out


async def test_the_callback_address_is_verified_with_a_challenge(
    fake: FakeFeishu, receiver: Receiver
) -> None:
    assert fake.webhook_url is not None
    await fake.url_verification(fake.webhook_url)
    body, _ = receiver.bodies[0]
    plain = json.loads(crypto.decrypt(json.loads(body)["encrypt"], fake.encrypt_key))
    assert plain["type"] == "url_verification" and plain["challenge"]
    assert plain["token"] == fake.verification_token


# -- the API -------------------------------------------------------------------------------


async def api(fake: FakeFeishu, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            fake.url + "/open-apis/auth/v3/tenant_access_token/internal",
            json={"app_id": fake.app_id, "app_secret": fake.app_secret},
        ) as response:
            token = (await response.json())["tenant_access_token"]
        headers = {"Authorization": f"Bearer {token}"}
        async with session.request(
            method, fake.url + "/open-apis" + path, headers=headers, **kwargs
        ) as response:
            return dict(await response.json())


def text_body(chat: str, text: str, uuid: str = "") -> dict[str, Any]:
    body = {"receive_id": chat, "msg_type": "text", "content": json.dumps({"text": text})}
    if uuid:
        body["uuid"] = uuid
    return body


async def test_a_send_repeated_with_its_uuid_makes_one_message(fake: FakeFeishu) -> None:
    chat = fake.p2p_chat(fake.add_person("ann"))
    params = {"receive_id_type": "chat_id"}
    first = await api(
        fake, "POST", "/im/v1/messages", params=params, json=text_body(chat, "hi", "u-1")
    )
    again = await api(
        fake, "POST", "/im/v1/messages", params=params, json=text_body(chat, "hi", "u-1")
    )
    other = await api(
        fake, "POST", "/im/v1/messages", params=params, json=text_body(chat, "hi", "u-2")
    )
    assert first["data"]["message_id"] == again["data"]["message_id"]
    assert other["data"]["message_id"] != first["data"]["message_id"]
    assert len(fake.bot_messages()) == 2


async def test_more_than_five_sends_a_second_to_one_chat_are_refused(fake: FakeFeishu) -> None:
    chat = fake.p2p_chat(fake.add_person("ann"))
    params = {"receive_id_type": "chat_id"}
    codes = [
        (await api(fake, "POST", "/im/v1/messages", params=params, json=text_body(chat, "x")))[
            "code"
        ]
        for _ in range(6)
    ]
    assert codes[:5] == [0] * 5
    assert codes[5] == RATE_LIMITED


async def test_an_expired_token_is_refused_by_name(fake: FakeFeishu) -> None:
    chat = fake.p2p_chat(fake.add_person("ann"))
    async with aiohttp.ClientSession() as session:
        async with session.post(
            fake.url + "/open-apis/auth/v3/tenant_access_token/internal",
            json={"app_id": fake.app_id, "app_secret": fake.app_secret},
        ) as response:
            token = (await response.json())["tenant_access_token"]
        fake.expire_tokens()
        async with session.post(
            fake.url + "/open-apis/im/v1/messages",
            params={"receive_id_type": "chat_id"},
            headers={"Authorization": f"Bearer {token}"},
            json=text_body(chat, "x"),
        ) as response:
            assert (await response.json())["code"] == TOKEN_INVALID


async def test_replies_quote_keep_threads_and_edits_stop_at_twenty(fake: FakeFeishu) -> None:
    person = fake.add_person("ann")
    group = fake.group_chat("team", [person])
    asked = fake.user_message(group, person, "question", mention=[fake.bot_open_id])
    asked_id = asked["event"]["message"]["message_id"]
    post = {"zh_cn": {"content": [[{"tag": "md", "text": "**answer**"}]]}}
    body = {"msg_type": "post", "content": json.dumps(post)}
    quoted = await api(fake, "POST", f"/im/v1/messages/{asked_id}/reply", json=body)
    assert quoted["data"]["parent_id"] == asked_id and not quoted["data"]["thread_id"]
    threaded = await api(
        fake,
        "POST",
        f"/im/v1/messages/{asked_id}/reply",
        json={**body, "reply_in_thread": True},
    )
    thread = threaded["data"]["thread_id"]
    assert thread.startswith("omt_")
    inside = fake.user_message(group, person, "more", thread_of=asked_id)
    assert inside["event"]["message"]["thread_id"] == thread
    message_id = quoted["data"]["message_id"]
    codes = []
    for n in range(EDIT_LIMIT + 1):
        post = {"zh_cn": {"content": [[{"tag": "md", "text": f"v{n}"}]]}}
        answer = await api(
            fake,
            "PUT",
            f"/im/v1/messages/{message_id}",
            json={"msg_type": "post", "content": json.dumps(post)},
        )
        codes.append(answer["code"])
    assert codes[:EDIT_LIMIT] == [0] * EDIT_LIMIT and codes[EDIT_LIMIT] == NOT_EDITABLE
    assert FakeFeishu.rendered(fake.message(message_id)) == f"v{EDIT_LIMIT - 1}"


async def test_a_post_that_mentions_everyone_is_seen_as_a_ping(fake: FakeFeishu) -> None:
    chat = fake.group_chat("team", [fake.add_person("ann")])
    post = {"zh_cn": {"content": [[{"tag": "md", "text": "hi <at id=all></at>"}]]}}
    await api(
        fake,
        "POST",
        "/im/v1/messages",
        params={"receive_id_type": "chat_id"},
        json={"receive_id": chat, "msg_type": "post", "content": json.dumps(post)},
    )
    [sent] = fake.bot_messages()
    assert FakeFeishu.notifies(sent)[1]
