"""The conformance kit's driver for WhatsApp, over the fake Cloud API
(tests/fakes/whatsapp_server.py).

What the driver plays is Meta's behaviour (docs/whatsapp.md):

- WhatsApp conversations are one-to-one: person n writes to the business number from a
  wa_id of their own; there are no groups, threads or mentions, and nobody to ping.
- Each message is its own webhook delivery, signed with the app secret
  (`X-Hub-Signature-256`), POSTed to the gateway's /whatsapp/webhook; a 2xx within 3 s
  delivers it, anything else is retried with the same body: after 0.25, 0.5, 1 and 2 s,
  then every 2 s for two minutes (Meta backs off from a minute to hours, for 7 days;
  here faster, and long enough for every downtime of the kit). So what people write
  while the gateway is down reaches it after the next start. The statuses of the bot's
  messages come back over the same webhook, the same way.
- Meta does not promise the order of deliveries; a person writing at a human pace sees
  theirs in order, so each person's messages are delivered one at a time, in order
  (tests/conformance/lanes.py), people in parallel.
- The network: the gateway reaches the Graph API through a TCP proxy, and Meta reaches
  the webhook through another; `platform_down` cuts both.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.conformance.lanes import Lanes
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.whatsapp_server import PHONE_NUMBER_ID, TEXT_LIMIT, FakeWhatsApp, Payload

#: Meta's retries of a delivery that got no 2xx, compressed (see the module docstring).
META_RETRIES = (0.25, 0.5, 1.0, 2.0, *itertools.repeat(2.0, 60))
ACK_TIMEOUT = 3.0


def wa_id(person: int) -> str:
    """Person n's WhatsApp id (their phone number, digits only)."""
    return f"49151{person:08d}"


class WhatsAppDriver(ChannelDriver):
    """WhatsApp Business over the Cloud API: Meta's webhook deliveries in, the Graph API
    out; `forge` posts a delivery signed with a wrong secret."""

    name = "whatsapp"
    requirements = Requirements(
        groups=False,  # one-to-one: a person and a business number
        mentions=False,
        threads=False,
        edits=False,  # the channel answers no edit (the fake sends none)
        duplicate_delivery=True,  # Meta delivers again what got no 2xx
        catch_up=True,  # Meta retries a delivery for 7 days
        strangers=True,
        signed_inbound=True,  # X-Hub-Signature-256 with the app secret
        split_long_replies=True,  # at 4,096 characters
        mass_pings=False,  # nobody else to ping
        platform_outage=True,
    )
    max_message_length = TEXT_LIMIT

    def __init__(self) -> None:
        self._fake: FakeWhatsApp | None = None
        self._graph: TcpProxy | None = None
        self._inbound: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._port = 0
        self._payloads: dict[str, Payload] = {}  # by wamid: what `redeliver` sends again

    @property
    def fake(self) -> FakeWhatsApp:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Meta delivers to the URL the app set
        with FakeWhatsApp.in_thread(retry_delays=META_RETRIES, ack_timeout=ACK_TIMEOUT) as fake:
            graph = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            inbound = TcpProxy("127.0.0.1", self._port)
            graph.restore()
            inbound.restore()
            fake.webhook_url = f"http://127.0.0.1:{inbound.port}/whatsapp/webhook"
            lanes = Lanes(self._deliver, name="kit-whatsapp")
            lanes.start()
            self._fake, self._graph, self._inbound, self._lanes = fake, graph, inbound, lanes
            self._payloads = {}
            try:
                yield
            finally:
                lanes.stop()
                fake.webhook_url = None  # no more statuses
                graph.close()
                inbound.close()
                self._fake = self._graph = self._inbound = self._lanes = None

    def gateway_env(self) -> dict[str, str]:
        assert self._graph is not None
        fake = self.fake
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            "GATEWAY_CHANNELS__WHATSAPP__ENABLED": "true",
            "GATEWAY_CHANNELS__WHATSAPP__PHONE_NUMBER_IDS": f'["{PHONE_NUMBER_ID}"]',
            "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN": fake.token,
            "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET": fake.app_secret,
            "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN": fake.verify_token,
            "GATEWAY_CHANNELS__WHATSAPP__API_URL": f"http://127.0.0.1:{self._graph.port}",
            "GATEWAY_CHANNELS__WHATSAPP__DM_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._graph is not None and self._inbound is not None
        self._inbound.cut()
        self._graph.cut()

    def platform_up(self) -> None:
        assert self._graph is not None and self._inbound is not None
        self._graph.restore()
        self._inbound.restore()

    # -- people -------------------------------------------------------------------------

    async def _deliver(self, payload: Payload) -> None:
        await self.fake.deliver(payload)

    def dm(self, person: int, text: str) -> MessageRef:
        sender = wa_id(person)
        payload = self.fake.text_message(sender, text, name=f"Person {person}")
        [message] = payload["entry"][0]["changes"][0]["value"]["messages"]
        ref = MessageRef(str(message["id"]), Place(sender), sender, str(message["id"]))
        self._payloads[ref.event] = payload
        assert self._lanes is not None
        self._lanes.put(sender, payload)
        return ref

    def redeliver(self, ref: MessageRef) -> None:
        assert self._lanes is not None
        self._lanes.put(ref.sender, self._payloads[ref.event])

    def forge(self, text: str) -> bool:
        payload = self.fake.text_message(wa_id(999), text)
        url = f"http://127.0.0.1:{self._port}/whatsapp/webhook"
        status, _ = asyncio.run(self.fake.post(url, payload, secret="not-the-app-secret"))
        return status in (401, 403)

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for sent in self.fake.sent:
            content: Any = sent.request.get(sent.type) or {}
            if sent.type == "text":
                text = sent.text
            elif sent.type == "template":
                parameters = [
                    str(p.get("text") or "")
                    for c in content.get("components") or ()
                    for p in c.get("parameters") or ()
                ]
                text = " ".join(parameters) or str(content.get("name"))
            else:
                text = str(content.get("caption") or content.get("filename") or sent.type)
            posts.append(Post(Place(sent.to), text, reply_to=sent.context))
        return posts

    def delivering(self) -> bool:
        """The platform still retries an event the gateway has not acknowledged."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            what = [str(m.get("text", {}).get("body"))[:60] for m in delivery.messages] or [
                f"{s.get('status')} of {str(s.get('id'))[-8:]}" for s in delivery.statuses
            ]
            attempts = ", ".join(
                f"{a.sent_at:.3f} {a.status} {a.failure or 'delivered'}" for a in delivery.attempts
            )
            yield f"delivery {delivery.number} {what}: {attempts}"
        for call in self.fake.calls:
            if call.method == "POST /messages":
                body = call.body
                text = str((body.get("text") or {}).get("body") or body.get("status"))[:80]
                yield f"{call.at:.3f} POST /messages to {body.get('to')} {call.status} {text!r}"
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)
