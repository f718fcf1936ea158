"""The conformance kit's driver for email, over a real Dovecot (the bot's mailbox, IMAP) and
a real SMTP server (aiosmtpd, tests/smtp_server.py).

People write by delivering mail into the bot's INBOX (IMAP APPEND, as their servers'
mail would arrive), straight to Dovecot, so they can write while the gateway is cut off.
The gateway reaches both servers through TCP proxies (tests/fakes/tcp_proxy.py), which
`platform_down` cuts. The bot's posts are the mails the SMTP server accepted.

How the kit's words map onto mail:

| the kit | email |
|---|---|
| person n | `person<n>@example.net`, whose server vouches for them |
| their DM | one thread, each mail answering their last (or new mails: `threads = false`) |
| a `Place` | the correspondent's address, and (with `threads`) the thread's root id |
| `MessageRef.id`, `Post.reply_to` | the mail's Message-ID; a reply's In-Reply-To |
| handed over twice | the same mail (its Message-ID) delivered into the mailbox again |
| signed inbound | the receiving server's Authentication-Results, `require_auth` on |
| a stranger | `dm_policy = "pairing"`, nobody in `allow_from`: a code by reply |
| the platform away | both proxies cut: IMAP and SMTP unreachable |

The channel's two kinds of conversation are two drivers: with `threads = true` (the
default) a person's thread is one conversation, `email:<address>:thread:<root>`; with
`threads = false` (`EmailDriver(threads=False)`) everything a person writes is one,
`email:<address>`, and each of their mails is a new one. Mail is vouched for by
`Authentication-Results: mx.kit.example; ... dmarc=pass header.from=example.net`, with
`require_auth = ["dmarc"]` and `authserv_id = "mx.kit.example"` on in every scenario.

The Dovecot may be shared by many `running` blocks (starting one takes seconds): each
block empties the bot's INBOX first, and a fresh workspace has no read mark, so the
gateway starts from that empty folder.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from email.utils import formatdate
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.dovecot_server import Dovecot, running_dovecot
from tests.email_gateway import BOT, BOT_PASSWORD
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.smtp_server import Accepted, SmtpServer, running_smtp

PEOPLE_DOMAIN = "example.net"
#: The receiving server's id in Authentication-Results (the gateway trusts only it).
AUTHSERV_ID = "mx.kit.example"
#: A thread's References keep its root and the latest ids (RFC 5322 allows shortening).
REFERENCES_KEPT = 10
_MAIL_TOTAL = re.compile(r'^gateway_email_mail_total\{outcome="(\w+)"\} ([0-9.e+]+)$', re.M)
_PARSER = BytesParser(policy=policy.default)


def person_address(person: int) -> str:
    return f"person{person}@{PEOPLE_DOMAIN}"


def vouched(address: str) -> str:
    """What the receiving server writes for mail whose sender's domain vouched for it
    (SPF, DKIM and DMARC passed, aligned with the From domain)."""
    domain = address.rpartition("@")[2]
    return (
        f"{AUTHSERV_ID}; spf=pass smtp.mailfrom={address}; "
        f"dkim=pass header.d={domain} header.s=kit; dmarc=pass header.from={domain}"
    )


class EmailDriver(ChannelDriver):
    """Email: one mailbox in Dovecot, replies through aiosmtpd. Give it a running
    Dovecot to share one across scenarios; without one, `running` starts its own.
    `threads`: the channel's setting (a conversation per mail thread, or per
    correspondent)."""

    name = "email"
    requirements = Requirements(
        groups=False,  # mail has no groups: Cc'd people are not answered (docs/email.md, 11)
        mentions=False,
        # The kit's threads are threads of a group. A mail thread is a conversation of
        # its own (with the channel's `threads`): each person's DM is one thread.
        threads=False,
        edits=False,  # a mail cannot be changed once sent
        duplicate_delivery=True,  # the same Message-ID delivered into the mailbox again
        catch_up=True,  # unseen mail stays on the server until flagged \Seen after the journal
        strangers=True,  # dm_policy = "pairing": a code by reply
        signed_inbound=True,  # Authentication-Results with require_auth
        split_long_replies=False,  # a reply is one mail, whatever its length
        mass_pings=False,  # mail has no ping of everyone
        platform_outage=True,
    )

    def __init__(self, dovecot: Dovecot | None = None, *, threads: bool = True) -> None:
        self._shared = dovecot
        self.threads = threads
        self._dovecot: Dovecot | None = None
        self._smtp: SmtpServer | None = None
        self._imap_proxy: TcpProxy | None = None
        self._smtp_proxy: TcpProxy | None = None
        self._writer: Any = None  # the people's IMAP connection (APPEND)
        self._lock = threading.Lock()
        self._run = ""  # a nonce in the Message-IDs of this `running` block
        self._numbers: Iterator[int] = iter(())
        self._threads: dict[int, list[str]] = {}  # person -> Message-IDs of their thread
        self._mails: dict[str, bytes] = {}  # Message-ID -> the mail, for `redeliver`
        self._posts: list[Post] = []  # parsed from the SMTP server's record, in order
        self._events: list[str] = []  # the driver's own record, for `platform_log`
        self.http_port = 0  # the gateway's port: `forge` reads its /metrics

    # -- the platform ---------------------------------------------------------------------

    @property
    def dovecot(self) -> Dovecot:
        if self._dovecot is None:
            raise RuntimeError("the platform is not running")
        return self._dovecot

    @property
    def smtp(self) -> SmtpServer:
        if self._smtp is None:
            raise RuntimeError("the platform is not running")
        return self._smtp

    @contextmanager
    def running(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            dovecot = self._shared or stack.enter_context(running_dovecot({BOT: BOT_PASSWORD}))
            smtp = stack.enter_context(running_smtp({BOT: BOT_PASSWORD}, dovecot=dovecot))
            imap_proxy = TcpProxy(dovecot.host, dovecot.imaps_port)
            stack.callback(imap_proxy.close)
            smtp_proxy = TcpProxy("127.0.0.1", smtp.port)
            stack.callback(smtp_proxy.close)
            imap_proxy.restore()
            smtp_proxy.restore()
            self._dovecot, self._smtp = dovecot, smtp
            self._imap_proxy, self._smtp_proxy = imap_proxy, smtp_proxy
            self._run = secrets.token_hex(4)
            self._numbers = iter(range(1, 10**9))
            self._threads, self._mails, self._posts, self._events = {}, {}, [], []
            self.http_port = free_port()
            stack.callback(self._stopped)
            self._empty_inbox()
            yield

    def _stopped(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.logout()
        self._writer = None
        self._dovecot = self._smtp = None
        self._imap_proxy = self._smtp_proxy = None

    def _empty_inbox(self) -> None:
        """Another scenario's mail out of the shared mailbox."""
        client: Any = self.dovecot.client(BOT)
        try:
            uids = client.search(["ALL"])
            if uids:
                client.delete_messages(uids)
                client.expunge()
        finally:
            client.logout()

    def gateway_env(self) -> dict[str, str]:
        assert self._imap_proxy is not None and self._smtp_proxy is not None
        prefix = "GATEWAY_CHANNELS__EMAIL__"
        return {
            "GATEWAY_HTTP__PORT": str(self.http_port),
            f"{prefix}ENABLED": "true",
            f"{prefix}ADDRESS": BOT,
            f"{prefix}PASSWORD": BOT_PASSWORD,
            f"{prefix}IMAP_HOST": "127.0.0.1",
            f"{prefix}IMAP_PORT": str(self._imap_proxy.port),
            f"{prefix}IMAP_SECURITY": "tls",
            f"{prefix}SMTP_HOST": "127.0.0.1",
            f"{prefix}SMTP_PORT": str(self._smtp_proxy.port),
            f"{prefix}SMTP_SECURITY": "starttls",
            f"{prefix}TLS_CA_FILE": str(self.dovecot.ca_file),
            f"{prefix}THREADS": "true" if self.threads else "false",
            f"{prefix}DM_POLICY": "open",
            f"{prefix}REQUIRE_AUTH": '["dmarc"]',
            f"{prefix}AUTHSERV_ID": AUTHSERV_ID,
        }

    def platform_down(self) -> None:
        self.imap_down()
        self.smtp_down()

    def platform_up(self) -> None:
        self.imap_up()
        self.smtp_up()

    def imap_down(self) -> None:
        assert self._imap_proxy is not None
        self._imap_proxy.cut()
        self._note("IMAP cut")

    def imap_up(self) -> None:
        assert self._imap_proxy is not None
        self._imap_proxy.restore()
        self._note("IMAP restored")

    def smtp_down(self) -> None:
        assert self._smtp_proxy is not None
        self._smtp_proxy.cut()
        self._note("SMTP cut")

    def smtp_up(self) -> None:
        assert self._smtp_proxy is not None
        self._smtp_proxy.restore()
        self._note("SMTP restored")

    def _note(self, event: str) -> None:
        self._events.append(f"{time.time():.3f} {event}")

    # -- people ---------------------------------------------------------------------------

    def _deliver(self, raw: bytes) -> None:
        """Put a mail into the bot's INBOX, as the receiving server does (IMAP APPEND over
        a connection of the people's own, straight to Dovecot)."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._writer is None:
                        self._writer = self.dovecot.client(BOT, folder=None)
                    self._writer.append("INBOX", raw)
                    return
                except Exception:
                    with contextlib.suppress(Exception):
                        self._writer.shutdown()
                    self._writer = None
                    if attempt == 2:
                        raise

    def _mail(
        self, sender: str, text: str, thread: list[str], authentication: list[str]
    ) -> tuple[str, bytes]:
        """A mail as a person's client writes it, in `thread` (the Message-IDs so far),
        with the receiving server's `authentication` headers on top."""
        mid = f"<kit.{self._run}.{next(self._numbers)}@{PEOPLE_DOMAIN}>"
        msg = EmailMessage()
        for value in authentication:
            msg["Authentication-Results"] = value
        msg["From"] = sender
        msg["To"] = BOT
        msg["Subject"] = "Re: kit" if thread else "kit"
        msg["Date"] = formatdate(usegmt=True)
        msg["Message-ID"] = mid
        if thread:
            msg["In-Reply-To"] = thread[-1]
            kept = [thread[0], *thread[1:][-(REFERENCES_KEPT - 1) :]]
            msg["References"] = " ".join(kept)
        msg.set_content(text)
        return mid, msg.as_bytes()

    def dm(self, person: int, text: str) -> MessageRef:
        address = person_address(person)
        thread = self._threads.setdefault(person, []) if self.threads else []
        mid, raw = self._mail(address, text, thread, [vouched(address)])
        thread.append(mid)
        self._mails[mid] = raw
        self._deliver(raw)
        place = Place(address, thread[0] if self.threads else None)
        return MessageRef(id=mid, place=place, sender=address, event=mid)

    def redeliver(self, ref: MessageRef) -> None:
        self._deliver(self._mails[ref.id])

    def forge(self, text: str) -> bool:
        """A mail from someone at example.net that their domain never sent: the receiving
        server found SPF and DMARC failing and wrote so on top; below it, the forger's
        own headers claim a pass, under another server's id and under the receiving
        server's (one it failed to drop: only the topmost counts). True once the gateway
        counted it not answered (`gateway_email_mail_total{outcome="not_answered"}`:
        mail it read and did not take, so it stays unflagged); False when it took it."""
        address = person_address(0)
        domain = address.rpartition("@")[2]
        authentication = [
            f"{AUTHSERV_ID}; spf=fail smtp.mailfrom=forger@evil.example; dkim=none; "
            f"dmarc=fail header.from={domain}",
            f"mx.evil.example; dmarc=pass header.from={domain}",
            f"{AUTHSERV_ID}; dmarc=pass header.from={domain}",
        ]
        before = self._mail_counts()
        _, raw = self._mail(address, text, [], authentication)
        self._deliver(raw)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = self._mail_counts()
            if now.get("taken", 0) > before.get("taken", 0):
                return False
            if now.get("not_answered", 0) > before.get("not_answered", 0):
                return True
            time.sleep(0.2)
        raise AssertionError("the gateway did not read the forged mail within 60 s")

    def _mail_counts(self) -> dict[str, float]:
        """The gateway's count of mail read, by outcome (its /metrics)."""
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            scrape = answer.read().decode()
        return {outcome: float(value) for outcome, value in _MAIL_TOTAL.findall(scrape)}

    # -- what the bot posted --------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        accepted = list(self.smtp.accepted)
        for item in accepted[len(self._posts) :]:
            self._posts.append(as_post(item, threads=self.threads))
        return list(self._posts)

    def mails_sent(self) -> list[EmailMessage]:
        """Every mail the SMTP server accepted from the bot, in order."""
        return [item.message for item in list(self.smtp.accepted)]

    def platform_log(self) -> Iterator[str]:
        yield from list(self._events)
        for item in list(self.smtp.refused):
            yield f"SMTP refused: {describe(item)}"
        for item in list(self.smtp.accepted):
            yield f"SMTP accepted: {describe(item)}"
        try:
            mailbox = self.dovecot.messages(BOT)
        except Exception as exc:  # the log of a failure must not fail
            yield f"the mailbox could not be read: {exc!r}"
            return
        for uid, flags, raw in mailbox:
            msg = _PARSER.parsebytes(raw)
            seen = sorted(f.decode() for f in flags)
            yield f"INBOX uid {uid} {seen} {msg['Message-ID']} from {msg['From']}"


def as_post(item: Accepted, *, threads: bool) -> Post:
    """A mail the bot sent, as its reader sees it: to its envelope's recipients, in the
    thread its References start (else its In-Reply-To; with `threads` only, where a
    thread is a conversation), answering its In-Reply-To."""
    msg = item.message
    chain = str(msg.get("References") or "").split() or str(msg.get("In-Reply-To") or "").split()
    body = msg.get_body(preferencelist=("plain",))
    text = str(body.get_content()) if body is not None else ""
    return Post(
        place=Place(",".join(sorted(item.rcpt_tos)), chain[0] if chain and threads else None),
        text=text.replace("\r\n", "\n").strip(),
        reply_to=str(msg["In-Reply-To"]).strip() if msg["In-Reply-To"] else None,
    )


def describe(item: Accepted) -> str:
    msg = item.message
    body = msg.get_body(preferencelist=("plain",))
    text = str(body.get_content()).strip() if body is not None else ""
    return (
        f"to {','.join(item.rcpt_tos)} {msg['Message-ID']} in reply to {msg['In-Reply-To']}: "
        f"{text[:100]!r}"
    )
