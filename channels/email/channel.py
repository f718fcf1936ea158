"""The email channel: one mailbox read over IMAP (IDLE where the server has it, polling
otherwise), replies sent over SMTP.

Inbound: the channel watches one folder. Each new message is parsed (`translate_mail`):
mail a machine sent, or from the gateway's own addresses, is never answered (see
`channels.email.headers.automated`); with `require_auth`, neither is mail whose sender
the receiving server did not authenticate. The rest becomes an `InboundMessage` with the
new text only (quoted history and signature cut, HTML read as text), its files as
attachments, and is submitted.

Session keys: `email:<sender address>`, and with `threads = true` (the default)
`email:<address>:thread:<root>`, where root is the Message-ID that started the thread
(the first of References, else In-Reply-To, else the message's own), without its angle
brackets, or `h<16 hex of its SHA-256>` when the key would be too long for a file name.

Promises (tested in tests/test_email*.py, the kill test in tests/test_email_kill.py):
- Journal before confirm: a message is flagged `\\Seen` (or moved to `processed_folder`)
  only once `submit` returned for it (it is journaled, or settled); it is fetched with
  BODY.PEEK, which leaves the flag alone. A kill at any moment leaves every message
  journaled or still unconfirmed on the server. Messages are submitted one at a time, in
  UID order; one the journal did not take stops the round, and is fetched again.
- Which mail is taken: every message above the mark (the folder's UIDVALIDITY and the
  highest UID taken, kept per mailbox in the workspace or in PostgreSQL), whatever its
  flags. Without a mark for the folder's current UIDVALIDITY (the first start; a server
  that renumbered the folder), the unseen mail of the last `catch_up_days` days. The
  journal's message id is the mail's Message-ID, so a renumbered folder's unseen mail
  that was already answered is dropped as a duplicate, not answered again.
- A reply is sent once: a failure before the message data went out (a refused or lost
  connection, a 4xx answer) is retried with backoff, and past the channel's attempts
  raised as `DeliveryFailed`, for the dispatcher to send it again later; after the data
  went out without an answer, the reply is logged as possibly lost instead. Its
  Message-ID is derived from what it answers and says, so a reply sent again (by the
  dispatcher, or by the outbox after a crash) carries the same Message-ID (mail clients
  show one).
- Every mail the gateway sends carries `Auto-Submitted: auto-replied` (auto-generated
  when it answers nothing) and `X-Auto-Response-Suppress: All`, and mail that carries
  either is never answered: two gateways, or a gateway and a vacation responder, do not
  loop.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from email import policy
from email.message import EmailMessage, Message
from email.parser import BytesParser
from email.utils import formataddr, formatdate, parsedate_to_datetime
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.to_thread
from loguru import logger

from channels.email.format import (
    DEFAULT_SUBJECT,
    html_to_text,
    markdown_to_html,
    new_text,
    reply_subject,
)
from channels.email.headers import (
    authentication_problem,
    automated,
    header,
    message_id,
    normalize_address,
    references,
    sender_of,
    thread_root,
)
from channels.email.mailbox import (
    Fetched,
    ImapOptions,
    ImapSession,
    MailboxError,
    network_errors,
    tls_context,
)
from channels.email.settings import EmailSettings
from channels.email.state import MailboxMark, MailboxMarks
from gateway import failpoints
from gateway.channel import DeliveryFailed, Submit
from gateway.config import ConfigError
from gateway.journal.protocol import CursorStore, Lead
from gateway.media import MediaError
from gateway.messages import (
    META_IS_GROUP,
    META_REPLY_CONTEXT,
    META_SENDER_NAME,
    META_SENT_AT,
    Attachment,
    InboundMessage,
    OutboundMessage,
    build_session_key,
)
from gateway.sessions.errors import SessionKeyError
from gateway.sessions.keys import encode_key

if TYPE_CHECKING:
    import aiosmtplib

CHANNEL = "email"
THREAD = "thread"
#: Metadata: where the message was read, `<uidvalidity>:<uid>` of the watched folder.
META_EMAIL_UID = "email_uid"
#: Metadata: the mail's subject (also in the reply context).
META_SUBJECT = "email_subject"
#: References kept on a reply: the thread's first id and the latest ones (RFC 5322
#: allows shortening the chain; clients thread on its first and last entries).
MAX_REFERENCES = 20
#: Parts that sign or encrypt a message rather than carry something to read.
_SIGNATURES = frozenset(
    {"application/pgp-signature", "application/pkcs7-signature", "application/x-pkcs7-signature"}
)
_PARSER = BytesParser(policy=policy.default)
#: How long `fetch_file` keeps the mail it read last (a turn fetches a mail's files one
#: after another, within seconds).
MAIL_KEPT_SECONDS = 60.0


class EmailSetupError(Exception):
    """The mailbox or the SMTP server cannot be used as configured; says what to fix."""


@dataclass(frozen=True, slots=True)
class Pacing:
    """How patiently the channel talks to its servers (seconds)."""

    idle_check: float = 1.0  # one blocking IDLE wait; a stop waits at most this long
    idle_renew: float = 300.0  # IDLE is re-issued (and the folder read) this often
    retry_backoff: float = 1.0
    retry_backoff_max: float = 30.0
    send_attempts: int = 4
    batch: int = 10  # messages fetched at once
    timeout: float = 60.0


@dataclass(frozen=True, slots=True)
class Skip:
    """A message not submitted, and why (logged)."""

    reason: str


# --------------------------------------------------------------------------- inbound


def _text_of(part: Message) -> str:
    """A text part's content as str, whatever its declared charset says."""
    try:
        content = part.get_content()  # type: ignore[attr-defined]
        if isinstance(content, str):
            return content
    except (LookupError, ValueError, AssertionError):
        pass
    payload = part.get_payload(decode=True)
    if not isinstance(payload, bytes):
        return ""
    charset = part.get_content_charset() or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:  # a charset Python does not know: read it as UTF-8
        charset = "utf-8"
    return payload.decode(charset, errors="replace")


def body_parts(msg: EmailMessage) -> tuple[Message | None, Message | None]:
    """(plain, html) body parts of a message, either may be missing."""
    try:
        plain = msg.get_body(preferencelist=("plain",))
        markup = msg.get_body(preferencelist=("html",))
    except (KeyError, ValueError):
        return None, None
    return plain, markup


def body_text(msg: EmailMessage) -> str:
    """The new text of a message: the plain part (or the HTML part read as text), without
    the quoted history and the signature."""
    plain, markup = body_parts(msg)
    if plain is not None:
        text = _text_of(plain)
        if text.strip():
            return new_text(text)
    if markup is not None:
        return new_text(html_to_text(_text_of(markup)))
    return ""


def attachment_parts(msg: EmailMessage) -> list[Message]:
    """The parts of a message that are files, in a fixed order (the index in this list
    is how a file is found again at turn time): every leaf that is not one of the body's
    text parts or a signature, and every attached message (as one file)."""
    plain, markup = body_parts(msg)
    body = {id(p) for p in (plain, markup) if p is not None}
    found: list[Message] = []

    def visit(part: Message) -> None:
        kind = part.get_content_type()
        if kind == "message/rfc822":
            found.append(part)
            return
        if part.is_multipart():
            for sub in part.get_payload():
                if isinstance(sub, Message):
                    visit(sub)
            return
        if id(part) in body or kind in _SIGNATURES:
            return
        if kind in ("text/plain", "text/html") and part.get_content_disposition() != "attachment":
            return  # an alternative of the body, or inline text beside it
        found.append(part)

    visit(msg)
    return found


def attachment_bytes(part: Message) -> bytes:
    if part.get_content_type() == "message/rfc822":
        inner = part.get_payload()
        if isinstance(inner, list) and inner and isinstance(inner[0], Message):
            return inner[0].as_bytes()
        return b""
    payload = part.get_payload(decode=True)
    return payload if isinstance(payload, bytes) else b""


def _attachment_kind(mime: str) -> str:
    if mime.startswith("image/"):
        return "image"
    if mime.startswith("audio/"):
        return "voice"
    return "document"


def file_id(uidvalidity: int, uid: int, index: int, mid: str | None) -> str:
    """An attachment's id: where its message was read, its index among the message's
    files, and the Message-ID that finds the message again after a move or a renumber."""
    return f"{uidvalidity}|{uid}|{index}|{mid or ''}"


def parse_file_id(value: str) -> tuple[int, int, int, str]:
    parts = value.split("|", 3)
    if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        raise MediaError("the mail's file reference is unreadable")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]


def thread_id_for(address: str, root: str) -> str:
    """The thread part of a session key: the root Message-ID without brackets, or its
    hash when the key would not fit a file name."""
    bare = root.strip("<>")
    try:
        encode_key(build_session_key(CHANNEL, address, thread=(THREAD, bare)))
        return bare
    except SessionKeyError:
        return "h" + hashlib.sha256(root.encode()).hexdigest()[:16]


def translate_mail(
    raw: bytes,
    *,
    uidvalidity: int,
    uid: int,
    settings: EmailSettings,
    whole: bool = True,
    size: int | None = None,
) -> InboundMessage | Skip:
    """The inbound message for one mail (or why it is not answered). Pure: the whole
    policy of which mail is answered, its session key and what the agent reads."""
    msg = _PARSER.parsebytes(raw)
    assert isinstance(msg, EmailMessage)
    sender = sender_of(msg)
    if sender is None:
        return Skip("no From address")
    own = own_addresses(settings)
    reason = automated(msg, sender, own)
    if reason is not None:
        return Skip(reason)
    problem = authentication_problem(msg, sender, settings.require_auth, settings.authserv_id)
    if problem is not None:
        return Skip(f"unauthenticated sender {sender.address}: {problem}")
    try:
        encode_key(build_session_key(CHANNEL, sender.address))
    except SessionKeyError:
        return Skip(f"an address too long for a session key ({len(sender.address)} characters)")
    mid = message_id(msg)
    chain = references(msg)
    subject = header(msg, "Subject")
    thread = None
    if settings.threads:
        root = thread_root(msg)
        if root is not None:
            thread = thread_id_for(sender.address, root)
    files: list[Attachment] = []
    if whole:
        text = body_text(msg)
        for index, part in enumerate(attachment_parts(msg)):
            mime = part.get_content_type()
            name = part.get_filename() or (
                "message.eml" if mime == "message/rfc822" else f"attachment-{index + 1}"
            )
            files.append(
                Attachment(
                    kind=_attachment_kind(mime),
                    file_id=file_id(uidvalidity, uid, index, mid),
                    name=name,
                    mime_type=mime,
                    size=len(attachment_bytes(part)),
                )
            )
    else:
        megabytes = (size or 0) / 2**20
        text = (
            f"[This email is {megabytes:.1f} MB, over the limit of "
            f"{settings.max_message_mb:g} MB: only its subject was read.]"
        )
    command = text.lstrip().startswith("/")
    if subject and not command and (not chain or not text.strip()):
        # The subject says what a new conversation is about; in a thread it repeats. A
        # command (/new, /status) stays first, where the agent looks for it.
        text = f"Subject: {subject}\n\n{text}".rstrip()
    if not text.strip() and not files:
        return Skip("an empty mail")
    metadata: dict[str, Any] = {
        META_IS_GROUP: False,
        META_SENDER_NAME: sender.label,
        META_SUBJECT: subject,
        META_EMAIL_UID: f"{uidvalidity}:{uid}",
        META_REPLY_CONTEXT: {
            "subject": subject,
            "references": _trimmed([*chain, mid] if mid else chain),
        },
    }
    sent = _sent_at(msg)
    if sent is not None:
        metadata[META_SENT_AT] = sent
    return InboundMessage(
        channel=CHANNEL,
        chat_id=sender.address,
        text=text,
        sender_id=sender.address,
        # The Message-ID is the journal's key: a message read again (a move, a renumbered
        # folder) is the same message. Without one, where it was read.
        message_id=mid or f"uid:{uidvalidity}:{uid}",
        thread_kind=THREAD if thread is not None else None,
        thread_id=thread,
        metadata=metadata,
        attachments=tuple(files),
    )


def _trimmed(chain: list[str]) -> list[str]:
    unique = list(dict.fromkeys(chain))
    if len(unique) <= MAX_REFERENCES:
        return unique
    return [unique[0], *unique[-(MAX_REFERENCES - 1) :]]


def _sent_at(msg: Message) -> float | None:
    value = header(msg, "Date")
    if not value:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def own_addresses(settings: EmailSettings) -> frozenset[str]:
    found = {normalize_address(a) for a in settings.own_addresses}
    if settings.address:
        found.add(normalize_address(settings.address))
    return frozenset(found)


# --------------------------------------------------------------------------- outbound


def reply_message_id(message: OutboundMessage, domain: str) -> str:
    """The Message-ID of a reply: the same for the same reply to the same message, so
    one sent again after a crash is recognized as the same mail."""
    digest = hashlib.sha256()
    for part in (message.session_key, message.reply_to or "", message.text):
        digest.update(part.encode("utf-8", "replace") + b"\0")
    for file in message.files:
        digest.update(file.name.encode("utf-8", "replace") + b"\0")
        digest.update(hashlib.sha256(file.data).digest())
    return f"<gw.{digest.hexdigest()[:32]}@{domain}>"


def compose_reply(message: OutboundMessage, settings: EmailSettings, *, now: float) -> EmailMessage:
    """The mail that carries `message`: a plain and an HTML part (rendered from the
    Markdown), its files attached, and the headers that thread it under what it answers."""
    sender = normalize_address(settings.address or "")
    domain = sender.rpartition("@")[2] or "localhost"
    context = message.metadata.get(META_REPLY_CONTEXT)
    context = context if isinstance(context, dict) else {}
    answering = bool(message.reply_to and message.reply_to.startswith("<"))
    mail = EmailMessage()
    mail["From"] = formataddr((settings.from_name, sender)) if settings.from_name else sender
    mail["To"] = message.chat_id
    subject = str(context.get("subject") or "")
    mail["Subject"] = reply_subject(subject) if message.reply_to else DEFAULT_SUBJECT
    mail["Date"] = formatdate(now, usegmt=True)
    mail["Message-ID"] = reply_message_id(message, domain)
    if answering:
        assert message.reply_to is not None
        chain = [str(r) for r in context.get("references") or () if isinstance(r, str)]
        if message.reply_to not in chain:
            chain.append(message.reply_to)
        mail["In-Reply-To"] = message.reply_to
        mail["References"] = " ".join(_trimmed(chain))
    # RFC 3834: an answer a program wrote; responders must not answer it (no loops).
    mail["Auto-Submitted"] = "auto-replied" if message.reply_to else "auto-generated"
    mail["X-Auto-Response-Suppress"] = "All"
    mail.set_content(message.text or "")
    if message.text.strip():
        mail.add_alternative(markdown_to_html(message.text), subtype="html")
    for file in message.files:
        main, _, sub = file.mime_type.partition("/")
        mail.add_attachment(
            file.data,
            maintype=main or "application",
            subtype=sub or "octet-stream",
            filename=file.name,
        )
    return mail


class SendFailure(Exception):
    """A reply that could not be sent; `retry` says whether trying again is safe."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


# --------------------------------------------------------------------------- channel


def imap_options(settings: EmailSettings, password: str, timeout: float = 60.0) -> ImapOptions:
    username = settings.username or settings.address or ""
    port = settings.imap_port or (993 if settings.imap_security == "tls" else 143)
    return ImapOptions(
        host=settings.imap_host or "",
        port=port,
        security=settings.imap_security,
        username=username,
        password=password,
        folder=settings.folder,
        processed_folder=settings.processed_folder,
        ca_file=settings.tls_ca_file,
        timeout=timeout,
    )


def smtp_port(settings: EmailSettings) -> int:
    """The configured SMTP port, else the standard one for its TLS mode."""
    return settings.smtp_port or (465 if settings.smtp_security == "tls" else 587)


def smtp_client(settings: EmailSettings, *, timeout: float) -> aiosmtplib.SMTP:
    """An SMTP client for the configured server, not yet connected (the channel's sends
    and `gateway doctor` use the same port and TLS choice)."""
    import aiosmtplib

    security = settings.smtp_security
    return aiosmtplib.SMTP(
        hostname=settings.smtp_host,
        port=smtp_port(settings),
        use_tls=security == "tls",
        start_tls=security == "starttls",
        tls_context=tls_context(settings.tls_ca_file),
        timeout=timeout,
    )


def check_settings(settings: EmailSettings) -> None:
    """Raise ConfigError naming what is missing for the channel to run."""
    missing = [
        key
        for key, value in (
            ("address", settings.address),
            ("imap_host", settings.imap_host),
            ("smtp_host", settings.smtp_host),
        )
        if not value
    ]
    if missing:
        names = ", ".join(f"channels.email.{key}" for key in missing)
        raise ConfigError(f"{names}: the email channel needs them (see docs/email.md)")
    if not settings.resolved_password():
        raise ConfigError(
            "channels.email.password: set GATEWAY_CHANNELS__EMAIL__PASSWORD or "
            "channels.email.password_file"
        )


class EmailChannel:
    """The email adapter; see the module docstring for what it promises.

    `lead` runs the watch loop with the cursor store that keeps the mailbox's mark: at
    once with the workspace's cursor file (`gateway.journal.cursors.run_with`), or in the shared
    mode once this replica holds the "email watcher" role (`gateway.journal.pg_cursors.lead_as`),
    so exactly one replica holds the IMAP connection that watches the folder; every
    replica sends replies.
    """

    name = CHANNEL

    def __init__(
        self, settings: EmailSettings, *, lead: Lead, pacing: Pacing | None = None
    ) -> None:
        check_settings(settings)
        self.settings = settings
        self.lead = lead
        self.state: MailboxMarks | None = None  # while watching: the marks' store
        self.pacing = pacing or Pacing()
        password = settings.resolved_password() or ""
        self.imap = imap_options(settings, password, timeout=self.pacing.timeout)
        self._submit: Submit | None = None
        self._paused = False
        self._watch_scope: anyio.CancelScope | None = None
        self.live = anyio.Event()  # set once the folder was read once (tests, probes)
        #: Messages taken and confirmed since start, and those skipped (tests, metrics).
        self.taken = 0
        self.skipped = 0
        #: The mail `fetch_file` read last: ((uidvalidity, uid, Message-ID), bytes, when).
        self._last_mail: tuple[tuple[int, int, str], bytes, float] | None = None

    @property
    def mailbox(self) -> str:
        return self.imap.name

    # ----------------------------------------------------------------- running

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Watch the folder until cancelled. Raises EmailSetupError when the server
        refuses the login or lacks the folder (the daemon restarts the channel)."""
        self._submit = submit
        self._paused = False
        session = await self._open()  # the login is checked on every replica
        await anyio.to_thread.run_sync(session.close)
        logger.info("email: {} is reachable", self.mailbox)
        task_status.started()
        # Several replicas: one holds the IMAP connection; the others stand by.
        await self.lead(self._watch)
        await anyio.sleep_forever()

    def pause_intake(self) -> None:
        """Take no more mail (the daemon is draining): what is not confirmed stays
        unseen on the server for the next start. Replies still go out."""
        self._paused = True
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    async def _open(self, *, readonly: bool = False) -> ImapSession:
        try:
            return await anyio.to_thread.run_sync(
                lambda: ImapSession.open(self.imap, readonly=readonly)
            )
        except MailboxError as exc:
            raise EmailSetupError(str(exc)) from None
        except network_errors() as exc:
            raise EmailSetupError(
                f"email: cannot reach {self.imap.host}:{self.imap.port} ({exc}); check "
                "channels.email.imap_host, imap_port and imap_security"
            ) from None

    async def _watch(self, store: CursorStore) -> None:
        """Read the folder, then wait for mail (IDLE, or a poll interval) and read it
        again; reconnect with backoff after a network failure. The mark lives in
        `store`."""
        self.state = MailboxMarks(store)
        failures = 0
        with anyio.CancelScope() as scope:
            self._watch_scope = scope
            while not self._paused:
                session: ImapSession | None = None
                try:
                    # A network failure here is retried with backoff (below); a refused
                    # login or a missing folder stops the channel with what to fix.
                    try:
                        session = await anyio.to_thread.run_sync(ImapSession.open, self.imap)
                    except MailboxError as exc:
                        raise EmailSetupError(str(exc)) from None
                    logger.info(
                        "email: watching {} ({})",
                        self.mailbox,
                        "IDLE" if session.can_idle and self.settings.idle else "polling",
                    )
                    while not self._paused:
                        found = await self._read_new(session)
                        if found is None:
                            failures += 1
                            await anyio.sleep(self._backoff(failures))
                            continue
                        failures = 0
                        self.live.set()
                        if found:
                            # Mail that came while these were handled was announced in
                            # the answers to those commands, and IDLE would not announce
                            # it again: read until a round finds nothing, then wait.
                            continue
                        await self._wait(session)
                except EmailSetupError:
                    raise
                except network_errors() as exc:
                    failures += 1
                    delay = self._backoff(failures)
                    logger.warning(
                        "email: connection to {} failed ({!r}); reconnecting in {:g}s",
                        self.imap.host,
                        exc,
                        delay,
                    )
                    await anyio.sleep(delay)
                finally:
                    if session is not None:
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(session.close)
        self._watch_scope = None

    def _marks(self) -> MailboxMarks:
        assert self.state is not None, "the marks are there while the channel watches"
        return self.state

    def _backoff(self, failures: int) -> float:
        delay = self.pacing.retry_backoff * 2 ** min(failures - 1, 10)
        return float(min(delay, self.pacing.retry_backoff_max))

    async def _wait(self, session: ImapSession) -> None:
        """Until the server tells of new mail (IDLE), or the poll interval passed."""
        if not (session.can_idle and self.settings.idle):
            await anyio.sleep(self.settings.poll_interval_seconds)
            return
        await anyio.to_thread.run_sync(session.idle_start)
        try:
            with anyio.move_on_after(self.pacing.idle_renew):
                while not self._paused:
                    if await anyio.to_thread.run_sync(session.idle_check, self.pacing.idle_check):
                        return
        finally:
            # Also when stopping: a server in IDLE answers nothing else (not even LOGOUT)
            # until it gets DONE.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(session.end_idle)

    async def _read_new(self, session: ImapSession) -> int | None:
        """Take in the mail that arrived since the mark, in UID order; how many messages
        there were. None when the journal did not take one (it is fetched again after a
        pause)."""
        await anyio.to_thread.run_sync(session.select)
        mark = await self._marks().load(self.mailbox)
        catch_up = mark is None or mark.uidvalidity != session.uidvalidity
        if catch_up:
            if mark is not None:
                logger.warning(
                    "email: {} was renumbered (UIDVALIDITY {} -> {}); reading its unseen "
                    "mail again, the journal drops what was answered",
                    self.mailbox,
                    mark.uidvalidity,
                    session.uidvalidity,
                )
            days = self.settings.catch_up_days
            since = (datetime.now(UTC) - timedelta(days=days)).date() if days else None
            uids = await anyio.to_thread.run_sync(session.unseen, since)
            top = max([session.uidnext - 1, *uids])
        else:
            assert mark is not None
            uids = await anyio.to_thread.run_sync(session.uids_after, mark.last_uid)
            top = None
        max_bytes = int(self.settings.max_message_mb * 2**20)
        for start in range(0, len(uids), self.pacing.batch):
            batch = uids[start : start + self.pacing.batch]
            fetch = functools.partial(session.fetch, batch, max_bytes=max_bytes)
            fetched = await anyio.to_thread.run_sync(fetch)
            for mail in fetched:
                if self._paused:
                    return 0
                if not await self._take(session, mail, mark=not catch_up):
                    return None
        if catch_up:
            # Every unseen message is settled: from now on, what comes after `top`.
            assert top is not None
            await self._marks().save(self.mailbox, MailboxMark(session.uidvalidity, max(top, 0)))
        return len(uids)

    async def _take(self, session: ImapSession, mail: Fetched, *, mark: bool) -> bool:
        """Translate and submit one message, and confirm it once the journal has it
        (then raise the mark past it, with `mark`). True when the message is settled
        (journaled, skipped, or a duplicate)."""
        # Parsing a large mail takes a while: in a worker thread, off the event loop.
        translate = functools.partial(
            translate_mail,
            mail.raw,
            uidvalidity=session.uidvalidity,
            uid=mail.uid,
            settings=self.settings,
            whole=mail.whole,
            size=mail.size,
        )
        try:
            result: InboundMessage | Skip = await anyio.to_thread.run_sync(translate)
        except Exception as exc:
            # A mail nothing here can read must not stop the mailbox (it would come
            # first again at every start): it is left unanswered, and said so.
            logger.opt(exception=exc).error("email: message {} is unreadable", mail.uid)
            result = Skip(f"unreadable ({type(exc).__name__}: {exc})")
        if isinstance(result, Skip):
            self.skipped += 1
            logger.info("email: message {} not answered: {}", mail.uid, result.reason)
            if mark:
                await self._marks().save(self.mailbox, MailboxMark(session.uidvalidity, mail.uid))
            return True
        if self._submit is None:
            return False
        with logger.contextualize(session=result.session_key):
            ticket = await self._submit(result)
            if not ticket.taken:
                logger.warning("email: message {} was not taken; reading it again", mail.uid)
                return False
            await failpoints.reach("email.before_confirm", result.session_key)
            # Journaled: now the server may learn we have it. Shielded: a stop right now
            # would only make the next start fetch it again for the journal to drop (the
            # connection's timeout bounds it).
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(session.confirm, mail.uid)
                if mark:
                    await self._marks().save(
                        self.mailbox, MailboxMark(session.uidvalidity, mail.uid)
                    )
                self.taken += 1
        return True

    # ----------------------------------------------------------------- outbound

    async def send(self, message: OutboundMessage) -> None:
        """Send a reply as one mail; retried only while it certainly did not go out.
        Raises `DeliveryFailed` when it certainly did not go out after the channel's
        attempts and may later (the server unreachable, or answering 4xx): the
        dispatcher sends it again, as the same mail. Raises SendFailure when it never
        will (a 5xx refusal, a refused login) or may have gone out."""
        compose = functools.partial(
            compose_reply, message, self.settings, now=datetime.now(UTC).timestamp()
        )
        mail = await anyio.to_thread.run_sync(compose)  # files are encoded: off the loop
        with logger.contextualize(session=message.session_key):
            attempt = 0
            while True:
                attempt += 1
                try:
                    await self._smtp_send(mail, message.chat_id)
                    return
                except SendFailure as exc:
                    if not exc.retry:
                        logger.error("email: reply to {} not sent: {}", message.chat_id, exc)
                        raise
                    if attempt >= self.pacing.send_attempts:
                        raise DeliveryFailed(
                            f"email: reply to {message.chat_id} not sent yet: {exc}"
                        ) from exc
                    delay = self._backoff(attempt)
                    logger.warning(
                        "email: reply to {} failed ({}); retry {} in {:g}s",
                        message.chat_id,
                        exc,
                        attempt,
                        delay,
                    )
                    await anyio.sleep(delay)

    async def _smtp_send(self, mail: EmailMessage, recipient: str) -> None:
        """One attempt over a fresh SMTP connection. SendFailure(retry=True) only when
        the message data certainly did not go out, or the server refused it for now."""
        import aiosmtplib

        settings = self.settings
        smtp = smtp_client(settings, timeout=self.pacing.timeout)
        sender = normalize_address(settings.address or "")
        data_sent = False
        try:
            await smtp.connect()
            username = settings.smtp_username or settings.username or sender
            await smtp.login(username, settings.resolved_smtp_password() or "")
            await smtp.mail(sender)
            await smtp.rcpt(recipient)
            data_sent = True
            await smtp.data(mail.as_bytes(policy=policy.SMTP))
        except aiosmtplib.SMTPAuthenticationError:
            raise SendFailure(
                f"{settings.smtp_host} refused the SMTP login; check "
                "channels.email.smtp_username and GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD",
                retry=False,
            ) from None
        except aiosmtplib.SMTPResponseException as exc:
            # An answer: the server did not take the message (4xx: not now; 5xx: never).
            raise SendFailure(f"{exc.code} {exc.message}", retry=exc.code < 500) from None
        except aiosmtplib.SMTPNotSupported as exc:
            raise SendFailure(
                f"{settings.smtp_host}:{smtp_port(settings)} does not offer it ({exc}); check "
                "channels.email.smtp_security and smtp_port",
                retry=False,
            ) from None
        except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
            if data_sent:
                raise SendFailure(
                    f"no answer after the message went out ({exc!r}); not sent again, as it "
                    "may have arrived",
                    retry=False,
                ) from None
            raise SendFailure(repr(exc), retry=True) from None
        finally:
            if smtp.is_connected:
                with anyio.CancelScope(shield=True):
                    try:
                        await smtp.quit()
                    except (aiosmtplib.SMTPException, OSError, TimeoutError):
                        smtp.close()

    # ----------------------------------------------------------------- files in

    async def fetch_file(self, attachment: Attachment, *, max_bytes: int) -> bytes:
        """A file of a mail: the mail is read again (over a connection of its own, on
        whichever replica runs the turn), found by UID or, after a move or a renumber,
        by its Message-ID, and the file taken out of it. The mail read last is kept for
        `MAIL_KEPT_SECONDS`: a turn asks for a mail's files one after another, and each
        would otherwise cost a login and the whole mail again."""
        uidvalidity, uid, index, mid = parse_file_id(attachment.file_id)
        limit = int(self.settings.max_message_mb * 2**20)
        key = (uidvalidity, uid, mid)

        def read() -> bytes:
            for folder in (self.settings.folder, self.settings.processed_folder):
                if not folder:
                    continue
                options = replace(self.imap, folder=folder)
                session = ImapSession.open(options, readonly=True)
                try:
                    found = uid if session.uidvalidity == uidvalidity else None
                    if mid and (found is None or folder != self.settings.folder):
                        found = session.find(mid)
                    if found is None:
                        continue
                    fetched = session.fetch([found], max_bytes=limit)
                    if fetched and fetched[0].whole:
                        return fetched[0].raw
                finally:
                    session.close()
            raise MediaError("the mail is no longer in the mailbox")

        def extract(raw: bytes) -> bytes | None:
            msg = _PARSER.parsebytes(raw)
            assert isinstance(msg, EmailMessage)
            parts = attachment_parts(msg)
            return attachment_bytes(parts[index]) if index < len(parts) else None

        try:
            raw = self._kept_mail(key)
            if raw is None:
                raw = await anyio.to_thread.run_sync(read)
                self._last_mail = (key, raw, time.monotonic())
            data = await anyio.to_thread.run_sync(extract, raw)  # parsing too: off the loop
        except MailboxError as exc:
            raise MediaError(str(exc)) from None
        except network_errors() as exc:
            logger.warning("email: fetching a file failed: {!r}", exc)
            raise MediaError(
                "the mail server did not hand over the file; please try again"
            ) from None
        if data is None:
            raise MediaError("the mail no longer has that file")
        if len(data) > max_bytes:
            raise MediaError(
                f"it is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB"
            )
        return data

    def _kept_mail(self, key: tuple[int, int, str]) -> bytes | None:
        """The mail `fetch_file` read last, if it is `key` and recent; it is let go
        after `MAIL_KEPT_SECONDS` (it may be large)."""
        kept = self._last_mail
        if kept is None:
            return None
        if time.monotonic() - kept[2] > MAIL_KEPT_SECONDS:
            self._last_mail = None
            return None
        return kept[1] if kept[0] == key else None


# --------------------------------------------------------------------------- doctor


async def check_mailbox(settings: EmailSettings) -> str:
    """`gateway doctor`: log in to IMAP (and see the folder, and the processed folder),
    then to SMTP. Returns what was found; raises EmailSetupError saying what to fix."""
    import aiosmtplib

    check_settings(settings)
    options = imap_options(settings, settings.resolved_password() or "", timeout=15.0)

    def imap() -> tuple[bool, int]:
        session = ImapSession.open(options, readonly=True)
        try:
            folder = settings.processed_folder
            if folder and not session.client.folder_exists(folder):
                raise MailboxError(
                    f"email: no folder {folder!r} for processed mail (the gateway makes it "
                    "at start, if the server lets it)"
                )
            return session.can_idle, session.uidnext
        finally:
            session.close()

    try:
        idle, _ = await anyio.to_thread.run_sync(imap)
    except MailboxError as exc:
        raise EmailSetupError(str(exc)) from None
    except network_errors() as exc:
        raise EmailSetupError(
            f"email: cannot reach IMAP at {options.host}:{options.port} ({exc})"
        ) from None
    port = smtp_port(settings)
    smtp = smtp_client(settings, timeout=15.0)
    try:
        await smtp.connect()
        username = settings.smtp_username or settings.username or settings.address or ""
        await smtp.login(username, settings.resolved_smtp_password() or "")
        await smtp.quit()
    except aiosmtplib.SMTPAuthenticationError:
        raise EmailSetupError(
            f"email: {settings.smtp_host} refused the SMTP login; check "
            "channels.email.smtp_username and GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD"
        ) from None
    except (aiosmtplib.SMTPException, OSError, TimeoutError) as exc:
        raise EmailSetupError(
            f"email: cannot use SMTP at {settings.smtp_host}:{port} ({exc})"
        ) from None
    finally:
        if smtp.is_connected:
            smtp.close()
    where = f"{options.folder} ({'IDLE' if idle and settings.idle else 'polling'})"
    return f"IMAP {options.username}@{options.host}: {where}; SMTP {settings.smtp_host}:{port}"
