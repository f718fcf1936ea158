"""The conformance kit's driver for Discord, over the fake Discord (tests/fakes).

People write through FakeDiscord, which keeps Discord's rules: a message is dispatched
to the Gateway sessions alive at that moment and kept in the channel's history, a new
session gets nothing from before it (only the HTTP API's history has it), a RESUME
replays what its own session missed, and a message's pings follow its
`allowed_mentions`. The bot's posts are read back from the fake's channels. The gateway
reaches the fake (its HTTP API and its Gateway WebSocket both) through a TCP proxy,
which `platform_down` cuts.

The places: person n has a DM with the bot; the group is one text channel of one
server, whose threads are made on first use; a mention is Discord's ``<@bot id>`` with
the bot in the message's `mentions`, as a client sends it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.discord_server import MESSAGE_LIMIT, THREAD_TYPES, FakeDiscord
from tests.fakes.tcp_proxy import TcpProxy


class DiscordDriver(ChannelDriver):
    """Discord: a bot in DMs and in a server's text channel and its threads."""

    name = "discord"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,  # MESSAGE_UPDATE, taken live
        # The Gateway hands a session each event once; a RESUME replays only what that
        # connection missed, and the read-back after a new session is deduped by the
        # channel before it reaches the journal. No event is ever handed over twice.
        duplicate_delivery=False,
        catch_up=True,  # the read-back of each conversation's history after READY
        strangers=True,
        signed_inbound=False,  # a bot's Gateway connection takes nothing over HTTP
        split_long_replies=True,  # 2,000 characters a message
        mass_pings=True,  # @everyone, @here (and roles)
        platform_outage=True,
    )
    max_message_length = MESSAGE_LIMIT

    def __init__(self) -> None:
        self._fake: FakeDiscord | None = None
        self._proxy: TcpProxy | None = None
        self._people: dict[int, int] = {}  # person -> Discord user id
        self._guild = 0
        self._group = 0  # the server's text channel
        self._threads: dict[int, int] = {}  # kit thread number -> thread channel id

    @property
    def fake(self) -> FakeDiscord:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        # Discord's own rate limit for a bot posting in one channel: 5 per 5 s.
        with FakeDiscord.in_thread(bot_name="kit-gateway") as fake:
            proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            proxy.restore()
            self._fake, self._proxy = fake, proxy
            self._people, self._threads = {}, {}
            self._guild = fake.add_guild("Kit server")
            self._group = fake.add_text_channel(self._guild, "kit")
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    @property
    def _root(self) -> str:
        assert self._proxy is not None
        return f"127.0.0.1:{self._proxy.port}"

    def gateway_env(self) -> dict[str, str]:
        return {
            "GATEWAY_CHANNELS__DISCORD__ENABLED": "true",
            "GATEWAY_CHANNELS__DISCORD__TOKEN": self.fake.token,
            "GATEWAY_CHANNELS__DISCORD__API_URL": f"http://{self._root}/api/v10",
            "GATEWAY_CHANNELS__DISCORD__GATEWAY_URL": f"ws://{self._root}/",
            "GATEWAY_CHANNELS__DISCORD__DM_POLICY": "open",
            "GATEWAY_CHANNELS__DISCORD__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> int:
        if person not in self._people:
            self._people[person] = self.fake.add_user(f"person{person}")
        return self._people[person]

    def _thread(self, number: int) -> int:
        if number not in self._threads:
            self._threads[number] = self.fake.add_thread(self._group, f"kit thread {number}")
        return self._threads[number]

    def _place(self, channel_id: int) -> Place:
        channel = self.fake.channels[channel_id]
        if channel["type"] in THREAD_TYPES:
            return Place(str(channel["parent_id"]), str(channel_id))
        return Place(str(channel_id))

    def _ref(self, message: dict[str, Any], event: str = "") -> MessageRef:
        channel = int(message["channel_id"])
        return MessageRef(
            id=str(message["id"]),
            place=self._place(channel),
            sender=str(message["author"]["id"]),
            event=event or f"create {message['id']}",
        )

    def dm(self, person: int, text: str) -> MessageRef:
        user = self._person(person)
        return self._ref(self.fake.user_message(self.fake.dm_channel(user), user, text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        where = self._group if thread is None else self._thread(thread)
        bot = self.fake.bot_id
        message = self.fake.user_message(
            where,
            self._person(person),
            f"<@{bot}> {text}" if mention else text,
            mentions=[bot] if mention else [],
        )
        return self._ref(message)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        channel = int(ref.place.thread or ref.place.conversation)
        original = next(
            m for m in self.fake.messages[channel] if str(m["id"]) == ref.id
        )  # the author keeps the mention
        mention = f"<@{self.fake.bot_id}> "
        content = mention + text if str(original["content"]).startswith(mention) else text
        edited = self.fake.edit_user_message(channel, int(ref.id), content)
        return self._ref(edited, event=f"edit {ref.id} {edited['edited_timestamp']}")

    def ping_everyone_text(self) -> str:
        return "@everyone and @here"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        fake = self.fake
        posts = []
        for message in fake.bot_messages():
            channel = int(message["channel_id"])
            reference = message.get("message_reference") or {}
            pinged = fake.pings.get(int(message["id"]), {})
            posts.append(
                Post(
                    place=self._place(channel),
                    text=str(message["content"]),
                    reply_to=str(reference["message_id"]) if reference else None,
                    mentions=frozenset(str(u) for u in pinged.get("users", ())),
                    pings_everyone=self._pings_everyone(channel, pinged),
                )
            )
        return posts

    def _pings_everyone(self, channel: int, pinged: dict[str, Any]) -> bool:
        """Discord notified everyone, or would have had the text held an @everyone: in
        a server a post whose `allowed_mentions` lets one through (missing, or parsing
        "everyone") pings everyone as soon as the model writes one, whatever the
        channel does to the text."""
        if pinged.get("everyone"):
            return True
        if not self.fake.channels[channel].get("guild_id"):
            return False  # a DM: Discord notifies no one else there
        allowed = pinged.get("allowed_mentions")
        return not isinstance(allowed, dict) or "everyone" in (allowed.get("parse") or ())

    def platform_log(self) -> Iterator[str]:
        fake = self.fake
        for conn in fake.connections:
            yield (
                f"{conn.opened_at:.3f} gateway connection {conn.number} {conn.path} "
                f"identified={conn.identified} resumed={conn.resumed} closed_by={conn.closed_by!r}"
            )
        for call in fake.calls:
            yield f"{call.at:.3f} {call.method} {call.path} {call.status}"
        for message in fake.bot_messages():
            yield f"posted in {message['channel_id']}: {str(message['content'])[:100]!r}"
        # Replies sent again (a kill's repeats) that Discord recognized by their nonce.
        yield f"nonce_repeats={fake.nonce_repeats} (replies sent again, not posted twice)"
