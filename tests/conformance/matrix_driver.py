"""The conformance kit's driver for Matrix, over a real Synapse (tests/synapse_server.py).

One Synapse serves the whole test session; each scenario (`running`) registers a bot of
its own (a fresh account, so a fresh device for the gateway's new workspace) and its
people on first use, and makes its rooms, as a Matrix client would:

- A DM is a room its person makes with Element's preset (`trusted_private_chat`,
  `is_direct`), inviting the bot, and writes in at once. The bot joins it, or declines:
  a stranger under `dm_policy = "pairing"` gets their code as the reason, which clients
  show in the room, so it is a post of the bot here. A person the bot declined invites it
  again before writing again.
- The group is a room of a host account with the bot and whoever writes in it (more than
  two members: the channel gates it by mention). Its threads are `m.thread` replies to a
  root the host wrote. A mention is Element's: the bot's display name as a pill at the
  start, and the bot in `m.mentions`.
- An edit is an `m.replace` whose `m.new_content` keeps the mention.

The bot holds power level 100 in its DMs (the preset gives the invitee the creator's)
and 50 in the group, as a moderator bot would: enough that an `@room` in its messages
would notify everyone (`pings_everyone`). The gateway reaches Synapse through a TCP proxy,
which `platform_down` cuts; people and the driver talk to Synapse directly. The bot's
posts are read back with `/messages` in every room, as the room's members see them.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from channels.matrix.format import MATRIX_LIMIT
from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.tcp_proxy import TcpProxy
from tests.synapse_server import MatrixUser, Synapse

BOT_NAME = "Kit Bot"
#: How long the host waits for the bot to join the group (a gateway must run).
INVITE_WAIT = 60.0
#: `bot_posts` reads the rooms again at most this often (it is called a few times a
#: second; each read is a request per room).
READ_INTERVAL = 0.3
_ROOM_MENTION = re.compile(r"(?<![\w@])@room\b")


@dataclass
class _Sent:
    """What a person sent, for its edit: who, where, and the content they wrote."""

    user: MatrixUser
    room: str
    content: dict[str, Any]
    mention: bool


@dataclass
class _BotEvent:
    """One event of the bot that a room's members see as a post."""

    at: int  # origin_server_ts
    seq: int  # order of reading, for equal timestamps
    post: Post


class MatrixDriver(ChannelDriver):
    """Matrix over Synapse; see the module docstring."""

    name = "matrix"
    requirements = Requirements(
        groups=True,  # a room of more than two members
        mentions=True,  # a pill, m.mentions, or a reply to the bot; require_mention
        threads=True,  # m.thread: matrix:<room>:thread:<root>
        edits=True,  # m.replace
        # Synapse hands one /sync stream each event once, and a real homeserver cannot
        # be told to deliver an event again (the channel's own rewinds are its business).
        duplicate_delivery=False,
        catch_up=True,  # the stored /sync since token
        strangers=True,  # invites declined with the pairing code as the reason
        # The gateway pulls /sync with its own token: nothing comes in to forge.
        signed_inbound=False,
        split_long_replies=True,  # the channel splits at MATRIX_LIMIT characters
        mass_pings=True,  # @room
        platform_outage=True,  # a TCP proxy between the gateway and Synapse
    )
    #: The channel's split limit. The homeserver takes up to 65,536 bytes an event,
    #: `body` and HTML `formatted_body` together; the channel cuts the text at 16,000
    #: characters so one event always fits.
    max_message_length = MATRIX_LIMIT

    def __init__(self, synapse: Synapse) -> None:
        self.synapse = synapse
        self._bot: MatrixUser | None = None
        self._proxy: TcpProxy | None = None
        self._reset()

    def _reset(self) -> None:
        self._people: dict[int, MatrixUser] = {}
        self._dms: dict[int, str] = {}
        self._joined: set[int] = set()  # people whose DM the bot is known to have joined
        self._host: MatrixUser | None = None
        self._group: str | None = None
        self._in_group: set[int] = set()
        self._roots: dict[int, str] = {}  # thread number -> root event id
        self._thread_last: dict[int, str] = {}  # thread number -> its latest event id
        self._sent: dict[str, _Sent] = {}
        self._readers: dict[str, MatrixUser] = {}  # room -> a member who reads it
        self._from: dict[str, str | None] = {}  # room -> /messages token read up to
        self._events: dict[str, _BotEvent] = {}  # event id -> the post it shows
        self._seq = 0
        self._read_at = 0.0
        self._cached: list[Post] = []
        self._log: list[str] = []

    # -- the platform -------------------------------------------------------------------

    @property
    def bot(self) -> MatrixUser:
        if self._bot is None:
            raise RuntimeError("the platform is not running")
        return self._bot

    @contextmanager
    def running(self) -> Iterator[None]:
        self._reset()
        self._bot = self.synapse.register(displayname=BOT_NAME)
        proxy = TcpProxy("127.0.0.1", self.synapse.port)
        proxy.restore()
        self._proxy = proxy
        try:
            yield
        finally:
            proxy.close()
            self._proxy = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None, "the platform is not running"
        return {
            "GATEWAY_CHANNELS__MATRIX__ENABLED": "true",
            "GATEWAY_CHANNELS__MATRIX__HOMESERVER": f"http://127.0.0.1:{self._proxy.port}",
            "GATEWAY_CHANNELS__MATRIX__USER_ID": self.bot.user_id,
            "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN": self.bot.access_token,
            "GATEWAY_CHANNELS__MATRIX__SYNC_TIMEOUT": "5",
            "GATEWAY_CHANNELS__MATRIX__DM_POLICY": "open",
            "GATEWAY_CHANNELS__MATRIX__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._note("the network to the gateway is cut")
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()
        self._note("the network to the gateway is back")

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> MatrixUser:
        if person not in self._people:
            self._people[person] = self.synapse.register(displayname=f"Person {person}")
        return self._people[person]

    def _bot_membership(self, reader: MatrixUser, room: str) -> str | None:
        quoted = urllib.parse.quote(room, safe="")
        who = urllib.parse.quote(self.bot.user_id, safe="")
        try:
            state = self.synapse.request(
                "GET",
                f"/_matrix/client/v3/rooms/{quoted}/state/m.room.member/{who}",
                token=reader.access_token,
            )
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return str(state.get("membership"))

    def _answered_invite(self, reader: MatrixUser, room: str) -> str:
        """Wait until the bot joined `room` or declined its invite; which one."""
        deadline = time.monotonic() + INVITE_WAIT
        while (membership := self._bot_membership(reader, room)) not in ("join", "leave"):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the bot never answered the invite to {room} within {INVITE_WAIT:g}s "
                    f"(membership {membership}): the Matrix driver makes its group only while a "
                    "gateway runs"
                )
            time.sleep(0.05)
        self._note(f"the bot answered the invite to {room}: {membership}")
        return membership

    def _watch(self, room: str, reader: MatrixUser) -> None:
        self._readers.setdefault(room, reader)
        self._from.setdefault(room, None)

    def _dm_room(self, person: int) -> str:
        """The person's DM with the bot. A new one is made with the bot invited and
        written in at once, as Element does (the bot reads what came before its join,
        also when it was down or cut off then); once the bot declined, the person invites
        it again before writing again."""
        user = self._person(person)
        room = self._dms.get(person)
        if room is None:
            room = self.synapse.create_room(
                user, invite=[self.bot.user_id], direct=True, preset="trusted_private_chat"
            )
            self._dms[person] = room
            self._watch(room, user)
            self._note(f"person {person} ({user.user_id}) made DM {room}, inviting the bot")
            return room
        if person in self._joined:
            return room
        membership = self._bot_membership(user, room)
        if membership == "join":
            self._joined.add(person)
        elif membership == "leave":
            self.synapse.invite(user, room, self.bot.user_id)
            self._note(f"person {person} invites the bot to {room} again")
        return room

    def _send(self, user: MatrixUser, room: str, content: dict[str, Any], mention: bool) -> str:
        event_id = self.synapse.send(user, room, content)
        self._sent[event_id] = _Sent(user, room, content, mention)
        self._note(f"{user.user_id} in {room}: {event_id} {str(content.get('body'))[:60]!r}")
        return event_id

    def dm(self, person: int, text: str) -> MessageRef:
        room = self._dm_room(person)
        user = self._person(person)
        event_id = self._send(user, room, _text(text), mention=False)
        return MessageRef(event_id, Place(room), user.user_id, event_id)

    def _group_room(self) -> str:
        if self._group is None:
            host = self._host = self.synapse.register(displayname="Kit Host")
            room = self.synapse.create_room(
                host,
                invite=[self.bot.user_id],
                preset="public_chat",
                name="Kit group",
                # The creator's power is unlimited (room version 12): not listed.
                power_level_content_override={"users": {self.bot.user_id: 50}},
            )
            self._watch(room, host)
            self._note(f"the host made group {room}, inviting the bot")
            if self._answered_invite(host, room) != "join":
                raise AssertionError(f"the bot declined the group {room}")
            self._group = room
        return self._group

    def _thread_root(self, room: str, thread: int) -> str:
        if thread not in self._roots:
            assert self._host is not None
            root = self._send(self._host, room, _text(f"thread {thread}"), mention=False)
            self._roots[thread] = self._thread_last[thread] = root
        return self._roots[thread]

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        room = self._group_room()
        user = self._person(person)
        if person not in self._in_group:
            self.synapse.join(user, room)
            self._in_group.add(person)
        content = self._mentioning(text) if mention else _text(text)
        root = None
        if thread is not None:
            root = self._thread_root(room, thread)
            content["m.relates_to"] = {
                "rel_type": "m.thread",
                "event_id": root,
                "is_falling_back": True,
                "m.in_reply_to": {"event_id": self._thread_last[thread]},
            }
        event_id = self._send(user, room, content, mention)
        if thread is not None:
            self._thread_last[thread] = event_id
        return MessageRef(event_id, Place(room, root), user.user_id, event_id)

    def _mentioning(self, text: str) -> dict[str, Any]:
        """A message that mentions the bot as Element writes one: a pill of its display
        name first, and the bot in `m.mentions`."""
        link = f"https://matrix.to/#/{self.bot.user_id}"
        return {
            "msgtype": "m.text",
            "body": f"{BOT_NAME}: {text}",
            "format": "org.matrix.custom.html",
            "formatted_body": f'<a href="{link}">{BOT_NAME}</a>: {text}',
            "m.mentions": {"user_ids": [self.bot.user_id]},
        }

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        sent = self._sent[ref.id]
        new = self._mentioning(text) if sent.mention else _text(text)
        content = {
            "msgtype": "m.text",
            "body": f"* {new['body']}",
            "m.new_content": new,
            "m.mentions": {},  # nobody newly mentioned (the spec's rule for an edit)
            "m.relates_to": {"rel_type": "m.replace", "event_id": ref.id},
        }
        event_id = self._send(sent.user, sent.room, content, sent.mention)
        return MessageRef(event_id, ref.place, ref.sender, event_id)

    def ping_everyone_text(self) -> str:
        return "@room"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        if time.monotonic() - self._read_at >= READ_INTERVAL:
            for room in list(self._readers):
                self._read(room)
            self._read_at = time.monotonic()
            ordered = sorted(self._events.values(), key=lambda e: (e.at, e.seq))
            self._cached = [e.post for e in ordered]
        return list(self._cached)

    def _read(self, room: str) -> None:
        """The bot's events in `room` since the last read (`/messages` forwards)."""
        reader = self._readers[room]
        wanted = {"types": ["m.room.message", "m.room.member"], "senders": [self.bot.user_id]}
        quoted = urllib.parse.quote(room, safe="")
        while True:
            query = {"dir": "f", "limit": "500", "filter": json.dumps(wanted)}
            if self._from[room] is not None:
                query["from"] = str(self._from[room])
            answer = self.synapse.request(
                "GET",
                f"/_matrix/client/v3/rooms/{quoted}/messages?{urllib.parse.urlencode(query)}",
                token=reader.access_token,
            )
            end = answer.get("end")
            if not end:
                return  # read to the end: the next read starts where this one did
            for event in answer.get("chunk") or ():
                self._take(room, event)
            self._from[room] = str(end)

    def _take(self, room: str, event: dict[str, Any]) -> None:
        content = event.get("content")
        if not isinstance(content, dict):
            return
        event_id = str(event.get("event_id"))
        if event.get("type") == "m.room.member":
            # A declined invite's reason shows in the room: a stranger's pairing code.
            reason = content.get("reason")
            if content.get("membership") == "leave" and isinstance(reason, str) and reason:
                self._add(event_id, event, Post(Place(room), reason))
            return
        relates = content.get("m.relates_to")
        relates = relates if isinstance(relates, dict) else {}
        if relates.get("rel_type") == "m.replace":
            # Clients show an edit in place of the post it replaces.
            original = self._events.get(str(relates.get("event_id")))
            new = content.get("m.new_content")
            if original is not None and isinstance(new, dict):
                post = self._post(room, new, relates_from=original.post)
                self._events[str(relates.get("event_id"))].post = post
            return
        self._add(event_id, event, self._post(room, content))

    def _add(self, event_id: str, event: dict[str, Any], post: Post) -> None:
        self._seq += 1
        self._events[event_id] = _BotEvent(int(event.get("origin_server_ts") or 0), self._seq, post)
        self._note(f"the bot posted {event_id} in {post.place}: {post.text[:80]!r}")

    def _post(
        self, room: str, content: dict[str, Any], *, relates_from: Post | None = None
    ) -> Post:
        body = str(content.get("body") or "")
        if relates_from is not None:
            place, reply_to = relates_from.place, relates_from.reply_to
        else:
            relates = content.get("m.relates_to")
            relates = relates if isinstance(relates, dict) else {}
            thread = relates.get("event_id") if relates.get("rel_type") == "m.thread" else None
            replied = relates.get("m.in_reply_to")
            reply_to = None
            if isinstance(replied, dict) and not relates.get("is_falling_back"):
                reply_to = str(replied.get("event_id"))
            place = Place(room, None if thread is None else str(thread))
        mentions = content.get("m.mentions")
        if isinstance(mentions, dict):
            # Intentional mentions (Matrix 1.7): whom the event names is all that notifies.
            named = frozenset(str(u) for u in mentions.get("user_ids") or ())
            everyone = mentions.get("room") is True
        else:
            # Without them the homeserver's legacy push rules read the body: a person's
            # display name or user name, and @room from a sender of enough power.
            named = frozenset(u for u in self._everyone() if _names(body, u, self._name_of(u)))
            everyone = _ROOM_MENTION.search(body) is not None
        return Post(place, body, reply_to=reply_to, mentions=named, pings_everyone=everyone)

    def _everyone(self) -> list[str]:
        users = [u.user_id for u in self._people.values()]
        return users + ([self._host.user_id] if self._host is not None else [])

    def _name_of(self, user_id: str) -> str:
        for number, user in self._people.items():
            if user.user_id == user_id:
                return f"Person {number}"
        return "Kit Host"

    # -- the record ---------------------------------------------------------------------

    def _note(self, line: str) -> None:
        self._log.append(f"{time.time():.3f} {line}")

    def platform_log(self) -> Iterator[str]:
        yield from list(self._log)
        yield "--- the end of Synapse's log (WARNING and up)"
        yield from self.synapse.log_tail(200).splitlines()


def _text(text: str) -> dict[str, Any]:
    """A plain message, as a client of Matrix 1.7 writes one (it mentions nobody)."""
    return {"msgtype": "m.text", "body": text, "m.mentions": {}}


def _names(body: str, user_id: str, display_name: str) -> bool:
    """Do the legacy push rules find this person in `body` (their display name, or the
    localpart of their id, as a word)?"""
    localpart = user_id[1:].split(":", 1)[0]
    return any(
        re.search(rf"(?<!\w){re.escape(name)}(?!\w)", body, re.IGNORECASE)
        for name in (display_name, localpart)
        if name
    )
