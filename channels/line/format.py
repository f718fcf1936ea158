"""LINE text: the model's Markdown as plain text, and long replies split into text
messages under LINE's 5,000-character limit. Pure functions; no HTTP here.

A LINE text message shows its text as it is: no bold, no links with labels, no code
blocks (the Messaging API's text message has no markup at all). So the Markdown's
markers go and what they meant stays readable:

- `**b**`, `*i*`, `~~s~~` and code spans lose their markers; a heading is its line;
- a `-`/`*`/`+` bullet becomes `• `, a task `☐ `/`☑ `, a rule a line of `―`;
- `[label](url)` becomes `label (url)` (LINE links the bare URL), an image its alt
  text and URL;
- a fenced code block keeps its lines without the fences; a table becomes lines of
  cells joined by ` | `.

A mention can only be made with a `textV2` message's `{placeholder}` substitution, which
the channel never sends: an `@All` the model writes is plain text, and pings nobody.

`split_line` then cuts the text on paragraph, line and word boundaries
(`channels.telegram.format.split_markdown`, which counts UTF-16 units: never fewer than
LINE's characters).

Promises (tested in tests/test_line_format.py, partly with hypothesis):
- every message is at most `LINE_TEXT_LIMIT` characters and none is blank;
- the messages hold all of the text's words, in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from channels.markdown_tables import table_at, table_cells
from channels.telegram.format import split_markdown

#: The most characters a text message may hold (Messaging API, "Text message").
LINE_TEXT_LIMIT = 5000
#: The most message objects one reply or push request may carry.
MESSAGES_PER_REQUEST = 5

FENCE = "```"
# A backtick run left in the text would read as a fence to the splitter.
_BROKEN_FENCE = "`\u200b`\u200b`"
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})[^`]*$")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_QUOTE = re.compile(r"^ {0,3}>[ \t]?(.*)$")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+(.*)$")
_TASK = re.compile(r"^\[([ xX])\][ \t]+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?://|mailto:)[^<>\s]+)>")
_EMPHASIS = (
    re.compile(r"(\*\*\*|___)(?=\S)(.+?)(?<=\S)\1"),
    re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1"),
    re.compile(r"(~~)(?=\S)(.+?)(?<=\S)~~"),
    re.compile(r"(?<![*\w])(\*)(?=[^\s*])(.+?)(?<=[^\s*])\*(?![*\w])"),
    re.compile(r"(?<![_\w])(_)(?=[^\s_])(.+?)(?<=[^\s_])_(?![_\w])"),
)
_HOLE = re.compile("\ue001(\\d+)\ue002")
_PRIVATE = re.compile("[\ue001\ue002]")


def markdown_to_line(markdown: str) -> str:
    """The model's Markdown as the plain text of LINE messages (see the module docstring)."""
    text = _PRIVATE.sub("", markdown.replace("\r\n", "\n").replace("\r", "\n"))
    out = [_code(chunk) if is_code else _prose(chunk) for is_code, chunk in _segments(text)]
    return "\n".join(out).strip("\n")


def split_line(text: str, limit: int = LINE_TEXT_LIMIT) -> list[str]:
    """Plain text (from `markdown_to_line`) as messages of at most `limit` characters,
    in order; empty text gives none."""
    return split_markdown(text, limit)


def line_messages(markdown: str, limit: int = LINE_TEXT_LIMIT) -> list[str]:
    """The texts of the messages one reply becomes."""
    return split_line(markdown_to_line(markdown), limit)


def _segments(text: str) -> Iterator[tuple[bool, str]]:
    """(is_code, text) runs of prose lines and fenced code blocks' contents; a fence
    that is never closed runs to the end."""
    lines = text.split("\n")
    prose: list[str] = []
    i = 0
    while i < len(lines):
        opening = _FENCE_OPEN.match(lines[i])
        if opening is None:
            prose.append(lines[i])
            i += 1
            continue
        if prose:
            yield False, "\n".join(prose)
            prose = []
        marker = opening.group(1)
        closing = re.compile(rf"^ {{0,3}}{re.escape(marker[0])}{{{len(marker)},}}[ \t]*$")
        code: list[str] = []
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            code.append(lines[i])
            i += 1
        i += 1
        yield True, "\n".join(code)
    if prose:
        yield False, "\n".join(prose)


def _code(code: str) -> str:
    return code.replace(FENCE, _BROKEN_FENCE)


def _prose(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        rows = table_at(lines, i)
        if rows:
            out.extend(_table(lines[i : i + rows]))
            i += rows
            continue
        out.append(_line(lines[i]).replace(FENCE, _BROKEN_FENCE))
        i += 1
    return "\n".join(out)


def _line(line: str) -> str:
    if _RULE.match(line):
        return "――――――――――"
    if heading := _HEADING.match(line):
        return _inline(heading.group(1))
    if quote := _QUOTE.match(line):
        return "> " + _inline(quote.group(1)) if quote.group(1).strip() else ">"
    if bullet := _BULLET.match(line):
        indent, item = bullet.groups()
        item = _TASK.sub(lambda m: "☐ " if m.group(1) == " " else "☑ ", item)
        return f"{indent}• {_inline(item)}"
    return _inline(line)


def _table(lines: list[str]) -> list[str]:
    """A table as lines of cells: LINE draws no tables and has no monospace font."""
    rows = [lines[0], *lines[2:]]
    return [" | ".join(_inline(cell) for cell in table_cells(row)) for row in rows]


def _inline(text: str) -> str:
    """One line's inline Markdown as plain text: markers dropped, links spelled out."""
    pieces: list[str] = []

    def hole(piece: str) -> str:
        pieces.append(piece)
        return f"\ue001{len(pieces) - 1}\ue002"

    def link(m: re.Match[str]) -> str:
        label, url = _unmark(m.group(2).strip()), m.group(3)
        if not label or label == url:
            return hole(url)
        return label + " (" + hole(url) + ")"

    text = _CODE_SPAN.sub(lambda m: hole(m.group(2).strip()), text)
    text = _LINK.sub(link, text)
    text = _AUTOLINK.sub(lambda m: hole(m.group(1)), text)
    text = _unmark(text)
    while "\ue001" in text:
        text = _HOLE.sub(lambda m: pieces[int(m.group(1))], text)
    return text


def _unmark(text: str) -> str:
    for pattern in _EMPHASIS:
        text = pattern.sub(lambda m: m.group(2), text)
    return text
