"""Slack: the adapter (`channel`: slack-bolt events in over Socket Mode or HTTP, Web API
replies out) and its formatter (`format`: the model's Markdown as Slack's mrkdwn)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.slack.channel import (
        RetryPolicy,
        Skipped,
        SlackChannel,
        SlackCredentialsError,
        address_of,
        check_credentials,
        translate_event,
    )

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": (
            "RetryPolicy",
            "Skipped",
            "SlackChannel",
            "SlackCredentialsError",
            "address_of",
            "check_credentials",
            "translate_event",
        ),
    },
)

__all__ = [
    "RetryPolicy",
    "Skipped",
    "SlackChannel",
    "SlackCredentialsError",
    "address_of",
    "check_credentials",
    "translate_event",
]
