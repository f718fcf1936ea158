"""Telegram: the adapter (`channel`: python-telegram-bot, polling or a webhook) and its
formatter (`format`: the model's Markdown as Telegram's HTML, split to its limits)."""

from channels.telegram.channel import (
    Address,
    Notice,
    Pacing,
    Skip,
    TelegramChannel,
    TelegramSetupError,
    check_credentials,
    failure_kind,
    parse_target,
    telegram_message_id,
    translate_update,
)

__all__ = [
    "Address",
    "Notice",
    "Pacing",
    "Skip",
    "TelegramChannel",
    "TelegramSetupError",
    "check_credentials",
    "failure_kind",
    "parse_target",
    "telegram_message_id",
    "translate_update",
]
