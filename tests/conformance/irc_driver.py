"""The conformance kit's driver for IRC, against a real ngIRCd (Debian's ngircd, started
privately per scenario by tests/ngircd_server.py).

People are IRC clients of their own (`person0`, `person1`, ...) on ngIRCd's plain port, in
the channel `#kit`; the gateway connects over TLS (the certificate made for the run)
through a TCP proxy, which `platform_down` stalls: every byte waits where it is, as on a
network that drops packets for a while, and TCP delivers it all once the proxy flows
again. The bot's posts are read as the people got them: its private messages by the
person they went to, its channel messages by a watcher in `#kit`.

What the Requirements say, and why:
- groups, mentions: IRC channels; a message addresses the bot with `kitbot: ...` (or its
  nick as a word), and only those are answered.
- catch_up False: IRC keeps nothing. A line the server sends while the gateway is not
  connected is gone (ngIRCd has no IRCv3 chathistory to read back), and a private
  message to a nick that is not there is refused to its sender ("No such nick"). So the
  backlog and kill scenarios cannot hold on IRC; docs/irc.md says what is promised.
- duplicate_delivery, edits, threads, signed_inbound False: IRC never delivers twice,
  has no edits and no threads, and takes nothing over the gateway's HTTP port.
- mass_pings False: IRC has no ping of everyone (a client highlights its own nick only).
- split_long_replies True: a line is at most 512 bytes with the prefix the server adds;
  `max_message_length` is what is left of it for the bot's text to `person0` here.
- platform_outage True: a stall of the link, not a reset (with a reset, what is written
  meanwhile is gone, as above).

Ordering: ngIRCd paces each client by itself (3 lines a second past a backlog), so two
people's channel messages can reach
the channel in another order than they were sent. A person's channel message counts as
written once the watcher saw it, and the next one is written only then, so the order the
kit records is the server's.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from channels.irc.wire import strip_formatting
from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.tcp_proxy import TcpProxy
from tests.ngircd_server import IrcPerson, Ngircd, running_ngircd

BOT = "kitbot"
CHANNEL = "#kit"
WATCHER = "kitwatch"
NETWORK = "kit"


def person_nick(person: int) -> str:
    return f"person{person}"


#: What one line leaves for the bot's text to `person0` (the longest post there is).
MAX_POST = 512 - 2 - len(f":{BOT}!~{BOT}@127.0.0.1 PRIVMSG {person_nick(0)} :")


class IrcDriver(ChannelDriver):
    """IRC on a private ngIRCd, the gateway over TLS."""

    name = "irc"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=False,
        edits=False,
        duplicate_delivery=False,
        catch_up=False,
        strangers=True,
        signed_inbound=False,
        split_long_replies=True,
        mass_pings=False,
        platform_outage=True,
    )
    max_message_length = MAX_POST

    def __init__(self) -> None:
        self._server: Ngircd | None = None
        self._proxy: TcpProxy | None = None
        self._people: dict[int, IrcPerson] = {}
        self._watcher: IrcPerson | None = None
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def server(self) -> Ngircd:
        if self._server is None:
            raise RuntimeError("the platform is not running")
        return self._server

    @contextmanager
    def running(self) -> Iterator[None]:
        with running_ngircd() as server:
            proxy = TcpProxy("127.0.0.1", server.tls_port)
            proxy.restore()
            self._server, self._proxy, self._people = server, proxy, {}
            self._watcher = server.person(WATCHER, channels=(CHANNEL,))
            try:
                yield
            finally:
                proxy.close()
                self._server = self._proxy = self._watcher = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        return {
            "GATEWAY_CHANNELS__IRC__ENABLED": "true",
            "GATEWAY_CHANNELS__IRC__HOST": "127.0.0.1",
            "GATEWAY_CHANNELS__IRC__PORT": str(self._proxy.port),
            "GATEWAY_CHANNELS__IRC__TLS": "true",
            "GATEWAY_CHANNELS__IRC__TLS_CA_FILE": str(self.server.ca_file),
            "GATEWAY_CHANNELS__IRC__NETWORK": NETWORK,
            "GATEWAY_CHANNELS__IRC__NICK": BOT,
            "GATEWAY_CHANNELS__IRC__CHANNELS": f'["{CHANNEL}"]',
            # ngIRCd takes 3 lines a second from a client with more waiting; the bot
            # keeps to that, so its queue stays in the gateway (PONGs go first).
            "GATEWAY_CHANNELS__IRC__BURST_LINES": "5",
            "GATEWAY_CHANNELS__IRC__LINE_INTERVAL_SECONDS": "0.34",
            "GATEWAY_CHANNELS__IRC__DM_POLICY": "open",
            "GATEWAY_CHANNELS__IRC__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.stall()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.flow()

    # -- people -------------------------------------------------------------------------

    def _person(self, person: int) -> IrcPerson:
        with self._lock:
            found = self._people.get(person)
            if found is None:
                found = self.server.person(person_nick(person), channels=(CHANNEL,))
                self._people[person] = found
            return found

    def dm(self, person: int, text: str) -> MessageRef:
        who = self._person(person)
        who.say(BOT, text)
        return MessageRef(f"irc-{next(self._numbers)}", Place(who.nick), who.nick)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        if thread is not None:
            raise NotImplementedError("IRC has no threads")
        who = self._person(person)
        line = f"{BOT}: {text}" if mention else text
        who.say(CHANNEL, line)
        # Written once the server relayed it (see the module docstring).
        assert self._watcher is not None
        self._watcher.wait_for(f"PRIVMSG {CHANNEL} :{line}", timeout=30, what=repr(line))
        return MessageRef(f"irc-{next(self._numbers)}", Place(CHANNEL), who.nick)

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        received: list[tuple[float, str, str]] = []
        with self._lock:
            listeners = list(self._people.values())
        if self._watcher is not None:
            listeners.append(self._watcher)
        for listener in listeners:
            for stamp, sender, target, text in listener.received():
                if sender != BOT:
                    continue
                if target.startswith("#") and listener.nick != WATCHER:
                    continue  # the channel's posts are read once, by the watcher
                received.append((stamp, target, text))
        received.sort(key=lambda item: item[0])
        people = {nick.lower() for nick in self._known_nicks()}
        posts = []
        for _, target, raw in received:
            text = strip_formatting(raw)
            words = {w.lower() for w in re.findall(r"[A-Za-z0-9\[\]\\`_^{|}-]+", text)}
            posts.append(
                Post(
                    place=Place(target),
                    text=text,
                    mentions=frozenset(words & people),
                )
            )
        return posts

    def _known_nicks(self) -> list[str]:
        return [person_nick(n) for n in range(64)]

    def platform_log(self) -> Iterator[str]:
        if self._server is not None:
            yield from self._server.log_tail(400).splitlines()
        with self._lock:
            listeners = list(self._people.values())
        for listener in listeners:
            for stamp, sender, target, text in listener.received():
                yield f"{time.strftime('%H:%M:%S', time.localtime(stamp))} {listener.nick} got "
                yield f"  {sender} -> {target}: {text[:120]!r}"
