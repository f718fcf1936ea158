"""Feishu / Lark: the adapter (`channel`: the long connection or event callbacks, the IM
API), its wire format (`frames`), its callback crypto (`crypto`), its API calls (`api`),
its translation of events (`translate`) and its formatter (`format`)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light,
# and a missing platform library is reported by the spec, not as an ImportError here.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.feishu.channel import FeishuChannel, FeishuSetupError, check_credentials
    from channels.feishu.translate import translate_event

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "channel": ("FeishuChannel", "FeishuSetupError", "check_credentials"),
        "translate": ("translate_event",),
    },
)

__all__ = ["FeishuChannel", "FeishuSetupError", "check_credentials", "translate_event"]
