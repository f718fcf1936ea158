"""Which session a caller of the HTTP API names: the one place a session name sent to
the gateway becomes a session key, `resolve_session(caller, sent)`.

Every door that takes a session name from a caller resolves it here: `/api/chat`'s
`session`, `/v1/chat/completions`'s `user` or `X-Session`, and the admin page's `key`.
A tool or chat command that ever takes a session name from a client must do the same;
today none does (tools and commands act on the session of the turn they run in).

| caller | route | the name `N` is the session |
|---|---|---|
| client `C` (`[http.api_tokens.C]`) | `/v1` | `api:C:N`, `N` within C's `sessions` prefixes |
| `[http] token` (client `default`) | `/v1` | `api:default:N` |
| `[http] token` (client `default`) | `/api/chat` | `api:N` (`api:N` given whole too) |
| the operator | `/admin` | `N` itself: any session of any channel |

Invariants (tested in tests/test_http_namespace.py and tests/test_api_isolation.py):
- A client never names a key in another client's namespace. On `/v1` the client's own
  name is put in front of whatever it sends, so no name can leave `api:C:`. On
  `/api/chat` a name has no such part, so a name of the form `<word>:<rest>` (a word of
  letters, digits, `-` and `_`: the form of `api:<client>:<name>`) is refused with 403,
  unless the word is the caller's own client name: `api:default:N` is the token's own
  `/v1` session `N`, under `/v1`'s rules.
- The refusal does not depend on which clients are configured. A client added later
  does not inherit a conversation the chat token wrote, a client removed does not leave
  its conversations to the chat token, and the answer does not tell a caller which
  client names exist.
- The word is compared after NFKC and case folding, so `IDE:`, `Ide:` and the
  fullwidth `ide` and colon (U+FF49 U+FF44 U+FF45 U+FF1A) are refused like `ide:`. A
  lookalike that NFKC does not fold (a Cyrillic U+0456 for `i`) is another key, in the
  caller's own namespace: keys are stored and compared byte for byte
  (`gateway.sessions.keys` encodes them injectively, `%3A` included), so it reaches
  nothing of another client's. The same holds for a subagent's key (`<key>:sub:<id>`,
  whose memory is its parent's): its parent is in the same namespace.
- A name is printable and short enough to store (`check_session_name`).
- The operator reaches every session on purpose: the admin page's key is used as given.

Refused, never mapped: a name in another client's form gets 403 saying which names are
the caller's, and nothing is stored. Mapping it into the caller's namespace would give
the client a conversation it did not name, silently (a client with the wrong token
would talk to an empty session and think the agent forgot), and any key it were
mapped to is one another name already spells, or needs an escape that renames
sessions stored today.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from enum import Enum

from gateway.sessions.errors import SessionKeyError
from gateway.sessions.keys import MAX_STEM_BYTES, encode_key

API_CHANNEL = "api"
#: The client the `[http] token` is, on `/v1` and on `/api/chat`.
DEFAULT_CLIENT = "default"
#: The prefix of a stateless call's throwaway session name (the gateway's own).
STATELESS_PREFIX = "~stateless-"
# Unicode categories refused in a session name: control, format (e.g. U+202E), surrogate,
# private use, unassigned, line and paragraph separators.
_HOSTILE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# The form of a client's name in front of a colon: what `api:<client>:<name>` starts with
# (a superset of the names `[http.api_tokens.NAME]` accepts).
_CLIENT_WORD = re.compile(r"[a-z0-9_-]+")


class Route(Enum):
    """Where a session name comes from; the value is the field that carries it."""

    CHAT = "session"  # POST /api/chat
    OPENAI = "user"  # POST /v1/chat/completions (`user` or X-Session)
    ADMIN = "key"  # the /admin pages


@dataclass(frozen=True, slots=True)
class Caller:
    """Who names a session, as its token proved it, and through which route."""

    client: str
    route: Route
    #: `[http.api_tokens.NAME] sessions`: the names this client may use (empty: any).
    prefixes: tuple[str, ...] = ()


#: The `[http] token` on /api/chat.
CHAT_CALLER = Caller(DEFAULT_CLIENT, Route.CHAT)
#: Whoever the admin page let in (its login cookie or its bearer token).
OPERATOR = Caller("operator", Route.ADMIN)


class SessionRefused(Exception):
    """A session name the caller may not use: `status` 400 (it cannot be a session) or
    403 (it is another client's); the message names the field and says what to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def resolve_session(caller: Caller, sent: str) -> str:
    """The session key `caller` means by `sent`, or SessionRefused (see the module doc
    for the namespaces, and why a foreign name is refused rather than mapped)."""
    if caller.route is Route.ADMIN:
        return _any_key(sent)
    if caller.route is Route.OPENAI:
        return _client_key(caller, sent)
    return _chat_key(caller, sent)


def throwaway_session_key(caller: Caller, seed: str) -> str:
    """A stateless call's session, in the caller's namespace: the same `seed` (its
    Idempotency-Key) gives the same session, so a retry finds its reply."""
    digest = hashlib.sha256(f"{caller.client}\0{seed}".encode()).hexdigest()[:32]
    return f"{API_CHANNEL}:{caller.client}:{STATELESS_PREFIX}{digest}"


def _client_key(caller: Caller, name: str) -> str:
    """`/v1`: `api:<client>:<name>`, within the client's `sessions` prefixes."""
    field = caller.route.value
    if caller.prefixes and not any(name.startswith(p) for p in caller.prefixes):
        allowed = " or ".join(repr(p) for p in caller.prefixes)
        raise SessionRefused(
            403, f"{field}: this token may only use sessions whose names start with {allowed}"
        )
    if name.startswith(STATELESS_PREFIX):
        raise SessionRefused(400, f"{field}: names starting {STATELESS_PREFIX!r} are reserved")
    prefix = f"{API_CHANNEL}:{caller.client}:"
    check_session_name(name, prefix, field)
    return prefix + name


def _chat_key(caller: Caller, sent: str) -> str:
    """`/api/chat`: `api:<name>`, a name of no other client's form."""
    if caller.client != DEFAULT_CLIENT:
        # `api:<name>` is the `[http] token`'s layout alone: a second client here would
        # share every one of its conversations.
        raise ValueError(f"/api/chat names sessions for {DEFAULT_CLIENT!r} only")
    field = caller.route.value
    prefix = f"{API_CHANNEL}:"
    if sent.startswith(prefix):
        name = sent[len(prefix) :]
    elif ":" in sent:
        raise SessionRefused(
            400,
            f"{field}: the chat API only reaches {API_CHANNEL}: sessions; "
            f"send a bare name or {API_CHANNEL}:<name>",
        )
    else:
        name = sent
    check_session_name(name, prefix, field)
    own = f"{caller.client}:"
    if name.startswith(own):
        # The same token's /v1 sessions: its own, under /v1's rules.
        return _client_key(caller, name[len(own) :])
    word, colon, _ = unicodedata.normalize("NFKC", name).casefold().partition(":")
    if colon and _CLIENT_WORD.fullmatch(word):
        raise SessionRefused(
            403,
            f"{field}: a name of the form <word>:<name> is a session of the /v1 API's "
            f"clients ({API_CHANNEL}:<client>:<name>), which this token may not use. Send a "
            "name with no word and ':' in front (e.g. 'proj-notes', not 'proj:notes'), "
            f"whose session is {API_CHANNEL}:<name>; or {prefix}{own}<name> for this "
            "token's own /v1 session <name>",
        )
    return prefix + name


def _any_key(sent: str) -> str:
    """The operator's: any key of any channel, as given, if it can be stored."""
    try:
        encode_key(sent)
    except SessionKeyError as exc:
        raise SessionRefused(400, f"{Route.ADMIN.value}: {exc}") from None
    return sent


def check_session_name(name: str, prefix: str, field: str) -> None:
    """SessionRefused(400) naming `field` unless `name` is printable and its session
    key (`prefix` + `name`) fits a file name."""
    if not name.strip():
        raise SessionRefused(400, f"{field}: the name is empty")
    if any(unicodedata.category(char) in _HOSTILE_CATEGORIES for char in name):
        raise SessionRefused(400, f"{field}: the name holds control or invisible characters")
    try:
        encode_key(prefix + name)
    except SessionKeyError:
        raise SessionRefused(
            400,
            f"{field}: the name is too long to store; the limit is {max_name_chars(prefix)} "
            "letters, digits, '.', '_' or '-' (other characters take up to 12 each)",
        ) from None


def max_name_chars(prefix: str) -> int:
    """The longest name of plain characters whose key (`prefix` + name) a file holds."""
    return MAX_STEM_BYTES - len(encode_key(prefix))
