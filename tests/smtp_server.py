"""A real SMTP server for the email tests: aiosmtpd (the aio-libs SMTP server) on
127.0.0.1 with STARTTLS required before AUTH, like a submission port.

Every message it accepts is recorded, and delivered by IMAP APPEND into the Dovecot
mailbox of each recipient that has one there, so a reply the gateway sends lands in the
correspondent's mailbox as it would in production. `refuse_next` makes the next
transactions answer DATA with a given code (a 451 "try again later", a 554 refusal);
what they carried is recorded in `refused`.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path
from typing import Any

from tests.dovecot_server import Dovecot
from tests.fakes._serving import free_port


@dataclass(frozen=True)
class Accepted:
    """One message the server took: envelope and content."""

    mail_from: str
    rcpt_tos: tuple[str, ...]
    data: bytes
    login: str

    @property
    def message(self) -> EmailMessage:
        parsed = BytesParser(policy=policy.default).parsebytes(self.data)
        assert isinstance(parsed, EmailMessage)
        return parsed


@dataclass
class SmtpServer:
    """The running server; `accepted` lists what it took, in order, and `refused` what
    `refuse_next` turned away."""

    port: int
    users: dict[str, str]
    dovecot: Dovecot | None
    accepted: list[Accepted] = field(default_factory=list)
    refused: list[Accepted] = field(default_factory=list)
    refuse_next: list[str] = field(default_factory=list)
    logins: list[tuple[str, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    controller: Any = None

    def texts(self) -> list[str]:
        """The plain part of every accepted message, in order."""
        out = []
        for item in list(self.accepted):
            body = item.message.get_body(preferencelist=("plain",))
            text = body.get_content() if body is not None else ""
            out.append(text.replace("\r\n", "\n").strip())
        return out


class _Handler:
    def __init__(self, server: SmtpServer) -> None:
        self.server = server

    async def handle_DATA(self, smtp: Any, session: Any, envelope: Any) -> str:
        server = self.server
        data = bytes(envelope.original_content or envelope.content)
        auth = getattr(session, "auth_data", None)
        login = auth.login.decode() if auth is not None and hasattr(auth, "login") else ""
        item = Accepted(envelope.mail_from, tuple(envelope.rcpt_tos), data, str(login))
        with server.lock:
            if server.refuse_next:
                server.refused.append(item)
                return server.refuse_next.pop(0)
        dovecot = server.dovecot
        if dovecot is not None:
            import anyio.to_thread

            for rcpt in item.rcpt_tos:
                if rcpt in dovecot.users:
                    await anyio.to_thread.run_sync(dovecot.append, rcpt, data)
        with server.lock:
            server.accepted.append(item)
        return "250 OK queued"


def _context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert), str(key))
    return context


@contextlib.contextmanager
def running_smtp(
    users: dict[str, str], *, dovecot: Dovecot, implicit_tls: bool = False
) -> Iterator[SmtpServer]:
    """aiosmtpd on a free port, with Dovecot's certificate and STARTTLS + AUTH required
    (with `implicit_tls`: TLS from the first byte, as on port 465)."""
    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult, LoginPassword

    server = SmtpServer(port=free_port(), users=dict(users), dovecot=dovecot)
    # aiosmtpd warns of its own deprecated attribute at every login: not ours to fix.
    logging.getLogger("mail.log").setLevel(logging.ERROR)

    def authenticate(
        smtp: Any, session: Any, envelope: Any, mechanism: str, data: Any
    ) -> AuthResult:
        if not isinstance(data, LoginPassword):
            return AuthResult(success=False, handled=False)
        login, password = data.login.decode(), data.password.decode()
        ok = server.users.get(login) == password
        server.logins.append((login, ok))
        # handled=False: aiosmtpd answers a failure with its 535 itself.
        return AuthResult(success=ok, handled=False)

    context = _context(dovecot.ca_file, dovecot.root / "key.pem")
    # aiosmtpd does not count TLS from the first byte as TLS for auth_require_tls (it
    # would hide AUTH): there the whole connection is TLS anyway.
    tls: dict[str, Any] = (
        {"ssl_context": context, "auth_require_tls": False}
        if implicit_tls
        else {"tls_context": context, "require_starttls": True, "auth_require_tls": True}
    )
    controller = Controller(
        _Handler(server),
        hostname="127.0.0.1",
        port=server.port,
        authenticator=authenticate,
        auth_required=True,
        **tls,
    )
    controller.start()
    server.controller = controller
    try:
        yield server
    finally:
        controller.stop()
