"""The conformance kit's driver for Mattermost, over the fake server (tests/fakes).

People write through FakeMattermost as their clients would (a post in their direct
channel with the bot, in the kit's public channel, or in one of its threads), and the
bot's posts are read back from the server's record, as they are now (a streamed post
edited in place is one post). The gateway reaches the fake through a TCP proxy, which
`platform_down` cuts (the WebSocket drops, requests are refused).

What Mattermost can do, as the channel meets it (`requirements`):
- groups, mentions (`@kit-bot`), threads (a post's `root_id`): yes;
- edits: yes, live (`post_edited`);
- duplicate delivery: yes: a post reaches the bot twice when a read-back after a
  reconnect meets a post already delivered live, or when the server sends an event
  again (a reliable WebSocket's replay, a cluster peer); `redeliver` has the fake send
  the post's event again;
- catch-up: yes, by the read-back (Mattermost itself keeps nothing for an absent bot);
- strangers: yes (DM pairing); signed inbound: no (the bot opens the WebSocket itself:
  nothing reaches the gateway that anyone could forge);
- long replies are split at 16,383 characters; `@channel`, `@all` and `@here` ping
  everyone; the network can be cut.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.mattermost_server import DEFAULT_TOKEN, MAX_POST_CHARS, FakeMattermost
from tests.fakes.tcp_proxy import TcpProxy

BOT_USERNAME = "kit-bot"
GROUP = "kit-town"
PEOPLE = 12  # person n is user `person<n>`; 99 opens the threads


class MattermostDriver(ChannelDriver):
    """Mattermost: direct channels, a public channel and its threads."""

    name = "mattermost"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=False,
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )
    max_message_length = MAX_POST_CHARS

    def __init__(self) -> None:
        self._fake: FakeMattermost | None = None
        self._proxy: TcpProxy | None = None
        self._people: dict[int, str] = {}
        self._dms: dict[int, str] = {}
        self._group = ""
        self._threads: dict[int, str] = {}

    @property
    def fake(self) -> FakeMattermost:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeMattermost.in_thread(bot_username=BOT_USERNAME, token=DEFAULT_TOKEN) as fake:
            port = int(fake.url.rsplit(":", 1)[1])
            proxy = TcpProxy("127.0.0.1", port)
            proxy.restore()
            self._fake, self._proxy = fake, proxy
            self._people, self._dms, self._threads = {}, {}, {}
            members = [self._person(n) for n in (*range(PEOPLE), 99)]
            self._group = str(fake.open_channel(GROUP, [fake.bot_id, *members])["id"])
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        return {
            "GATEWAY_CHANNELS__MATTERMOST__ENABLED": "true",
            "GATEWAY_CHANNELS__MATTERMOST__URL": f"http://127.0.0.1:{self._proxy.port}",
            "GATEWAY_CHANNELS__MATTERMOST__TOKEN": DEFAULT_TOKEN,
            "GATEWAY_CHANNELS__MATTERMOST__DM_POLICY": "open",
            "GATEWAY_CHANNELS__MATTERMOST__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> str:
        """Person n's user id (made on first use, in the kit's team)."""
        found = self._people.get(person)
        if found is None:
            user = self.fake.add_user(f"person{person}", first_name=f"Person {person}")
            found = self._people[person] = str(user["id"])
            self.fake.add_to_team(self.fake.team_id, found)
        return found

    def _dm(self, person: int) -> str:
        found = self._dms.get(person)
        if found is None:
            channel = self.fake.dm_channel(self._person(person), self.fake.bot_id)
            found = self._dms[person] = str(channel["id"])
        return found

    def _thread(self, thread: int) -> str:
        """The root post of thread n, opened by someone who never addresses the bot."""
        found = self._threads.get(thread)
        if found is None:
            root = self.fake.user_message(self._group, self._person(99), f"thread {thread}")
            found = self._threads[thread] = str(root["id"])
        return found

    @staticmethod
    def _ref(post: dict[str, Any]) -> MessageRef:
        root = str(post.get("root_id") or "") or None
        return MessageRef(
            id=str(post["id"]),
            place=Place(str(post["channel_id"]), root),
            sender=str(post["user_id"]),
            event=str(post["id"]),
        )

    def dm(self, person: int, text: str) -> MessageRef:
        post = self.fake.user_message(self._dm(person), self._person(person), text)
        return self._ref(post)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        root = self._thread(thread) if thread is not None else ""
        body = f"@{BOT_USERNAME} {text}" if mention else text
        post = self.fake.user_message(self._group, self._person(person), body, root_id=root)
        return self._ref(post)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        original = self.fake.posts[ref.id]
        mention = f"@{BOT_USERNAME} "
        if str(original["message"]).startswith(mention):
            text = mention + text  # the author keeps the mention
        return self._ref(self.fake.edit_message(ref.id, text))

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.rebroadcast(ref.id)

    def ping_everyone_text(self) -> str:
        return "@channel"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for post in self.fake.bot_posts():
            mentioned, everyone = self.fake.mentioned_users(post)
            root = str(post.get("root_id") or "") or None
            posts.append(
                Post(
                    place=Place(str(post["channel_id"]), root),
                    text=str(post["message"]),
                    mentions=frozenset(mentioned),
                    pings_everyone=everyone,
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for call in self.fake.calls:
            said = ""
            if isinstance(call.body, dict) and "message" in call.body:
                said = f" {str(call.body.get('channel_id', ''))[:6]} {call.body['message'][:60]!r}"
            yield (
                f"{call.at:.3f} {call.method} {call.path} {call.params or ''} -> {call.status} "
                f"by {call.user_id[:6]}{said}"
            )
        for user, event, payload in list(self.fake.events_sent):
            yield f"event {event} seq={payload.get('seq')} to {user}"
