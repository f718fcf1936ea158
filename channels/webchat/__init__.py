"""The web chat: a chat page on the gateway's port and a widget for other sites.

The adapter (`channel`: the page's API and its event stream, replies into the log), the
conversation log and files of each visitor (`store`, in the workspace or PostgreSQL), who
a browser is (`visitors`: signed cookies, CSRF tokens, the password), the rate limits
(`limits`), the pages open in this process (`hub`), the pages themselves (`site`, and the
JavaScript and CSS under `static/`) and the model's Markdown as safe HTML (`render`)."""

# Names are imported on first use: the package's `spec` (its entry point) stays light.

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from channels.webchat.channel import WebChatChannel
    from channels.webchat.store import BACKENDS, WebChatStore

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"channel": ("WebChatChannel",), "store": ("BACKENDS", "WebChatStore")},
)

__all__ = ["BACKENDS", "WebChatChannel", "WebChatStore"]
