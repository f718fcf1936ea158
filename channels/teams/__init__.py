"""Microsoft Teams: the adapter (`channel`: the Bot Framework's activities in on the
gateway's HTTP port, the Bot Connector's REST API out), the service authentication both
ways (`auth`), the connector's calls (`connector`), the policy of which activities are
taken and their session keys (`translate`) and the formatter (`format`: the model's
Markdown as a Teams text message's, notifying no one)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.teams.auth import AuthError, BotToken, ConnectorKeys, verify_activity
    from channels.teams.channel import (
        Pacing,
        TeamsChannel,
        TeamsSetupError,
        check_credentials,
    )
    from channels.teams.translate import Skip, translate_activity

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "auth": ("AuthError", "BotToken", "ConnectorKeys", "verify_activity"),
        "channel": ("Pacing", "TeamsChannel", "TeamsSetupError", "check_credentials"),
        "translate": ("Skip", "translate_activity"),
    },
)

__all__ = [
    "AuthError",
    "BotToken",
    "ConnectorKeys",
    "Pacing",
    "Skip",
    "TeamsChannel",
    "TeamsSetupError",
    "check_credentials",
    "translate_activity",
    "verify_activity",
]
