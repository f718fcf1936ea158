"""The IRC channel: one connection to one network, IRC spoken over anyio's streams inside
the daemon's event loop (TLS by default), with no IRC library.

Why no library. IRC is a line protocol, and what the gateway needs of a client is in how
it reads and writes lines, which is where the libraries decide for it. A side-by-side
trial against ngIRCd (Debian's ngircd 26) of what the gateway needs:

- Journal before reading on (a line's handler awaited before the next line is read):
  pydle spawns a task per line (`on_data` -> `create_task(on_raw)`); irc's handlers are
  synchronous, so an await can only be scheduled; bottom spawns a task per event (and 2.2
  does not run on Python 3.11: `asyncio.Event(loop=)`). Here: one line, one `submit`,
  then the next line.
- Flood control: pydle's is fixed (3 lines, then 2 s waits: 300 lines took 450 s), with
  PONGs queued behind it; irc's asyncio client and bottom have none (300 lines written
  at once, which ngIRCd then takes 3 a second: PONGs wait 100 s behind them). Here: a token bucket
  from the settings, which PONG, QUIT and registration jump.
- IRCv3 capabilities and SASL: pydle has both; irc and bottom neither. Here: CAP LS 302
  and SASL PLAIN.
- TLS with a private CA: all three, and here.

Each of them would have to be worked around at the one place the delivery promise lives,
so the channel speaks the protocol itself (`channels.irc.wire`: parsing, case mapping,
SASL's payload, the token bucket; all pure and tested alone).

Where a conversation lives (the session key, built here):
- a channel: `irc:<network>:<#channel>`; a private message: `irc:<network>:<nick>`, the
  sender's nick. Both names are folded as the server compares them (ISUPPORT
  CASEMAPPING: `#Team` and `#team` are one conversation, and so are `Bob` and `bob`).
  `<network>` is `channels.irc.network` (default: the host), so the keys stay when the
  bot moves to another server of the same network.
- A nick is not an identity: IRC has no stable user id, so a person who changes nick
  starts a new DM conversation, and whoever takes a nick that is free gets its DM
  conversation and its pairing approval. Where that matters, give the bot an allowlist
  only on a network where nicks are registered (docs/irc.md, "Who is who").
In a channel the bot answers a message addressed to it (`nick: ...`, `nick, ...`, or its
nick as a word anywhere: `require_mention`, applied by the access gate); a private
message is a DM (pairing by default). `!command` is the gateway's `/command` (an IRC
client sends a line that starts with `/` to the server as a command of its own).

Delivery. IRC keeps nothing and confirms nothing: a line the server sends while the bot
is not connected is gone, and there is no message id and no redelivery. So:
- Journal before reading on: a line is handed to the gateway when it is read from the
  socket. Lines are read one at a time, and the next is read only once `submit` returned
  for this one (journaled, or settled). One that was not taken (the journal failed) is
  submitted again, reading held meanwhile, until it is taken or the connection ends.
- A message's id is its IRCv3 `msgid` where the server tags messages, else one made up
  from the connection and the line's place in it (unique, never sent twice).
- What is written while the bot is away (a restart, a reconnect, a drain) is not seen,
  unless the server offers IRCv3 chathistory (`draft/chathistory` with `batch`), which
  ngIRCd does not. Where it does, the channel reads back what it missed (`_catch_up`):
  each conversation's position (the server-time of the last message settled there, in
  the workspace's `channel-cursors.json` or the shared mode's `gw_channel_cursors`)
  moves past a message only after it was submitted; after a channel is joined, and for
  private conversations the server lists (`CHATHISTORY TARGETS`), the messages after the
  position (less a second: the journal drops what it has by `msgid`) are read back in
  pages, oldest first, and the conversation's live messages wait until its history is
  in. Bounds: `history_max_age_seconds`, `history_max_messages` per conversation; the
  first connection reads nothing back (there is no position yet).
- IRC hands no line over twice, so the channel says `redelivers = False`: at a drain
  the bot goes on reading, the dispatcher journals what people write for the next
  start (`gateway.channel`), and the bot marks itself away (`pause_intake`), so the
  server tells them the answer comes after the restart (docs/irc.md says what is
  promised instead of catch-up where there is no chathistory).
- A reply goes out as one PRIVMSG per line, each at most what fits in 512 bytes with the
  prefix the server adds (`channels.irc.format`), paced by a token bucket
  (`burst_lines`, then one per `line_interval_seconds`) so the server neither delays the
  bot's PONGs behind a flood nor disconnects it ("Excess Flood"). A reply that could not
  be written (no connection for `Pacing.send_wait`, or the connection broke) raises
  `DeliveryFailed`, and the same reply sent again goes on at the first line that was not
  written. IRC acknowledges nothing: a line the kernel took just before the connection
  broke may be lost.
- Reconnects: a connection that ends (the server closed it, no line for
  `Pacing.ping_idle` + `Pacing.ping_timeout` after a PING, a network error) is made again
  after 2, 4, 8, ... seconds, at most `reconnect_max_seconds`, with jitter; the wait starts
  over after a connection that lived `Pacing.stable_after`. A refusal that retrying cannot
  mend (SASL or the server password refused, the nick invalid) raises `IrcSetupError`.
- Replicas: only one replica may hold the nick's connection (the "irc connection"
  leader role, which writes the read positions); the others hand their replies to it
  (`gateway.journal.pg_relay`), keyed by the reply, so a reply relayed twice goes out
  once.
- Nothing the model writes can become a command: CR, LF, NUL and CTCP's `\\x01` never
  reach the wire (`channels.irc.format`, `wire.Line.render`).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from loguru import logger

from channels.irc.format import reply_lines, text_budget
from channels.irc.settings import IrcSettings
from channels.irc.wire import (
    MAX_INCOMING,
    ISupport,
    Line,
    TokenBucket,
    ctcp,
    decode,
    parse_source,
    sasl_plain_chunks,
    strip_formatting,
)
from gateway.agent.commands import COMMANDS
from gateway.channel import DeliveryFailed, PartsSent, Submit
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    META_SENT_AT,
    InboundMessage,
    OutboundMessage,
)

CHANNEL = "irc"
#: The IRCv3 capabilities the channel asks for when the server offers them.
WANTED_CAPS = (
    "message-tags",
    "server-time",
    "multi-prefix",
    "batch",
    "draft/chathistory",
    "chathistory",
)
HISTORY_CAPS = ("draft/chathistory", "chathistory")
HISTORY_BATCH = ("chathistory", "draft/chathistory")
TARGETS_BATCH = ("draft/chathistory-targets", "chathistory-targets")
#: The read positions' cursor holds this key for the last moment everything was read.
EVERYTHING = "*"
#: Numerics that end a SASL exchange in failure (IRCv3 `sasl`).
SASL_FAILED = {"902", "904", "905", "906", "908"}
#: Numerics of a JOIN the server refused.
JOIN_REFUSED = {"403", "405", "471", "473", "474", "475", "476", "477", "489"}
#: A host part as long as a server may show it, for the budget before the bot knows its own.
LONGEST_HOST = 63
_REMEMBERED = 10_000
AWAY_TEXT = "restarting: what you write now is answered once I am back"


class IrcSetupError(Exception):
    """The connection was refused for a reason retrying cannot mend (says what to fix;
    never holds a password)."""


class ConnectionLost(Exception):
    """The connection ended (or was found dead) while a line was read or written."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patient the channel is with the server (seconds)."""

    connect_timeout: float = 20.0
    #: From the TCP connection to the end of the MOTD (SASL included).
    register_timeout: float = 60.0
    #: Joining the configured channels, after which the bot is live whatever answered.
    join_timeout: float = 20.0
    #: A PING after this long without a line from the server...
    ping_idle: float = 90.0
    #: ...and the connection is dead when still nothing came this long after it.
    ping_timeout: float = 60.0
    #: A line that cannot be written for this long (the kernel's buffer stays full)
    #: means the connection is dead.
    write_timeout: float = 30.0
    reconnect_first: float = 2.0
    #: A connection that lived this long starts the reconnect backoff over.
    stable_after: float = 60.0
    #: How long a reply waits for a connection before `DeliveryFailed`.
    send_wait: float = 30.0
    #: Between two submits of a line that was not taken (the journal failed).
    resubmit_pause: float = 1.0
    #: How often the bot asks for its own nick back while the server gave it another.
    regain_nick: float = 30.0
    rejoin_after: float = 10.0
    stop_timeout: float = 5.0
    #: How long live messages of a conversation wait for its history before they go on.
    history_wait: float = 30.0
    #: Read positions are saved at most this often (and when the connection ends).
    save_positions: float = 1.0


# --------------------------------------------------------------------------- inbound


@dataclass(frozen=True, slots=True)
class Skip:
    """Nothing to do for this line (logged at debug level with `reason`)."""

    reason: str


def chat_id_for(network: str, name: str, isupport: ISupport) -> str:
    """The chat id of a channel or a nick: `<network>:<name folded>`."""
    return f"{network}:{isupport.casemap.fold(name)}"


def split_chat_id(chat_id: str) -> tuple[str, str]:
    """(network, target) of a chat id."""
    network, sep, target = chat_id.rpartition(":")
    if not sep or not network or not target:
        raise ValueError(f"not an IRC chat id (<network>:<#channel or nick>): {chat_id!r}")
    return network, target


_NICK_CHARS = r"A-Za-z0-9\[\]\\`_^{|}-"


def addressing(text: str, nick: str, isupport: ISupport) -> tuple[bool, str]:
    """Whether a channel message addresses `nick`, and its text without the address.
    Addressed: it starts with the nick and `:` or `,` (the address is cut), or holds
    the nick as a word (as clients highlight it), compared as the server folds names."""
    fold = isupport.casemap.fold
    head = re.match(rf"\s*([{_NICK_CHARS}]+)[:,]\s*", text)
    if head is not None and fold(head.group(1)) == fold(nick):
        rest = text[head.end() :]
        return True, rest if rest.strip() else text.strip()
    folded, me = fold(text), fold(nick)
    for found in re.finditer(re.escape(me), folded):
        before = folded[found.start() - 1] if found.start() else " "
        after = folded[found.end()] if found.end() < len(folded) else " "
        if not re.match(rf"[{_NICK_CHARS}]", before) and not re.match(rf"[{_NICK_CHARS}]", after):
            return True, text.strip()
    return False, text.strip()


def as_command(text: str) -> str:
    """`!new` as the gateway's `/new` (an IRC client would send `/new` to the server as a
    command of its own); any other text as it is."""
    match = re.match(r"!([a-z]+)\b", text)
    if match is not None and match.group(1) in COMMANDS:
        return "/" + text[1:]
    return text


def translate(
    line: Line,
    *,
    me: str,
    isupport: ISupport,
    network: str,
    message_id: str,
    now: float,
) -> InboundMessage | Skip:
    """The inbound message (or nothing) for one PRIVMSG line."""
    if line.command != "PRIVMSG" or len(line.params) < 2:
        return Skip(f"a {line.command} line")
    nick, user, _ = parse_source(line.source)
    if not nick or not user:
        return Skip("a message from a server")
    fold = isupport.casemap.fold
    if fold(nick) == fold(me):
        return Skip("the bot's own message")
    target, raw = line.params[0], line.params[1]
    special = ctcp(raw)
    if special is not None:
        if special[0] != "ACTION" or not special[1].strip():
            return Skip(f"a CTCP {special[0]}")
        raw = f"* {nick} {special[1]}"
    text = strip_formatting(raw).strip()
    if not text:
        return Skip("an empty message")
    channel = target
    if channel[:1] in "~@%+" and isupport.is_channel(channel[1:]):
        channel = channel[1:]  # a STATUSMSG (`@#team`: to the channel's operators)
    is_group = isupport.is_channel(channel)
    metadata: dict[str, Any] = {
        META_IS_GROUP: is_group,
        META_SENDER_NAME: nick,
        META_SENT_AT: _server_time(line) or now,
        META_REPLY_CONTEXT: {"nick": nick},
    }
    if is_group:
        mentioned, text = addressing(text, me, isupport)
        metadata[META_MENTIONED] = mentioned
        metadata[META_REPLY_TO_BOT] = False
        chat_id = chat_id_for(network, channel, isupport)
    else:
        chat_id = chat_id_for(network, nick, isupport)
    return InboundMessage(
        channel=CHANNEL,
        chat_id=chat_id,
        text=as_command(text),
        sender_id=fold(nick),
        message_id=line.tags.get("msgid") or message_id,
        metadata=metadata,
    )


def _server_time(line: Line) -> float | None:
    """The IRCv3 `time` tag (server-time) as Unix seconds."""
    stamp = line.tags.get("time")
    if not stamp:
        return None
    from datetime import datetime

    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _iso(when: float) -> str:
    """Unix seconds as IRCv3's timestamp (`2024-01-02T03:04:05.678Z`)."""
    from datetime import UTC, datetime

    stamp = datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


class _MemoryCursors:
    """Read positions kept in memory only (a channel built without a store)."""

    def __init__(self) -> None:
        self._values: dict[str, str] = {}
        self._blobs: dict[str, bytes] = {}

    async def load(self, name: str) -> str | None:
        return self._values.get(name)

    async def save(self, name: str, value: str) -> None:
        self._values[name] = value

    async def load_blob(self, name: str) -> bytes | None:
        return self._blobs.get(name)

    async def save_blob(self, name: str, data: bytes) -> None:
        self._blobs[name] = data


def _at_once(store: CursorStore) -> Lead:
    async def lead(work: Callable[[CursorStore], Awaitable[None]]) -> None:
        await work(store)

    return lead


# --------------------------------------------------------------------------- the link


class Link:
    """One TCP (or TLS) connection to the server: lines in, lines out, writes paced."""

    def __init__(
        self, stream: anyio.abc.ByteStream, bucket: TokenBucket, *, write_timeout: float
    ) -> None:
        self._stream = stream
        self._receive = BufferedByteReceiveStream(stream)
        self._bucket = bucket
        self._write_timeout = write_timeout
        self._write_lock = anyio.Lock()
        self._pace_lock = anyio.Lock()
        self.last_read = time.monotonic()
        self.reading = False  # waiting for the server (not busy with a line)
        self.closed = False

    async def read(self) -> Line:
        """The next line from the server; ConnectionLost when the connection ended."""
        self.reading = True
        try:
            raw = await self._receive.receive_until(b"\n", MAX_INCOMING)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError) as exc:
            raise ConnectionLost("the server closed the connection") from exc
        except anyio.DelimiterNotFound as exc:
            raise ConnectionLost("the server sent a line over 8,703 bytes") from exc
        except (OSError, anyio.BrokenResourceError, ssl.SSLError) as exc:
            raise ConnectionLost(f"reading failed: {exc!r}") from exc
        finally:
            self.reading = False
        self.last_read = time.monotonic()
        return Line.parse(decode(raw.rstrip(b"\r")))

    async def send(self, line: Line, *, paced: bool = True) -> None:
        """Write one line; `paced` lines wait for the token bucket, in order (PONG,
        QUIT and registration go at once). ConnectionLost when it could not be written:
        a line cut short is never taken by the server (it has no CRLF)."""
        data = line.render().encode("utf-8") + b"\r\n"
        if paced:
            async with self._pace_lock:
                await anyio.sleep(self._bucket.take(time.monotonic()))
                await self._write(data)
        else:
            await self._write(data)

    async def _write(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionLost("the connection is closed")
        async with self._write_lock:
            try:
                with anyio.fail_after(self._write_timeout):
                    await self._stream.send(data)
            except TimeoutError as exc:
                await self.aclose()
                raise ConnectionLost("the server took no data for a while") from exc
            except (
                OSError,
                ssl.SSLError,
                anyio.EndOfStream,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
            ) as exc:
                await self.aclose()
                raise ConnectionLost(f"writing failed: {exc!r}") from exc

    async def aclose(self) -> None:
        self.closed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            try:
                await self._stream.aclose()
            except (OSError, anyio.BrokenResourceError, ssl.SSLError):
                pass


async def open_link(settings: IrcSettings, pacing: Pacing) -> Link:
    """Connect (TLS when `settings.tls`); OSError or ssl.SSLError when it cannot."""
    host, port = settings.host or "", settings.resolved_port()
    with anyio.fail_after(pacing.connect_timeout):
        if settings.tls:
            context = ssl.create_default_context(
                cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None
            )
            stream: anyio.abc.ByteStream = await anyio.connect_tcp(
                host, port, ssl_context=context, tls_hostname=host, tls_standard_compatible=False
            )
        else:
            stream = await anyio.connect_tcp(host, port)
    bucket = TokenBucket(settings.burst_lines, settings.line_interval_seconds)
    return Link(stream, bucket, write_timeout=pacing.write_timeout)


# --------------------------------------------------------------------------- registration


@dataclass
class Identity:
    """Who the bot is on the connection: its nick, its `nick!user@host` (once the server
    showed it), what the server supports, and the capabilities it acknowledged."""

    nick: str
    user: str
    host: str = ""
    isupport: ISupport = field(default_factory=ISupport)
    caps: set[str] = field(default_factory=set)

    @property
    def source(self) -> str:
        return f"{self.nick}!{self.user}@{self.host or 'x' * LONGEST_HOST}"

    @property
    def history(self) -> bool:
        """The server reads history back to the bot (IRCv3 chathistory, with batches)."""
        return "batch" in self.caps and any(cap in self.caps for cap in HISTORY_CAPS)


async def register(link: Link, settings: IrcSettings, pacing: Pacing) -> Identity:
    """CAP negotiation (SASL PLAIN when an account is set), PASS, NICK and USER, up to
    the end of the MOTD. Raises IrcSetupError for a refusal retrying cannot mend,
    ConnectionLost when the connection ends, TimeoutError past `register_timeout`."""
    nick = settings.nick
    user = settings.username or settings.nick
    me = Identity(nick=nick, user=user[:10])
    account, password = settings.sasl_username, settings.resolved_sasl_password()
    offered: set[str] = set()
    sasl_pending = bool(account)
    negotiating = True
    await link.send(Line("CAP", ("LS", "302")), paced=False)
    if server_password := settings.resolved_password():
        await link.send(Line("PASS", (server_password,)), paced=False)
    await link.send(Line("NICK", (nick,)), paced=False)
    await link.send(Line("USER", (me.user, "0", "*", settings.realname)), paced=False)
    registered = False
    with anyio.fail_after(pacing.register_timeout):
        while True:
            line = await link.read()
            command, params = line.command, line.params
            if command == "PING":
                await link.send(Line("PONG", params[-1:]), paced=False)
            elif command == "ERROR":
                reason = params[-1] if params else ""
                if not registered and ("password" in reason.lower() or "ban" in reason.lower()):
                    raise IrcSetupError(f"irc: the server refused the bot: {reason}")
                raise ConnectionLost(f"the server closed the connection: {reason}")
            elif command == "CAP" and len(params) >= 3:
                sub = params[1].upper()
                if sub == "LS":
                    offered |= {cap.split("=", 1)[0] for cap in params[-1].split()}
                    if len(params) >= 4 and params[2] == "*":
                        continue  # more to come
                    wanted = [c for c in WANTED_CAPS if c in offered]
                    if account:
                        if "sasl" not in offered:
                            raise IrcSetupError(
                                f"irc: {settings.host} offers no SASL, and "
                                "channels.irc.sasl_username is set; remove it (and log in "
                                "another way) or use a server of the network that has SASL"
                            )
                        wanted.append("sasl")
                    if wanted:
                        await link.send(Line("CAP", ("REQ", " ".join(wanted))), paced=False)
                    else:
                        negotiating = False
                        await link.send(Line("CAP", ("END",)), paced=False)
                elif sub == "ACK":
                    me.caps |= set(params[-1].split())
                    if sasl_pending and "sasl" in me.caps:
                        await link.send(Line("AUTHENTICATE", ("PLAIN",)), paced=False)
                    else:
                        negotiating = False
                        await link.send(Line("CAP", ("END",)), paced=False)
                elif sub == "NAK":
                    if account:
                        raise IrcSetupError(f"irc: {settings.host} refused the SASL capability")
                    negotiating = False
                    await link.send(Line("CAP", ("END",)), paced=False)
            elif command == "AUTHENTICATE" and params == ("+",) and account:
                for chunk in sasl_plain_chunks(account, password or ""):
                    await link.send(Line("AUTHENTICATE", (chunk,)), paced=False)
            elif command == "903":  # RPL_SASLSUCCESS
                sasl_pending = False
                negotiating = False
                await link.send(Line("CAP", ("END",)), paced=False)
            elif command in SASL_FAILED:
                raise IrcSetupError(
                    f"irc: SASL login as {account!r} failed ({params[-1] if params else command}); "
                    "check channels.irc.sasl_username and GATEWAY_CHANNELS__IRC__SASL_PASSWORD"
                )
            elif command == "001":
                registered = True
                me.nick = params[0] if params else me.nick
                _, user_seen, host = parse_source(params[-1].rsplit(" ", 1)[-1])
                if host:
                    me.user, me.host = user_seen or me.user, host
            elif command == "005":
                me.isupport.update(params[1:-1])
            elif command in ("376", "422"):  # end of MOTD, or none
                if account and sasl_pending:
                    raise IrcSetupError(f"irc: {settings.host} registered the bot without SASL")
                return me
            elif command in ("432",):
                raise IrcSetupError(
                    f"irc: the server refuses the nick {nick!r} ({params[-1]}); change "
                    "channels.irc.nick"
                )
            elif command in ("433", "436") and not registered:
                me.nick = _next_nick(me.nick, settings.nick)
                await link.send(Line("NICK", (me.nick,)), paced=False)
            elif command == "464":
                raise IrcSetupError(
                    "irc: the server refused its password; check GATEWAY_CHANNELS__IRC__PASSWORD"
                )
            elif command == "465":
                raise IrcSetupError(f"irc: the server bans the bot: {params[-1]}")
            elif command == "421" and len(params) >= 2 and params[1] == "CAP" and negotiating:
                # A server without IRCv3 capabilities goes on registering.
                negotiating = False
                if account:
                    raise IrcSetupError(f"irc: {settings.host} knows no CAP, so no SASL")


def _next_nick(current: str, wanted: str) -> str:
    """The nick to try after `current` was taken: the wanted one with one more `_`."""
    extra = max(1, len(current) - len(wanted) + 1)
    return wanted + "_" * extra if extra <= 3 else f"{wanted[:20]}{secrets.token_hex(2)}"


# --------------------------------------------------------------------------- channel


def sole(exc: BaseException) -> BaseException:
    """The one exception inside (nested) groups of one, so that a caller catches the
    channel's own errors (ConnectionLost, IrcSetupError) and not a task group's wrapper."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class IrcChannel:
    """The IRC adapter; see the module docstring for what it promises."""

    name = CHANNEL
    #: A line is read once: the dispatcher keeps what comes while the gateway stops.
    redelivers = False

    def __init__(self, settings: IrcSettings, *, pacing: Pacing | None = None) -> None:
        if not settings.host:
            raise ConfigError(
                "channels.irc.host: set the IRC server (GATEWAY_CHANNELS__IRC__HOST), e.g. "
                "irc.libera.chat"
            )
        if settings.sasl_username and not settings.resolved_sasl_password():
            raise ConfigError(
                "channels.irc.sasl_username is set without a password: set "
                "GATEWAY_CHANNELS__IRC__SASL_PASSWORD (or sasl_password_file)"
            )
        self.settings = settings
        self.pacing = pacing or Pacing()
        self.network = settings.resolved_network()
        #: Runs the connection with the store of read positions: at once (one process,
        #: `gateway.journal.cursors.run_with`), or once this replica holds the "irc
        #: connection" role; None: at once, positions in memory only.
        self.lead: Lead | None = None
        #: Several replicas share the nick: one holds the connection, the others hand it
        #: their replies (`relay`) and are ready at once.
        self.replicas = False
        self.relay: Any = None
        self._store: CursorStore | None = None
        self._positions: dict[str, float] = {}  # conversation -> server-time settled
        self._positions_dirty = False
        self._history: dict[str, list[Line]] = {}  # conversation -> live lines held
        self._history_since: dict[str, float] = {}  # conversation -> read back after
        self._history_read: dict[str, int] = {}  # conversation -> messages read back
        self._batches: dict[str, tuple[str, str]] = {}  # reference -> (type, target)
        self._batch_count: dict[str, int] = {}
        self._batch_last: dict[str, str] = {}  # reference -> msgid of its last message
        self._intake = anyio.Lock()  # one message (or held history) submitted at a time
        self._watermark_at = 0.0
        self._targets_pending = False  # private conversations with news not listed yet
        self.read_back = 0  # messages read back through chathistory (tests, logs)
        self._submit: Submit | None = None
        self._link: Link | None = None
        self._me: Identity | None = None
        self._up = anyio.Event()  # set while a registered connection is there
        self._holding = False
        self._paused = False
        self._lines = 0
        self._connection_id = ""
        self._joining: set[str] = set()
        self._joined = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None  # the connection's tasks
        self._sent_parts = PartsSent[str, tuple[list[str], int]](_REMEMBERED)
        self.connections = 0  # connections registered (tests, logs)
        self.live = anyio.Event()  # set once the first connection joined its channels

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold the connection until cancelled, reconnecting with backoff (in the shared
        mode once this replica holds the "irc connection" role). Raises IrcSetupError
        when the server refuses the bot for good (the daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        try:
            async with anyio.create_task_group() as tg:
                if self.relay is not None:
                    tg.start_soon(self.relay.listen)
                lead = self.lead or _at_once(_MemoryCursors())
                if self.replicas:
                    # One replica holds the nick's connection (a second would be a second
                    # nick, answering every message again); the others relay replies.
                    task_status.started()
                    await lead(lambda store: self._hold(None, store))
                else:
                    await lead(lambda store: self._hold(task_status.started, store))
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise sole(group) from None  # the daemon reports the channel's own error
        finally:
            self._link = None
            self._up = anyio.Event()
            self.live = anyio.Event()

    def pause_intake(self) -> None:
        """The daemon is draining: the bot marks itself away, so the server tells whoever
        writes to it that the answer comes after the restart. Lines are still read and
        submitted (the dispatcher journals them for the next start: IRC would not hand
        them over again). Replies still go out until the channel stops."""
        self._paused = True
        self._spawn(self._mark_away)

    async def _mark_away(self) -> None:
        link = self._link
        if link is not None and not link.closed:
            try:
                await link.send(Line("AWAY", (AWAY_TEXT,)), paced=False)
            except ConnectionLost:
                pass

    def _spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        if self._tg is not None:
            self._tg.start_soon(func, *args)

    async def _hold(self, on_live: Callable[[], None] | None, store: CursorStore) -> None:
        """Connections, one after another, with backoff between them; the read positions
        loaded from `store` first and saved there while they move, and at the end."""
        self._holding = True
        self._store = store
        await self._load_positions()
        backoff = self.pacing.reconnect_first
        try:
            async with anyio.create_task_group() as tg:
                if self.relay is not None:
                    tg.start_soon(self.relay.serve, self._relayed_send)
                tg.start_soon(self._keep_positions)
                while True:
                    began = time.monotonic()
                    try:
                        await self._connection(on_live)
                        problem = "the connection ended"
                    except (ConnectionLost, OSError, ssl.SSLError, TimeoutError) as exc:
                        problem = str(exc) or type(exc).__name__
                    if on_live is not None and self.live.is_set():
                        on_live = None
                    if time.monotonic() - began >= self.pacing.stable_after:
                        backoff = self.pacing.reconnect_first
                    delay = backoff * random.uniform(0.75, 1.25)
                    logger.warning(
                        "irc: {} ({}:{}); reconnecting in {:.1f}s",
                        problem,
                        self.settings.host,
                        self.settings.resolved_port(),
                        delay,
                    )
                    await anyio.sleep(delay)
                    backoff = min(backoff * 2, self.settings.reconnect_max_seconds)
        except BaseExceptionGroup as group:
            raise sole(group) from None
        finally:
            self._holding = False
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.pacing.stop_timeout):
                await self._save_positions()
            self._store = None

    async def _connection(self, on_live: Callable[[], None] | None) -> None:
        """One connection: register, join, then read until it ends."""
        link = await open_link(self.settings, self.pacing)
        try:
            me = await register(link, self.settings, self.pacing)
            self.connections += 1
            self._connection_id = f"{int(time.time())}{secrets.token_hex(3)}"
            self._lines = 0
            self._me, self._link = me, link
            logger.info(
                "irc: registered as {} on {} ({}:{}{})",
                me.nick,
                me.isupport.network or self.network,
                self.settings.host,
                self.settings.resolved_port(),
                ", TLS" if self.settings.tls else "",
            )
            self._up.set()
            self._history.clear()
            self._history_since.clear()
            self._history_read.clear()
            self._batches.clear()
            self._batch_count.clear()
            self._batch_last.clear()
            self._targets_pending = False
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._keepalive, link)
                tg.start_soon(self._join_all, link, on_live)
                if me.history:
                    tg.start_soon(self._catch_up_private, link)
                if self._paused:
                    tg.start_soon(self._mark_away)
                try:
                    await self._read(link)
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise sole(group) from None
        finally:
            self._tg = None
            self._up = anyio.Event()
            self._link = None
            if not link.closed:
                # Leaving: QUIT frees the nick at once (a next start gets it back).
                with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                    try:
                        await link.send(Line("QUIT", ("gateway stopping",)), paced=False)
                    except ConnectionLost:
                        pass
            await link.aclose()

    async def _join_all(self, link: Link, on_live: Callable[[], None] | None) -> None:
        """Join the configured channels; live once each answered (or after a while)."""
        me = self._me
        assert me is not None
        self._joined = anyio.Event()
        self._joining = {
            me.isupport.casemap.fold(entry.split(" ", 1)[0]) for entry in self.settings.channels
        }
        for entry in self.settings.channels:
            name, _, key = entry.partition(" ")
            await link.send(Line("JOIN", (name, key) if key else (name,)))
        if self._joining:
            with anyio.move_on_after(self.pacing.join_timeout):
                await self._joined.wait()
            if self._joining:
                logger.warning("irc: no answer to joining {}", ", ".join(sorted(self._joining)))
        self.live.set()
        if on_live is not None:
            on_live()

    def _joined_one(self, name: str) -> None:
        me = self._me
        if me is None:
            return
        self._joining.discard(me.isupport.casemap.fold(name))
        if not self._joining:
            self._joined.set()

    async def _keepalive(self, link: Link) -> None:
        """PING when the server is quiet, and close a connection that stays silent; ask
        for the wanted nick back while the bot has another."""
        pinged = False
        regained = time.monotonic()
        while not link.closed:
            await anyio.sleep(min(5.0, self.pacing.ping_idle / 4))
            now = time.monotonic()
            quiet = now - link.last_read
            if not link.reading:
                continue  # busy with a line (a submit): the server is not to blame
            if quiet > self.pacing.ping_idle + self.pacing.ping_timeout and pinged:
                logger.warning("irc: no answer from the server for {:.0f}s", quiet)
                await link.aclose()
                return
            if quiet > self.pacing.ping_idle and not pinged:
                await link.send(Line("PING", ("keepalive",)), paced=False)
                pinged = True
            elif quiet <= self.pacing.ping_idle:
                pinged = False
            me = self._me
            if (
                me is not None
                and me.nick != self.settings.nick
                and now - regained > self.pacing.regain_nick
            ):
                regained = now
                await link.send(Line("NICK", (self.settings.nick,)), paced=False)

    # ----------------------------------------------------------------- inbound

    async def _read(self, link: Link) -> None:
        """Read lines one at a time; a PRIVMSG is submitted before the next is read."""
        while True:
            line = await link.read()
            await self._on_line(link, line)

    async def _on_line(self, link: Link, line: Line) -> None:
        me = self._me
        assert me is not None
        command, params = line.command, line.params
        nick = line.nick
        fold = me.isupport.casemap.fold
        if command == "PING":
            await link.send(Line("PONG", params[-1:]), paced=False)
        elif command == "PRIVMSG":
            await self._on_message(link, line, me)
        elif command == "BATCH" and params:
            await self._on_batch(link, line)
        elif command == "CHATHISTORY" and len(params) >= 3 and params[0] == "TARGETS":
            async with self._intake:
                await self._on_history_target(link, line, me)
        elif command == "FAIL" and params[:1] == ("CHATHISTORY",):
            logger.warning("irc: the server refused to read history back: {}", params[-1])
            async with self._intake:
                for target in list(self._history):
                    await self._release(target)
        elif command == "ERROR":
            raise ConnectionLost(f"the server closed the connection: {params[-1:]}")
        elif command == "JOIN" and params and fold(nick) == fold(me.nick):
            _, user, host = parse_source(line.source)
            if host:
                me.user, me.host = user or me.user, host
            self._joined_one(params[0])
            logger.info("irc: joined {}", params[0])
            if me.history:
                async with self._intake:
                    await self._ask_history(link, params[0])
        elif command in JOIN_REFUSED and len(params) >= 2:
            logger.error("irc: cannot join {}: {}", params[1], params[-1])
            self._joined_one(params[1])
        elif command == "NICK" and params and fold(nick) == fold(me.nick):
            me.nick = params[0]
            logger.info("irc: the bot's nick is now {}", me.nick)
        elif command == "KICK" and len(params) >= 2 and fold(params[1]) == fold(me.nick):
            logger.warning("irc: kicked from {} by {}: {}", params[0], nick, params[-1])
            self._spawn(self._rejoin, link, params[0])
        elif command == "005":
            me.isupport.update(params[1:-1])

    async def _rejoin(self, link: Link, channel: str) -> None:
        """Join a configured channel again a while after the bot was kicked from it."""
        configured = {self._fold(entry.split(" ", 1)[0]): entry for entry in self.settings.channels}
        entry = configured.get(self._fold(channel))
        if entry is None:
            return
        await anyio.sleep(self.pacing.rejoin_after)
        name, _, key = entry.partition(" ")
        try:
            await link.send(Line("JOIN", (name, key) if key else (name,)))
        except ConnectionLost:
            pass

    def _fold(self, name: str) -> str:
        me = self._me
        return me.isupport.casemap.fold(name) if me is not None else name.lower()

    # ----------------------------------------------------------------- history

    def _conversation(self, line: Line, me: Identity) -> str:
        """The folded name of the conversation of a PRIVMSG: its channel, or the other
        party's nick (the target, for the bot's own message read back)."""
        fold = me.isupport.casemap.fold
        target = line.params[0] if line.params else ""
        if target[:1] in "~@%+" and me.isupport.is_channel(target[1:]):
            target = target[1:]
        if me.isupport.is_channel(target) or fold(line.nick) == fold(me.nick):
            return fold(target)
        return fold(line.nick)

    async def _on_message(self, link: Link, line: Line, me: Identity) -> None:
        """A PRIVMSG: held while its conversation's history is being read back, else
        submitted (a read-back one too), and its conversation's position moved past it."""
        conversation = self._conversation(line, me)
        batch = line.tags.get("batch")
        async with self._intake:
            if batch is None and conversation in self._history:
                self._history[conversation].append(line)  # after what is read back
                return
            if batch is not None and batch in self._batch_count:
                self._batch_count[batch] += 1
                self._batch_last[batch] = line.tags.get("msgid", "")
                self.read_back += 1
            if await self._take(line, me):
                self._settled(conversation, line)

    def _settled(self, conversation: str, line: Line) -> None:
        when = _server_time(line)
        if when is not None and when > self._positions.get(conversation, 0.0):
            self._positions[conversation] = when
            self._positions_dirty = True

    async def _ask_history(
        self, link: Link, target: str, since: float | None = None, *, after_id: str = ""
    ) -> None:
        """Read back what `target` (a channel, or a nick's private conversation) holds
        after its position (or, for a next page, after the message `after_id`); its live
        messages wait meanwhile (`history_wait` at most). The caller holds `_intake`."""
        me = self._me
        if me is None or not me.history:
            return
        conversation = me.isupport.casemap.fold(target)
        if since is None:
            since = self._positions.get(conversation) or self._positions.get(EVERYTHING)
        if since is None:
            return  # the first connection: nothing was missed that the bot owes
        since = max(since, time.time() - self.settings.history_max_age_seconds)
        left = self.settings.history_max_messages - self._history_read.get(conversation, 0)
        if left <= 0:
            await self._release(conversation)
            return
        page = min(left, me.isupport.history_limit or 100)
        first = conversation not in self._history
        self._history.setdefault(conversation, [])
        self._history_since[conversation] = since
        # The first page from a second back: messages of the same millisecond are asked
        # again, and the journal drops those it has by their msgid.
        selector = f"msgid={after_id}" if after_id else f"timestamp={_iso(since - 1.0)}"
        await link.send(Line("CHATHISTORY", ("AFTER", target, selector, str(page))), paced=False)
        if first:
            self._spawn(self._history_deadline, conversation)

    async def _history_deadline(self, conversation: str) -> None:
        await anyio.sleep(self.pacing.history_wait)
        if conversation in self._history:
            logger.warning("irc: no history of {} from the server; going on", conversation)
            async with self._intake:
                await self._release(conversation)

    async def _release(self, conversation: str) -> None:
        """The history of `conversation` is in: its held live messages go on, in order
        (the caller holds `_intake`)."""
        held = self._history.pop(conversation, [])
        self._history_since.pop(conversation, None)
        me = self._me
        if me is None:
            return
        for line in held:
            if await self._take(line, me):
                self._settled(conversation, line)

    async def _on_batch(self, link: Link, line: Line) -> None:
        reference = line.params[0]
        if reference.startswith("+") and len(line.params) >= 2:
            target = line.params[2] if len(line.params) >= 3 else ""
            self._batches[reference[1:]] = (line.params[1], target)
            self._batch_count[reference[1:]] = 0
            return
        kind, target = self._batches.pop(reference[1:], ("", ""))
        count = self._batch_count.pop(reference[1:], 0)
        last = self._batch_last.pop(reference[1:], "")
        me = self._me
        if kind in TARGETS_BATCH:
            self._targets_pending = False
        if kind not in HISTORY_BATCH or me is None or not target:
            return
        conversation = me.isupport.casemap.fold(target)
        async with self._intake:
            read = self._history_read.get(conversation, 0) + count
            self._history_read[conversation] = read
            page = me.isupport.history_limit or 100
            if count >= min(page, self.settings.history_max_messages) and last:
                await self._ask_history(link, target, after_id=last)  # the next page
                return
            if count:
                logger.info("irc: read back {} messages of {}", read, target)
            await self._release(conversation)

    async def _catch_up_private(self, link: Link) -> None:
        """Ask which private conversations had messages since everything was last read
        (`CHATHISTORY TARGETS`); each is then read back (`_on_history_target`)."""
        since = self._positions.get(EVERYTHING)
        if since is None and self._positions:
            since = min(self._positions.values())  # everything was never read in one go
        if since is None:
            return  # the first connection: nothing was missed that the bot owes
        since = max(since, time.time() - self.settings.history_max_age_seconds)
        now = _iso(time.time() + 60)
        self._targets_pending = True
        await link.send(
            Line("CHATHISTORY", ("TARGETS", f"timestamp={_iso(since)}", f"timestamp={now}", "100")),
            paced=False,
        )

    async def _on_history_target(self, link: Link, line: Line, me: Identity) -> None:
        target = line.params[1]
        if me.isupport.is_channel(target):
            return  # a channel's history is read when it is joined
        conversation = me.isupport.casemap.fold(target)
        if conversation in self._history or conversation == me.isupport.casemap.fold(me.nick):
            return
        await self._ask_history(link, target)

    # ----------------------------------------------------------------- positions

    @property
    def cursor_name(self) -> str:
        return f"{CHANNEL}:{self.network}:{self.settings.nick}"

    async def _load_positions(self) -> None:
        store = self._store
        raw = await store.load(self.cursor_name) if store is not None else None
        try:
            loaded = json.loads(raw) if raw else {}
        except ValueError:
            logger.warning("irc: the read positions were unreadable; starting without them")
            loaded = {}
        self._positions = {
            str(k): float(v) for k, v in loaded.items() if isinstance(v, int | float)
        }
        self._positions_dirty = False

    async def _save_positions(self) -> None:
        store = self._store
        if store is None or not self._positions_dirty:
            return
        self._positions_dirty = False
        kept = sorted(self._positions.items(), key=lambda item: item[1])[-_REMEMBERED:]
        try:
            await store.save(self.cursor_name, json.dumps(dict(kept), sort_keys=True))
        except Exception as exc:  # the storage is away: saved at the next round
            self._positions_dirty = True
            logger.warning("irc: the read positions were not saved ({})", exc)

    async def _keep_positions(self) -> None:
        """Save the positions when they moved, at most once per `save_positions`; while
        connected to a server with history and nothing held, note (every 30 s) that
        everything until a minute ago was read."""
        while True:
            await anyio.sleep(self.pacing.save_positions)
            me, now = self._me, time.time()
            if (
                me is not None
                and me.history
                and self._link is not None
                and not self._history
                and not self._targets_pending
                and not self._paused
                and now - self._watermark_at >= 30.0
            ):
                self._watermark_at = now
                self._positions[EVERYTHING] = now - 60.0
                self._positions_dirty = True
            await self._save_positions()

    async def _take(self, line: Line, me: Identity) -> bool:
        """Translate and submit one PRIVMSG; until it is taken, nothing else is read.
        False for a message left unread (draining): its position must not move past it,
        so that a server with history gives it to the next start."""
        self._lines += 1
        result = translate(
            line,
            me=me.nick,
            isupport=me.isupport,
            network=self.network,
            message_id=f"{self.network}:{self._connection_id}:{self._lines}",
            now=time.time(),
        )
        if isinstance(result, Skip):
            logger.debug("irc: line skipped: {}", result.reason)
            return True
        submit = self._submit
        assert submit is not None
        while True:
            ticket = await submit(result)
            if ticket.taken:
                return True
            if self._paused:
                return False
            logger.warning("irc: the gateway did not take a message; submitting it again")
            await anyio.sleep(self.pacing.resubmit_pause)

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Deliver a reply: Markdown as IRC lines, one PRIVMSG each, paced, in order; in a
        channel the first names the person it answers. Raises DeliveryFailed when a line
        could not be written (the next attempt goes on from it)."""
        network, target = split_chat_id(message.chat_id)
        if network != self.network:
            raise ValueError(
                f"irc: this gateway is on network {self.network!r}, not {network!r}; reply not sent"
            )
        context = message.metadata.get(META_REPLY_CONTEXT)
        nick = str(context.get("nick") or "") if isinstance(context, dict) else ""
        key = hashlib.sha256(
            f"{message.session_key}\n{message.reply_to}\n{message.text}".encode()
        ).hexdigest()[:32]
        text = message.text
        for file in message.files:
            label = file.caption or file.name
            text += f"\n\n[{label}: a file IRC cannot carry; it was not sent]"
        if not self._holding and self.relay is not None:
            await self._send_by_relay(key, target, text, nick)
            return
        with logger.contextualize(session=message.session_key):
            await self._send_lines(key, target, text, nick)

    async def _send_lines(self, key: str, target: str, text: str, nick: str) -> int:
        """Send a reply's lines from where an earlier attempt stopped; the lines sent."""
        link = await self._wait_link()
        me = self._me
        assert me is not None
        lines, done = self._sent_parts.take(key, (None, 0))
        if lines is None:
            is_channel = me.isupport.is_channel(target)
            lead = f"{nick}: " if is_channel and nick else ""
            # Room for a nick regained or changed by a few characters before the end.
            budget = text_budget(me.source + "___", target, linelen=512)
            lines = reply_lines(text, budget, formatting=self.settings.formatting, lead=lead)
        if not lines:
            logger.warning("irc: empty reply not sent")
            return 0
        try:
            for index in range(done, len(lines)):
                link = await self._wait_link()
                await link.send(Line("PRIVMSG", (target, lines[index])))
                done = index + 1
        except (ConnectionLost, DeliveryFailed) as exc:
            self._sent_parts.keep(key, (lines, done))
            raise DeliveryFailed(f"irc: {exc}", sent=done) from exc
        return done

    async def _wait_link(self) -> Link:
        link = self._link
        if link is not None and not link.closed:
            return link
        with anyio.move_on_after(self.pacing.send_wait):
            await self._up.wait()
        link = self._link
        if link is None or link.closed:
            raise DeliveryFailed(
                f"irc: not connected to {self.settings.host} for {self.pacing.send_wait:g}s"
            )
        return link

    async def _send_by_relay(self, key: str, target: str, text: str, nick: str) -> None:
        from gateway.journal.protocol import RelayRefused, RelayUnanswered

        request = {"key": key, "target": target, "text": text, "nick": nick}
        deadline = time.monotonic() + self.pacing.send_wait
        try:
            await self.relay.call(key, request, deadline=deadline)
        except RelayUnanswered as exc:
            raise DeliveryFailed(f"irc: the replica holding the connection: {exc}") from None
        except RelayRefused as exc:
            raise RuntimeError(f"irc: reply not sent: {exc}") from None

    async def _relayed_send(self, request: dict[str, Any]) -> dict[str, Any]:
        """Another replica's reply, sent on the connection this one holds."""
        from gateway.journal.protocol import RelayRefused

        try:
            key, target = str(request["key"]), str(request["target"])
            text, nick = str(request["text"]), str(request.get("nick") or "")
        except (KeyError, TypeError) as exc:
            raise RelayRefused(f"a malformed request ({exc!r})") from None
        sent = await self._send_lines(key, target, text, nick)  # DeliveryFailed: asked again
        return {"sent": sent}


# --------------------------------------------------------------------------- doctor


async def check_connection(settings: IrcSettings) -> str:
    """`gateway doctor`: connect, register (SASL included) and quit. Returns who the bot
    was on which server; raises IrcSetupError, ConnectionLost, OSError or TimeoutError."""
    pacing = Pacing(register_timeout=20.0)
    try:
        link = await open_link(settings, pacing)
    except ssl.SSLError as exc:
        raise IrcSetupError(
            f"irc: TLS with {settings.host}:{settings.resolved_port()} failed ({exc.reason}); "
            "check channels.irc.tls_ca_file, or the port (6697 is TLS, 6667 is not)"
        ) from None
    try:
        me = await register(link, settings, pacing)
        await link.send(Line("QUIT", ("gateway doctor",)), paced=False)
    finally:
        await link.aclose()
    network = me.isupport.network or settings.resolved_network()
    how = ", SASL" if "sasl" in me.caps else ""
    return f"{me.nick} on {network} ({settings.host}:{settings.resolved_port()}{how})"
