"""The model's Markdown as HTML the chat page can show: CommonMark (with tables and
strikethrough) through markdown-it-py with raw HTML off.

The promise (tested in tests/test_webchat_render.py, hostile input and hypothesis): the
HTML holds only the elements and attributes in `ALLOWED`; whatever a reply holds (tags,
entities, `javascript:` links, attribute breakouts) arrives as text or as one of those.
Links open in a new tab without a referrer; an image becomes a link to it (the page loads
nothing from elsewhere: its CSP forbids it). The page sanitizes again before it shows the
HTML (`static/chat.js`), so a mistake here alone runs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.token import Token

#: Every element the rendered HTML may hold, with the attributes each may carry.
ALLOWED: dict[str, frozenset[str]] = {
    **{
        tag: frozenset()
        for tag in (
            *("p", "br", "hr", "strong", "em", "del", "s", "pre", "blockquote", "ul", "li"),
            *("h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr"),
        )
    },
    "ol": frozenset({"start"}),
    "th": frozenset({"style"}),
    "td": frozenset({"style"}),
    "a": frozenset({"href", "rel", "target"}),
    # The fence's language, for the page's highlighter: `language-<info word>`.
    "code": frozenset({"class"}),
}
#: What the `style` of a table cell may be (markdown-it's column alignment).
CELL_STYLES = frozenset({"text-align:left", "text-align:right", "text-align:center"})
LINK_REL = "noopener noreferrer nofollow"


def _link_open(renderer: Any, tokens: Sequence[Token], index: int, options: Any, env: Any) -> str:
    token = tokens[index]
    token.attrSet("rel", LINK_REL)
    token.attrSet("target", "_blank")
    return str(renderer.renderToken(tokens, index, options, env))


def _image(renderer: Any, tokens: Sequence[Token], index: int, options: Any, env: Any) -> str:
    token = tokens[index]
    source = str(token.attrGet("src") or "")
    words = "".join(child.content for child in token.children or ()) or source
    return (
        f'<a href="{escapeHtml(source)}" rel="{LINK_REL}" target="_blank">{escapeHtml(words)}</a>'
    )


def _fence(renderer: Any, tokens: Sequence[Token], index: int, options: Any, env: Any) -> str:
    token = tokens[index]
    words = token.info.split()
    language = re.sub(r"[^A-Za-z0-9_+#-]", "", words[0])[:30] if words else ""
    kind = f' class="language-{language}"' if language else ""
    return f"<pre><code{kind}>{escapeHtml(token.content)}</code></pre>\n"


def link_allowed(url: str) -> bool:
    """Only web and mail links: anything else (`javascript:`, `data:`, relative paths into
    the gateway) stays text."""
    return url.strip().lower().startswith(("https://", "http://", "mailto:"))


def _renderer() -> MarkdownIt:
    markdown = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
    markdown.enable(["table", "strikethrough"])
    markdown.validateLink = link_allowed  # type: ignore[method-assign]
    markdown.add_render_rule("link_open", _link_open)
    markdown.add_render_rule("image", _image)
    markdown.add_render_rule("fence", _fence)
    markdown.add_render_rule("code_block", _fence)
    return markdown


_MARKDOWN = _renderer()


def render(text: str) -> str:
    """`text` (the model's Markdown) as safe HTML; see the module docstring."""
    return str(_MARKDOWN.render(text))
