"""The conformance kit's driver for Microsoft Teams, over the fake Teams (tests/fakes).

People write through FakeTeams as their Teams clients would: a message in their personal
chat with the bot, in the kit's group chat (the kit's "group itself": a group chat has no
threads), or a reply in one of the threads of the kit's team channel (a channel post and
its reply chain; every post in a channel starts a thread of its own, so a channel has no
place where all its posts share one conversation). The fake delivers each activity to
the gateway's messaging endpoint, signed, as Teams does: retried once when it got no 200,
then dropped. The bot's messages are read back from the fake's connector, as they are now
(a streamed message updated in place is one message). The gateway reaches the fake (its
keys, its token endpoint, its connector) through a TCP proxy, which `platform_down` cuts.

What Teams can do, as the channel meets it (`requirements`):
- groups, mentions (an `<at>` mention entity), threads (a channel post's reply chain, the
  `;messageid=` of its conversation id): yes. The kit's group chat and team have the
  resource-specific consent to read every message, so the bot gets the chatter too and
  must leave it alone (without it Teams would hand over only the mentions);
- edits: yes (`messageUpdate` with `editMessage`);
- duplicate delivery: yes: Teams sends an activity again when the bot did not answer 200
  within 15 seconds (`redeliver` sends the same activity again);
- catch-up: NO. Teams keeps nothing for a bot: an activity the gateway did not answer
  200 (down, killed before its journal, draining) is sent once more and then dropped, and
  no API hands a bot what it missed. The backlog and kill scenarios are skipped for
  that; docs/teams.md says what is promised instead;
- strangers: yes (pairing in personal chats); signed inbound: yes (a JWT from the Bot
  Framework's keys; `forge` signs with a key Teams does not list);
- long replies are split at the channel's 20,000 characters; mass pings: a mention of
  the channel itself notifies everyone, and the bot makes none;
- platform outage: the gateway's requests to Teams (keys, token, connector) are cut, as a
  network failure on the gateway's side would; Teams' deliveries still arrive (cut too,
  for longer than its one retry, they would be lost: catch-up, above).
"""

from __future__ import annotations

import asyncio
import html
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.teams_server import APP_ID, APP_PASSWORD, FakeTeams, new_signing_key

PEOPLE = 12  # person n is "Person n"; 99 starts the channel's threads
MAX_MESSAGE_CHARS = 20_000

_AT = re.compile(r"<at>(.*?)</at>", re.DOTALL)


class TeamsDriver(ChannelDriver):
    """Teams: personal chats, a team channel and its threads."""

    name = "teams"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,
        catch_up=False,
        strangers=True,
        signed_inbound=True,
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )
    max_message_length = MAX_MESSAGE_CHARS

    def __init__(self) -> None:
        self._fake: FakeTeams | None = None
        self._proxy: TcpProxy | None = None
        self._port = 0
        self._people: dict[int, dict[str, Any]] = {}
        self._chats: dict[int, Any] = {}
        self._team: Any = None
        self._group: Any = None
        self._threads: dict[int, str] = {}
        self._events: dict[str, dict[str, Any]] = {}
        self._edits = 0
        self._lock = threading.Lock()

    @property
    def fake(self) -> FakeTeams:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Teams posts to the bot's messaging endpoint
        with FakeTeams.in_thread(retry_delay=1.0) as fake:
            port = int(fake.url.rsplit(":", 1)[1])
            proxy = TcpProxy("127.0.0.1", port)
            proxy.restore()
            fake.public_url = f"http://127.0.0.1:{proxy.port}"
            fake.bot_url = f"http://127.0.0.1:{self._port}/api/messages"
            self._fake, self._proxy = fake, proxy
            self._people, self._chats, self._threads, self._events = {}, {}, {}, {}
            members = [self._person(n) for n in (*range(PEOPLE), 99)]
            self._team = fake.team_channel(members, name="Kit channel", rsc=True)
            self._group = fake.group_chat(members, rsc=True)
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    def gateway_env(self) -> dict[str, str]:
        fake = self.fake
        return {
            "GATEWAY_HTTP__PORT": str(self._port),
            "GATEWAY_CHANNELS__TEAMS__ENABLED": "true",
            "GATEWAY_CHANNELS__TEAMS__APP_ID": APP_ID,
            "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD": APP_PASSWORD,
            "GATEWAY_CHANNELS__TEAMS__OPENID_METADATA_URL": fake.openid_metadata_url,
            "GATEWAY_CHANNELS__TEAMS__TOKEN_URL": fake.token_url,
            "GATEWAY_CHANNELS__TEAMS__DM_POLICY": "open",
            "GATEWAY_CHANNELS__TEAMS__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> dict[str, Any]:
        found = self._people.get(person)
        if found is None:
            found = self._people[person] = self.fake.add_person(f"Person {person}")
        return found

    def _chat(self, person: int) -> Any:
        found = self._chats.get(person)
        if found is None:
            found = self._chats[person] = self.fake.personal_chat(self._person(person))
        return found

    def _thread(self, thread: int) -> str:
        """The root post of thread n, by someone who never addresses the bot (with the
        team's consent to read everything, the bot gets it, and must leave it alone)."""
        found = self._threads.get(thread)
        if found is None:
            root = self.fake.message(self._person(99), self._team, f"thread {thread}")
            self._hand_over(root)
            found = self._threads[thread] = str(root["id"])
        return found

    def _hand_over(self, activity: dict[str, Any]) -> None:
        if self.fake.reaches_bot(activity):
            self.fake.deliver_soon(activity)

    def _ref(self, activity: dict[str, Any], event: str | None = None) -> MessageRef:
        base, _, post = str(activity["conversation"]["id"]).partition(";messageid=")
        ref = MessageRef(
            id=str(activity["id"]),
            place=Place(base, post or None),
            sender=str(activity["from"]["id"]),
            event=event or str(activity["id"]),
        )
        with self._lock:
            self._events[ref.event] = activity
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        activity = self.fake.message(self._person(person), self._chat(person), text)
        self._hand_over(activity)
        return self._ref(activity)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        if thread is None:
            place, root = self._group, None
        else:
            place, root = self._team, self._thread(thread)
        activity = self.fake.message(
            self._person(person), place, text, mention_bot=mention, thread=root
        )
        self._hand_over(activity)
        return self._ref(activity)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        edited = self.fake.edit(self._events[ref.event], text)
        self._hand_over(edited)
        with self._lock:
            self._edits += 1
            event = f"{ref.id}:edit:{self._edits}"
        return self._ref(edited, event)

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.deliver_soon(self._events[ref.event])

    def forge(self, text: str) -> bool:
        """An activity signed by a key the Bot Framework does not list."""
        person = self._person(7)
        activity = self.fake.message(person, self._chat(7), text)
        token = self.fake.sign(activity, key=new_signing_key("forged-key", ["msteams"]))
        url = f"http://127.0.0.1:{self._port}/api/messages"

        async def post() -> int:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    url, json=activity, headers={"Authorization": f"Bearer {token}"}
                ) as answer,
            ):
                return answer.status

        return asyncio.run(post()) in (401, 403)

    def ping_everyone_text(self) -> str:
        return "<at>everyone</at>"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for message in self.fake.posts():
            base, _, post = message.conversation.partition(";messageid=")
            people, everyone = self.fake.mentioned(message)
            text = html.unescape(_AT.sub(lambda m: m.group(1), message.text))
            posts.append(
                Post(
                    place=Place(base, post or None),
                    text=text,
                    reply_to=post or None,  # a channel reply sits in its post's thread
                    mentions=frozenset(people),
                    pings_everyone=everyone,
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.deliveries:
            attempts = ", ".join(
                f"{a.status or '-'}{f' {a.failure}' if a.failure else ''}"
                for a in delivery.attempts
            )
            activity = delivery.activity
            yield (
                f"delivery {delivery.number} {activity['type']} {activity['id']} "
                f"{str(activity.get('text'))[:50]!r}: {attempts}"
                f"{' DROPPED' if delivery.dropped else ''}"
            )
        for call in self.fake.calls:
            yield f"{call.at:.3f} {call.method} {call.path[:90]} -> {call.status}"
