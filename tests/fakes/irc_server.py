"""A small IRC server with IRCv3 capability negotiation and SASL PLAIN, for what no Debian
IRC server here does: ngIRCd (the IRC tests' real server, tests/ngircd_server.py) has no
SASL, and InspIRCd's needs a services package linked to it.

It keeps the rules a client meets (IRCv3 `capability-negotiation` 302 and `sasl` 3.1):
- `CAP LS 302` is answered with the offered capabilities, over two lines (`CAP * LS *
  :...` then `CAP * LS :...`), `sasl=PLAIN` carrying its mechanisms;
- registration waits for `CAP END` once a client sent `CAP LS`: no 001 before it;
- `CAP REQ` is acknowledged whole or refused whole (NAK) when any capability is not
  offered;
- `AUTHENTICATE PLAIN` gets `AUTHENTICATE +`; the payload is base64 in chunks of 400
  bytes, a shorter chunk (or `+` after a full one) ending it; `authzid NUL authcid NUL
  password` is checked against `accounts` (900 RPL_LOGGEDIN and 903 RPL_SASLSUCCESS,
  else 904 ERR_SASLFAIL); a mechanism it lacks is 908 RPL_SASLMECHS then 904;
  `AUTHENTICATE *` aborts (906); a payload over 400 bytes per line is 905;
- after registration: 001 (with the client's `nick!user@host`), 005 (`CASEMAPPING`,
  `NETWORK`), 376; PING is answered with PONG; everything the client sends is recorded
  (`received`), and `tell` sends a client a line (tags kept only when it acknowledged
  `message-tags`);
- with `history` (IRCv3 `chathistory`, draft 2020 as servers ship it, and `batch`):
  `batch` and `draft/chathistory` are offered and 005 says `CHATHISTORY=<history_limit>`;
  JOIN is echoed with 366; every PRIVMSG (`post`, or a client's) is kept with its
  `time` and `msgid` and delivered live to the channel's members or the nick;
  `CHATHISTORY AFTER <target> timestamp=<t>|msgid=<id> <limit>` answers the first
  `limit` (at most `history_limit`) messages after `t` or after that message (of a
  channel, or between the asker and a nick) in a `chathistory` batch,
  oldest first, after `history_delay` seconds; `CHATHISTORY TARGETS timestamp=<a>
  timestamp=<b> <limit>` lists the conversations with a message between the two in a
  `draft/chathistory-targets` batch.

Served from a loop in a thread of its own (`FakeIrc.running()`), on a free port of
127.0.0.1, without TLS.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

from channels.irc.wire import Line

SERVER = "fake.irc.test"
OFFERED = ("message-tags", "server-time", "multi-prefix", "sasl=PLAIN,EXTERNAL")


@dataclass(frozen=True)
class Said:
    """A PRIVMSG as the server keeps it for chathistory."""

    at: float
    msgid: str
    source: str
    target: str
    text: str

    def line(self, batch: str = "") -> str:
        stamp = datetime.fromtimestamp(self.at, UTC).isoformat(timespec="milliseconds")
        tags = f"time={stamp.replace('+00:00', 'Z')};msgid={self.msgid}"
        if batch:
            tags = f"batch={batch};{tags}"
        return f"@{tags} :{self.source} PRIVMSG {self.target} :{self.text}"


def parse_stamp(selector: str) -> float:
    value = selector.removeprefix("timestamp=").replace("Z", "+00:00")
    return datetime.fromisoformat(value).timestamp()


@dataclass
class Client:
    writer: asyncio.StreamWriter
    nick: str = ""
    user: str = ""
    caps: set[str] = field(default_factory=set)
    negotiating: bool = False
    registered: bool = False
    mechanism: str = ""
    payload: str = ""
    account: str = ""
    channels: set[str] = field(default_factory=set)

    def send(self, line: str) -> None:
        self.writer.write(line.encode() + b"\r\n")


class FakeIrc:
    """The server; `accounts` maps SASL accounts to passwords."""

    def __init__(
        self,
        accounts: dict[str, str] | None = None,
        *,
        offered: tuple[str, ...] = OFFERED,
        history: bool = False,
        history_limit: int = 50,
    ) -> None:
        self.accounts = dict(accounts or {})
        self.history = history
        self.history_limit = history_limit
        self.history_delay = 0.0
        self.offered = tuple(offered) + (("batch", "draft/chathistory") if history else ())
        self.said: list[Said] = []
        self._ids = itertools.count(1)
        self._last = 0.0
        self.received: list[str] = []
        self.clients: list[Client] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None

    @classmethod
    @contextlib.contextmanager
    def running(cls, accounts: dict[str, str] | None = None, **kwargs: object) -> Iterator[FakeIrc]:
        fake = cls(accounts, **kwargs)  # type: ignore[arg-type]
        thread = threading.Thread(target=fake._loop.run_forever, name="fake-irc", daemon=True)
        thread.start()
        asyncio.run_coroutine_threadsafe(fake._start(), fake._loop).result(10)
        try:
            yield fake
        finally:
            asyncio.run_coroutine_threadsafe(fake._stop(), fake._loop).result(10)
            fake._loop.call_soon_threadsafe(fake._loop.stop)
            thread.join(5)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for client in self.clients:
            client.writer.close()

    def post(self, source: str, target: str, text: str) -> None:
        """`source` (a nick, or `nick!user@host`) says `text` to `target`, a channel or a
        nick: kept for chathistory and delivered to whoever is there now."""
        if "!" not in source:
            source = f"{source}!~{source}@people.test"
        self._loop.call_soon_threadsafe(self._say, source, target, text)

    def _say(self, source: str, target: str, text: str) -> None:
        # Distinct, growing times: a real server's clock ticks between messages too.
        now = max(time.time(), self._last + 0.002)
        self._last = now
        said = Said(now, f"msg{next(self._ids)}", source, target, text)
        self.said.append(said)
        sender = source.split("!", 1)[0]
        for client in self.clients:
            if not client.registered or client.nick == sender:
                continue
            if (target.startswith("#") and target.lower() in client.channels) or (
                client.nick.lower() == target.lower()
            ):
                line = said.line()
                client.send(line if "message-tags" in client.caps else line.split(" ", 1)[1])

    def tell(self, nick: str, line: str) -> None:
        """Send `line` (with `@tags` first, if any) to the client registered as `nick`."""

        def send() -> None:
            for client in self.clients:
                if client.registered and client.nick == nick:
                    text = line
                    if text.startswith("@") and "message-tags" not in client.caps:
                        text = text.split(" ", 1)[1]
                    client.send(text)

        self._loop.call_soon_threadsafe(send)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = Client(writer)
        self.clients.append(client)
        try:
            while raw := await reader.readline():
                text = raw.decode("utf-8", "replace").rstrip("\r\n")
                self.received.append(text)
                self._handle(client, Line.parse(text))
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    def _handle(self, client: Client, line: Line) -> None:
        command, params = line.command, line.params
        target = client.nick or "*"
        if command == "CAP" and params:
            sub = params[0].upper()
            if sub == "LS":
                client.negotiating = True
                half = len(self.offered) // 2
                client.send(f":{SERVER} CAP {target} LS * :{' '.join(self.offered[:half])}")
                client.send(f":{SERVER} CAP {target} LS :{' '.join(self.offered[half:])}")
            elif sub == "REQ":
                names = {cap.split("=", 1)[0] for cap in self.offered}
                wanted = params[-1].split()
                if all(cap in names for cap in wanted):
                    client.caps |= set(wanted)
                    client.send(f":{SERVER} CAP {target} ACK :{params[-1]}")
                else:
                    client.send(f":{SERVER} CAP {target} NAK :{params[-1]}")
            elif sub == "END":
                client.negotiating = False
                self._maybe_register(client)
        elif command == "AUTHENTICATE" and params:
            self._authenticate(client, params[0])
        elif command == "NICK" and params:
            client.nick = params[0]
            self._maybe_register(client)
        elif command == "USER" and params:
            client.user = params[0]
            self._maybe_register(client)
        elif command == "JOIN" and params and client.registered:
            for name in params[0].split(","):
                client.channels.add(name.lower())
                client.send(f":{client.nick}!~{client.user}@127.0.0.1 JOIN {name}")
                client.send(f":{SERVER} 366 {client.nick} {name} :End of /NAMES list.")
        elif command == "PRIVMSG" and len(params) >= 2 and client.registered:
            self._say(f"{client.nick}!~{client.user}@127.0.0.1", params[0], params[1])
        elif command == "CHATHISTORY" and self.history and len(params) >= 3:
            self._loop.call_later(self.history_delay, self._history, client, params)
        elif command == "PING":
            client.send(f":{SERVER} PONG {SERVER} :{params[-1] if params else ''}")
        elif command == "QUIT":
            client.send("ERROR :Closing link (Quit)")
            client.writer.close()

    def _history(self, client: Client, params: tuple[str, ...]) -> None:
        reference = f"h{next(self._ids)}"
        if params[0].upper() == "TARGETS" and len(params) >= 4:
            start, end, limit = parse_stamp(params[1]), parse_stamp(params[2]), int(params[3])
            latest: dict[str, float] = {}
            for said in self.said:
                if not start < said.at <= end:
                    continue
                sender = said.source.split("!", 1)[0]
                if said.target.startswith("#"):
                    if said.target.lower() in client.channels:
                        latest[said.target] = said.at
                elif said.target.lower() == client.nick.lower():
                    latest[sender] = said.at
                elif sender == client.nick:
                    latest[said.target] = said.at
            client.send(f":{SERVER} BATCH +{reference} draft/chathistory-targets")
            for target, at in sorted(latest.items(), key=lambda item: item[1])[:limit]:
                stamp = datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds")
                stamp = stamp.replace("+00:00", "Z")
                client.send(
                    f"@batch={reference} :{SERVER} CHATHISTORY TARGETS {target} timestamp={stamp}"
                )
            client.send(f":{SERVER} BATCH -{reference}")
            return
        if params[0].upper() != "AFTER" or len(params) < 4:
            client.send(f"FAIL CHATHISTORY INVALID_PARAMS {params[0]} :not understood")
            return
        target, selector, limit = params[1], params[2], min(int(params[3]), self.history_limit)
        if selector.startswith("msgid="):
            marks = [said.at for said in self.said if said.msgid == selector[6:]]
            after = marks[0] if marks else float("inf")
        else:
            after = parse_stamp(selector)

        def belongs(said: Said) -> bool:
            if target.startswith("#"):
                return said.target.lower() == target.lower()
            sender = said.source.split("!", 1)[0].lower()
            pair = {sender, said.target.lower()}
            return pair == {client.nick.lower(), target.lower()}

        found = [said for said in self.said if said.at > after and belongs(said)][:limit]
        client.send(f":{SERVER} BATCH +{reference} chathistory {target}")
        for said in found:
            client.send(said.line(reference))
        client.send(f":{SERVER} BATCH -{reference}")

    def _authenticate(self, client: Client, argument: str) -> None:
        target = client.nick or "*"
        if "sasl" not in client.caps:
            client.send(f":{SERVER} 421 {target} AUTHENTICATE :Unknown command")
            return
        if argument == "*":
            client.mechanism = client.payload = ""
            client.send(f":{SERVER} 906 {target} :SASL authentication aborted")
            return
        if not client.mechanism:
            if argument.upper() != "PLAIN":
                client.send(f":{SERVER} 908 {target} PLAIN :are available SASL mechanisms")
                client.send(f":{SERVER} 904 {target} :SASL authentication failed")
                return
            client.mechanism = "PLAIN"
            client.send("AUTHENTICATE +")
            return
        if len(argument) > 400:
            client.mechanism = client.payload = ""
            client.send(f":{SERVER} 905 {target} :SASL message too long")
            return
        if argument != "+":
            client.payload += argument
        if len(argument) == 400:
            return  # more to come
        payload, client.payload, client.mechanism = client.payload, "", ""
        try:
            authzid, authcid, password = base64.b64decode(payload).decode().split("\0")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            client.send(f":{SERVER} 904 {target} :SASL authentication failed")
            return
        if self.accounts.get(authcid) != password or authzid not in ("", authcid):
            client.send(f":{SERVER} 904 {target} :SASL authentication failed")
            return
        client.account = authcid
        mask = f"{target}!{client.user or target}@127.0.0.1"
        client.send(f":{SERVER} 900 {target} {mask} {authcid} :You are now logged in")
        client.send(f":{SERVER} 903 {target} :SASL authentication successful")

    def _maybe_register(self, client: Client) -> None:
        if client.registered or client.negotiating or not (client.nick and client.user):
            return
        client.registered = True
        nick = client.nick
        client.send(
            f":{SERVER} 001 {nick} :Welcome to the fake network {nick}!~{client.user}@127.0.0.1"
        )
        history = f" CHATHISTORY={self.history_limit}" if self.history else ""
        client.send(
            f":{SERVER} 005 {nick} CASEMAPPING=rfc1459 NETWORK=FakeNet CHANTYPES=#{history} "
            ":are supported by this server"
        )
        client.send(f":{SERVER} 376 {nick} :End of /MOTD command.")
