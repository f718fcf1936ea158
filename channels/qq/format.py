"""QQ text: the model's Markdown as the plain text a QQ message shows, and long replies
split into messages under the channel's length limit. Pure functions; no network here.

QQ shows a message's text as it is: no Markdown, no HTML (a personal account has no
formatted messages; QQ's `markdown` messages are for official bots only). So the markup
goes and its structure stays: headings and paragraphs on lines of their own, list items
as `- ` and `1. `, quotes as `> `, code blocks as their lines, a link as `text (url)`,
a table as its rows with ` | ` between cells; emphasis and code markers are dropped.

Nothing in the text can notify anyone or become anything but text: the channel sends
it in text segments of the array format, which OneBot never parses for CQ codes
(message/array.md), so `[CQ:at,qq=all]` or `@all` written by the model is shown as the
characters it is. The only mention the bot makes is the `at` segment naming a group
message's sender.

`split_messages` cuts on paragraph, line and word boundaries
(`channels.telegram.format.split_markdown`, which counts UTF-16 units: never fewer than
characters).

Promises (tested in tests/test_qq_format.py, partly with hypothesis):
- every message is at most `limit` characters;
- the messages hold all of the converted text, in order.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

from channels.qq.settings import MAX_MESSAGE_CHARS
from channels.telegram.format import split_markdown

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.token import Token

#: What the bot's own `at` of the sender may take of the first message's length.
MENTION_RESERVE = 40


@functools.cache
def _parser() -> MarkdownIt:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(
        ["table", "strikethrough"]
    )


def markdown_to_qq(markdown: str) -> str:
    """The model's Markdown as the plain text of a QQ message."""
    source = markdown.replace("\r\n", "\n").replace("\r", "\n")
    blocks = _Blocks()
    tokens = _parser().parse(source)
    index = 0
    while index < len(tokens):
        index = blocks.take(tokens, index)
    text = "\n".join(blocks.lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def split_messages(text: str, limit: int = MAX_MESSAGE_CHARS) -> list[str]:
    """A reply's text (already converted) as the messages to send, in order, each at most
    `limit` characters; blank ones are left out."""
    return split_markdown(text, limit)


def qq_messages(
    markdown: str, limit: int = MAX_MESSAGE_CHARS, *, mention: bool = False
) -> list[str]:
    """The texts of one reply of the model: converted, then split to `limit` (less what
    an `at` of the sender takes, when the first one carries it)."""
    budget = limit - MENTION_RESERVE if mention else limit
    return split_messages(markdown_to_qq(markdown), budget)


# --------------------------------------------------------------------------- rendering


class _Blocks:
    """Renders block tokens to lines, keeping the list and quote context."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.lists: list[list[int]] = []  # per open list: [ordered (0/1), next number]
        self.quotes = 0
        self.marker: str | None = None  # a list item's marker, for its first line
        self.indent = 0
        self.tight_item = False
        self.list_starts = False

    def _emit(self, text_lines: list[str], *, tight: bool = False) -> None:
        if self.lines and not tight and self.lines[-1] != "":
            self.lines.append("")
        quote = "> " * self.quotes
        for number, line in enumerate(text_lines):
            if number == 0 and self.marker is not None:
                lead = " " * (self.indent - len(self.marker)) + self.marker
                self.marker = None
            else:
                lead = " " * self.indent
            self.lines.append((quote + lead + line).rstrip())

    def take(self, tokens: list[Token], index: int) -> int:
        """Render the block at `index`; the index of the next token."""
        token = tokens[index]
        kind = token.type
        if kind in ("bullet_list_open", "ordered_list_open"):
            start = int(token.attrGet("start") or 1)
            self.list_starts = not self.lists  # a list of its own: a blank line before it
            self.lists.append([1 if kind == "ordered_list_open" else 0, start])
        elif kind in ("bullet_list_close", "ordered_list_close"):
            self.lists.pop()
            self.indent = sum(_marker_width(level) for level in self.lists)
        elif kind == "list_item_open":
            level = self.lists[-1]
            self.marker = f"{level[1]}. " if level[0] else "- "
            level[1] += 1
            self.indent = sum(_marker_width(level) for level in self.lists)
            self.tight_item = True
        elif kind == "list_item_close":
            self.marker = None
        elif kind == "blockquote_open":
            self.quotes += 1
        elif kind == "blockquote_close":
            self.quotes -= 1
        elif kind in ("paragraph_open", "heading_open"):
            inline = tokens[index + 1]
            tight = bool(self.lists) and (token.hidden or self.tight_item)
            tight = tight and not self.list_starts
            self.tight_item = self.list_starts = False
            self._emit(render_inline(inline.children or []).split("\n"), tight=tight)
            return index + 3
        elif kind in ("fence", "code_block"):
            tight = bool(self.lists) and self.tight_item and not self.list_starts
            self.tight_item = self.list_starts = False
            self._emit(token.content.rstrip("\n").split("\n"), tight=tight)
        elif kind == "hr":
            self._emit(["----------"])
        elif kind == "html_block":
            self._emit(token.content.rstrip("\n").split("\n"))
        elif kind == "table_open":
            return self._table(tokens, index)
        return index + 1

    def _table(self, tokens: list[Token], index: int) -> int:
        rows: list[list[str]] = []
        row: list[str] = []
        while index < len(tokens) and tokens[index].type != "table_close":
            token = tokens[index]
            if token.type == "tr_open":
                row = []
            elif token.type == "tr_close":
                rows.append(row)
            elif token.type == "inline":
                row.append(render_inline(token.children or []).replace("\n", " ").strip())
            index += 1
        self._emit([" | ".join(cells) for cells in rows])
        return index + 1


def _marker_width(level: list[int]) -> int:
    return len(f"{level[1] - 1}. ") if level[0] else 2


def render_inline(children: list[Token]) -> str:
    """An inline run as plain text: markers dropped, links and images with their address."""
    out: list[str] = []
    links: list[tuple[str, int]] = []  # (href, where its text starts in `out`)
    for token in children:
        kind = token.type
        if kind in ("text", "code_inline", "html_inline"):
            out.append(token.content)
        elif kind in ("softbreak", "hardbreak"):
            out.append("\n")
        elif kind == "link_open":
            links.append((str(token.attrGet("href") or ""), len(out)))
        elif kind == "link_close" and links:
            href, start = links.pop()
            shown = "".join(out[start:]).strip()
            if href and shown != href and shown != href.removeprefix("mailto:"):
                out.append(f" ({href})")
        elif kind == "image":
            alt = "".join(c.content for c in token.children or []) or token.content
            src = str(token.attrGet("src") or "")
            out.append(f"{alt} ({src})" if alt and src else alt or src)
    return "".join(out)
