"""Signal text: the model's Markdown as a plain body with Signal's text styles, and long
replies split into messages that fit in one Signal body. Pure functions; no HTTP here.

Signal formats text by ranges (`bodyRanges`), not by markers: a message is its plain
text plus styles over spans of it, `BOLD`, `ITALIC`, `STRIKETHROUGH`, `MONOSPACE` and
`SPOILER`, each `start:length` in UTF-16 code units (signal-cli's `--text-style
start:length:STYLE`, signal-cli(1), "send"). So the Markdown is parsed (markdown-it-py,
CommonMark with tables and strikethrough) and written out as text with spans:

- `**b**` bold, `*i*` italic, `~~s~~` strikethrough, `` `code` `` and code blocks
  monospace, `||hidden||` a spoiler; a heading is a bold line;
- a list item starts with `• ` (or its number), nested ones indented; a quote's lines
  start with `> `; a rule is a line of `―`;
- `[label](url)` becomes `label (url)` (Signal links bare URLs), an image its alt text
  and URL; a table becomes aligned monospace lines.

`signal_messages` cuts a reply (Telegram's Markdown planner: paragraph, line and word
boundaries, code blocks closed and reopened around a cut) into messages whose body is at
most `SIGNAL_BODY_BYTES` of UTF-8: signal-cli sends a longer body as a truncated message
with a "long text" attachment uploaded to Signal's CDN (`ManagerImpl`,
`MAX_MESSAGE_SIZE_BYTES`), which adds a request that can fail on its own.

Promises (tested in tests/test_signal_format.py, partly with hypothesis):
- every message's body is at most `SIGNAL_BODY_BYTES` bytes of UTF-8, and none is blank;
- every style lies within its message's text;
- the messages hold all of the reply's words, in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from markdown_it.token import Token

from channels.telegram.format import MIN_LIMIT, split_markdown

#: The largest body signal-cli sends as it is (bytes of UTF-8).
SIGNAL_BODY_BYTES = 2000

STYLES = ("BOLD", "ITALIC", "STRIKETHROUGH", "MONOSPACE", "SPOILER")

_MARKDOWN = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(
    ["table", "strikethrough"]
)
_SPOILER = re.compile(r"\|\|(?=\S)(.+?)(?<=\S)\|\|", re.DOTALL)
_INLINE_STYLES = {"strong": "BOLD", "em": "ITALIC", "s": "STRIKETHROUGH"}
_RULE = "―" * 10


def utf16_len(text: str) -> int:
    """The length of `text` in UTF-16 code units (Signal's and signal-cli's unit)."""
    return len(text.encode("utf-16-le")) // 2


@dataclass(frozen=True, slots=True)
class Style:
    """One style over `length` UTF-16 units of a text from `start`."""

    start: int
    length: int
    style: str

    def param(self) -> str:
        """signal-cli's form: ``start:length:STYLE``."""
        return f"{self.start}:{self.length}:{self.style}"


@dataclass(frozen=True, slots=True)
class Styled:
    """A message body and its styles."""

    text: str
    styles: tuple[Style, ...] = ()

    def params(self) -> list[str]:
        return [s.param() for s in self.styles]


@dataclass
class _Writer:
    """Text written so far, its UTF-16 length, the styles closed and those open."""

    parts: list[str] = field(default_factory=list)
    length: int = 0
    styles: list[Style] = field(default_factory=list)
    open: list[tuple[str, int]] = field(default_factory=list)
    #: What each new line inside the current block starts with (quotes, list items).
    prefixes: list[str] = field(default_factory=list)
    at_line_start: bool = True
    blocks: int = 0

    def write(self, text: str) -> None:
        lines = text.split("\n")
        for index, line in enumerate(lines):
            if index:
                self._raw("\n")
                self.at_line_start = True
            if line:
                if self.at_line_start:
                    self._raw("".join(self.prefixes))
                    self.at_line_start = False
                self._raw(line)

    def _raw(self, text: str) -> None:
        self.parts.append(text)
        self.length += utf16_len(text)

    def begin(self, style: str) -> None:
        self.open.append((style, self.length))

    def end(self, style: str) -> None:
        for index in range(len(self.open) - 1, -1, -1):
            name, start = self.open[index]
            if name == style:
                del self.open[index]
                if self.length > start:
                    self.styles.append(Style(start, self.length - start, style))
                return

    def newline(self) -> None:
        if not self.at_line_start:
            self._raw("\n")
            self.at_line_start = True

    def separate(self, *, tight: bool = False) -> None:
        """Start a new block: on a new line, after a blank one unless `tight`."""
        if self.blocks:
            self.newline()
            if not tight:
                self._raw("".join(self.prefixes).rstrip() + "\n")
        self.blocks += 1

    def result(self) -> Styled:
        text = "".join(self.parts)
        stripped = text.rstrip()
        end = utf16_len(stripped)
        lead = utf16_len(text) - utf16_len(text.lstrip())
        styles = []
        for s in sorted(self.styles, key=lambda s: (s.start, -s.length, s.style)):
            start = max(s.start, lead)
            stop = min(s.start + s.length, end)
            if stop > start:
                styles.append(Style(start - lead, stop - start, s.style))
        return Styled(stripped.lstrip(), tuple(styles))


def markdown_to_signal(markdown: str) -> Styled:
    """The model's Markdown as a Signal body and its styles (see the module docstring)."""
    writer = _Writer()
    tokens = _MARKDOWN.parse(markdown.replace("\r\n", "\n").replace("\r", "\n"))
    lists: list[_List] = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        kind = token.type
        if kind in ("bullet_list_open", "ordered_list_open"):
            start = token.attrGet("start")
            number = (int(start) if start is not None else 1) if kind[0] == "o" else None
            lists.append(_List(number, _is_tight(tokens, index), nested=bool(lists)))
        elif kind in ("bullet_list_close", "ordered_list_close"):
            lists.pop()
        elif kind == "list_item_open":
            current = lists[-1] if lists else _List(None, True, nested=False)
            writer.separate(tight=current.tight and (current.items > 0 or current.nested))
            current.items += 1
            marker = "• " if current.number is None else f"{current.number}. "
            if current.number is not None:
                current.number += 1
            writer.write(marker)
            writer.prefixes.append(" " * len(marker))
        elif kind == "list_item_close":
            writer.prefixes.pop()
        elif kind == "blockquote_open":
            writer.separate()
            writer.prefixes.append("> ")
            writer.blocks = 0
        elif kind == "blockquote_close":
            writer.prefixes.pop()
            writer.blocks = 1
        elif kind == "paragraph_open":
            if not token.hidden and not _first_in_item(tokens, index):
                writer.separate()
            elif token.hidden and not _first_in_item(tokens, index):
                writer.separate(tight=True)
        elif kind == "heading_open":
            writer.separate()
            writer.begin("BOLD")
        elif kind == "heading_close":
            writer.end("BOLD")
        elif kind in ("fence", "code_block"):
            writer.separate(tight=_first_in_item(tokens, index))
            writer.begin("MONOSPACE")
            writer.write(token.content.rstrip("\n") or " ")
            writer.end("MONOSPACE")
        elif kind == "hr":
            writer.separate()
            writer.write(_RULE)
        elif kind == "table_open":
            close = _closing(tokens, index, "table_close")
            writer.separate()
            writer.begin("MONOSPACE")
            writer.write(_table(tokens[index:close]))
            writer.end("MONOSPACE")
            index = close
        elif kind == "inline":
            _inline(writer, token.children or [])
        index += 1
    return writer.result()


@dataclass
class _List:
    """An open list: its next number (None: bullets), whether it is tight, whether it is
    inside another one, and how many items it has shown."""

    number: int | None
    tight: bool
    nested: bool
    items: int = 0


def _is_tight(tokens: list[Token], index: int) -> bool:
    """Whether the list opened at `index` is tight (markdown-it hides its paragraphs)."""
    for token in tokens[index + 1 :]:
        if token.type == "paragraph_open":
            return token.hidden
        if token.type.endswith("_close") and token.level <= tokens[index].level:
            break
    return True


def _first_in_item(tokens: list[Token], index: int) -> bool:
    return index > 0 and tokens[index - 1].type == "list_item_open"


def _closing(tokens: list[Token], index: int, kind: str) -> int:
    depth = 0
    for position in range(index, len(tokens)):
        if tokens[position].type == tokens[index].type:
            depth += 1
        elif tokens[position].type == kind:
            depth -= 1
            if depth == 0:
                return position
    return len(tokens) - 1


def _inline(writer: _Writer, children: list[Token]) -> None:
    links: list[tuple[str, int]] = []  # (href, where its label starts in writer.parts)
    for child in children:
        kind = child.type
        if kind == "text":
            _text_with_spoilers(writer, child.content)
        elif kind in ("softbreak", "hardbreak"):
            writer.write("\n")
        elif kind == "code_inline":
            writer.begin("MONOSPACE")
            writer.write(child.content)
            writer.end("MONOSPACE")
        elif kind.endswith("_open") and kind[:-5] in _INLINE_STYLES:
            writer.begin(_INLINE_STYLES[kind[:-5]])
        elif kind.endswith("_close") and kind[:-6] in _INLINE_STYLES:
            writer.end(_INLINE_STYLES[kind[:-6]])
        elif kind == "link_open":
            links.append((str(child.attrGet("href") or ""), len(writer.parts)))
        elif kind == "link_close" and links:
            href, start = links.pop()
            label = "".join(writer.parts[start:]).strip()
            if href and href not in (label, f"mailto:{label}"):
                writer.write(f" ({href})" if label else href)
        elif kind == "image":
            alt = child.content.strip()
            src = str(child.attrGet("src") or "")
            writer.write(f"{alt} ({src})" if alt and src else alt or src)
        elif child.content:
            writer.write(child.content)


def _text_with_spoilers(writer: _Writer, text: str) -> None:
    position = 0
    for match in _SPOILER.finditer(text):
        writer.write(text[position : match.start()])
        writer.begin("SPOILER")
        writer.write(match.group(1))
        writer.end("SPOILER")
        position = match.end()
    writer.write(text[position:])


def _cell_text(children: list[Token]) -> str:
    cell = _Writer()
    _inline(cell, children)
    return cell.result().text.replace("\n", " ")


def _table(tokens: list[Token]) -> str:
    """A table's rows as aligned lines (Signal draws no tables)."""
    rows: list[list[str]] = []
    for token in tokens:
        if token.type == "tr_open":
            rows.append([])
        elif token.type == "inline" and rows:
            rows[-1].append(_cell_text(token.children or []))
    if not rows:
        return ""
    width = max(len(row) for row in rows)
    rows = [row + [""] * (width - len(row)) for row in rows]
    widths = [max(len(row[col]) for row in rows) for col in range(width)]

    def line(row: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([line(rows[0]), "-+-".join("-" * w for w in widths), *map(line, rows[1:])])


def signal_messages(
    markdown: str, limit: int = SIGNAL_BODY_BYTES, *, units: int | None = None
) -> list[Styled]:
    """The messages of one reply, in order: each body at most `limit` bytes of UTF-8, none
    blank. The Markdown is cut into pieces of `units` UTF-16 units (`limit` at first); a
    piece whose body is too large is cut again into pieces of half as many."""
    size = units or limit
    messages: list[Styled] = []
    for piece in split_markdown(markdown, size):
        styled = markdown_to_signal(piece)
        if not styled.text.strip():
            continue
        if len(styled.text.encode()) <= limit:
            messages.append(styled)
        elif size // 2 < MIN_LIMIT:
            messages.append(_cut(styled, limit))
        else:
            messages.extend(signal_messages(piece, limit, units=size // 2))
    return messages


def _cut(styled: Styled, limit: int) -> Styled:
    """The last resort: the body cut to `limit` bytes (never reached by text a reader
    writes; a guard against a body of nothing but four-byte characters)."""
    text = styled.text.encode()[:limit].decode(errors="ignore")
    end = utf16_len(text)
    styles = tuple(
        Style(s.start, min(s.length, end - s.start), s.style)
        for s in styled.styles
        if s.start < end
    )
    return Styled(text, styles)
