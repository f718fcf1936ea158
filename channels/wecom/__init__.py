"""WeCom (企业微信): the adapter (`channel`: a self-built app's encrypted callback in on the
gateway's HTTP port, `message/send` out), its cipher (`crypto`), its wire calls (`api`),
the callbacks as the gateway's messages (`translate`) and the formatter (`format`: plain
text, split at 2,048 bytes)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.wecom.api import WeComApi, WeComError
    from channels.wecom.channel import Pacing, WeComChannel, WeComRefused, WeComSetupError

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "api": ("WeComApi", "WeComError"),
        "channel": ("Pacing", "WeComChannel", "WeComRefused", "WeComSetupError"),
    },
)

__all__ = ["Pacing", "WeComApi", "WeComChannel", "WeComError", "WeComRefused", "WeComSetupError"]
