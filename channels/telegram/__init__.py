"""Telegram: the adapter (`channel`: python-telegram-bot, polling or a webhook) and its
formatter (`format`: the model's Markdown as Telegram's HTML, split to its limits)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
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

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
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
        ),
    },
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
