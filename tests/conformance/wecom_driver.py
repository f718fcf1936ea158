"""The conformance kit's drivers for WeCom: callback mode over the fake WeCom
(tests/fakes/wecom_server.py), and robot mode over the fake robot long connection
(`WeComRobotDriver`, at the end).

What the driver plays is WeCom's behaviour for the self-built app docs/wecom.md sets up:

- Person n is a member of the corp within the app's visible range; their chat with the
  app is their DM. A self-built app's callback carries no group messages (an app chat
  it creates is written to, not read), so the kit's group scenarios are skipped.
- Each message is its own callback: encrypted XML POSTed to the gateway's
  /wecom/callback with `msg_signature`, `timestamp` and `nonce`. A 200 within 5 s
  delivers it; anything else is retried three times, signed afresh, with the same MsgId
  (WeCom: "总共重试三次"). WeCom does not publish when it retries; here after 5, 15 and
  30 s, so a gateway back within about 50 s gets what was written while it was down,
  and the kit's downtimes (kills, a stopped gateway's backlog) stay within that. A
  gateway down longer than WeCom's retries loses what was written meanwhile
  (docs/wecom.md says so).
- WeCom promises no order between callbacks; a person writing at a human pace sees
  theirs in order, so each conversation's messages are delivered one at a time, in
  order (tests/conformance/lanes.py), conversations in parallel.
- Replies go through message/send; its text is cut at 2,048 bytes, so a long reply must
  be split by the channel; `@all` as `touser` would notify everyone.
- The network: the gateway reaches WeCom's API through a TCP proxy, and WeCom reaches
  the callback through another; `platform_down` cuts both.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.conformance.lanes import Lanes
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.wecom_robot_server import FakeWeComRobot, Pushed
from tests.fakes.wecom_server import TEXT_LIMIT_BYTES, FakeWeCom, Fields

#: WeCom's three retries of a callback it got no 200 for (see the module docstring).
WECOM_RETRIES = (5.0, 15.0, 30.0)
ACK_TIMEOUT = 5.0
ROBOT_GROUP = "wrkSFfCgAAkitgroup"


class WeComDriver(ChannelDriver):
    """A WeCom self-built app in callback mode: encrypted, signed callbacks in,
    message/send out; `forge` posts a callback signed with a wrong Token."""

    name = "wecom"
    requirements = Requirements(
        groups=False,  # a self-built app's callback carries one-to-one chats only
        mentions=False,
        threads=False,
        edits=False,  # WeCom has none for an app (a message can only be recalled)
        duplicate_delivery=True,  # a retried callback keeps its MsgId
        catch_up=True,  # within WeCom's three retries (see the module docstring)
        strangers=True,  # any member in the app's visible range may write
        signed_inbound=True,  # msg_signature with the callback Token, AES with the corp id
        split_long_replies=True,  # at 2,048 bytes (the kit's texts are ASCII)
        mass_pings=True,  # touser "@all"; the channel sends to the member only
        platform_outage=True,
    )
    max_message_length = TEXT_LIMIT_BYTES

    def __init__(self) -> None:
        self._fake: FakeWeCom | None = None
        self._api: TcpProxy | None = None
        self._inbound: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._port = 0
        self._people: dict[int, str] = {}
        self._messages: dict[str, Fields] = {}  # by MsgId: what `redeliver` sends

    @property
    def fake(self) -> FakeWeCom:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: WeCom calls the URL saved in the console
        with FakeWeCom.in_thread(retry_delays=WECOM_RETRIES, ack_timeout=ACK_TIMEOUT) as fake:
            api = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            inbound = TcpProxy("127.0.0.1", self._port)
            api.restore()
            inbound.restore()
            fake.callback_url = f"http://127.0.0.1:{inbound.port}/wecom/callback"
            lanes = Lanes(self.fake_deliver, name="kit-wecom")
            self._fake, self._api, self._inbound, self._lanes = fake, api, inbound, lanes
            lanes.start()
            self._people, self._messages = {}, {}
            try:
                yield
            finally:
                lanes.stop()
                fake.callback_url = None
                api.close()
                inbound.close()
                self._fake = self._api = self._inbound = self._lanes = None

    async def fake_deliver(self, fields: Fields) -> None:
        await self.fake.deliver(fields)

    def gateway_env(self) -> dict[str, str]:
        assert self._api is not None
        fake = self.fake
        prefix = "GATEWAY_CHANNELS__WECOM__"
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            f"{prefix}ENABLED": "true",
            f"{prefix}CORP_ID": fake.corp_id,
            f"{prefix}AGENT_ID": str(fake.agent_id),
            f"{prefix}SECRET": fake.secret,
            f"{prefix}TOKEN": fake.callback_token,
            f"{prefix}ENCODING_AES_KEY": fake.encoding_aes_key,
            f"{prefix}API_URL": f"http://127.0.0.1:{self._api.port}",
            f"{prefix}DM_POLICY": "open",
            f"{prefix}GROUP_POLICY": "open",
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

    def dm(self, person: int, text: str) -> MessageRef:
        user = self._person(person)
        fields = self.fake.text_message(user, text)
        self._messages[fields["MsgId"]] = fields
        assert self._lanes is not None
        self._lanes.put(user, fields)
        return MessageRef(fields["MsgId"], Place(user), user, fields["MsgId"])

    def redeliver(self, ref: MessageRef) -> None:
        assert self._lanes is not None
        self._lanes.put(ref.place.conversation, dict(self._messages[ref.event]))

    def forge(self, text: str) -> bool:
        fields = self.fake.text_message(self._person(999), text)
        url = f"http://127.0.0.1:{self._port}/wecom/callback"
        status, _ = asyncio.run(self.fake.post(url, fields, token="not-the-callback-token"))
        return status in (401, 403)

    def ping_everyone_text(self) -> str:
        return "@all"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        return [Post(Place(s.to), s.text, pings_everyone=s.pings_everyone) for s in self.fake.sent]

    def delivering(self) -> bool:
        """WeCom still retries a callback the gateway has not answered 200."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            attempts = ", ".join(
                f"{a.sent_at:.3f} {a.status} {a.failure or 'delivered'}" for a in delivery.attempts
            )
            what = delivery.fields.get("Content", "")[:60]
            yield f"delivery {delivery.number} {delivery.fields.get('MsgId')} {what!r}: {attempts}"
        for call in self.fake.calls:
            if call.method == "message/send":
                text = str((call.body.get("text") or {}).get("content"))[:40]
                yield (
                    f"{call.at:.3f} send to {call.body.get('touser')} {dict(call.answer)} {text!r}"
                )
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)


class WeComRobotDriver(ChannelDriver):
    """A WeCom intelligent robot over its long connection (tests/fakes/
    wecom_robot_server.py): person n is a member who chats with the robot one-to-one;
    the group is one group chat the robot is in, where a message reaches the robot only
    when it @-mentions it (WeCom pushes nothing else). The long connection has no receipt
    and WeCom keeps nothing for a robot that is not connected, so nothing written while
    the gateway is down reaches it: no catch-up, and the kill and outage scenarios are
    skipped (docs/wecom.md, "Robot mode")."""

    name = "wecom"
    requirements = Requirements(
        groups=True,
        mentions=True,  # only @-mentions are pushed to the robot
        threads=False,
        edits=False,
        duplicate_delivery=True,  # the same msgid pushed again
        catch_up=False,  # nothing kept while the robot is not connected
        strangers=True,
        signed_inbound=False,  # nothing comes over HTTP: the connection is the gateway's own
        split_long_replies=True,  # 20,480 bytes (the kit's texts are ASCII)
        mass_pings=False,  # the robot's markdown documents no mention of everyone
        platform_outage=False,  # what is pushed to a dropped connection is gone
    )
    max_message_length = 20480

    def __init__(self) -> None:
        self._fake: FakeWeComRobot | None = None
        self._people: dict[int, str] = {}
        self._pushed: dict[str, Pushed] = {}

    @property
    def fake(self) -> FakeWeComRobot:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeWeComRobot.in_thread() as fake:
            self._fake, self._people, self._pushed = fake, {}, {}
            try:
                yield
            finally:
                self._fake = None

    def gateway_env(self) -> dict[str, str]:
        fake, prefix = self.fake, "GATEWAY_CHANNELS__WECOM__"
        return {
            f"{prefix}ENABLED": "true",
            f"{prefix}MODE": "robot",
            f"{prefix}BOT_ID": fake.bot_id,
            f"{prefix}BOT_SECRET": fake.secret,
            f"{prefix}WS_URL": fake.ws_url,
            f"{prefix}DM_POLICY": "open",
            f"{prefix}GROUP_POLICY": "open",
        }

    def _person(self, person: int) -> str:
        return self._people.setdefault(person, f"member{person:03d}")

    def _ref(self, pushed: Pushed) -> MessageRef:
        self._pushed[pushed.msgid] = pushed
        return MessageRef(pushed.msgid, Place(pushed.chat), pushed.user, pushed.msgid)

    def dm(self, person: int, text: str) -> MessageRef:
        return self._ref(self.fake.write(self._person(person), text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        pushed = self.fake.write(self._person(person), text, group=ROBOT_GROUP, mention=mention)
        return self._ref(pushed)

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.push_again(self._pushed[ref.event])

    def bot_posts(self) -> list[Post]:
        return [
            Post(Place(s.chat), s.text, reply_to=s.reply_to, mentions=s.mentions)
            for s in self.fake.sent
        ]

    def platform_log(self) -> Iterator[str]:
        for p in self.fake.pushed:
            how = p.req_id or "NOT PUSHED"
            yield f"pushed {p.msgid} in {p.chat} by {p.user}: {how} {p.text[:50]!r}"
        for s in self.fake.sent:
            yield f"{s.at:.3f} {s.how} to {s.chat} re {s.reply_to}: {s.text[:50]!r}"
