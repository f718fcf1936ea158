"""The conformance kit's driver for Google Chat, over the fake Google Chat (tests/fakes).

People write through FakeGoogleChat as their clients would (a message in their direct
message with the app, in the kit's space, or in one of its threads, mentioning the app
or not), and Google Chat's side POSTs the events it would send to the gateway's
endpoint, signed. The bot's messages are read back from the fake's record as they are
now (a streamed message edited in place is one post). The gateway reaches the Chat API,
the token endpoint and Google's keys through a TCP proxy, which `platform_down` cuts.

What Google Chat can do, as the channel meets it (`requirements`):
- groups, mentions (`@Kit Bot`, a USER_MENTION annotation), threads (`threadReply`):
  yes. In a space Google Chat sends the app only what mentions it, so the busy rooms'
  chatter never reaches the gateway at all;
- edits: no: Google Chat sends an HTTP-endpoint app no event when a message is edited;
- duplicate delivery: yes. Google documents no retry, but the same event can reach the
  endpoint twice (a proxy or load balancer in front of it repeating a POST whose answer
  it lost); `redeliver` has the fake POST a message's event again;
- catch-up: no. Google Chat sends each event once and never again: a message written
  while the gateway is stopped, or whose request fails, never reaches it (the person
  sees that the app is not responding). So the scenarios that write while the gateway
  is down, or kill it while people write, do not apply; docs/googlechat.md says what is
  promised instead;
- strangers: yes (DM pairing); signed inbound: yes (every request carries Google's
  bearer JWT; `forge` POSTs one signed by a key Google does not publish);
- long replies are split at 32,000 bytes (the kit's texts are ASCII: characters are
  bytes); `<users/all>` pings everyone; the network to the Chat API can be cut: the
  gateway's requests fail while Google Chat still delivers events (the cut is of the
  gateway's egress, or a Chat API outage).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes._serving import free_port
from tests.fakes.googlechat_server import (
    CHAT_CERTS_PATH,
    MAX_MESSAGE_BYTES,
    OIDC_CERTS_PATH,
    TOKEN_PATH,
    FakeGoogleChat,
    mentions_of,
)
from tests.fakes.tcp_proxy import TcpProxy

PEOPLE = 12  # person n is "Person n"; 99 opens the threads
THREAD_OPENER = 99
PREFIX = "GATEWAY_CHANNELS__GOOGLECHAT__"


def space_id(name: str) -> str:
    return name.removeprefix("spaces/")


class GoogleChatDriver(ChannelDriver):
    """Google Chat: direct messages, a space and its threads."""

    name = "googlechat"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=False,
        duplicate_delivery=True,
        catch_up=False,
        strangers=True,
        signed_inbound=True,
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )
    max_message_length = MAX_MESSAGE_BYTES

    def __init__(self) -> None:
        self._fake: FakeGoogleChat | None = None
        self._proxy: TcpProxy | None = None
        self._port = 0
        self._people: dict[int, str] = {}
        self._dms: dict[int, str] = {}
        self._space = ""
        self._threads: dict[int, str] = {}

    @property
    def fake(self) -> FakeGoogleChat:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Google Chat posts to the URL configured
        with FakeGoogleChat.in_thread() as fake:
            port = int(fake.url.rsplit(":", 1)[1])
            proxy = TcpProxy("127.0.0.1", port)
            proxy.restore()
            self._fake, self._proxy = fake, proxy
            self._people, self._dms, self._threads = {}, {}, {}
            fake.webhook_url = f"http://127.0.0.1:{self._port}/googlechat/events"
            members = [self._person(n) for n in (*range(PEOPLE), THREAD_OPENER)]
            self._space = str(fake.create_space("Kit town", members)["name"])
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        via = f"http://127.0.0.1:{self._proxy.port}"
        key = self.fake.service_account_info(token_uri=f"{via}{TOKEN_PATH}")
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            f"{PREFIX}ENABLED": "true",
            f"{PREFIX}AUDIENCE": self.fake.audience,
            f"{PREFIX}SERVICE_ACCOUNT_KEY": json.dumps(key),
            f"{PREFIX}API_URL": via,
            f"{PREFIX}CHAT_CERTS_URL": f"{via}{CHAT_CERTS_PATH}",
            f"{PREFIX}GOOGLE_CERTS_URL": f"{via}{OIDC_CERTS_PATH}",
            f"{PREFIX}DM_POLICY": "open",
            f"{PREFIX}GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> str:
        """Person n's user resource name (made on first use)."""
        found = self._people.get(person)
        if found is None:
            found = self._people[person] = str(self.fake.add_user(f"Person {person}")["name"])
        return found

    def _dm(self, person: int) -> str:
        found = self._dms.get(person)
        if found is None:
            found = self._dms[person] = str(self.fake.dm_space(self._person(person))["name"])
        return found

    def _thread(self, thread: int) -> str:
        """Thread n's name: opened by someone who never mentions the app (so the app
        never hears of its first message)."""
        found = self._threads.get(thread)
        if found is None:
            root = self.fake.user_message(
                self._space, self._person(THREAD_OPENER), f"thread {thread}"
            )
            found = self._threads[thread] = str(root["thread"]["name"])
        return found

    @staticmethod
    def _ref(message: dict[str, Any]) -> MessageRef:
        thread = str(message["thread"]["name"]).rsplit("/", 1)[-1]
        space = space_id(str(message["space"]["name"]))
        return MessageRef(
            id=str(message["name"]),
            place=Place(space, thread if message.get("threadReply") else None),
            sender=str(message["sender"]["name"]).removeprefix("users/"),
            event=str(message["name"]),
        )

    def dm(self, person: int, text: str) -> MessageRef:
        return self._ref(self.fake.user_message(self._dm(person), self._person(person), text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        where = self._thread(thread) if thread is not None else None
        message = self.fake.user_message(
            self._space, self._person(person), text, mention=mention, thread=where
        )
        return self._ref(message)

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.redeliver(ref.id)

    def forge(self, text: str) -> bool:
        event = self.fake.forged_event(text)
        delivery = self.fake.deliver_soon(event, token=self.fake.forged_token("unknown_key"))
        return delivery.result(30).status in (401, 403)

    def ping_everyone_text(self) -> str:
        return "<users/all>"

    # -- what the bot posted ------------------------------------------------------------

    def _shown(self, text: str) -> str:
        """The text as a reader sees it: a mention shows the person's name."""
        for name, user in self.fake.users.items():
            text = text.replace(f"<{name}>", f"@{user['displayName']}")
        return text

    def bot_posts(self) -> list[Post]:
        posts = []
        for message in self.fake.app_messages():
            people, everyone = mentions_of(message)
            thread = str(message["thread"]["name"]).rsplit("/", 1)[-1]
            posts.append(
                Post(
                    place=Place(
                        space_id(str(message["space"]["name"])),
                        thread if message.get("threadReply") else None,
                    ),
                    text=self._shown(str(message["text"])),
                    mentions=frozenset(people),
                    pings_everyone=everyone,
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for call in self.fake.calls:
            said = ""
            if isinstance(call.body, dict) and "text" in call.body:
                said = f" {str(call.body['text'])[:60]!r}"
            params = dict(call.params)
            yield f"{call.at:.3f} {call.method} {call.path} {params} -> {call.status}{said}"
        for delivery in self.fake.deliveries:
            message = delivery.event.get("message") or {}
            yield (
                f"{delivery.sent_at:.3f} event {delivery.event.get('type')} "
                f"{message.get('name')} {str(message.get('text'))[:40]!r} -> "
                f"{delivery.status} {delivery.failure or ''} {delivery.response or ''}"
            )
