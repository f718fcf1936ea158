"""Email: the adapter (`channel`: one mailbox over IMAP in, SMTP out), what the headers
of a mail say (`headers`: sender, machines, authentication, threads), its text both ways
(`format`), the IMAP connection (`mailbox`) and how far each mailbox was read (`state`)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.email.channel import (
        EmailChannel,
        EmailSetupError,
        Pacing,
        Skip,
        check_mailbox,
        compose_reply,
        translate_mail,
    )
    from channels.email.state import (
        MailboxMark,
        MailboxMarks,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "EmailChannel",
            "EmailSetupError",
            "Pacing",
            "Skip",
            "check_mailbox",
            "compose_reply",
            "translate_mail",
        ),
        "state": (
            "MailboxMark",
            "MailboxMarks",
        ),
    },
)

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
