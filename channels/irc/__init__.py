"""IRC: the adapter (`channel`: one connection, IRC spoken over anyio's streams), the wire
(`wire`: lines, case mapping, SASL PLAIN, the token bucket) and the formatter (`format`:
the model's Markdown as IRC lines within the 512-byte limit)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.irc.channel import IrcChannel, IrcSetupError, Pacing, translate

__getattr__, __dir__ = lazy_exports(
    __name__, {"channel": ("IrcChannel", "IrcSetupError", "Pacing", "translate")}
)

__all__ = ["IrcChannel", "IrcSetupError", "Pacing", "translate"]
