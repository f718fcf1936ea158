"""The WeCom channel: the cipher (against WeCom's and the fake's), callbacks as messages
(pure), the formatter (2,048 bytes), the callback (journal before the 200, forged or
misdirected requests refused, the URL check), and replies against the fake WeCom: the
access token fetched again when expired, each refusal by name (45009 waited out, 81013
given up, WeCom away)."""

from __future__ import annotations

import base64
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from channels.wecom import crypto
from channels.wecom.api import WeComError
from channels.wecom.channel import Pacing, WeComChannel, WeComRefused
from channels.wecom.format import TEXT_LIMIT_BYTES, split_bytes, wecom_texts
from channels.wecom.settings import WeComSettings
from channels.wecom.spec import SPEC
from channels.wecom.translate import Inbound, Notice, Skip, parse_fields, translate_message
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.messages import InboundMessage, OutboundMessage
from tests.fakes.wecom_server import FakeWeCom, to_xml, wecom_encrypt

pytestmark = pytest.mark.anyio

FAST = Pacing(reply_deadline=1.5, backoff=0.05, max_backoff=0.2)
KEY = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"
CORP = "wx5823bf96d3bd56c7"


# -- the cipher --------------------------------------------------------------------------


def test_the_signature_is_sha1_of_the_sorted_four() -> None:
    # The documentation's example: token QDG6eK, timestamp 1409659813, nonce 1372623149.
    expected = crypto.signature("QDG6eK", "1409659813", "1372623149", "RypEvHKD8QQKFhvQ6QleEB4J")
    assert expected == crypto.signature(
        "QDG6eK", "1372623149", "1409659813", "RypEvHKD8QQKFhvQ6QleEB4J"
    )
    assert crypto.signature_valid(
        "QDG6eK", "1409659813", "1372623149", "RypEvHKD8QQKFhvQ6QleEB4J", expected.upper()
    )
    assert not crypto.signature_valid(
        "other", "1409659813", "1372623149", "RypEvHKD8QQKFhvQ6QleEB4J", expected
    )


def test_what_the_fake_encrypts_opens_and_another_corp_or_key_is_refused() -> None:
    key = crypto.aes_key(KEY)
    message = "<xml><Content><![CDATA[你好]]></Content></xml>".encode()
    encrypted = wecom_encrypt(message, KEY, CORP)
    assert crypto.decrypt(encrypted, key, CORP) == message
    with pytest.raises(crypto.NotDecryptable, match="another corp"):
        crypto.decrypt(encrypted, key, "wwsomeoneelse")
    other = crypto.aes_key(base64.b64encode(os.urandom(32)).decode()[:43])
    with pytest.raises(crypto.NotDecryptable):
        crypto.decrypt(encrypted, other, CORP)
    with pytest.raises(crypto.NotDecryptable):
        crypto.decrypt("not base64!", key, CORP)
    # And the channel's own encryption is what WeCom's (the fake's) reader opens.
    assert crypto.decrypt(crypto.encrypt(b"echo", key, CORP), key, CORP) == b"echo"


def test_an_encoding_aes_key_is_43_characters() -> None:
    with pytest.raises(ValueError):
        crypto.aes_key(KEY[:42])
    assert len(crypto.aes_key(KEY)) == 32


# -- callbacks as messages ---------------------------------------------------------------


def fields(**overrides: str) -> dict[str, str]:
    base = {
        "ToUserName": CORP,
        "FromUserName": "ZhangSan",
        "CreateTime": "1700000000",
        "MsgType": "text",
        "Content": "hello",
        "MsgId": "7300000000000000001",
        "AgentID": "1000002",
    }
    return {**base, **overrides}


def test_a_text_is_keyed_by_the_member_with_its_msgid() -> None:
    item = translate_message(parse_fields(to_xml(fields())), agent_id=1000002, received_at=1.0)
    assert isinstance(item, Inbound)
    message = item.message
    assert message.session_key == "wecom:ZhangSan"
    assert (message.text, message.sender_id, message.message_id) == (
        "hello",
        "ZhangSan",
        "7300000000000000001",
    )
    assert message.metadata["sent_at"] == 1_700_000_000.0


def test_events_media_and_other_apps() -> None:
    event = fields(MsgType="event", Event="enter_agent")
    del event["MsgId"]
    assert isinstance(translate_message(event, agent_id=1000002, received_at=1.0), Skip)
    image = translate_message(fields(MsgType="image"), agent_id=1000002, received_at=1.0)
    assert isinstance(image, Notice) and image.user == "ZhangSan"
    other = translate_message(fields(AgentID="1000003"), agent_id=1000002, received_at=1.0)
    assert isinstance(other, Skip)
    no_id = fields()
    del no_id["MsgId"]
    assert isinstance(translate_message(no_id, agent_id=1000002, received_at=1.0), Skip)


# -- the formatter ---------------------------------------------------------------------------


@given(st.text(alphabet=st.sampled_from("ab 字\n😀."), max_size=5000))
def test_parts_fit_in_2048_bytes_and_keep_every_word_in_order(text: str) -> None:
    parts = split_bytes(text)
    assert all(len(p.encode()) <= TEXT_LIMIT_BYTES and p.strip() for p in parts)
    assert "".join(parts).split() == text.split() or " ".join(parts).split() == text.split()


def test_a_long_chinese_reply_is_cut_by_bytes_not_characters() -> None:
    text = "\n\n".join("字" * 600 for _ in range(4))  # 7,200 bytes, 2,406 characters
    parts = wecom_texts(text)
    assert len(parts) == 4 and all(len(p.encode()) <= 2048 for p in parts)
    assert wecom_texts("**bold** and [a link](https://example.com)") == [
        "bold and a link (https://example.com)"
    ]


# -- replies against the fake -------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeWeCom]:
    async with FakeWeCom() as server:
        yield server


def make_channel(fake: FakeWeCom, **settings: Any) -> WeComChannel:
    section = WeComSettings(
        enabled=True, corp_id=fake.corp_id, agent_id=fake.agent_id, api_url=fake.url, **settings
    )
    return WeComChannel(
        section,
        secret=fake.secret,
        token=fake.callback_token,
        encoding_aes_key=fake.encoding_aes_key,
        pacing=FAST,
    )


def reply(user: str, text: str, reply_to: str = "m1") -> OutboundMessage:
    return OutboundMessage("wecom", user, text, f"wecom:{user}", reply_to=reply_to)


async def test_a_reply_goes_to_the_member_with_the_duplicate_check(fake: FakeWeCom) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    await channel.send(reply(ann, "**hi** " + "x" * 3000))
    texts = fake.texts_to(ann)
    assert texts[0] == "hi" and "".join(texts[1:]) == "x" * 3000
    assert all(len(t.encode()) <= 2048 for t in texts)  # none cut by WeCom
    [first, *_] = fake.calls_to("message/send")
    assert first.body["touser"] == ann and first.body["agentid"] == fake.agent_id
    assert first.body["enable_duplicate_check"] == 1
    assert first.body["duplicate_check_interval"] == 600
    assert not any(s.pings_everyone for s in fake.sent)
    await channel.api.aclose()


async def test_an_expired_or_replaced_token_is_fetched_again_once(fake: FakeWeCom) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    await channel.send(reply(ann, "one"))
    fake.expire_tokens()
    await channel.send(reply(ann, "two", "m2"))
    fake.revoke_tokens()
    await channel.send(reply(ann, "three", "m3"))
    assert fake.texts_to(ann) == ["one", "two", "three"]
    codes = [c.answer.get("errcode") for c in fake.calls_to("message/send")]
    assert codes == [0, 42001, 0, 40014, 0]
    assert len(fake.calls_to("gettoken")) == 3
    await channel.api.aclose()


async def test_a_frequency_limit_is_waited_out_and_81013_given_up(fake: FakeWeCom) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    fake.fail_next(45009, 2)
    await channel.send(reply(ann, "patient"))
    assert fake.texts_to(ann) == ["patient"] and channel.stats.rate_limited == 2
    with pytest.raises(WeComRefused, match="81013"):
        await channel.send(reply("gone", "to nobody"))
    assert channel.stats.refused["not_visible"] == 1
    [given_up] = await channel.undeliverable()
    assert given_up.chat == "gone" and "81013" in given_up.reason
    await channel.api.aclose()


async def test_wecom_away_is_delivery_failed_and_goes_on_from_the_part_that_failed(
    fake: FakeWeCom,
) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    message = reply(ann, "\n\n".join(c * 2000 for c in "abc"))
    await channel.api.token()
    calls = 0
    original = channel.api._request

    async def flaky(*args: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls >= 2:
            raise WeComError("cannot connect", kind="not_sent")
        return await original(*args)

    channel.api._request = flaky  # type: ignore[method-assign]
    with pytest.raises(DeliveryFailed) as failed:
        await channel.send(message)
    assert failed.value.sent == 1 and [t[0] for t in fake.texts_to(ann)] == ["a"]
    channel.api._request = original  # type: ignore[method-assign]
    await channel.send(message)
    assert [t[0] for t in fake.texts_to(ann)] == ["a", "b", "c"]
    await channel.api.aclose()


async def test_a_send_that_may_have_gone_out_is_repeated_only_with_the_duplicate_check(
    fake: FakeWeCom,
) -> None:
    ann = fake.add_user("Ann")
    checked = make_channel(fake)
    fake.fail_next(0, processed=True)  # shown, then HTTP 500
    await checked.send(reply(ann, "once"))
    assert fake.texts_to(ann) == ["once"]  # repeated; WeCom's check showed it once
    unchecked = make_channel(fake, duplicate_check_seconds=0)
    fake.fail_next(0, processed=True)
    with pytest.raises(WeComRefused, match="may or may not"):
        await unchecked.send(reply(ann, "maybe"))
    assert fake.texts_to(ann) == ["once", "maybe"]
    await checked.api.aclose()
    await unchecked.api.aclose()


def test_missing_keys_are_a_config_error_naming_the_variable() -> None:
    section = WeComSettings(enabled=True, corp_id=CORP, agent_id=1)
    with pytest.raises(ConfigError, match="GATEWAY_CHANNELS__WECOM__SECRET"):
        WeComChannel(section, secret="", token="t", encoding_aes_key=KEY)
    with pytest.raises(ConfigError, match="ENCODING_AES_KEY is not"):
        WeComChannel(section, secret="s", token="t", encoding_aes_key="short")
    assert SPEC.name == "wecom" and SPEC.failpoints == ("wecom.before_ack",)
    assert SPEC.offers.groups and SPEC.offers.webhooks and SPEC.offers.catch_up


# -- the callback ----------------------------------------------------------------------------


@dataclass
class Ticket:
    taken: bool

    async def reply(self) -> OutboundMessage | None:
        return None


@dataclass
class Routes:
    app: web.Application = field(default_factory=web.Application)

    def mount(
        self,
        method: str,
        path: str,
        handler: Callable[[Any], Awaitable[Any]],
        *,
        require_ready: bool = True,
    ) -> None:
        self.app.router.add_route(method, path, handler)


async def test_the_callback_answers_200_only_once_the_journal_has_it(fake: FakeWeCom) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    routes = Routes()
    channel.mount(routes)
    runner = web.AppRunner(routes.app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/wecom/callback"
    submitted: list[InboundMessage] = []
    taking = [True]

    async def submit(message: InboundMessage) -> Ticket:
        submitted.append(message)
        return Ticket(taking[0])

    # The console's URL check works before the channel runs; a wrong Token fails it.
    assert (await fake.verify_url(url))[0]
    assert not (await fake.verify_url(url, token="wrong"))[0]
    status, _ = await fake.post(url, fake.text_message(ann, "before the start"))
    assert status == 503 and submitted == []
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        forged = await fake.post(url, fake.text_message(ann, "forged"), token="wrong")
        assert forged[0] == 401
        misdirected = await fake.post(url, fake.text_message(ann, "other corp"), corp_id="wwx")
        assert misdirected[0] == 401 and submitted == []
        assert channel.stats.bad_signatures == 3  # the URL check's, the forged, the other corp's
        kept = fake.text_message(ann, "kept")
        assert await fake.post(url, kept) == (200, "")
        taking[0] = False
        assert (await fake.post(url, fake.text_message(ann, "not kept")))[0] == 503
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=b"<not xml") as r,
        ):
            assert r.status == 401
        tg.cancel_scope.cancel()
    assert [m.text for m in submitted] == ["kept", "not kept"]
    assert submitted[0].message_id == kept["MsgId"]
    await runner.cleanup()


async def test_the_doctor_names_what_is_missing_and_asks_wecom_for_a_token(
    fake: FakeWeCom,
) -> None:
    from pydantic import SecretStr

    from channels.wecom.spec import checks

    missing = await checks(WeComSettings(enabled=True, corp_id=fake.corp_id))
    assert {f.what.split(" without ")[1] for f in missing} == {
        "the app's AgentId",
        "the app's Secret",
        "the callback Token",
        "the EncodingAESKey",
    }
    assert all(f.status == "fail" and "GATEWAY_CHANNELS__WECOM__" in f.fix for f in missing)
    section = WeComSettings(
        enabled=True,
        corp_id=fake.corp_id,
        agent_id=fake.agent_id,
        api_url=fake.url,
        secret=SecretStr(fake.secret),
        token=SecretStr(fake.callback_token),
        encoding_aes_key=SecretStr(fake.encoding_aes_key),
    )
    [ok] = await checks(section)
    assert ok.status == "ok" and fake.corp_id in ok.what
    [refused] = await checks(section.model_copy(update={"secret": SecretStr("wrong")}))
    assert refused.status == "fail" and "Secret" in refused.what
    assert "wrong" not in refused.what and fake.secret not in refused.what
