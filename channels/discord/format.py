"""Discord text: the model's Markdown as Discord's Markdown, with nothing in it that could
ping anyone, and long replies split into messages under Discord's 2,000-character limit.
Pure functions; no discord.py here.

Discord renders most of the model's Markdown as it is (`**bold**`, `*italic*`,
`~~strike~~`, `` `code` ``, fenced code blocks with a language, `> quotes`, lists,
`[text](url)` links and `#`-`###` headings), so the conversion is small:

- `@everyone`, `@here` and the mention syntax (`<@id>`, `<@!id>`, `<@&id>`) outside code
  get a zero-width space after their `@` or `<`, so they show as text and never ping
  (the channel also sends every message with `allowed_mentions` that parse nothing);
- `####`-`######` headings (which Discord shows as text) become bold lines, `__x__`
  (bold in Markdown, underline on Discord) becomes `**x**`, an image becomes its link,
  and a table (which Discord does not draw) becomes a code block with aligned columns.

`split_discord` then cuts the result on paragraph, line and word boundaries, never
inside a code block that fits in one message; a longer block is closed and reopened
with its language around the cut (`channels.telegram.format.plan_chunks`, counted in
UTF-16 units, which is never less than Discord's count of characters).

Promises (tested in tests/test_discord_format.py, partly with hypothesis):
- no message ever holds `@everyone`, `@here` or `<@` outside code;
- every message is at most `DISCORD_LIMIT` characters, and every code block opened in
  one is closed in it;
- the messages hold all of the text, in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from channels.markdown_tables import table_at, table_cells
from channels.telegram.format import split_markdown

DISCORD_LIMIT = 2000
ZWSP = "\u200b"

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_DEEP_HEADING = re.compile(r"^ {0,3}#{4,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_IMAGE = re.compile(r"!\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_UNDERSCORE_STRONG = re.compile(r"(?<![\w_])__(?=\S)(.+?)(?<=\S)__(?![\w_])")
_EVERYONE = re.compile(r"@(everyone|here)", re.IGNORECASE)
_USER_MENTION = re.compile(r"<(@[!&]?)")


def defuse_mentions(text: str) -> str:
    """`text` with every `@everyone`, `@here` and `<@...>` broken by a zero-width space
    (it reads the same and pings no one)."""
    text = _EVERYONE.sub(lambda m: f"@{ZWSP}{m.group(1)}", text)
    return _USER_MENTION.sub(lambda m: f"<{ZWSP}{m.group(1)}", text)


def markdown_to_discord(markdown: str) -> str:
    """The model's Markdown as Discord shows it (see the module docstring)."""
    text = markdown.replace("\r\n", "\n").replace("\r", "\n")
    out: list[str] = []
    for is_code, chunk in _segments(text):
        out.append(chunk if is_code else _prose(chunk))
    return "\n".join(out)


def split_discord(text: str, limit: int = DISCORD_LIMIT) -> list[str]:
    """A Discord message's text (already converted) as the messages to send, in order,
    each at most `limit` characters; blank ones are left out."""
    return split_markdown(text, limit)


def discord_messages(markdown: str, limit: int = DISCORD_LIMIT) -> list[str]:
    """The messages for one reply of the model: converted, then split."""
    return split_discord(markdown_to_discord(markdown), limit)


# --------------------------------------------------------------------------- pieces


def _segments(text: str) -> Iterator[tuple[bool, str]]:
    """(is_code, lines) runs of prose and of fenced code blocks (fences included); an
    unclosed fence runs to the end."""
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
        block = [lines[i]]
        i += 1
        while i < len(lines):
            block.append(lines[i])
            i += 1
            if closing.match(block[-1]):
                break
        yield True, "\n".join(block)
    if prose:
        yield False, "\n".join(prose)


def _prose(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        rows = table_at(lines, i)
        if rows:
            out.append(_table_block(lines[i : i + rows]))
            i += rows
            continue
        out.append(_prose_line(lines[i]))
        i += 1
    return "\n".join(out)


def _prose_line(line: str) -> str:
    heading = _DEEP_HEADING.match(line)
    if heading is not None and heading.group(1).strip():
        line = f"**{heading.group(1).strip()}**"
    return _outside_code_spans(line, _inline)


def _inline(text: str) -> str:
    text = _IMAGE.sub(lambda m: f"[{m.group(1)}]({m.group(2)})" if m.group(1) else m.group(2), text)
    text = _UNDERSCORE_STRONG.sub(r"**\1**", text)
    return defuse_mentions(text)


def _outside_code_spans(line: str, change: Callable[[str], str]) -> str:
    """`change` applied to the parts of `line` outside inline code spans."""
    out: list[str] = []
    position = 0
    for span in _CODE_SPAN.finditer(line):
        out.append(change(line[position : span.start()]))
        out.append(span.group(0))
        position = span.end()
    out.append(change(line[position:]))
    return "".join(out)


# --------------------------------------------------------------------------- tables


def _table_block(rows: list[str]) -> str:
    """A table as a code block with aligned columns (the delimiter row as dashes)."""
    table = [table_cells(row) for i, row in enumerate(rows) if i != 1]
    width = max(len(row) for row in table)
    table = [row + [""] * (width - len(row)) for row in table]
    sizes = [max(len(row[c]) for row in table) for c in range(width)]
    lines = [
        " | ".join(cell.ljust(size) for cell, size in zip(row, sizes, strict=True)) for row in table
    ]
    rule = "-+-".join("-" * size for size in sizes)
    body = [lines[0].rstrip(), rule, *(line.rstrip() for line in lines[1:])]
    return "```\n" + "\n".join(line.replace("```", "`\u200b``") for line in body) + "\n```"
