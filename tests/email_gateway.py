"""Running `gateway run` with the email channel against the test servers: the settings
as environment, and a mail as a correspondent's client writes it."""

from __future__ import annotations

import json
from email.message import EmailMessage
from email.utils import formatdate
from pathlib import Path

from tests.dovecot_server import Dovecot
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import base_env
from tests.smtp_server import SmtpServer

BOT = "bot@example.org"
BOT_PASSWORD = "bot-pw"


def email_env(
    workspace: Path,
    llm: FakeOpenAI,
    dovecot: Dovecot,
    smtp: SmtpServer,
    *,
    allow_from: list[str] | None = None,
    threads: bool = True,
) -> dict[str, str]:
    """`base_env` plus the email channel on `dovecot` and `smtp`, on a free HTTP port."""
    prefix = "GATEWAY_CHANNELS__EMAIL__"
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        f"{prefix}ENABLED": "true",
        f"{prefix}ADDRESS": BOT,
        f"{prefix}IMAP_HOST": dovecot.host,
        f"{prefix}IMAP_PORT": str(dovecot.imaps_port),
        f"{prefix}SMTP_HOST": "127.0.0.1",
        f"{prefix}SMTP_PORT": str(smtp.port),
        f"{prefix}TLS_CA_FILE": str(dovecot.ca_file),
        f"{prefix}PASSWORD": BOT_PASSWORD,
        f"{prefix}ALLOW_FROM": json.dumps(allow_from if allow_from is not None else ["*"]),
        f"{prefix}THREADS": "true" if threads else "false",
    }


def person_mail(
    sender: str,
    text: str,
    *,
    message_id: str,
    subject: str = "note",
    in_reply_to: str | None = None,
    references: str | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = BOT
    msg["Subject"] = subject
    msg["Date"] = formatdate(usegmt=True)
    msg["Message-ID"] = message_id
    if in_reply_to:
        msg["In-Reply-To"] = in_reply_to
    if references:
        msg["References"] = references
    for name, value in (headers or {}).items():
        msg[name] = value
    msg.set_content(text)
    return msg.as_bytes()
