"""WhatsApp text: the model's Markdown as WhatsApp's own formatting, and long replies split
into messages under WhatsApp's 4,096-character limit. Pure functions; no HTTP here.

WhatsApp formats plain text by markers: `*bold*`, `_italic_`, `~strike~`, ```` ``` ````
monospace blocks, `` `inline code` ``, `> ` quotes and `- ` / `1. ` lists. It has no
links with labels, headings or tables, and no way to escape a marker. So:

- `**b**` / `__b__` -> `*b*`, `*i*` / `_i_` -> `_i_`, `***bi***` -> `*_bi_*`,
  `~~s~~` -> `~s~`; code spans stay as they are;
- a heading becomes a bold line, a `*`/`+` bullet a `- ` bullet, a rule a line of dashes;
- `[label](url)` becomes `label (url)` (WhatsApp links the bare URL), an image its alt
  text and URL;
- a fenced code block becomes a ```` ``` ```` block without its language; a table becomes
  such a block with aligned columns.

`split_whatsapp` then cuts the converted text on paragraph, line and word boundaries,
never inside a code block that fits in one message; a longer block is closed and
reopened around the cut (`channels.telegram.format.split_markdown`, which counts UTF-16
units: never fewer than WhatsApp's characters).

Promises (tested in tests/test_whatsapp_format.py, partly with hypothesis):
- every message is at most `WHATSAPP_LIMIT` characters and none is blank;
- every ```` ``` ```` block opened in a message is closed in it;
- the messages hold all of the text, in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from channels.markdown_tables import table_at, table_cells
from channels.telegram.format import split_markdown

#: The most characters a text message's body may hold (the Cloud API's limit).
WHATSAPP_LIMIT = 4096

FENCE = "```"
# WhatsApp has no escape: a zero-width space breaks up a backtick run inside a block.
_BROKEN_FENCE = "`\u200b`\u200b`"
_BOLD = "\ue000"  # stands for a bold `*` while single `*`s are turned into `_`
_PRIVATE = re.compile("[\ue000-\ue002]")
_HOLE_OPEN, _HOLE_CLOSE = "\ue001", "\ue002"

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})[^`]*$")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_QUOTE = re.compile(r"^ {0,3}>[ \t]?(.*)$")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+(.*)$")
_TASK = re.compile(r"^\[([ xX])\][ \t]+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?://|mailto:)[^<>\s]+)>")
_STRONG_EM = re.compile(r"(\*\*\*|___)(?=\S)(.+?)(?<=\S)\1")
_STRONG = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_EM = re.compile(r"(?<![*\w])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![*\w])")


def markdown_to_whatsapp(markdown: str) -> str:
    """The model's Markdown as WhatsApp-formatted text (see the module docstring)."""
    text = _PRIVATE.sub("", markdown.replace("\r\n", "\n").replace("\r", "\n"))
    out = [_code_block(chunk) if is_code else _prose(chunk) for is_code, chunk in _segments(text)]
    return "\n".join(out).strip("\n")


def split_whatsapp(text: str, limit: int = WHATSAPP_LIMIT) -> list[str]:
    """WhatsApp text (from `markdown_to_whatsapp`) as messages of at most `limit`
    characters, in order; empty text gives none."""
    return split_markdown(text, limit)


def plain_line(text: str, limit: int) -> str:
    """`text` on one line of at most `limit` characters (a template parameter may hold
    no newline, tab or run of more than four spaces): whitespace runs become one space,
    and a cut text ends in `…`."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


# --------------------------------------------------------------------------- blocks


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


def _code_block(code: str) -> str:
    body = code.replace(FENCE, _BROKEN_FENCE)
    return f"{FENCE}\n{body}\n{FENCE}" if body.strip() else f"{FENCE}\n \n{FENCE}"


def _prose(text: str) -> str:
    out: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        rows = table_at(lines, i)
        if rows:
            out.append(_table_block(lines[i : i + rows]))
            i += rows
            continue
        # A backtick run left in prose would open a monospace block on WhatsApp.
        out.append(_prose_line(lines[i]).replace(FENCE, _BROKEN_FENCE))
        i += 1
    return "\n".join(out)


def _prose_line(line: str) -> str:
    if _RULE.match(line):
        return "――――――――――"
    if heading := _HEADING.match(line):
        title = _inline(re.sub(r"\*\*|__", "", heading.group(1)))
        return f"*{title}*" if title.strip() else ""
    if quote := _QUOTE.match(line):
        return "> " + _inline(quote.group(1)) if quote.group(1).strip() else ">"
    if bullet := _BULLET.match(line):
        indent, item = bullet.groups()
        item = _TASK.sub(lambda m: "☐ " if m.group(1) == " " else "☑ ", item)
        return f"{indent}- {_inline(item)}"
    return _inline(line)


# --------------------------------------------------------------------------- tables


def _plain_cell(cell: str) -> str:
    cell = _LINK.sub(lambda m: f"{m.group(2)} ({m.group(3)})" if m.group(2) else m.group(3), cell)
    cell = _CODE_SPAN.sub(lambda m: m.group(2), cell)
    return re.sub(r"\*\*\*|___|\*\*|__|~~", "", cell)


def _table_block(lines: list[str]) -> str:
    """A table as a monospace block with aligned columns: WhatsApp draws no tables."""
    header = [_plain_cell(c) for c in table_cells(lines[0])]
    width = len(header)
    rows = [header]
    for line in lines[2:]:
        cells = [_plain_cell(c) for c in table_cells(line)][:width]
        rows.append(cells + [""] * (width - len(cells)))
    widths = [max(len(row[col]) for row in rows) for col in range(width)]

    def fmt(row: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    grid = [fmt(rows[0]), "-+-".join("-" * w for w in widths), *(fmt(r) for r in rows[1:])]
    return _code_block("\n".join(grid))


# --------------------------------------------------------------------------- inline


def _inline(text: str) -> str:
    """One line's inline Markdown: code spans kept, links spelled out, emphasis mapped."""
    pieces: list[str] = []

    def hole(piece: str) -> str:
        pieces.append(piece)
        return f"{_HOLE_OPEN}{len(pieces) - 1}{_HOLE_CLOSE}"

    def code_span(m: re.Match[str]) -> str:
        return hole("`" + m.group(2).strip().replace("`", "\u02cb") + "`")

    def link(m: re.Match[str]) -> str:
        label, url = m.group(2).strip(), m.group(3)
        if not label or label == url:
            return hole(url)
        return _emphasis(label) + " (" + hole(url) + ")"

    text = _CODE_SPAN.sub(code_span, text)
    text = _LINK.sub(link, text)
    text = _AUTOLINK.sub(lambda m: hole(m.group(1)), text)
    text = _emphasis(text)
    hole_pattern = re.compile(f"{_HOLE_OPEN}(\\d+){_HOLE_CLOSE}")
    while _HOLE_OPEN in text:
        text = hole_pattern.sub(lambda m: pieces[int(m.group(1))], text)
    return text


def _emphasis(text: str) -> str:
    text = _STRONG_EM.sub(lambda m: f"{_BOLD}_{m.group(2)}_{_BOLD}", text)
    text = _STRONG.sub(lambda m: f"{_BOLD}{m.group(2)}{_BOLD}", text)
    text = _STRIKE.sub(r"~\1~", text)
    text = _EM.sub(r"_\1_", text)
    return text.replace(_BOLD, "*")
