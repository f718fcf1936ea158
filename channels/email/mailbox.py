"""One IMAP connection to the watched folder, over IMAPClient (imaplib underneath).

Blocking by design: every method here runs in a worker thread (the channel calls them
through `anyio.to_thread`), one at a time per connection. Mail is always fetched with
`BODY.PEEK[]`, which leaves `\\Seen` alone: a message is flagged (or moved) only by
`confirm`, which the channel calls once the message is in the journal.
"""

from __future__ import annotations

import imaplib
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from loguru import logger

if TYPE_CHECKING:
    from imapclient import IMAPClient

SEEN = b"\\Seen"
DELETED = b"\\Deleted"
#: Untagged answers during IDLE that mean the folder has something new.
_NEWS = (b"EXISTS", b"RECENT")


class MailboxError(Exception):
    """The mailbox cannot be used as configured (login refused, no such folder): the
    message says what to fix, never with the password."""


#: What may go wrong on the wire: the connection dropped, timed out, or the server
#: answered with an error. The channel reconnects after any of them.
def network_errors() -> tuple[type[BaseException], ...]:
    from imapclient.exceptions import IMAPClientError

    return (OSError, imaplib.IMAP4.error, IMAPClientError, ssl.SSLError, socket.timeout)


@dataclass(frozen=True, slots=True)
class ImapOptions:
    host: str
    port: int
    security: Literal["tls", "starttls"]
    username: str
    password: str
    folder: str = "INBOX"
    processed_folder: str | None = None
    ca_file: Path | None = None
    timeout: float = 60.0

    @property
    def name(self) -> str:
        """The mailbox as logs and the state store name it (no password)."""
        return f"{self.username}@{self.host}/{self.folder}"


def tls_context(ca_file: Path | None) -> ssl.SSLContext:
    """Certificates verified, against the system's CAs or `ca_file`."""
    return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)


@dataclass(frozen=True, slots=True)
class Fetched:
    """A message as fetched: its UID, its bytes (only the header when it was larger than
    the limit: `whole` is False then), and its size on the server."""

    uid: int
    raw: bytes
    size: int
    whole: bool


class ImapSession:
    """A logged-in connection with `options.folder` selected."""

    def __init__(self, client: IMAPClient, options: ImapOptions) -> None:
        self.client = client
        self.options = options
        self.uidvalidity = 0
        self.uidnext = 1
        caps = {c.upper() for c in client.capabilities()}
        self.can_idle = b"IDLE" in caps
        self.can_move = b"MOVE" in caps
        self.can_uidplus = b"UIDPLUS" in caps
        self._idling = False
        self._empty_wakes = 0

    @classmethod
    def open(cls, options: ImapOptions, *, readonly: bool = False) -> ImapSession:
        """Connect, log in and select the folder. Raises MailboxError when the server
        refuses the login or has no such folder; network errors as they are."""
        from imapclient import IMAPClient
        from imapclient.exceptions import LoginError

        context = tls_context(options.ca_file)
        client = IMAPClient(
            options.host,
            port=options.port,
            ssl=options.security == "tls",
            ssl_context=context,
            timeout=options.timeout,
        )
        try:
            if options.security == "starttls":
                client.starttls(context)
            try:
                client.login(options.username, options.password)
            except LoginError:
                raise MailboxError(
                    f"email: {options.host} refused the login of {options.username}; check "
                    "channels.email.username and GATEWAY_CHANNELS__EMAIL__PASSWORD"
                ) from None
            session = cls(client, options)
            session.select(readonly=readonly)
            if options.processed_folder and not readonly:
                session.ensure_folder(options.processed_folder)
            return session
        except BaseException:
            _close_quietly(client)
            raise

    def select(self, *, readonly: bool = False) -> None:
        """(Re-)select the folder: its UIDVALIDITY and UIDNEXT are current after this."""
        folder = self.options.folder
        try:
            info = self.client.select_folder(folder, readonly=readonly)
        except imaplib.IMAP4.error as exc:
            if not self.client.folder_exists(folder):
                raise MailboxError(
                    f"email: {self.options.host} has no folder {folder!r} for "
                    f"{self.options.username}; fix channels.email.folder"
                ) from None
            raise MailboxError(f"email: cannot open {folder!r}: {exc}") from None
        self.uidvalidity = int(info.get(b"UIDVALIDITY", 0))
        self.uidnext = int(info.get(b"UIDNEXT", 1))

    def ensure_folder(self, folder: str) -> None:
        if not self.client.folder_exists(folder):
            self.client.create_folder(folder)
            logger.info("email: made folder {!r} for processed mail", folder)

    # ----------------------------------------------------------------- reading

    def uids_after(self, last_uid: int) -> list[int]:
        """UIDs above `last_uid`, in order (any flags: a person may have read one first)."""
        found = self.client.search(["UID", f"{last_uid + 1}:*"])
        # "n:*" always matches the last message, even when its UID is below n.
        return sorted(int(u) for u in found if int(u) > last_uid)

    def unseen(self, since: date | None) -> list[int]:
        """UIDs of unseen mail (received on or after `since`), in order."""
        criteria: list[Any] = ["UNSEEN"]
        if since is not None:
            criteria += ["SINCE", since]
        return sorted(int(u) for u in self.client.search(criteria))

    def fetch(self, uids: Sequence[int], *, max_bytes: int) -> list[Fetched]:
        """The messages of `uids` that still exist, in UID order; one larger than
        `max_bytes` with its header only."""
        if not uids:
            return []
        sizes = self.client.fetch(list(uids), ["RFC822.SIZE"])
        small = [u for u in uids if u in sizes and int(sizes[u][b"RFC822.SIZE"]) <= max_bytes]
        large = [u for u in uids if u in sizes and u not in small]
        fetched: dict[int, Fetched] = {}
        if small:
            for uid, data in self.client.fetch(small, ["BODY.PEEK[]"]).items():
                raw = data.get(b"BODY[]") or b""
                fetched[uid] = Fetched(uid, raw, int(sizes[uid][b"RFC822.SIZE"]), True)
        if large:
            for uid, data in self.client.fetch(large, ["BODY.PEEK[HEADER]"]).items():
                raw = data.get(b"BODY[HEADER]") or b""
                fetched[uid] = Fetched(uid, raw, int(sizes[uid][b"RFC822.SIZE"]), False)
        return [fetched[u] for u in sorted(fetched)]

    def find(self, message_id: str) -> int | None:
        """The UID of the message with this Message-ID in the selected folder, if any."""
        found = self.client.search(["HEADER", "Message-ID", message_id])
        return int(found[0]) if found else None

    # ----------------------------------------------------------------- confirming

    def confirm(self, uid: int) -> None:
        """The message is in the journal: flag it `\\Seen`, or move it to the processed
        folder. After this it is never taken again."""
        target = self.options.processed_folder
        if not target:
            self.client.add_flags([uid], [SEEN], silent=True)
            return
        if self.can_move:
            self.client.move([uid], target)
            return
        self.client.copy([uid], target)
        self.client.add_flags([uid], [DELETED, SEEN], silent=True)
        if self.can_uidplus:
            self.client.uid_expunge([uid])
        else:
            self.client.expunge()

    # ----------------------------------------------------------------- waiting

    def idle_start(self) -> None:
        self.client.idle()
        self._idling = True

    def idle_check(self, seconds: float) -> bool:
        """Wait up to `seconds` in IDLE; True when the server told of new mail. Raises
        ConnectionResetError when the server has gone (IMAPClient then returns nothing
        at once, again and again, instead of waiting)."""
        started = time.monotonic()
        responses = self.client.idle_check(timeout=seconds)
        if not responses and time.monotonic() - started < seconds / 2:
            self._empty_wakes += 1
            if self._empty_wakes >= 3:
                raise ConnectionResetError("the IMAP server closed the connection")
        else:
            self._empty_wakes = 0
        return any(isinstance(r, tuple) and len(r) > 1 and r[1] in _NEWS for r in responses)

    def idle_done(self) -> None:
        if self._idling:
            self._idling = False
            self.client.idle_done()

    def end_idle(self) -> None:
        """Leave IDLE if the connection still lets us; a dead one fails at once, and
        the caller closes it anyway."""
        try:
            self.idle_done()
        except network_errors():
            pass

    def noop(self) -> None:
        self.client.noop()

    def close(self) -> None:
        _close_quietly(self.client)


def _close_quietly(client: IMAPClient) -> None:
    try:
        client.logout()
    except Exception:
        try:
            client.shutdown()
        except Exception:
            pass
