"""The fake WeCom keeps the semantics the delivery promise depends on: what WeCom signs
(msg_signature over the sorted Token, timestamp, nonce and Encrypt), how it encrypts (AES-
256-CBC, PKCS#7 to 32 bytes, the corp id at the tail), when it sends a callback again
(no 200 within 5 s: three retries, the same MsgId), what an access token allows (7200 s;
42001 expired, 40014 unknown) and what message/send refuses or cuts (45009, 81013, 2,048
bytes, the duplicate check)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tests.fakes.wecom_server import FakeWeCom

pytestmark = pytest.mark.anyio


def open_encrypt(encrypted: str, encoding_aes_key: str) -> tuple[bytes, bytes, int]:
    """(message, receiver id, padding) of an Encrypt, read by the documentation's steps."""
    key = base64.b64decode(encoding_aes_key + "=")
    raw = base64.b64decode(encrypted)
    decryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).decryptor()
    plain = decryptor.update(raw) + decryptor.finalize()
    pad = plain[-1]
    assert plain[-pad:] == bytes([pad]) * pad
    plain = plain[:-pad]
    (length,) = struct.unpack("!I", plain[16:20])
    return plain[20 : 20 + length], plain[20 + length :], pad


class Receiver:
    """A callback endpoint that answers with scripted statuses (then 200), or late."""

    def __init__(self) -> None:
        self.answers: list[int] = []
        self.delay = 0.0
        self.delays: list[float] = []  # per request, before `delay`
        self.requests: list[tuple[bytes, dict[str, str]]] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((await request.read(), dict(request.query)))
        wait = self.delays.pop(0) if self.delays else self.delay
        if wait:
            await asyncio.sleep(wait)
        return web.Response(status=self.answers.pop(0) if self.answers else 200)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    app = web.Application()
    app.router.add_post("/cb", found.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    found.url = f"http://127.0.0.1:{runner.addresses[0][1]}/cb"
    try:
        yield found
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake(receiver: Receiver) -> AsyncIterator[FakeWeCom]:
    async with FakeWeCom(retry_delays=(0.05, 0.1, 0.1), ack_timeout=0.3) as server:
        server.callback_url = receiver.url
        yield server


async def call(fake: FakeWeCom, path: str, **kwargs: Any) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.request(
            "POST" if "json" in kwargs else "GET", f"{fake.url}/cgi-bin/{path}", **kwargs
        ) as r,
    ):
        assert r.status == 200
        found: dict[str, Any] = await r.json()
        return found


async def token(fake: FakeWeCom) -> str:
    answer = await call(
        fake, "gettoken", params={"corpid": fake.corp_id, "corpsecret": fake.secret}
    )
    assert answer["errcode"] == 0 and answer["expires_in"] > 7000
    return str(answer["access_token"])


async def send(fake: FakeWeCom, to: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"touser": to, "msgtype": "text", "agentid": fake.agent_id, "text": {"content": content}}
    params = {"access_token": await token(fake)}
    return await call(fake, "message/send", params=params, json={**body, **extra})


async def test_a_callback_is_signed_and_encrypted_for_the_corp(
    fake: FakeWeCom, receiver: Receiver
) -> None:
    user = fake.add_user("Ann")
    fields = fake.text_message(user, "你好 <b>&")
    delivery = await fake.deliver(fields)
    assert delivery.delivered and len(delivery.attempts) == 1
    body, query = receiver.requests[0]
    outer = {c.tag: c.text for c in ET.fromstring(body)}
    encrypted = str(outer["Encrypt"])
    parts = sorted([fake.callback_token, query["timestamp"], query["nonce"], encrypted])
    assert query["msg_signature"] == hashlib.sha1("".join(parts).encode()).hexdigest()
    message, receiver_id, pad = open_encrypt(encrypted, fake.encoding_aes_key)
    assert receiver_id == fake.corp_id.encode()
    assert len(base64.b64decode(encrypted)) % 32 == 0 and 1 <= pad <= 32
    inner = {c.tag: c.text for c in ET.fromstring(message)}
    assert inner["Content"] == "你好 <b>&" and inner["MsgId"] == fields["MsgId"]
    assert inner["FromUserName"] == user and inner["MsgType"] == "text"


async def test_a_callback_without_a_200_is_retried_three_times_with_its_msgid(
    fake: FakeWeCom, receiver: Receiver
) -> None:
    fields = fake.text_message(fake.add_user("Ann"), "hello")
    receiver.answers = [503, 500]
    delivery = await fake.deliver(fields)
    assert [a.status for a in delivery.attempts] == [503, 500, 200] and delivery.delivered
    nonces = {query["nonce"] for _, query in receiver.requests}
    assert len(nonces) == 3  # each attempt signed afresh
    for body, _ in receiver.requests:
        encrypted = str(ET.fromstring(body).findtext("Encrypt"))
        inner = ET.fromstring(open_encrypt(encrypted, fake.encoding_aes_key)[0])
        assert inner.findtext("MsgId") == fields["MsgId"]
    receiver.answers = [503, 503, 503, 503, 503]
    given_up = await fake.deliver(fake.text_message(fake.add_user("Bob"), "x"))
    assert len(given_up.attempts) == 4 and not given_up.delivered  # the first and 3 retries


async def test_a_callback_answered_after_the_timeout_is_sent_again(
    fake: FakeWeCom, receiver: Receiver
) -> None:
    receiver.delay = 0.5  # past the fake's 0.3 s (WeCom's 5 s)
    delivery = await fake.deliver(fake.text_message(fake.add_user("Ann"), "slow"))
    assert [a.failure for a in delivery.attempts] == ["timeout"] * 4
    assert len(receiver.requests) == 4


async def test_wecom_waits_five_seconds_for_the_answer(receiver: Receiver) -> None:
    """WeCom's own window, unscaled: an answer after 5 s is a failed attempt."""
    async with FakeWeCom(retry_delays=(0.05,)) as fake:
        fake.callback_url = receiver.url
        receiver.delays = [5.6]
        delivery = await fake.deliver(fake.text_message(fake.add_user("Ann"), "slow"))
    first, second = delivery.attempts
    assert first.failure == "timeout" and 4.9 <= first.answered_at - first.sent_at <= 5.5
    assert second.failure is None and delivery.delivered


async def test_an_access_token_lasts_until_it_expires_then_42001_and_unknown_40014(
    fake: FakeWeCom,
) -> None:
    bad = await call(fake, "gettoken", params={"corpid": fake.corp_id, "corpsecret": "nope"})
    assert bad["errcode"] == 40001 and "access_token" not in bad
    other = await call(fake, "gettoken", params={"corpid": "wwother", "corpsecret": fake.secret})
    assert other["errcode"] == 40013
    first = await token(fake)
    assert await token(fake) == first  # the same while it lasts
    user = fake.add_user("Ann")
    body = {"touser": user, "msgtype": "text", "agentid": fake.agent_id, "text": {"content": "a"}}
    fake.expire_tokens()
    expired = await call(fake, "message/send", params={"access_token": first}, json=body)
    assert expired["errcode"] == 42001 and fake.sent == []
    second = await token(fake)
    assert second != first
    fake.revoke_tokens()
    unknown = await call(fake, "message/send", params={"access_token": second}, json=body)
    assert unknown["errcode"] == 40014 and fake.sent == []


async def test_message_send_cuts_at_2048_bytes_and_refuses_what_it_does_not_send(
    fake: FakeWeCom,
) -> None:
    ann = fake.add_user("Ann")
    answer = await send(fake, ann, "字" * 700)  # 2,100 bytes
    assert answer["errcode"] == 0
    assert fake.texts_to(ann) == ["字" * 682]  # 2,046 bytes: no half character
    assert (await send(fake, "nobody", "hi"))["errcode"] == 81013
    fake.per_member_per_minute = 3
    codes = [(await send(fake, ann, f"n{i}"))["errcode"] for i in range(3)]
    assert codes == [0, 0, 45009]  # the 700-character one counted: 3 in the minute
    assert fake.texts_to(ann)[-1] == "n1"
    everyone = await send(fake, "@all", "hello all")
    assert everyone["errcode"] == 0 and fake.sent[-1].pings_everyone


async def test_the_duplicate_check_shows_the_same_text_once_within_its_interval(
    fake: FakeWeCom,
) -> None:
    ann = fake.add_user("Ann")
    check = {"enable_duplicate_check": 1, "duplicate_check_interval": 600}
    for _ in range(2):
        assert (await send(fake, ann, "once", **check))["errcode"] == 0
    assert fake.texts_to(ann) == ["once"]
    assert (await send(fake, ann, "once"))["errcode"] == 0  # without the check: again
    assert fake.texts_to(ann) == ["once", "once"]


async def test_scripted_failures_are_answered_and_a_processed_one_shows(fake: FakeWeCom) -> None:
    ann = fake.add_user("Ann")
    fake.fail_next(45033)
    assert (await send(fake, ann, "a"))["errcode"] == 45033 and fake.sent == []
    fake.fail_next(0, processed=True)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{fake.url}/cgi-bin/message/send",
            params={"access_token": await token(fake)},
            json={
                "touser": ann,
                "msgtype": "text",
                "agentid": fake.agent_id,
                "text": {"content": "b"},
            },
        ) as r,
    ):
        assert r.status == 500
    assert fake.texts_to(ann) == ["b"]


async def test_the_url_check_wants_the_echostr_plaintext(fake: FakeWeCom) -> None:
    async def echo(request: web.Request) -> web.Response:
        plain, _, _ = open_encrypt(request.query["echostr"], fake.encoding_aes_key)
        return web.Response(text=plain.decode() + ("\n" if "bad" in request.path else ""))

    app = web.Application()
    app.router.add_get("/good", echo)
    app.router.add_get("/bad", echo)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    root = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        assert (await fake.verify_url(f"{root}/good"))[0]
        assert not (await fake.verify_url(f"{root}/bad"))[0]  # a newline fails WeCom's check
    finally:
        await runner.cleanup()
