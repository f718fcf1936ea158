"""Discord: the adapter (`channel`: discord.py's Gateway client in, its HTTP API out, with
a backfill after every new session) and its formatter (`format`: the model's Markdown as
Discord's, split to its 2,000-character limit)."""

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
