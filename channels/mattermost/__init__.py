"""Mattermost: the adapter (`channel`: the WebSocket in, the REST API v4 out, with a
read-back after every connection), its wire calls (`api`), the policy of which posts are
taken and their session keys (`translate`), the read positions (`positions`) and the
formatter (`format`: the model's Markdown with every mention defused, split to the
server's post length)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.mattermost.channel import (
        MattermostChannel,
        MattermostCheck,
        MattermostSetupError,
        Pacing,
        check_credentials,
        pending_post_id,
    )
    from channels.mattermost.translate import Sender, Skip, target_of, translate_post

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "MattermostChannel",
            "MattermostCheck",
            "MattermostSetupError",
            "Pacing",
            "check_credentials",
            "pending_post_id",
        ),
        "translate": ("Sender", "Skip", "target_of", "translate_post"),
    },
)

__all__ = [
    "MattermostChannel",
    "MattermostCheck",
    "MattermostSetupError",
    "Pacing",
    "Sender",
    "Skip",
    "check_credentials",
    "pending_post_id",
    "target_of",
    "translate_post",
]
