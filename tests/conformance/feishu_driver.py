"""The conformance kit's drivers for Feishu / Lark, over the fake Feishu
(tests/fakes/feishu_server.py): the long connection (`FeishuWebSocketDriver`) and HTTP
callbacks (`FeishuWebhookDriver`), the channel's two modes.

What the drivers play is Feishu's behaviour for the app docs/feishu.md sets up:

- Person n has an open_id of their own and a direct (p2p) chat with the bot; everyone
  writes in one group the bot is in. The app holds the scope to receive all group
  messages, so chatter in the group is pushed to the gateway too (and screened there); a
  mention is Feishu's `@_user_1` key with the bot's open_id in `mentions`.
- The kit's thread n is a topic under a message someone else posted in the group (a
  reply "in thread" to it); a mention there is answered in that thread. A top-level
  mention is answered by a reply quoting it, in the group.
- Feishu tells a bot of no edits (no `im.message.*` event carries one): `edits` is off.
- Feishu's delivery rules: an event is acknowledged by an answer frame with code 200
  (long connection) or an HTTP 200 (callbacks) within 3 s; anything else, and an event
  finding no connection open, is pushed again after 15 s, 5 minutes, 1 hour and 6 hours,
  then dropped. Here after 1.5 s, then every 3 s for a minute and a half
  (`KIT_RETRIES`): faster, so that each push comes within the kit's 15 s of patience,
  and more often, so that the pushes span every downtime of the kit (four kills and
  restarts on a busy machine take most of a minute), as Feishu's span about 7 hours. A
  gateway down for longer than the pushes reach loses what was written meanwhile, here
  as on Feishu (docs/feishu.md, section 6); tests/test_fake_feishu.py holds the fake to
  Feishu's own count of four re-pushes.
- Feishu promises no order for events that close together; a person writing at a human
  pace sees theirs in order, so each conversation's events are pushed one at a time, in
  order (tests/conformance/lanes.py), conversations in parallel.
- The network: the gateway reaches the open platform (the API, the endpoint discovery and
  the long connection it names) through a TCP proxy; with callbacks, Feishu reaches
  `/feishu/events` through another. `platform_down` cuts both.
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
from tests.fakes.feishu_server import FakeFeishu, Payload
from tests.fakes.tcp_proxy import TcpProxy

#: Feishu's re-pushes (15 s, 5 min, 1 h, 6 h), compressed (see the module docstring).
KIT_RETRIES = (1.5, *itertools.repeat(3.0, 30))
ACK_TIMEOUT = 3.0
#: The channel's part size (`channels.feishu.part_chars`, its default): a post holds 30 KB.
PART_CHARS = 4000


class FeishuDriver(ChannelDriver):
    """What both modes share: the fake, its people and chats, the bot's messages."""

    name = "feishu"
    max_message_length = PART_CHARS
    mode = "websocket"

    def __init__(self) -> None:
        self._fake: FakeFeishu | None = None
        self._proxy: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._people: dict[int, str] = {}
        self._group = ""
        self._roots: dict[int, str] = {}  # the kit's thread n: its root message
        self._events: dict[str, Payload] = {}  # by event_id, for `redeliver`

    @property
    def fake(self) -> FakeFeishu:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeFeishu.in_thread(
            mode=self.mode, retry_delays=KIT_RETRIES, ack_timeout=ACK_TIMEOUT
        ) as fake:
            proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]), port=free_port())
            proxy.restore()
            lanes = Lanes(self._deliver, name=f"kit-feishu-{self.mode}")
            lanes.start()
            self._fake, self._proxy, self._lanes = fake, proxy, lanes
            self._people, self._roots, self._events = {}, {}, {}
            self._group = fake.group_chat("kit group", [])
            try:
                with self._serving():
                    yield
            finally:
                lanes.stop()
                proxy.close()
                self._fake = self._proxy = self._lanes = None

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """What a mode adds around the running platform."""
        yield

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        prefix = "GATEWAY_CHANNELS__FEISHU__"
        return {
            f"{prefix}ENABLED": "true",
            f"{prefix}MODE": self.mode,
            f"{prefix}APP_ID": self.fake.app_id,
            f"{prefix}APP_SECRET": self.fake.app_secret,
            f"{prefix}API_URL": f"http://127.0.0.1:{self._proxy.port}",
            f"{prefix}PART_CHARS": str(PART_CHARS),
            f"{prefix}DM_POLICY": "open",
            f"{prefix}GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    async def _deliver(self, envelope: Payload) -> None:
        await self.fake.deliver(envelope)

    def _person(self, person: int) -> str:
        if person not in self._people:
            open_id = self.fake.add_person(f"Person {person}")
            self._people[person] = open_id
            self.fake.join(self._group, open_id)
        return self._people[person]

    def _hand_over(self, envelope: Payload, place: Place) -> MessageRef:
        message = envelope["event"]["message"]
        sender = envelope["event"]["sender"]["sender_id"]["open_id"]
        ref = MessageRef(str(message["message_id"]), place, sender, envelope["header"]["event_id"])
        self._events[ref.event] = envelope
        assert self._lanes is not None
        self._lanes.put(str(place), envelope)
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        sender = self._person(person)
        chat = self.fake.p2p_chat(sender)
        return self._hand_over(self.fake.user_message(chat, sender, text), Place(chat))

    def _root(self, thread: int) -> str:
        if thread not in self._roots:
            starter = self._person(900 + thread)
            envelope = self.fake.user_message(self._group, starter, f"thread {thread} here")
            self._roots[thread] = str(envelope["event"]["message"]["message_id"])
            self._hand_over(envelope, Place(self._group))  # chatter: pushed, screened
        return self._roots[thread]

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        sender = self._person(person)
        mentions = [self.fake.bot_open_id] if mention else []
        root = None if thread is None else self._root(thread)
        envelope = self.fake.user_message(
            self._group, sender, text, mention=mentions, thread_of=root
        )
        thread_id = envelope["event"]["message"].get("thread_id") or None
        return self._hand_over(envelope, Place(self._group, thread_id))

    def redeliver(self, ref: MessageRef) -> None:
        assert self._lanes is not None
        self._lanes.put(str(ref.place), self._events[ref.event])

    def ping_everyone_text(self) -> str:
        return '<at user_id="all"></at> <at id=all></at>'

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for message in self.fake.bot_messages():
            mentions, everyone = FakeFeishu.notifies(message)
            posts.append(
                Post(
                    place=Place(message.chat_id, message.thread_id or None),
                    text=FakeFeishu.rendered(message),
                    reply_to=message.parent_id or None,
                    mentions=mentions,
                    pings_everyone=everyone,
                )
            )
        return posts

    def delivering(self) -> bool:
        """The platform still retries an event the gateway has not acknowledged."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            message: Any = delivery.envelope.get("event", {}).get("message", {})
            text = str(message.get("content"))[:60]
            attempts = ", ".join(f"{a.sent_at:.3f} {a.outcome}" for a in delivery.attempts)
            yield f"event {delivery.event_id} {message.get('message_id')} {text}: {attempts}"
        for call in self.fake.calls:
            if call.method.startswith(("POST /im/", "PUT /im/")):
                yield (
                    f"{call.at:.3f} {call.method} {call.status} code={call.code} "
                    f"uuid={call.body.get('uuid')} {str(call.body.get('content'))[:80]!r}"
                )
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)


class FeishuWebSocketDriver(FeishuDriver):
    """Feishu's long connection: events pushed as frames on the gateway's own WebSocket
    (through the proxy), pushed again until a frame answers them with code 200."""

    mode = "websocket"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=False,  # Feishu tells a bot of no edits
        duplicate_delivery=True,  # a re-push of an event that got no answer in time
        catch_up=True,  # within Feishu's re-pushes (see the module docstring)
        strangers=True,
        signed_inbound=False,  # the connection is the app's own (its secret): nothing to forge
        split_long_replies=True,
        mass_pings=True,  # <at user_id="all"></at>
        platform_outage=True,
    )


class FeishuWebhookDriver(FeishuDriver):
    """Feishu's HTTP callbacks: each event POSTed, encrypted and signed with the Encrypt
    Key, to the gateway's /feishu/events through a proxy; `forge` signs one with a wrong
    key."""

    mode = "webhook"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=False,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=True,  # X-Lark-Signature and AES with the Encrypt Key
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )

    def __init__(self) -> None:
        super().__init__()
        self._port = 0
        self._inbound: TcpProxy | None = None

    @contextmanager
    def _serving(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Feishu posts to the address the app set
        inbound = TcpProxy("127.0.0.1", self._port, port=free_port())
        inbound.restore()
        self._inbound = inbound
        self.fake.webhook_url = f"http://127.0.0.1:{inbound.port}/feishu/events"
        try:
            yield
        finally:
            inbound.close()
            self._inbound = None

    def gateway_env(self) -> dict[str, str]:
        prefix = "GATEWAY_CHANNELS__FEISHU__"
        return super().gateway_env() | {
            "GATEWAY_HTTP__PORT": str(self._port),
            f"{prefix}ENCRYPT_KEY": self.fake.encrypt_key,
            f"{prefix}VERIFICATION_TOKEN": self.fake.verification_token,
        }

    def platform_down(self) -> None:
        assert self._inbound is not None
        self._inbound.cut()
        super().platform_down()

    def platform_up(self) -> None:
        super().platform_up()
        assert self._inbound is not None
        self._inbound.restore()

    def forge(self, text: str) -> bool:
        sender = self._person(999)
        envelope = self.fake.user_message(self.fake.p2p_chat(sender), sender, text)
        body, headers = self.fake.callback_request(envelope, encrypt_key="not-the-encrypt-key")
        url = f"http://127.0.0.1:{self._port}/feishu/events"
        status, _ = asyncio.run(self.fake.post_callback(url, body, headers))
        return status in (401, 403)
