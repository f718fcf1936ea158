"""Slack: the adapter (`channel`: slack-bolt events in over Socket Mode or HTTP, Web API
replies out) and its formatter (`format`: the model's Markdown as Slack's mrkdwn)."""

from channels.slack.channel import (
    RetryPolicy,
    Skipped,
    SlackChannel,
    SlackCredentialsError,
    address_of,
    check_credentials,
    translate_event,
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
