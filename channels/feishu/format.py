"""Feishu text: the model's Markdown as the `md` element of a rich-text (`post`) message,
with nothing in it that could notify anyone, split into parts. Pure functions.

Feishu draws a `post`'s `md` element as Markdown: bold, italic, strikethrough, links,
lists, quotes, code blocks and rules. What it does not draw is rewritten:

- headings (`#` to `######`) become bold lines;
- a table becomes a code block with aligned columns;
- `<at ...>` (Feishu's mention: `<at id=all></at>` notifies everyone in a group,
  `<at user_id="ou_..."></at>` one person) gets a zero-width space after its `<`, in code
  too, so it shows as text and notifies no one.

`split_parts` then cuts the result on paragraph, line and word boundaries, never inside a
code block that fits in one part (`channels.telegram.format.split_markdown`).

Promises (tested in tests/test_feishu.py, partly with hypothesis):
- no part holds `<at`;
- every part is at most `limit` characters and closes every code block it opens;
- the parts hold all of the text, in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from channels.markdown_tables import table_at, table_cells
from channels.telegram.format import split_markdown

ZWSP = "\u200b"
#: A part's default size: a post holds 30 KB of JSON, and a CJK character is 3 bytes.
PART_CHARS = 4000

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_AT_TAG = re.compile(r"<(?=\s*at\b)", re.IGNORECASE)


def defuse_mentions(text: str) -> str:
    """`text` with every `<at` broken by a zero-width space (it reads the same)."""
    return _AT_TAG.sub("<" + ZWSP, text)


def markdown_to_feishu(markdown: str) -> str:
    """The model's Markdown as a `post`'s `md` element shows it (see the docstring)."""
    text = markdown.replace("\r\n", "\n").replace("\r", "\n")
    out: list[str] = []
    for is_code, chunk in _segments(text):
        out.append(chunk if is_code else _prose(chunk))
    return defuse_mentions("\n".join(out))


def split_parts(text: str, limit: int = PART_CHARS) -> list[str]:
    """Converted text as the parts to send, in order, each at most `limit` characters;
    blank ones left out."""
    return split_markdown(text, limit)


def feishu_parts(markdown: str, limit: int = PART_CHARS) -> list[str]:
    """The parts of one reply of the model: converted, then split."""
    return split_parts(markdown_to_feishu(markdown), limit)


def post_content(text: str) -> str:
    """A `post` message's `content` (a JSON string) holding `text` as one `md` element."""
    body = {"zh_cn": {"title": "", "content": [[{"tag": "md", "text": text}]]}}
    return json.dumps(body, ensure_ascii=False)


def text_content(text: str) -> str:
    """A `text` message's `content`: the plain fallback when Feishu refuses a post."""
    return json.dumps({"text": defuse_mentions(text)}, ensure_ascii=False)


# --------------------------------------------------------------------------- reading


def post_text(content: Any) -> tuple[str, list[str]]:
    """(the text, the image keys) of a received `post`'s content: its title and every
    element, `at` elements as their `user_name` (or the placeholder key), images left
    out of the text. Both shapes are read: `{"title", "content"}` and a language map."""
    if not isinstance(content, dict):
        return "", []
    body = content
    if "content" not in body:
        body = next((v for v in content.values() if isinstance(v, dict) and "content" in v), {})
    lines: list[str] = []
    images: list[str] = []
    title = str(body.get("title") or "").strip()
    if title:
        lines.append(title)
    for paragraph in body.get("content") or ():
        if not isinstance(paragraph, list):
            continue
        words: list[str] = []
        for element in paragraph:
            if not isinstance(element, dict):
                continue
            tag = element.get("tag")
            if tag in ("text", "md", "code_block"):
                words.append(str(element.get("text") or ""))
            elif tag == "a":
                words.append(str(element.get("text") or element.get("href") or ""))
            elif tag == "at":
                key = str(element.get("user_id") or "")
                name = str(element.get("user_name") or "")
                words.append(key if key.startswith("@_") else f"@{name or key}")
            elif tag == "img" and element.get("image_key"):
                images.append(str(element["image_key"]))
            elif tag == "emotion":
                words.append(f":{element.get('emoji_type', '')}:")
        lines.append("".join(words))
    return "\n".join(lines).strip(), images


# --------------------------------------------------------------------------- pieces


def _segments(text: str) -> Iterator[tuple[bool, str]]:
    """(is_code, lines) runs of prose and of fenced code blocks (fences included); an
    unclosed fence runs to the end."""
    lines = text.split("\n")
    index = 0
    prose: list[str] = []
    while index < len(lines):
        opened = _FENCE_OPEN.match(lines[index])
        if not opened:
            prose.append(lines[index])
            index += 1
            continue
        if prose:
            yield False, "\n".join(prose)
            prose = []
        fence = opened.group(1)
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        yield True, "\n".join(lines[index : end + 1])
        index = end + 1
    if prose:
        yield False, "\n".join(prose)


def _prose(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        rows = table_at(lines, index)
        if rows:
            out.append(_table_block(lines[index : index + rows]))
            index += rows
            continue
        line = lines[index]
        heading = _HEADING.match(line)
        if heading:
            line = f"**{heading.group(1)}**" if heading.group(1) else ""
        out.append(line)
        index += 1
    return "\n".join(out)


def _table_block(rows: list[str]) -> str:
    """A table as a code block with aligned columns (the delimiter row as dashes)."""
    table = [table_cells(row) for i, row in enumerate(rows) if i != 1]
    width = max(len(row) for row in table)
    table = [row + [""] * (width - len(row)) for row in table]
    sizes = [max(len(row[c]) for row in table) for c in range(width)]
    lines = [
        " | ".join(cell.ljust(size) for cell, size in zip(row, sizes, strict=True)).rstrip()
        for row in table
    ]
    rule = "-+-".join("-" * size for size in sizes)
    body = [lines[0], rule, *lines[1:]]
    return "```\n" + "\n".join(line.replace("```", "`\u200b``") for line in body) + "\n```"
