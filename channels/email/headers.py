"""What the headers of a mail say: who sent it, whether a machine did (never answered),
whether the sender's domain vouched for it, and which thread it belongs to. Pure
functions over `email.message.EmailMessage`.

Promises (tested in tests/test_email_headers.py):
- `automated` names a reason for every mail RFC 3834 and the mail systems' conventions
  mark as not written by a person at that moment: `Auto-Submitted` other than `no`,
  `Precedence: bulk|list|junk|auto_reply`, a mailing list (`List-Id`, `List-Unsubscribe`,
  `List-Post`), a bounce (`Return-Path: <>`, MAILER-DAEMON/postmaster senders, a
  delivery report), vacation and auto-responder marks (`X-Autoreply`, `X-Autorespond`,
  `X-Auto-Response-Suppress: All|AutoReply`), `noreply` senders, and mail from the
  gateway's own addresses. The gateway answers none of them: no loops.
- `authentication_problem` trusts only the `Authentication-Results` header that the
  configured server (`authserv_id`) wrote, and counts a pass only when it is for the
  sender's own domain (aligned as DMARC aligns: the From domain or a parent of it).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from email.message import EmailMessage, Message
from email.utils import getaddresses, parseaddr

# --------------------------------------------------------------------------- reading


def header(msg: Message, name: str) -> str:
    """A header's value as text ("" when absent or unreadable); folded lines unfolded."""
    try:
        value = msg.get(name)
    except (ValueError, TypeError, IndexError):  # a header the email package cannot parse
        return ""
    if value is None:
        return ""
    return " ".join(str(value).split())


def all_headers(msg: Message, name: str) -> list[str]:
    try:
        values = msg.get_all(name) or []
    except (ValueError, TypeError, IndexError):
        return []
    return [" ".join(str(v).split()) for v in values]


@dataclass(frozen=True, slots=True)
class Sender:
    """The mail's From: its address (lower case, the identity used for access and
    replies), display name and domain."""

    address: str
    name: str
    domain: str

    @property
    def label(self) -> str:
        return f"{self.name} <{self.address}>" if self.name else self.address


def normalize_address(address: str) -> str:
    """An address as the gateway compares it: without spaces and brackets, lower case."""
    return address.strip().strip("<>").strip().lower()


def sender_of(msg: Message) -> Sender | None:
    """The (first) From address, or None when there is none that looks like an address.
    Reply-To is not used: a reply goes to the address access was checked for."""
    raw = header(msg, "From")
    pairs = getaddresses([raw]) if raw else []
    for name, address in pairs:
        address = normalize_address(address)
        local, at, domain = address.rpartition("@")
        if at and local and domain and " " not in address:
            return Sender(address, name.strip(), domain)
    return None


_ID = re.compile(r"<([^<>\s]+)>")


def message_ids(value: str) -> list[str]:
    """The `<id>`s in a Message-ID, In-Reply-To or References value, in order, with
    their brackets."""
    return [f"<{found}>" for found in _ID.findall(value)]


def message_id(msg: Message) -> str | None:
    ids = message_ids(header(msg, "Message-ID"))
    return ids[0] if ids else None


def references(msg: Message) -> list[str]:
    """The thread so far: References, else In-Reply-To (older clients send only that)."""
    found = message_ids(header(msg, "References"))
    if not found:
        found = message_ids(header(msg, "In-Reply-To"))[:1]
    return found


def thread_root(msg: Message) -> str | None:
    """The Message-ID that starts this mail's thread: the first of References (RFC 5322
    keeps it when a chain is shortened), else In-Reply-To, else the mail's own id."""
    chain = references(msg)
    return chain[0] if chain else message_id(msg)


# --------------------------------------------------------------------------- machines

_BULK = frozenset({"bulk", "list", "junk", "auto_reply"})
_LIST_HEADERS = ("List-Id", "List-Unsubscribe", "List-Post")
_AUTORESPONDER_HEADERS = ("X-Autoreply", "X-Autorespond", "X-Auto-Reply-From", "X-Vacation")
_DAEMONS = re.compile(r"^(mailer-daemon|postmaster|mail-daemon|mailerdaemon)(\+.*)?$", re.I)
_NOREPLY = re.compile(r"^(no-?reply|do-?not-?reply|donotreply|notifications?)([+._-].*)?$", re.I)


def automated(msg: Message, sender: Sender, own: Collection[str]) -> str | None:
    """Why this mail must not be answered (a machine sent it, or the gateway itself),
    or None: a person wrote it."""
    if sender.address in own:
        return "mail from the gateway's own address"
    auto = header(msg, "Auto-Submitted").lower()
    if auto and auto.split(";")[0].strip() != "no":
        return f"Auto-Submitted: {auto}"
    precedence = header(msg, "Precedence").lower()
    if precedence in _BULK:
        return f"Precedence: {precedence}"
    for name in _LIST_HEADERS:
        if header(msg, name):
            return f"a mailing list ({name})"
    return_path = header(msg, "Return-Path")
    if return_path and not parseaddr(return_path)[1].strip("<> "):
        return "a bounce (Return-Path: <>)"
    local = sender.address.rpartition("@")[0]
    if _DAEMONS.match(local):
        return f"a bounce (from {sender.address})"
    if msg.get_content_type() == "multipart/report":
        return "a delivery or read report"
    for name in _AUTORESPONDER_HEADERS:
        if header(msg, name):
            return f"an auto-responder ({name})"
    suppress = {part.strip().lower() for part in header(msg, "X-Auto-Response-Suppress").split(",")}
    if suppress & {"all", "autoreply", "oof"}:
        return "the sender asks for no automatic replies (X-Auto-Response-Suppress)"
    if _NOREPLY.match(local):
        return f"a no-reply sender ({sender.address})"
    return None


# --------------------------------------------------------------------------- authentication

_COMMENT = re.compile(r"\([^()]*\)")
_SEMICOLON = re.compile(r';(?=(?:[^"]*"[^"]*")*[^"]*$)')


@dataclass(frozen=True, slots=True)
class AuthResult:
    """One method's result in an Authentication-Results header (RFC 8601)."""

    method: str  # dkim, spf, dmarc, ...
    result: str  # pass, fail, none, ...
    properties: dict[str, str]


def parse_authentication_results(value: str) -> tuple[str, list[AuthResult]]:
    """(authserv-id, results) of one Authentication-Results header value."""
    text = value
    while True:  # comments may nest: strip the innermost until none is left
        stripped = _COMMENT.sub(" ", text)
        if stripped == text:
            break
        text = stripped
    parts = [p.strip() for p in _SEMICOLON.split(text)]
    if not parts or not parts[0]:
        return "", []
    authserv = parts[0].split()[0].lower()
    results: list[AuthResult] = []
    for part in parts[1:]:
        tokens = part.split()
        if not tokens or "=" not in tokens[0]:
            continue
        method, _, result = tokens[0].partition("=")
        properties: dict[str, str] = {}
        for token in tokens[1:]:
            key, eq, val = token.partition("=")
            if eq and "." in key:
                properties[key.lower()] = val.strip('"').lower()
        results.append(AuthResult(method.split("/")[0].lower(), result.lower(), properties))
    return authserv, results


def _aligned(domain: str, sender_domain: str) -> bool:
    """Relaxed alignment (as DMARC's): the same domain, or `domain` a parent of it."""
    domain = domain.strip().rstrip(".").lower()
    return bool(domain) and (sender_domain == domain or sender_domain.endswith("." + domain))


def _passes(result: AuthResult, sender: Sender) -> bool:
    if result.result != "pass":
        return False
    props = result.properties
    if result.method == "dkim":
        signer = props.get("header.d") or props.get("header.i", "").rpartition("@")[2]
        return _aligned(signer, sender.domain)
    if result.method == "spf":
        mailfrom = props.get("smtp.mailfrom", "")
        return _aligned(mailfrom.rpartition("@")[2], sender.domain)
    if result.method == "dmarc":
        return _aligned(props.get("header.from", sender.domain), sender.domain)
    return False


def authentication_problem(
    msg: Message, sender: Sender, required: Iterable[str], authserv_id: str | None
) -> str | None:
    """Why the mail does not prove its sender (None: every required method passed for
    the sender's domain, or none is required). Only the first header written by
    `authserv_id` counts: one a sender wrote can claim anything."""
    wanted = [m.lower() for m in required]
    if not wanted:
        return None
    trusted = (authserv_id or "").lower()
    results: list[AuthResult] | None = None
    for value in all_headers(msg, "Authentication-Results"):
        serv, found = parse_authentication_results(value)
        if serv == trusted:
            results = found
            break
    if results is None:
        return f"no Authentication-Results from {authserv_id}"
    for method in wanted:
        if not any(r.method == method and _passes(r, sender) for r in results):
            return f"{method} did not pass for {sender.domain}"
    return None


def as_email_message(msg: Message) -> EmailMessage:
    """`msg` typed as the modern API's message (parsed with `email.policy.default`)."""
    assert isinstance(msg, EmailMessage)
    return msg
