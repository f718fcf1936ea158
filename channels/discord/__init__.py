"""Discord: the adapter (`channel`: discord.py's Gateway client in, its HTTP API out, with
a backfill after every new session) and its formatter (`format`: the model's Markdown as
Discord's, split to its 2,000-character limit)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.discord.channel import (
        DiscordChannel,
        DiscordCheck,
        DiscordSetupError,
        Notice,
        Pacing,
        Place,
        Skip,
        check_credentials,
        discord_message_id,
        target_channel,
        translate_message,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "DiscordChannel",
            "DiscordCheck",
            "DiscordSetupError",
            "Notice",
            "Pacing",
            "Place",
            "Skip",
            "check_credentials",
            "discord_message_id",
            "target_channel",
            "translate_message",
        ),
    },
)

__all__ = [
    "DiscordChannel",
    "DiscordCheck",
    "DiscordSetupError",
    "Notice",
    "Pacing",
    "Place",
    "Skip",
    "check_credentials",
    "discord_message_id",
    "target_channel",
    "translate_message",
]
