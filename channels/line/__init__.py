"""LINE: the adapter (`channel`: the Messaging API's signed webhook in on the gateway's
HTTP port, reply tokens and retry-keyed pushes out), its wire calls (`api`), the webhook
events as the gateway's messages (`translate`) and the formatter (`format`: the model's
Markdown as plain text, split at 5,000 characters)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.line.api import LineApi, LineError
    from channels.line.channel import (
        LineChannel,
        LineRefused,
        LineSetupError,
        Pacing,
        retry_key,
        signature_ok,
    )
    from channels.line.translate import ReplyContext, translate_event, translate_request

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "api": ("LineApi", "LineError"),
        "channel": (
            "LineChannel",
            "LineRefused",
            "LineSetupError",
            "Pacing",
            "retry_key",
            "signature_ok",
        ),
        "translate": ("ReplyContext", "translate_event", "translate_request"),
    },
)

__all__ = [
    "LineApi",
    "LineChannel",
    "LineError",
    "LineRefused",
    "LineSetupError",
    "Pacing",
    "ReplyContext",
    "retry_key",
    "signature_ok",
    "translate_event",
    "translate_request",
]
