"""Signal: the adapter (`channel`: signal-cli's JSON-RPC daemon over HTTP), its client
(`client`), the translation of what signal-cli hands over (`inbound`) and its formatter
(`format`: the model's Markdown as Signal's text styles)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.signal.channel import Pacing, SignalChannel, SignalSetupError, check_daemon
    from channels.signal.inbound import Me, parse_target, translate

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": ("Pacing", "SignalChannel", "SignalSetupError", "check_daemon"),
        "inbound": ("Me", "parse_target", "translate"),
    },
)

__all__ = [
    "Me",
    "Pacing",
    "SignalChannel",
    "SignalSetupError",
    "check_daemon",
    "parse_target",
    "translate",
]
