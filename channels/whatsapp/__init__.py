"""WhatsApp: the adapter (`channel`: the Cloud API's webhook in on the gateway's HTTP port,
the Graph API out), its formatter (`format`: the model's Markdown as WhatsApp's own
formatting, split at 4,096 characters) and its store (`store`: the 24-hour windows, the
sent messages' statuses and the replies kept as undeliverable)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.whatsapp.channel import (
        GraphApi,
        GraphError,
        RetryPolicy,
        WhatsAppChannel,
        WhatsAppSetupError,
        check_credentials,
        signature_ok,
        translate_payload,
    )
    from channels.whatsapp.store import (
        STORE_FILE,
        FileWhatsAppStore,
        PostgresWhatsAppStore,
        WhatsAppStore,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "GraphApi",
            "GraphError",
            "RetryPolicy",
            "WhatsAppChannel",
            "WhatsAppSetupError",
            "check_credentials",
            "signature_ok",
            "translate_payload",
        ),
        "store": (
            "STORE_FILE",
            "FileWhatsAppStore",
            "PostgresWhatsAppStore",
            "WhatsAppStore",
        ),
    },
)

__all__ = [
    "STORE_FILE",
    "FileWhatsAppStore",
    "GraphApi",
    "GraphError",
    "PostgresWhatsAppStore",
    "RetryPolicy",
    "WhatsAppChannel",
    "WhatsAppSetupError",
    "WhatsAppStore",
    "check_credentials",
    "signature_ok",
    "translate_payload",
]
