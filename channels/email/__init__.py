"""Email: the adapter (`channel`: one mailbox over IMAP in, SMTP out), what the headers
of a mail say (`headers`: sender, machines, authentication, threads), its text both ways
(`format`), the IMAP connection (`mailbox`) and how far each mailbox was read (`state`)."""

from channels.email.channel import (
    EmailChannel,
    EmailSetupError,
    Pacing,
    Skip,
    check_mailbox,
    compose_reply,
    translate_mail,
)
from channels.email.state import MailboxMark, MailboxMarks

__all__ = [
    "EmailChannel",
    "EmailSetupError",
    "MailboxMark",
    "MailboxMarks",
    "Pacing",
    "Skip",
    "check_mailbox",
    "compose_reply",
    "translate_mail",
]
