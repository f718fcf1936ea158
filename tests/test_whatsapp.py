"""WhatsApp end to end: the real Daemon in-process with its WhatsApp channel (built from
settings, webhook on the daemon's own port) against the fake Cloud API, and the fake
OpenAI server as the model."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from channels.whatsapp import RetryPolicy, WhatsAppChannel, check_credentials
from channels.whatsapp.channel import WHATSAPP_WEBHOOK_PATH, GraphApi
from channels.whatsapp.settings import WhatsAppSettings
from channels.whatsapp.store import FileWhatsAppStore
from gateway.access.commands import cli_pairing_approve
from gateway.access.store import PairingStore
from gateway.channel import DeliveryFailed
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.messages import OutboundMessage
from gateway.storage.files import pairing_path
from tests.fakes.openai_server import FakeOpenAI, Reply, echo_responder
from tests.fakes.whatsapp_server import PHONE_NUMBER_ID, FakeWhatsApp, Sent, _GraphFailure

pytestmark = pytest.mark.anyio

TOKEN = "test-api-token-123"
ALICE = "4915112345678"
BOB = "4915187654321"
DAY = 24 * 3600.0


@dataclass
class Running:
    daemon: Daemon
    channel: WhatsAppChannel
    settings: Settings
    url: str

    @property
    def webhook(self) -> str:
        return self.url + WHATSAPP_WEBHOOK_PATH

    @property
    def store(self) -> FileWhatsAppStore:
        store = self.channel.store
        assert isinstance(store, FileWhatsAppStore)
        return store


@pytest.fixture
async def fake_whatsapp() -> AsyncIterator[FakeWhatsApp]:
    async with FakeWhatsApp(retry_delays=(0.2, 0.5, 1.0), ack_timeout=5) as server:
        yield server


def whatsapp_options(fake: FakeWhatsApp) -> dict[str, Any]:
    return {
        "http__port": 0,
        "http__token": TOKEN,
        "channels__whatsapp__enabled": "true",
        "channels__whatsapp__phone_number_ids": f'["{PHONE_NUMBER_ID}"]',
        "channels__whatsapp__access_token": fake.token,
        "channels__whatsapp__app_secret": fake.app_secret,
        "channels__whatsapp__verify_token": fake.verify_token,
        "channels__whatsapp__api_url": fake.url,
        "channels__whatsapp__dm_policy": "open",
        "agent__offline_after_seconds": 0,  # old messages are answered, not noticed
    }


@asynccontextmanager
async def whatsapp_gateway(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    fake: FakeWhatsApp,
    **overrides: Any,
) -> AsyncIterator[Running]:
    settings = make_settings(fake_openai, **(whatsapp_options(fake) | overrides))
    daemon = Daemon(Gateway.build(settings), interactive=False)
    channel = daemon.channels["whatsapp"]
    assert isinstance(channel, WhatsAppChannel)
    channel.retry = RetryPolicy(backoff=0.05, max_backoff=0.2, typing_grace=0.05)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        with anyio.fail_after(10):
            while not channel.live:  # noqa: ASYNC110 (the supervisor starts it soon)
                await anyio.sleep(0.01)
        running = Running(daemon, channel, settings, f"http://127.0.0.1:{port}")
        fake.webhook_url = running.webhook
        try:
            yield running
        finally:
            daemon.stop()


async def texts(fake: FakeWhatsApp, count: int, to: str = ALICE) -> list[Sent]:
    """The text messages sent to `to`, once there are `count` of them."""

    def found() -> list[Sent]:
        return [s for s in fake.sent if s.to == to and s.type == "text"]

    with anyio.fail_after(10):
        while len(found()) < count:  # noqa: ASYNC110 (polling the fake's log)
            await anyio.sleep(0.01)
    return found()


async def eventually(check: Callable[[], Any]) -> Any:
    with anyio.fail_after(10):
        while not (found := check()):  # noqa: ASYNC110
            await anyio.sleep(0.02)
    return found


def slow_echo(seconds: float) -> Callable[[dict[str, Any]], Reply]:
    def respond(body: dict[str, Any]) -> Reply:
        answer = echo_responder(body)
        return Reply(text=answer if isinstance(answer, str) else answer.text, delay=seconds)

    return respond


def chat_requests(fake: FakeOpenAI) -> list[Any]:
    return [r for r in fake.requests if r.path.endswith("/chat/completions")]


def wamid_of(payload: dict[str, Any]) -> str:
    return str(payload["entry"][0]["changes"][0]["value"]["messages"][0]["id"])


async def test_the_handshake_echoes_the_challenge_only_for_the_verify_token(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        assert await fake_whatsapp.handshake(gw.webhook, fake_whatsapp.verify_token) == (
            200,
            "1158201444",
        )
        status, body = await fake_whatsapp.handshake(gw.webhook, "guess")
        assert status == 403 and "VERIFY_TOKEN" in body


async def test_a_message_is_answered_once_read_and_its_statuses_recorded(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        fake_openai.responder = slow_echo(0.3)  # long enough for the typing indicator
        payload = fake_whatsapp.text_message(ALICE, "hello **there**", name="Alice")
        delivery = await fake_whatsapp.deliver(payload)
        assert delivery.delivered and len(delivery.attempts) == 1
        [answer] = await texts(fake_whatsapp, 1)
        assert answer.text == "echo: hello *there*"  # WhatsApp's bold
        assert answer.request["to"] == ALICE and answer.context is None
        # The same delivery again (Meta retries what it thinks was not answered): once.
        again = await fake_whatsapp.deliver(payload)
        assert again.delivered
        await anyio.sleep(0.3)
        assert len([s for s in fake_whatsapp.sent if s.type == "text"]) == 1
        reads = fake_whatsapp.reads
        assert reads and reads[0]["message_id"] == wamid_of(payload)
        assert any(r.get("typing_indicator") == {"type": "text"} for r in reads)
        # The statuses Meta sent for the reply moved it on in the store.
        row = await status_of(gw, answer.wamid, "delivered")
        assert row.body == answer.text
        assert row.session_key == f"whatsapp:{PHONE_NUMBER_ID}:{ALICE}"
        history = fake_openai.last_request.messages
        assert history[-1]["content"].endswith("hello **there**")


async def test_bad_signatures_are_refused_before_anything_is_read(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        payload = fake_whatsapp.text_message(ALICE, "forged")
        assert (await fake_whatsapp.post(gw.webhook, payload, secret="not-the-secret"))[0] == 401
        assert (await fake_whatsapp.post(gw.webhook, payload, signature=""))[0] == 401
        status, _ = await fake_whatsapp.post(gw.webhook, payload, signature="sha256=" + "0" * 64)
        assert status == 401
        assert (await fake_whatsapp.post(gw.webhook, b"not json"))[0] == 400
        await anyio.sleep(0.2)
        assert not chat_requests(fake_openai) and not fake_whatsapp.sent
        assert gw.channel.stats.bad_signatures == 3


async def test_a_batched_delivery_is_answered_in_order_and_keys_are_per_person(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        batch = fake_whatsapp.batch(
            fake_whatsapp.text_message(ALICE, "one"),
            fake_whatsapp.text_message(BOB, "bob here"),
            fake_whatsapp.text_message(ALICE, "two"),
        )
        assert (await fake_whatsapp.deliver(batch)).delivered
        alice = await texts(fake_whatsapp, 2)
        [bob] = await texts(fake_whatsapp, 1, to=BOB)
        assert [s.text for s in alice] == ["echo: one", "echo: two"]
        assert bob.text == "echo: bob here"
        keys = {s.key for s in gw.daemon.gateway.sessions.list_sessions()}
        assert {f"whatsapp:{PHONE_NUMBER_ID}:{ALICE}", f"whatsapp:{PHONE_NUMBER_ID}:{BOB}"} <= keys


async def test_long_replies_are_split_and_quote_when_the_person_wrote_again(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        long = "\n\n".join(f"Paragraph {i}: " + "word " * 150 for i in range(12))
        fake_openai.add(Reply(text=long, delay=0.5))
        first = fake_whatsapp.text_message(ALICE, "tell me a lot")
        await fake_whatsapp.deliver(first)
        await fake_whatsapp.deliver(fake_whatsapp.text_message(ALICE, "and then?"))
        sent = await texts(fake_whatsapp, 3)
        parts = [s for s in sent if s.text.startswith("Paragraph")]
        assert len(parts) >= 3 and all(len(p.text) <= 4096 for p in parts)
        assert " ".join(p.text for p in parts).split() == long.split()  # all of it, in order
        # Alice wrote again while it was written: the answer quotes the message it answers.
        assert parts[0].context == wamid_of(first) and all(p.context is None for p in parts[1:])
        answer = (await texts(fake_whatsapp, len(parts) + 1))[-1]
        assert answer.text == "echo: and then?" and answer.context is None
        assert gw.channel.settings.quote_replies == "auto"


async def test_outside_the_window_a_reply_is_kept_and_shown_without_a_template(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        # Meta retried this one for a day (the gateway was down): the window has closed.
        old = fake_whatsapp.text_message(ALICE, "still there?", sent_at=time.time() - DAY - 120)
        assert (await fake_whatsapp.deliver(old)).delivered
        [kept] = await held_rows(gw)
        assert kept.text == "echo: still there?" and "24-hour" in kept.reason
        assert not [s for s in fake_whatsapp.sent if s.type != "text" or s.to == ALICE]
        # The admin page marks it.
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with (
            aiohttp.ClientSession() as session,
            session.get(gw.url + "/admin/live", headers=headers) as response,
        ):
            page = await response.text()
        assert 'id="undeliverable"' in page and "still there?" in page
        async with (
            aiohttp.ClientSession() as session,
            session.get(gw.url + "/metrics") as response,
        ):
            metrics = await response.text()
        assert "gateway_whatsapp_held_replies 1.0" in metrics


async def status_of(gw: Running, wamid: str, status: str) -> Any:
    """The store's row of `wamid` once it has `status`."""
    with anyio.fail_after(10):
        while (row := await gw.store.sent(wamid)) is None or row.status != status:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    return row


async def held_rows(gw: Running, count: int = 1) -> list[Any]:
    """The replies kept as undeliverable, once there are `count` of them."""
    with anyio.fail_after(10):
        while len(rows := await gw.store.held()) < count:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    return rows


async def test_outside_the_window_the_template_goes_instead(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    fake_whatsapp.templates[("pending_reply", "en_US")] = 1
    options = {
        "channels__whatsapp__template": "pending_reply",
        "channels__whatsapp__template_language": "en_US",
    }
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp, **options) as gw:
        old = fake_whatsapp.text_message(
            ALICE, "line one\n\nline two", sent_at=time.time() - 2 * DAY
        )
        await fake_whatsapp.deliver(old)
        [template] = await eventually(
            lambda: [s for s in fake_whatsapp.sent if s.type == "template"] or None
        )
        body = template.request["template"]
        assert body["name"] == "pending_reply" and body["language"] == {"code": "en_US"}
        [parameter] = body["components"][0]["parameters"]
        assert parameter == {"type": "text", "text": "echo: line one line two"}  # one line
        assert not [s for s in fake_whatsapp.sent if s.type == "text"]
        assert await gw.store.held() == []  # sent as the template: not undeliverable
        assert gw.channel.stats.templates == 1
        # A reply a scheduled job makes outside the window takes the same way.
        await gw.channel.send(
            OutboundMessage(
                "whatsapp",
                f"{PHONE_NUMBER_ID}:{ALICE}",
                "Reminder: call Ann",
                f"whatsapp:{PHONE_NUMBER_ID}:{ALICE}",
                reply_to="schedule:abc:2030-01-01T09:00",
            )
        )
        templates = [s for s in fake_whatsapp.sent if s.type == "template"]
        assert templates[-1].request["template"]["components"][0]["parameters"][0]["text"] == (
            "Reminder: call Ann"
        )


async def test_a_131047_that_meta_reports_later_keeps_the_part_and_counts_once(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        # Meta's clock says the window closed, the gateway's that it is open: the send is
        # accepted and fails later, as a status.
        fake_whatsapp.clock_offset = 600
        await fake_whatsapp.deliver(
            fake_whatsapp.text_message(ALICE, "edge", sent_at=time.time() - DAY + 300)
        )
        [answer] = await texts(fake_whatsapp, 1)
        [kept] = await held_rows(gw)
        assert kept.text == answer.text and "131047" in kept.reason
        row = await status_of(gw, answer.wamid, "failed")
        assert row.error_code == 131047
        # Meta sends the same status again: nothing changes, nothing is counted twice.
        again = fake_whatsapp.status_payload(answer.wamid, "failed", error=131047)
        assert (await fake_whatsapp.deliver(again)).delivered
        assert gw.channel.stats.failures["re_engagement"] == 1
        assert gw.channel.stats.statuses["failed"] == 1
        assert len(await gw.store.held()) == 1
        async with (
            aiohttp.ClientSession() as session,
            session.get(gw.url + "/metrics") as response,
        ):
            metrics = await response.text()
        assert 'gateway_whatsapp_failures_total{error="re_engagement"} 1.0' in metrics


async def test_undeliverable_and_throughput_errors_are_handled_by_name(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        # 130429 twice: waited out and sent.
        fake_whatsapp.fail_next(130429, 2)
        await fake_whatsapp.deliver(fake_whatsapp.text_message(ALICE, "busy?"))
        [answer] = await texts(fake_whatsapp, 1)
        assert answer.text == "echo: busy?"
        assert gw.channel.stats.failures["throughput"] == 0  # retried, not failed
        refused = [c for c in fake_whatsapp.calls_to("POST /messages") if c.status == 400]
        assert len(refused) == 2
        # 131026: the person cannot get messages; the reply is kept, with why.
        fake_whatsapp.unreachable.add(BOB)
        await fake_whatsapp.deliver(fake_whatsapp.text_message(BOB, "hi"))
        [kept] = await held_rows(gw)
        assert kept.chat == f"{PHONE_NUMBER_ID}:{BOB}" and "131026" in kept.reason
        assert gw.channel.stats.failures["undeliverable"] == 1
        # 131016 with a 503: Meta did not take it; sent again.
        fake_whatsapp.fail_next(131016, status=503)
        await fake_whatsapp.deliver(fake_whatsapp.text_message(ALICE, "again"))
        assert (await texts(fake_whatsapp, 2))[-1].text == "echo: again"


async def test_a_reply_the_graph_api_did_not_take_is_sent_again_not_kept(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    """131016 (HTTP 503) past the channel's retries: the reply certainly did not go out,
    so the dispatcher sends it again later (`DeliveryFailed`), and it arrives once; it
    was kept as undeliverable, and its message marked answered without it."""
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp) as gw:
        attempts = gw.channel.retry.attempts
        fake_whatsapp.fail_next(131016, attempts + 2, status=503)
        await fake_whatsapp.deliver(fake_whatsapp.text_message(ALICE, "still there?"))
        [answer] = await texts(fake_whatsapp, 1)
        assert answer.text == "echo: still there?"
        sends = fake_whatsapp.calls_to("POST /messages")
        assert [c.status for c in sends if c.body.get("type") == "text"] == [503] * (
            attempts + 2
        ) + [200]
        assert await gw.store.held() == []


async def test_a_reply_cut_short_goes_on_from_the_part_that_failed(
    tmp_path: Path, fake_whatsapp: FakeWhatsApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply of several parts whose second part meets the Graph API unreachable: the
    parts sent are remembered, and the reply, sent again, goes on from there (each part
    once, in order); an API that refuses connections is `DeliveryFailed` too."""
    settings = WhatsAppSettings(
        enabled=True, phone_number_ids=[PHONE_NUMBER_ID], api_url=fake_whatsapp.url
    )
    store = FileWhatsAppStore(tmp_path / "whatsapp.sqlite")
    channel = WhatsAppChannel(
        settings,
        store=store,
        token=fake_whatsapp.token,
        app_secret=fake_whatsapp.app_secret,
        verify_token=fake_whatsapp.verify_token,
        retry=RetryPolicy(attempts=2, backoff=0.01, max_backoff=0.01, reply_deadline=5),
    )
    chat = f"{PHONE_NUMBER_ID}:{ALICE}"
    fake_whatsapp.text_message(ALICE, "tell me everything")  # opens the window at Meta
    await store.note_inbound(chat, "wamid.in", time.time())
    post = fake_whatsapp._post_messages
    down = True

    def down_after_the_first_part(number: str, body: dict[str, Any]) -> dict[str, Any]:
        if down and fake_whatsapp.sent:
            raise _GraphFailure(131016)
        return post(number, body)

    monkeypatch.setattr(fake_whatsapp, "_post_messages", down_after_the_first_part)
    text = "\n\n".join(f"part {n} " + "x" * 3000 for n in range(3))
    reply = OutboundMessage("whatsapp", chat, text, f"whatsapp:{chat}", reply_to="wamid.in")
    try:
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == len(fake_whatsapp.sent) == 1
        down = False
        await channel.send(reply)  # sent again: only what had not gone out
        assert [s.text.split()[1] for s in fake_whatsapp.sent] == ["0", "1", "2"]
        assert await store.held() == []
        channel.graph = GraphApi("http://127.0.0.1:9", "v26.0", fake_whatsapp.token)
        with pytest.raises(DeliveryFailed, match="cannot connect"):
            await channel.send(OutboundMessage("whatsapp", chat, "hello?", f"whatsapp:{chat}"))
    finally:
        await channel.graph.aclose()
        await store.aclose()


async def test_media_in_and_files_out(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    options = {"media__code_block_file_chars": 200}
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp, **options):
        notes = fake_whatsapp.add_media(b"the meeting is at noon", "text/plain")
        message = fake_whatsapp.media_message(
            ALICE, "document", notes, caption="read this", filename="notes.txt"
        )
        await fake_whatsapp.deliver(message)
        [answer] = await texts(fake_whatsapp, 1)
        assert "the meeting is at noon" in answer.text and "read this" in answer.text
        voice = fake_whatsapp.add_media(
            b"OggS\x00SPEECH: what time is it", "audio/ogg; codecs=opus"
        )
        await fake_whatsapp.deliver(fake_whatsapp.media_message(ALICE, "audio", voice, voice=True))
        assert (await texts(fake_whatsapp, 2))[-1].text == "echo: what time is it"
        # A reply with a long code block: the block goes out as a file (a document).
        code = "\n".join(f"print({i})" for i in range(60))
        fake_openai.add(Reply(text=f"Here:\n```python\n{code}\n```"))
        await fake_whatsapp.deliver(fake_whatsapp.text_message(ALICE, "code please"))
        [document] = await eventually(
            lambda: [s for s in fake_whatsapp.sent if s.type == "document"] or None
        )
        data, _ = fake_whatsapp.media(document.request["document"]["id"])
        assert data.decode().strip() == code and document.request["document"]["filename"].endswith(
            ".py"
        )
        # A sticker gets a short notice, without the model.
        before = len(chat_requests(fake_openai))
        await fake_whatsapp.deliver(
            fake_whatsapp.other_message(ALICE, "sticker", {"id": "1", "mime_type": "image/webp"})
        )
        notice = (await texts(fake_whatsapp, 4))[-1]
        assert notice.text.startswith("Sorry, I can't open a sticker")
        assert len(chat_requests(fake_openai)) == before


async def test_strangers_get_a_pairing_code_and_are_answered_once_approved(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    options = {"channels__whatsapp__dm_policy": "pairing"}
    async with whatsapp_gateway(make_settings, fake_openai, fake_whatsapp, **options) as gw:
        await fake_whatsapp.deliver(fake_whatsapp.text_message(BOB, "who are you?"))
        [code_message] = await texts(fake_whatsapp, 1, to=BOB)
        code = re.search(r"\b[A-Z0-9]{8}\b", code_message.text)
        assert code is not None and not chat_requests(fake_openai)
        store = PairingStore(pairing_path(gw.settings))
        assert cli_pairing_approve(store, "whatsapp", code.group()) is not None
        await fake_whatsapp.deliver(fake_whatsapp.text_message(BOB, "now?"))
        assert (await texts(fake_whatsapp, 2, to=BOB))[-1].text == "echo: now?"


async def test_doctor_checks_the_token_against_each_number(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_whatsapp: FakeWhatsApp
) -> None:
    settings = make_settings(fake_openai, **whatsapp_options(fake_whatsapp))
    found = await check_credentials(settings.channels.whatsapp, fake_whatsapp.token)
    assert found == f"WhatsApp: 15550783881 (Fake Business, quality GREEN, id {PHONE_NUMBER_ID})"
    with pytest.raises(Exception, match="refused the access token"):
        await check_credentials(settings.channels.whatsapp, "EAA-wrong")
    from gateway.doctor import check_channels

    findings = await check_channels(settings)
    assert [f.status for f in findings] == ["ok"], findings
    bare = make_settings(
        fake_openai,
        channels__whatsapp__enabled="true",
        channels__whatsapp__phone_number_ids=f'["{PHONE_NUMBER_ID}"]',
    )
    missing = {f.what for f in await check_channels(bare)}
    assert missing == {
        "whatsapp is enabled without the webhook's verify token",
        "whatsapp is enabled without the app secret",
        "whatsapp is enabled without an access token",
    }
