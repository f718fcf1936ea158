"""The conformance kit's driver for DingTalk, over the fake DingTalk
(tests/fakes/dingtalk_server.py), in stream mode.

What the driver plays is DingTalk's behaviour for the app docs/dingtalk.md sets up:

- Person n is a member of the organization with a userId of their own and a one-to-one
  chat with the robot; everyone writes in one group the robot is in. DingTalk hands the
  robot only the group messages that @ it: the kit's chatter (`mention=False`) is stored
  in the group and never pushed, so the gateway cannot store or answer it.
- DingTalk has no threads a robot sees, and tells a robot of no edits.
- A reply in the group @s its sender (`at.atUserIds`); a one-to-one reply is a message in
  that chat. `isAtAll` notifies everyone; the text `@所有人` alone does not.
- Delivery: a callback is acked by a frame with code 200; a callback that gets no ack
  in time, and one finding no connection open, is pushed again. DingTalk does not
  publish its schedule; the fake pushes again after 1.5 s, then every 3 s for a minute
  and a half (`KIT_RETRIES`), so that the pushes span every downtime of the kit. A
  gateway down for longer than DingTalk keeps pushing loses what was written meanwhile
  (docs/dingtalk.md, "Delivery").
- DingTalk promises no order for callbacks that close together; a person writing at a
  human pace sees theirs in order, so each conversation's callbacks are pushed one at a
  time, in order (tests/conformance/lanes.py), conversations in parallel.
- The network: the gateway reaches DingTalk (the API, the stream endpoint and the session
  webhooks, all named by the fake at the proxy's address) through a TCP proxy, which
  `platform_down` cuts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.conformance.lanes import Lanes
from tests.fakes._serving import free_port
from tests.fakes.dingtalk_server import FakeDingTalk
from tests.fakes.tcp_proxy import TcpProxy

KIT_RETRIES = (1.5, *itertools.repeat(3.0, 30))
ACK_TIMEOUT = 3.0
#: The channel's part size (`channels.dingtalk.part_chars`, its default).
PART_CHARS = 3500


class DingTalkDriver(ChannelDriver):
    """DingTalk's stream mode: callbacks pushed as frames on the gateway's own WebSocket
    (through the proxy), pushed again until a frame acks them."""

    name = "dingtalk"
    max_message_length = PART_CHARS
    requirements = Requirements(
        groups=True,
        mentions=True,  # only an @ of the robot reaches it
        threads=False,
        edits=False,
        duplicate_delivery=True,  # a callback pushed again that got no ack in time
        catch_up=True,  # within DingTalk's re-pushes (see the module docstring)
        strangers=True,
        signed_inbound=False,  # the connection is the app's own (its secret): nothing to forge
        split_long_replies=True,
        mass_pings=True,  # at.isAtAll
        platform_outage=True,
    )

    def __init__(self) -> None:
        self._fake: FakeDingTalk | None = None
        self._proxy: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._people: dict[int, str] = {}
        self._group = ""
        self._callbacks: dict[str, dict[str, Any]] = {}  # by msgId, for `redeliver`

    @property
    def fake(self) -> FakeDingTalk:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeDingTalk.in_thread(retry_delays=KIT_RETRIES, ack_timeout=ACK_TIMEOUT) as fake:
            proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]), port=free_port())
            proxy.restore()
            fake.public_url = f"http://127.0.0.1:{proxy.port}"
            lanes = Lanes(self._deliver, name="kit-dingtalk")
            lanes.start()
            self._fake, self._proxy, self._lanes = fake, proxy, lanes
            self._people, self._callbacks = {}, {}
            self._group = fake.group("kit group")
            try:
                yield
            finally:
                lanes.stop()
                proxy.close()
                self._fake = self._proxy = self._lanes = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        prefix = "GATEWAY_CHANNELS__DINGTALK__"
        return {
            f"{prefix}ENABLED": "true",
            f"{prefix}CLIENT_ID": self.fake.client_id,
            f"{prefix}CLIENT_SECRET": self.fake.client_secret,
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

    async def _deliver(self, data: dict[str, Any]) -> None:
        await self.fake.deliver(data)

    def _person(self, person: int) -> str:
        if person not in self._people:
            self._people[person] = self.fake.add_person(f"Person {person}")
        return self._people[person]

    def _hand_over(
        self, msg_id: str, data: dict[str, Any] | None, place: Place, user: str
    ) -> MessageRef:
        ref = MessageRef(msg_id, place, user, msg_id)
        if data is not None:
            self._callbacks[msg_id] = data
            assert self._lanes is not None
            self._lanes.put(str(place), data)
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        user = self._person(person)
        conversation = self.fake.dm(user)
        msg_id, data = self.fake.write(conversation, user, text)
        return self._hand_over(msg_id, data, Place(conversation), user)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        user = self._person(person)
        msg_id, data = self.fake.write(self._group, user, text, mention=mention)
        return self._hand_over(msg_id, data, Place(self._group), user)

    def redeliver(self, ref: MessageRef) -> None:
        assert self._lanes is not None
        self._lanes.put(str(ref.place), self._callbacks[ref.event])

    def ping_everyone_text(self) -> str:
        return "@所有人 @all"

    # -- what the robot posted ----------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        return [
            Post(
                place=Place(message.conversation_id),
                text=message.text,
                reply_to=None,
                mentions=frozenset(message.at_users),
                pings_everyone=message.at_all,
            )
            for message in self.fake.bot_messages()
        ]

    def delivering(self) -> bool:
        """DingTalk still pushes a callback the gateway has not acked."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            text = str(delivery.data.get("text"))[:60]
            attempts = ", ".join(f"{a.sent_at:.3f} {a.outcome}" for a in delivery.attempts)
            yield f"callback {delivery.data.get('msgId')} {text}: {attempts}"
        for call in self.fake.calls:
            if call.method != "POST /v1.0/oauth2/accessToken":
                yield f"{call.at:.3f} {call.method} {call.status} code={call.code}"
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)
