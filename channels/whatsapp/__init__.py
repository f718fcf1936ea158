"""WhatsApp: the adapter (`channel`: the Cloud API's webhook in on the gateway's HTTP port,
the Graph API out), its formatter (`format`: the model's Markdown as WhatsApp's own
formatting, split at 4,096 characters) and its store (`store`: the 24-hour windows, the
sent messages' statuses and the replies kept as undeliverable)."""

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
