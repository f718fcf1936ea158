"""Teams text: the model's Markdown as the Markdown a Teams text message shows, notifying
no one, split into messages under the channel's length limit. Pure functions.

Teams renders a subset of Markdown in a text message (`textFormat: "markdown"`; "Format
your bot messages"): bold, italic, strikethrough, code spans and blocks, quotes, links and
(on the desktop) lists, but no headings, tables, rules or images. So:

- a heading becomes a bold line, a table a code block with aligned columns, a rule an
  empty line, an image its link;
- `<at` outside code gets a zero-width space after its `<`: a mention needs an entity the
  channel adds only for the sender it answers, so the text alone can notify no one, and
  what the model writes never even looks like a mention;
- `split_teams` cuts on paragraph, line and word boundaries, never inside a code block
  that fits in one message (`channels.telegram.format.split_markdown`, counted in UTF-16
  units, as Teams counts a message's size).

A reply in a group chat or a channel starts with its sender's mention (`mention_prefix`
and `mention_entity`), the only mention the bot ever makes.

Promises (tested in tests/test_teams_format.py, partly with hypothesis):
- no message holds `<at` outside code;
- every message is at most `limit` characters, and every code block opened in one is
  closed in it;
- the messages hold all of the text, in order.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator
from typing import Any

from channels.markdown_tables import table_at, table_cells
from channels.telegram.format import split_markdown

ZWSP = "\u200b"

#: A fence as CommonMark reads one: a backtick fence's info string holds no backtick.
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}(?=[^`]*$)|~{3,})")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}([-*_])[ \t]*(?:\1[ \t]*){2,}$")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_IMAGE = re.compile(r"!\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_AT_TAG = re.compile(r"<(/?at)\b", re.IGNORECASE)


def defuse_mentions(text: str) -> str:
    """`text` (prose, no code) with every `<at` and `</at` broken by a zero-width space."""
    return _AT_TAG.sub(lambda m: f"<{ZWSP}{m.group(1)}", text)


def markdown_to_teams(markdown: str) -> str:
    """The model's Markdown as a Teams text message shows it (see the module docstring)."""
    text = markdown.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(chunk if is_code else _prose(chunk) for is_code, chunk in _segments(text))


def split_teams(text: str, limit: int) -> list[str]:
    """A message's text (already converted) as the messages to send, in order, each at
    most `limit` characters; blank ones are left out."""
    return split_markdown(text, limit)


def teams_messages(markdown: str, limit: int, *, mention: str = "") -> list[str]:
    """The messages for one reply of the model: converted, `mention` (the sender's,
    `mention_prefix`) before the first, then split."""
    text = markdown_to_teams(markdown)
    if mention and text.strip():
        text = f"{mention}{text}"
    return split_teams(text, limit)


def mention_text(name: str) -> str:
    """A person's mention as it stands in a message: `<at>Name</at>`, the name escaped."""
    return f"<at>{html.escape(name or 'you', quote=False)}</at>"


def mention_prefix(name: str) -> str:
    return f"{mention_text(name)} "


def mention_entity(account_id: str, name: str) -> dict[str, Any]:
    """The `mention` entity that makes `mention_text(name)` notify `account_id`."""
    return {
        "type": "mention",
        "text": mention_text(name),
        "mentioned": {"id": account_id, "name": name},
    }


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
    if _RULE.match(line):
        return ""
    heading = _HEADING.match(line)
    if heading is not None and heading.group(1).strip():
        line = f"**{heading.group(1).strip()}**"
    return _outside_code_spans(line, _inline)


def _inline(text: str) -> str:
    text = _IMAGE.sub(lambda m: f"[{m.group(1)}]({m.group(2)})" if m.group(1) else m.group(2), text)
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
