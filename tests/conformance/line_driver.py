"""The conformance kit's driver for LINE, over the fake LINE Platform
(tests/fakes/line_server.py).

What the driver plays is LINE's behaviour (docs/line.md):

- Person n is a LINE user of their own, who has added the bot as a friend; their
  one-on-one chat is their DM. The group is one LINE group chat with the bot in it; a
  person addresses the bot by @-mentioning it (LINE's `mention` with `isSelf`). LINE has
  no threads and no edits (a message can only be unsent).
- Each message is its own webhook request, signed with the channel secret
  (`x-line-signature`), POSTed to the gateway's /line/webhook. A 2xx within 3 s delivers
  it; anything else is delivered again, with `isRedelivery: true` and the same event,
  because the driver turns the console's "Webhook redelivery" on, as docs/line.md asks:
  after 0.25, 0.5, 1 and 2 s, then every 2 s for two minutes (LINE does not publish its
  schedule; here fast, and long enough for every downtime of the kit). Without
  redelivery, LINE drops a request the gateway did not take: `catch_up` and
  `duplicate_delivery` hold only with it on.
- LINE promises no order between requests; a person writing at a human pace sees theirs
  in order, so each conversation's messages are delivered one at a time, in order
  (tests/conformance/lanes.py), conversations in parallel.
- A reply token is good for a minute: the backlog and kill scenarios' replies come after
  that, so they are pushed, with retry keys (the fake's quota is unlimited here).
- The network: the gateway reaches the Messaging API through a TCP proxy, and LINE
  reaches the webhook through another; `platform_down` cuts both.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.conformance.lanes import Lanes
from tests.fakes._serving import free_port
from tests.fakes.line_server import TEXT_LIMIT, FakeLine, Payload
from tests.fakes.tcp_proxy import TcpProxy

#: LINE's redeliveries of a request that got no 2xx, compressed (see the module docstring).
LINE_RETRIES = (0.25, 0.5, 1.0, 2.0, *itertools.repeat(2.0, 60))
ACK_TIMEOUT = 3.0


class LineDriver(ChannelDriver):
    """A LINE Official Account over the Messaging API: signed webhook requests in, reply
    and push out; `forge` posts a request signed with a wrong secret."""

    name = "line"
    requirements = Requirements(
        groups=True,  # group chats (and multi-person rooms)
        mentions=True,  # mention.mentionees[].isSelf, or quoting the bot's message
        threads=False,  # LINE has none
        edits=False,  # LINE has none: a message can only be unsent
        duplicate_delivery=True,  # webhook redelivery sends an event again
        catch_up=True,  # only with webhook redelivery on (docs/line.md)
        strangers=True,
        signed_inbound=True,  # x-line-signature with the channel secret
        split_long_replies=True,  # at 5,000 characters
        mass_pings=True,  # a textV2 {all} mention; the channel sends only plain text
        platform_outage=True,
    )
    max_message_length = TEXT_LIMIT

    def __init__(self) -> None:
        self._fake: FakeLine | None = None
        self._api: TcpProxy | None = None
        self._inbound: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._port = 0
        self._people: dict[int, str] = {}
        self._group = ""
        self._payloads: dict[str, Payload] = {}  # by message id: what `redeliver` sends

    @property
    def fake(self) -> FakeLine:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: LINE delivers to the URL set in the console
        with FakeLine.in_thread(retry_delays=LINE_RETRIES, ack_timeout=ACK_TIMEOUT) as fake:
            api = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            inbound = TcpProxy("127.0.0.1", self._port)
            api.restore()
            inbound.restore()
            fake.webhook_url = f"http://127.0.0.1:{inbound.port}/line/webhook"
            lanes = Lanes(self._deliver, name="kit-line")
            lanes.start()
            self._fake, self._api, self._inbound, self._lanes = fake, api, inbound, lanes
            self._people, self._payloads = {}, {}
            self._group = fake.add_group([])
            try:
                yield
            finally:
                lanes.stop()
                fake.webhook_url = None
                api.close()
                inbound.close()
                self._fake = self._api = self._inbound = self._lanes = None

    def gateway_env(self) -> dict[str, str]:
        assert self._api is not None
        fake = self.fake
        root = f"http://127.0.0.1:{self._api.port}"
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            "GATEWAY_CHANNELS__LINE__ENABLED": "true",
            "GATEWAY_CHANNELS__LINE__CHANNEL_ACCESS_TOKEN": fake.token,
            "GATEWAY_CHANNELS__LINE__CHANNEL_SECRET": fake.channel_secret,
            "GATEWAY_CHANNELS__LINE__API_URL": root,
            "GATEWAY_CHANNELS__LINE__DATA_API_URL": root,
            "GATEWAY_CHANNELS__LINE__DM_POLICY": "open",
            "GATEWAY_CHANNELS__LINE__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._api is not None and self._inbound is not None
        self._inbound.cut()
        self._api.cut()

    def platform_up(self) -> None:
        assert self._api is not None and self._inbound is not None
        self._api.restore()
        self._inbound.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> str:
        user = self._people.get(person)
        if user is None:
            user = self._people[person] = self.fake.add_user(f"Person {person}")
        return user

    async def _deliver(self, payload: Payload) -> None:
        await self.fake.deliver(payload)

    def _write(self, lane: str, place: str, payload: Payload) -> MessageRef:
        [event] = payload["events"]
        message_id = str(event["message"]["id"])
        self._payloads[message_id] = payload
        assert self._lanes is not None
        self._lanes.put(lane, payload)
        return MessageRef(message_id, Place(place), str(event["source"]["userId"]), message_id)

    def dm(self, person: int, text: str) -> MessageRef:
        user = self._person(person)
        return self._write(user, user, self.fake.text_message(user, text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        user = self._person(person)
        payload = self.fake.text_message(user, text, group=self._group, mention=mention)
        return self._write(self._group, self._group, payload)

    def redeliver(self, ref: MessageRef) -> None:
        payload = copy.deepcopy(self._payloads[ref.event])
        for event in payload["events"]:
            event["deliveryContext"] = {"isRedelivery": True}
        assert self._lanes is not None
        self._lanes.put(ref.place.conversation, payload)

    def forge(self, text: str) -> bool:
        payload = self.fake.text_message(self._person(999), text)
        url = f"http://127.0.0.1:{self._port}/line/webhook"
        status, _ = asyncio.run(self.fake.post(url, payload, secret="not-the-channel-secret"))
        return status in (401, 403)

    def ping_everyone_text(self) -> str:
        return "@All"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        return [
            Post(
                Place(s.chat),
                s.text,
                reply_to=s.quoted,
                mentions=s.mentions,
                pings_everyone=s.pings_everyone,
            )
            for s in self.fake.sent
        ]

    def delivering(self) -> bool:
        """The platform still retries an event the gateway has not acknowledged."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            events: Any = delivery.payload.get("events") or ()
            what = [str(e.get("message", {}).get("text"))[:60] for e in events]
            attempts = ", ".join(
                f"{a.sent_at:.3f} {a.status} {a.failure or 'delivered'}" for a in delivery.attempts
            )
            yield f"delivery {delivery.number} {what}: {attempts}"
        for call in self.fake.calls:
            if call.method in ("POST reply", "POST push"):
                texts = [str(m.get("text"))[:40] for m in call.body.get("messages") or ()]
                yield (
                    f"{call.at:.3f} {call.method} to {call.body.get('to', '-')} {call.status} "
                    f"key={call.headers.get('x-line-accepted-request-id', '-')} {texts!r}"
                )
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)
