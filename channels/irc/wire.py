"""The IRC wire: one line in (`Line.parse`, IRCv3 message tags included) and out
(`Line.render`), names folded as the server compares them (`Casemap`, from ISUPPORT's
CASEMAPPING), what the server said it supports (`ISupport`), SASL PLAIN's payload, and a
token bucket that paces what the bot sends. Pure functions and small classes; no I/O.

Promises (tested in tests/test_irc_wire.py):
- `Line.render` never puts a CR, LF or NUL on the wire (a parameter holding one would
  start a command of its own: an injection); it raises ValueError instead.
- `Line.parse(line.render())` gives the line back.
- Two names the server takes for one are folded alike (`Casemap.fold`).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field

#: RFC 1459's limit: a line is at most 512 bytes with its CRLF; IRCv3 tags do not count.
LINE_BYTES = 512
#: The most a server's line may be with its tags (IRCv3: 8191 bytes of tags, then the line).
MAX_INCOMING = 8191 + LINE_BYTES

_TAG_UNESCAPE = {":": ";", "s": " ", "\\": "\\", "r": "\r", "n": "\n"}
_FORBIDDEN = re.compile("[\r\n\0]")


def _unescape_tag(value: str) -> str:
    out = []
    chars = iter(value)
    for char in chars:
        if char == "\\":
            following = next(chars, "")
            out.append(_TAG_UNESCAPE.get(following, following))
        else:
            out.append(char)
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Line:
    """One IRC message: its tags, who sent it (the prefix, `nick!user@host` or a server),
    the command (upper case) and its parameters (the last one may hold spaces)."""

    command: str
    params: tuple[str, ...] = ()
    source: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str) -> Line:
        """A line as the server sent it (without its CRLF)."""
        rest = raw.lstrip(" ")
        tags: dict[str, str] = {}
        if rest.startswith("@"):
            blob, _, rest = rest[1:].partition(" ")
            for item in blob.split(";"):
                if item:
                    key, _, value = item.partition("=")
                    tags[key] = _unescape_tag(value)
            rest = rest.lstrip(" ")
        source = ""
        if rest.startswith(":"):
            source, _, rest = rest[1:].partition(" ")
            rest = rest.lstrip(" ")
        trailing = None
        if " :" in rest:
            rest, _, trailing = rest.partition(" :")
        elif rest.startswith(":"):
            rest, trailing = "", rest[1:]
        words = [word for word in rest.split(" ") if word]
        command = words[0].upper() if words else ""
        params = words[1:]
        if trailing is not None:
            params.append(trailing)
        return cls(command, tuple(params), source, tags)

    def render(self) -> str:
        """The line to send (without CRLF; tags are not sent by the bot)."""
        for part in (self.command, *self.params):
            if _FORBIDDEN.search(part):
                raise ValueError(f"an IRC line cannot hold CR, LF or NUL: {part[:40]!r}")
        params = list(self.params)
        for middle in params[:-1]:
            if not middle or " " in middle or middle.startswith(":"):
                raise ValueError(f"only the last IRC parameter may hold spaces: {middle!r}")
        if params and (not params[-1] or " " in params[-1] or params[-1].startswith(":")):
            params[-1] = ":" + params[-1]
        return " ".join((self.command, *params))

    @property
    def nick(self) -> str:
        """The sender's nick (the source up to `!`), or the server's name."""
        return self.source.split("!", 1)[0]


def parse_source(source: str) -> tuple[str, str, str]:
    """(nick, user, host) of a `nick!user@host` source (empty parts when absent)."""
    nick, _, userhost = source.partition("!")
    user, _, host = userhost.partition("@")
    return nick, user, host


# --------------------------------------------------------------------------- names


@dataclass(frozen=True, slots=True)
class Casemap:
    """How the server compares nicks and channel names (ISUPPORT CASEMAPPING): "ascii"
    folds A-Z; "rfc1459" also []\\~ to {}|^; "strict-rfc1459" []\\ to {}| only.
    Unknown mappings fold as rfc1459, the protocol's default."""

    name: str = "rfc1459"

    def fold(self, text: str) -> str:
        folded = text.translate(_ASCII)
        if self.name == "ascii":
            return folded
        if self.name == "strict-rfc1459":
            return folded.translate(_STRICT)
        return folded.translate(_RFC1459)


_ASCII = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_STRICT = str.maketrans("[]\\", "{}|")
_RFC1459 = str.maketrans("[]\\~", "{}|^")


@dataclass
class ISupport:
    """What the server said it supports (RPL_ISUPPORT, numeric 005), as far as the
    channel needs it."""

    casemap: Casemap = field(default_factory=Casemap)
    chantypes: str = "#&"
    network: str = ""
    #: IRCv3 LINELEN: the most bytes a line may be (512 without it).
    linelen: int = LINE_BYTES
    #: IRCv3 CHATHISTORY: the most messages one request returns (0: no limit said).
    history_limit: int = 0

    def update(self, tokens: tuple[str, ...]) -> None:
        for token in tokens:
            key, _, value = token.partition("=")
            if key == "CASEMAPPING" and value:
                self.casemap = Casemap(value.lower())
            elif key == "CHANTYPES":
                self.chantypes = value
            elif key == "NETWORK":
                self.network = value
            elif key == "LINELEN" and value.isdigit():
                self.linelen = max(LINE_BYTES, int(value))
            elif key in ("CHATHISTORY", "draft/CHATHISTORY") and value.isdigit():
                self.history_limit = int(value)

    def is_channel(self, target: str) -> bool:
        return bool(target) and target[0] in (self.chantypes or "#&")


# --------------------------------------------------------------------------- text

#: mIRC formatting: bold, italics, underline, strike-through, monospace, reverse, reset,
#: and colours (`\x03` with up to two numbers, `\x04` with a hex colour).
_CONTROL = re.compile(
    r"\x03(?:\d{1,2}(?:,\d{1,2})?)?|\x04(?:[0-9a-fA-F]{6}(?:,[0-9a-fA-F]{6})?)?"
    r"|[\x02\x1d\x1f\x1e\x11\x16\x0f]"
)


def strip_formatting(text: str) -> str:
    """`text` without mIRC formatting codes: what a person reads."""
    return _CONTROL.sub("", text)


def ctcp(text: str) -> tuple[str, str] | None:
    """(command, argument) of a CTCP message (`\\x01ACTION waves\\x01`), else None."""
    if not text.startswith("\x01"):
        return None
    body = text[1:].removesuffix("\x01")
    command, _, argument = body.partition(" ")
    return command.upper(), argument


def decode(raw: bytes) -> str:
    """A line's bytes as text: UTF-8, else Latin-1 (older clients' encoding; every byte
    is a character, so nothing is lost)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# --------------------------------------------------------------------------- SASL


def sasl_plain_chunks(account: str, password: str) -> list[str]:
    """The AUTHENTICATE arguments that carry SASL PLAIN's credentials (IRCv3 `sasl`):
    base64 of `authzid NUL authcid NUL password` in pieces of 400 bytes, then `+` when
    the last piece was exactly 400 (it says the payload ended)."""
    payload = base64.b64encode(f"{account}\0{account}\0{password}".encode()).decode("ascii")
    chunks = [payload[i : i + 400] for i in range(0, len(payload), 400)]
    if not chunks or len(chunks[-1]) == 400:
        chunks.append("+")
    return chunks


# --------------------------------------------------------------------------- pacing


class TokenBucket:
    """A burst of `burst` lines, then one line per `interval` seconds: how typical servers
    count a client's lines (and delay or disconnect one that sends faster)."""

    def __init__(self, burst: int, interval: float) -> None:
        self.burst = burst
        self.interval = interval
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> float:
        """Take one line's token at `now`; how many seconds to wait before sending it
        (0: at once). Waiting is the caller's: the token is already spent."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.interval)
        self._at = now
        self._tokens -= 1.0
        if self._tokens >= 0:
            return 0.0
        return -self._tokens * self.interval
