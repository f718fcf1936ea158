"""The conformance kit's driver for QQ, over the fake OneBot v11 implementation
(tests/fakes/onebot_server.py, NapCat's forward WebSocket).

People write through FakeOneBot as their QQ clients would (a private chat with the bot,
which every person has as a friend, or the kit's group, where a mention is an `at`
segment naming the bot), and the bot's messages are read back from the fake's record.
The gateway reaches the fake through a TCP proxy, which `platform_down` cuts (every
connection drops, new ones are refused).

What QQ over OneBot can do, as the channel meets it (`requirements`):
- groups and mentions (an `at` of the bot, or a quote of its message): yes; threads: no
  (QQ has none); edits: no (QQ has recalls, not edits);
- duplicate delivery: yes: a message reaches the channel twice when the read-back after
  a connection meets one delivered live, or when the implementation writes an event
  twice (two network adapters); `redeliver` has the fake write the event again;
- catch-up: yes, as far as the implementation's history reaches (NapCat and
  Lagrange.OneBot have `get_group_msg_history` and `get_friend_msg_history`; OneBot
  itself keeps nothing for a client that is away): what was written while the gateway
  was down is read back after the next connection. With an implementation without that
  history it would be False (docs/qq.md says what is promised then);
- strangers: yes (private-chat pairing); signed inbound: no (the gateway connects out
  to the implementation: nothing comes in that anyone could forge);
- long replies are split (QQ publishes no limit; the channel's `max_message_chars` is
  3,000 by default and the fake refuses text over 4,500); `at all` (`[CQ:at,qq=all]` in
  a string message) pings everyone; the network can be cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from channels.qq.settings import MAX_MESSAGE_CHARS
from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.onebot_server import DEFAULT_TOKEN, FakeOneBot, Record
from tests.fakes.tcp_proxy import TcpProxy

GROUP = 880001
#: Person n is QQ number BASE + n.
BASE = 20000


class QQDriver(ChannelDriver):
    """QQ: private chats with friends, and one group."""

    name = "qq"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=False,
        edits=False,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=False,
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )
    max_message_length = MAX_MESSAGE_CHARS

    def __init__(self) -> None:
        self._fake: FakeOneBot | None = None
        self._proxy: TcpProxy | None = None
        self._people: set[int] = set()

    @property
    def fake(self) -> FakeOneBot:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeOneBot.in_thread(access_token=DEFAULT_TOKEN) as fake:
            proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            proxy.restore()
            self._fake, self._proxy = fake, proxy
            self._people = set()
            fake.add_group(GROUP, "kit-town", {})
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        return {
            "GATEWAY_CHANNELS__QQ__ENABLED": "true",
            "GATEWAY_CHANNELS__QQ__URL": f"ws://127.0.0.1:{self._proxy.port}",
            "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN": DEFAULT_TOKEN,
            "GATEWAY_CHANNELS__QQ__DM_POLICY": "open",
            "GATEWAY_CHANNELS__QQ__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> int:
        """Person n's QQ number: a friend of the bot and a member of the group."""
        qq = BASE + person
        if qq not in self._people:
            self.fake.add_friend(qq, f"Person {person}")
            self.fake.groups[GROUP]["members"].add(qq)
            self._people.add(qq)
        return qq

    @staticmethod
    def _ref(record: Record) -> MessageRef:
        return MessageRef(
            id=str(record.message_id),
            place=Place(record.conversation),
            sender=str(record.sender),
            event=str(record.message_id),
        )

    def dm(self, person: int, text: str) -> MessageRef:
        return self._ref(self.fake.user_message(self._person(person), text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        qq = self._person(person)
        message = self.fake.mention(text) if mention else text
        return self._ref(self.fake.user_message(qq, message, group_id=GROUP))

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.redeliver(int(ref.id))

    def ping_everyone_text(self) -> str:
        return "[CQ:at,qq=all]"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for record in self.fake.bot_messages():
            quoted = next(
                (str(s["data"]["id"]) for s in record.segments if s["type"] == "reply"), None
            )
            mentioned = frozenset(
                str(s["data"]["qq"])
                for s in record.segments
                if s["type"] == "at" and str(s["data"].get("qq")) != "all"
            )
            shown = "".join(
                str(s["data"].get("text", ""))
                if s["type"] == "text"
                else f"@{self.fake.names.get(int(s['data']['qq']), s['data']['qq'])}"
                if s["type"] == "at" and str(s["data"].get("qq")).isdigit()
                else ""
                for s in record.segments
            )
            posts.append(
                Post(
                    place=Place(record.conversation),
                    text=shown,
                    reply_to=quoted,
                    mentions=mentioned,
                    pings_everyone=record.pings_everyone,
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for call in self.fake.calls:
            yield f"{call.at:.3f} {call.path} {call.method} -> {call.status} {call.retcode}"
        for path, event in list(self.fake.events_sent):
            yield f"event to {path}: {event.get('message_type')} {event.get('message_id')}"
