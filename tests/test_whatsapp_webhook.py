"""The WhatsApp webhook's side of journal-before-200, with the dispatcher replaced by a
stand-in whose `submit` the test holds open or refuses (a slow or failed journal commit):
Meta gets its 200 only once `submit` returned for every message of a delivery, and a
delivery with a message not taken is answered 503, so Meta delivers all of it again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from channels.whatsapp import FileWhatsAppStore, RetryPolicy, WhatsAppChannel
from channels.whatsapp.channel import WHATSAPP_WEBHOOK_PATH
from channels.whatsapp.settings import WhatsAppSettings
from gateway.config import Settings
from gateway.http import HealthState, HttpServer
from gateway.http.metrics import Metrics
from gateway.messages import InboundMessage, OutboundMessage
from tests.fakes.whatsapp_server import PHONE_NUMBER_ID, FakeWhatsApp

pytestmark = pytest.mark.anyio

ALICE = "4915112345678"


class StubTicket:
    def __init__(self, taken: bool) -> None:
        self.taken = taken
        self.status = "duplicate"  # no read receipts from this stand-in

    async def reply(self) -> OutboundMessage | None:
        return None


class GatedSubmit:
    """`submit` held open for chosen texts, refusing others (the journal failed)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.hold: dict[str, anyio.Event] = {}
        self.refuse: set[str] = set()

    async def submit(self, message: InboundMessage) -> StubTicket:
        self.messages.append(message.text)
        if message.text in self.hold:
            await self.hold[message.text].wait()
        return StubTicket(taken=message.text not in self.refuse)


@pytest.fixture
async def wired(tmp_path: Path) -> AsyncIterator[tuple[FakeWhatsApp, WhatsAppChannel, GatedSubmit]]:
    async with FakeWhatsApp(retry_delays=(0.2, 0.2, 0.2), ack_timeout=5) as fake:
        settings = WhatsAppSettings(
            enabled=True, phone_number_ids=[PHONE_NUMBER_ID], api_url=fake.url
        )
        channel = WhatsAppChannel(
            settings,
            store=FileWhatsAppStore(tmp_path / "whatsapp.sqlite"),
            token=fake.token,
            app_secret=fake.app_secret,
            verify_token=fake.verify_token,
            retry=RetryPolicy(backoff=0.05),
        )
        health = HealthState()
        http = HttpServer(
            Settings().http.model_copy(update={"port": 0}), health=health, metrics=Metrics()
        )
        channel.mount(http)
        gate = GatedSubmit()
        async with anyio.create_task_group() as tg:
            port = await tg.start(http.run)
            health.set_ready()
            await tg.start(channel.run, gate.submit)
            fake.webhook_url = f"http://127.0.0.1:{port}{WHATSAPP_WEBHOOK_PATH}"
            yield fake, channel, gate
            tg.cancel_scope.cancel()


async def test_the_200_waits_until_submit_returned_for_every_message(
    wired: tuple[FakeWhatsApp, WhatsAppChannel, GatedSubmit],
) -> None:
    fake, _, gate = wired
    gate.hold["two"] = anyio.Event()
    batch = fake.batch(fake.text_message(ALICE, "one"), fake.text_message(ALICE, "two"))
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.deliver, batch)
        with anyio.fail_after(5):
            while gate.messages != ["one", "two"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)
        [delivery] = fake.deliveries
        assert not delivery.attempts  # no answer yet: "two" is not journaled
        gate.hold["two"].set()
    [delivery] = fake.deliveries
    assert delivery.delivered and len(delivery.attempts) == 1


async def test_a_delivery_with_a_message_not_taken_is_503_and_comes_again_whole(
    wired: tuple[FakeWhatsApp, WhatsAppChannel, GatedSubmit],
) -> None:
    fake, channel, gate = wired
    gate.refuse.add("two")
    batch = fake.batch(
        fake.text_message(ALICE, "one"),
        fake.text_message(ALICE, "two"),
        fake.text_message(ALICE, "three"),
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.deliver, batch)
        with anyio.fail_after(5):
            while gate.messages.count("two") < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert "three" not in gate.messages  # in order: nothing past the one not kept
        gate.refuse.clear()
    [delivery] = fake.deliveries
    assert [a.status for a in delivery.attempts][:2] == [503, 503]
    assert delivery.delivered and gate.messages[-3:] == ["one", "two", "three"]
    # While the daemon drains, deliveries are left with Meta.
    channel.pause_intake()
    status, _ = await fake.post(fake.webhook_url or "", fake.text_message(ALICE, "late"))
    assert status == 503 and "late" not in gate.messages
