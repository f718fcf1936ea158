"""Google Chat: the adapter (`channel`: a Chat app on an HTTP endpoint, events in on the
gateway's port, replies out through the Chat API), trust both ways (`auth`: the bearer
token of Google's requests checked, the service account's access token), its wire calls
(`api`), which events are taken and their session keys (`translate`) and the formatter
(`format`: the model's Markdown in Chat's markup, nobody mentioned, split to the API's
size limit)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.googlechat.channel import (
        GoogleChatChannel,
        GoogleChatCheck,
        Pacing,
        check_credentials,
    )
    from channels.googlechat.translate import Skip, target_of, translate_event

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": ("GoogleChatChannel", "GoogleChatCheck", "Pacing", "check_credentials"),
        "translate": ("Skip", "target_of", "translate_event"),
    },
)

__all__ = [
    "GoogleChatChannel",
    "GoogleChatCheck",
    "Pacing",
    "Skip",
    "check_credentials",
    "target_of",
    "translate_event",
]
