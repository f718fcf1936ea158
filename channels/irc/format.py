"""IRC text: the model's Markdown as lines an IRC client shows, each small enough for one
PRIVMSG. Pure functions; no I/O.

IRC carries one line per message and nothing else: no newlines, no markup, no links with
labels. So a reply becomes one PRIVMSG per line of text, and:

- with `formatting` on, `**b**` / `__b__` is mIRC bold (`\\x02`), `*i*` / `_i_` italics
  (`\\x1d`), `~~s~~` strike-through (`\\x1e`), a code span monospace (`\\x11`), a heading a
  bold line; off (or inside a code block), the text is plain;
- `[label](url)` becomes `label <url>` (clients link the bare URL), an image its alt text
  and URL; a `*` or `+` bullet a `- ` bullet; a table aligned columns;
- a fenced code block is its lines as they are (without the fences); blank lines go (an
  empty PRIVMSG is refused), and so do control characters a client would act on.

`split_line` then cuts a line to the bytes one PRIVMSG leaves for text (`text_budget`: 512
bytes, less the CRLF and the `:nick!user@host PRIVMSG target :` the server puts before it
when it relays the line), on a space where it can and never inside a UTF-8 character; a
piece that continues a bold or italic run opens it again.

Promises (tested in tests/test_irc_format.py, partly with hypothesis):
- every line is at most the budget in UTF-8 bytes, and none is blank to a reader;
- no line holds CR, LF, NUL or CTCP's `\\x01`;
- the lines hold every word of the text, in order.
"""

from __future__ import annotations

import re

from channels.irc.wire import LINE_BYTES, strip_formatting
from channels.markdown_tables import table_at, table_cells

BOLD, ITALIC, STRIKE, MONO, RESET = "\x02", "\x1d", "\x1e", "\x11", "\x0f"
_TOGGLES = (BOLD, ITALIC, STRIKE, MONO, "\x1f")
#: What a server would take as the end of a line or a CTCP, and other controls that no
#: text of the model's means (mIRC's own codes are made here, never passed through).
_UNSENDABLE = re.compile("[\x00-\x08\x0a-\x1f\x7f]")

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})[^`]*$")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_QUOTE = re.compile(r"^ {0,3}>[ \t]?(.*)$")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+(.*)$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?://|mailto:)[^<>\s]+)>")
_STRONG = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_EM = re.compile(r"(?<![*\w])([*_])(?=[^\s*_])(.+?)(?<=[^\s*_])\1(?![*\w])")
_HOLE = re.compile("\ue001(\\d+)\ue002")


def markdown_to_lines(markdown: str, *, formatting: bool = True) -> list[str]:
    """The model's Markdown as the lines of an IRC reply (none blank), before splitting."""
    text = markdown.replace("\r\n", "\n").replace("\r", "\n").replace("\t", "    ")
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        fence = _FENCE_OPEN.match(lines[i])
        if fence is not None:
            marker = fence.group(1)
            closing = re.compile(rf"^ {{0,3}}{re.escape(marker[0])}{{{len(marker)},}}[ \t]*$")
            i += 1
            while i < len(lines) and not closing.match(lines[i]):
                out.append(_clean(lines[i]))
                i += 1
            i += 1
            continue
        rows = table_at(lines, i)
        if rows:
            out.extend(_table(lines[i : i + rows]))
            i += rows
            continue
        out.append(_prose_line(lines[i], formatting))
        i += 1
    return [line for line in out if strip_formatting(line).strip()]


def _clean(line: str) -> str:
    return _UNSENDABLE.sub("", line).rstrip()


def _prose_line(line: str, formatting: bool) -> str:
    line = _clean(line)
    if _RULE.match(line):
        return "----------"
    if heading := _HEADING.match(line):
        title = _inline(heading.group(1), formatting)
        return f"{BOLD}{title}{BOLD}" if formatting and title.strip() else title
    if quote := _QUOTE.match(line):
        return "> " + _inline(quote.group(1), formatting)
    if bullet := _BULLET.match(line):
        indent, item = bullet.groups()
        return f"{indent}- {_inline(item, formatting)}"
    return _inline(line, formatting)


def _table(lines: list[str]) -> list[str]:
    header = [_plain_cell(c) for c in table_cells(lines[0])]
    width = len(header)
    rows = [header]
    for line in lines[2:]:
        cells = [_plain_cell(c) for c in table_cells(line)][:width]
        rows.append(cells + [""] * (width - len(cells)))
    widths = [max(len(row[col]) for row in rows) for col in range(width)]

    def fmt(row: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return [fmt(rows[0]), "-+-".join("-" * w for w in widths), *(fmt(r) for r in rows[1:])]


def _plain_cell(cell: str) -> str:
    cell = _LINK.sub(lambda m: f"{m.group(2)} <{m.group(3)}>" if m.group(2) else m.group(3), cell)
    cell = _CODE_SPAN.sub(lambda m: m.group(2), cell)
    return _clean(re.sub(r"\*\*|__|~~", "", cell))


def _inline(text: str, formatting: bool) -> str:
    """One line's inline Markdown: code spans kept (monospace), links spelled out,
    emphasis as mIRC codes (or dropped, without formatting)."""
    pieces: list[str] = []

    def hole(piece: str) -> str:
        pieces.append(piece)
        return f"\ue001{len(pieces) - 1}\ue002"

    def code_span(m: re.Match[str]) -> str:
        code = m.group(2).strip()
        return hole(f"{MONO}{code}{MONO}" if formatting else code)

    def link(m: re.Match[str]) -> str:
        label, url = m.group(2).strip(), m.group(3)
        if not label or label == url:
            return hole(url)
        return f"{label} <{hole(url)}>"

    text = _CODE_SPAN.sub(code_span, text)
    text = _LINK.sub(link, text)
    text = _AUTOLINK.sub(lambda m: hole(m.group(1)), text)
    bold, italic, strike = (BOLD, ITALIC, STRIKE) if formatting else ("", "", "")
    text = _STRONG.sub(lambda m: f"{bold}{m.group(2)}{bold}", text)
    text = _STRIKE.sub(lambda m: f"{strike}{m.group(1)}{strike}", text)
    text = _EM.sub(lambda m: f"{italic}{m.group(2)}{italic}", text)
    while "\ue001" in text:
        text = _HOLE.sub(lambda m: pieces[int(m.group(1))], text)
    return text


# --------------------------------------------------------------------------- splitting


def text_budget(source: str, target: str, *, linelen: int = LINE_BYTES) -> int:
    """Bytes of text one PRIVMSG to `target` may carry, when the server relays it as
    `:<source> PRIVMSG <target> :<text>\\r\\n` in at most `linelen` bytes."""
    overhead = len(f":{source} PRIVMSG {target} :".encode()) + 2
    return max(32, linelen - overhead)


def split_line(line: str, budget: int) -> list[str]:
    """`line` in pieces of at most `budget` UTF-8 bytes, cut after a space where there is
    one in the second half of a piece, else between two characters; each piece after
    the first opens the formatting runs the cut left open."""
    pieces: list[str] = []
    rest = line
    carry = ""
    while rest:
        room = budget - len(carry.encode())
        if len(rest.encode()) <= room:
            pieces.append(carry + rest)
            break
        cut = _fit(rest, room)
        space = rest.rfind(" ", 0, cut + 1)
        if space > cut // 2:
            cut = space + 1
        piece, rest = rest[:cut].rstrip(" "), rest[cut:].lstrip(" ")
        pieces.append(carry + piece)
        carry = "".join(code for code in _open_runs(carry + piece))
    return [p for p in pieces if strip_formatting(p).strip()]


def _fit(text: str, room: int) -> int:
    """The most characters of `text` whose UTF-8 bytes fit in `room` (at least one)."""
    used = 0
    for index, char in enumerate(text):
        used += len(char.encode())
        if used > room:
            return max(1, index)
    return len(text)


def _open_runs(text: str) -> list[str]:
    """The toggles (bold, italics, ...) still open at the end of `text`."""
    state: dict[str, bool] = {}
    for char in text:
        if char in _TOGGLES:
            state[char] = not state.get(char, False)
        elif char == RESET:
            state.clear()
    return [code for code in _TOGGLES if state.get(code)]


def reply_lines(
    markdown: str, budget: int, *, formatting: bool = True, lead: str = ""
) -> list[str]:
    """A whole reply as PRIVMSG texts of at most `budget` bytes, in order; `lead` (the
    addressee's `nick: ` in a channel) starts the first."""
    lines = markdown_to_lines(markdown, formatting=formatting)
    if lead and lines:
        lines[0] = lead + lines[0]
    return [piece for line in lines for piece in split_line(line, budget)]
