"""DingTalk: the adapter (`channel`: the stream mode connection, replies through the
session webhook or the robot API), its translation of robot callbacks (`translate`) and
its formatter (`format`)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.dingtalk.channel import DingTalkChannel, DingTalkSetupError, check_credentials
    from channels.dingtalk.translate import translate_callback

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": ("DingTalkChannel", "DingTalkSetupError", "check_credentials"),
        "translate": ("translate_callback",),
    },
)

__all__ = ["DingTalkChannel", "DingTalkSetupError", "check_credentials", "translate_callback"]
