"""QQ over OneBot v11: the adapter (`channel`: the forward WebSocket's events in, with a
read-back of the history after every connection, and its API calls out), the wire
(`onebot`: calls matched by echo, segments and CQ codes), the policy of which messages
are taken and their session keys (`translate`), the read positions (`positions`) and the
formatter (`format`: the model's Markdown as plain text, split to the message length)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.qq.channel import (
        Pacing,
        QQChannel,
        QQCheck,
        QQRefused,
        QQSendUncertain,
        QQSetupError,
        check_credentials,
    )
    from channels.qq.translate import Skip, conversation_of, target_of, translate_event

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "Pacing",
            "QQChannel",
            "QQCheck",
            "QQRefused",
            "QQSendUncertain",
            "QQSetupError",
            "check_credentials",
        ),
        "translate": ("Skip", "conversation_of", "target_of", "translate_event"),
    },
)

__all__ = [
    "Pacing",
    "QQChannel",
    "QQCheck",
    "QQRefused",
    "QQSendUncertain",
    "QQSetupError",
    "Skip",
    "check_credentials",
    "conversation_of",
    "target_of",
    "translate_event",
]
