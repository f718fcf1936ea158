"""Slack's side of message text, as pure functions: the LLM's Markdown to Slack mrkdwn,
Slack's inbound markup to plain text, and a long reply split into messages.

Promises (tested in tests/test_slack_format.py, partly with hypothesis):
- `markdown_to_mrkdwn` escapes `&`, `<` and `>` everywhere, so the model's text can
  never make a Slack control sequence (a user mention, `@channel`, a raw link); the
  only `<...>` it emits are links written in Markdown (`[t](u)`, `<u>`) to http(s) and
  mailto URLs. Its code blocks are always closed, also when the Markdown's is not (a
  reply cut short, a streaming preview). Emphasis markers nest (`***a***` -> `*_a_*`);
  a Markdown table becomes a code block with aligned columns (Slack has no tables).
- `split_mrkdwn` returns parts of at most `limit` characters, in order, that together
  hold all of the text (only whitespace at the cuts and the fences of a split code
  block differ). It cuts at paragraph, then line, then word boundaries, never inside a
  code block (a code block longer than a part is split at line boundaries into
  several blocks, each one closed), a link or an `&amp;`-style entity.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from channels.markdown_tables import table_at, table_cells

#: A part's size for readability; Slack truncates a message's text at 40,000
#: characters and asks apps to stay under 4,000.
DEFAULT_PART_CHARS = 3_500
SLACK_MAX_TEXT = 40_000
MIN_PART_CHARS = 32

FENCE = "```"
# Slack has no escape for a backtick run inside code; a zero-width space breaks it up.
_BROKEN_FENCE = "`\u200b`\u200b`"
_BOLD = "\ue000"  # stands for a bold `*` while single `*`s are turned into `_`
_HOLE_OPEN, _HOLE_CLOSE = "\ue001", "\ue002"  # around the index of a finished piece
_PRIVATE = re.compile("[\ue000-\ue002]")

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})[^`]*$")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_RULE = re.compile(r"^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$")
_QUOTE = re.compile(r"^ {0,3}>[ \t]?(.*)$")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+(.*)$")
_TASK = re.compile(r"^\[([ xX])\][ \t]+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"(!?)\[([^\]\n]*)\]\(\s*<?([^()<>\s]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
_AUTOLINK = re.compile(r"<((?:https?://|mailto:)[^<>\s|]+)>")
_SAFE_URL = re.compile(r"^(?:https?://|mailto:)[^\s<>|]+$", re.IGNORECASE)
# Bold and italic together, outermost first, so the mrkdwn markers nest: `***a***`,
# `***a** b*` (bold inside italic) and `***a* b**` (italic inside bold).
_STRONG_EM = re.compile(r"(\*\*\*|___)(?=\S)(.+?)(?<=\S)\1")
_STRONG_IN_EM = re.compile(r"\*\*\*(?=\S)([^*]+?)(?<=\S)\*\*([^*]+?)(?<=\S)\*(?!\*)")
_EM_IN_STRONG = re.compile(r"\*\*\*(?=\S)([^*]+?)(?<=\S)\*(?!\*)([^*]+?)(?<=\S)\*\*")
_STRONG = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_EM = re.compile(r"(?<![*\w])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![*\w])")
_ENTITY_START = re.compile(r"&[a-z]{0,4}$")


def escape(text: str) -> str:
    """Slack's three control characters as entities: `&` -> `&amp;`, `<`, `>`."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def unescape(text: str) -> str:
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


# --------------------------------------------------------------------------- outbound


def markdown_to_mrkdwn(markdown: str) -> str:
    """The LLM's Markdown as Slack mrkdwn: `**b**` -> `*b*`, `*i*` -> `_i_`, `~~s~~` ->
    `~s~`, `***bi***` -> `*_bi_*`, `[t](u)` -> `<u|t>`, headings -> bold lines, `-`
    bullets -> `•`, tables -> code blocks with aligned columns, code blocks kept
    (without their language tag, which Slack would show), `&<>` escaped."""
    text = _PRIVATE.sub("", markdown.replace("\r\n", "\n").replace("\r", "\n"))
    out: list[str] = []
    for is_code, chunk in _fenced_segments(text):
        out.append(_code_block(chunk) if is_code else _prose(chunk))
    return "\n".join(out).strip("\n")


def _fenced_segments(text: str) -> Iterator[tuple[bool, str]]:
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
        i += 1  # the closing fence (or past the end)
        yield True, "\n".join(code)
    if prose:
        yield False, "\n".join(prose)


def _code_block(code: str) -> str:
    body = escape(code).replace(FENCE, _BROKEN_FENCE)
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
        # A backtick run that survived (or that a code span and a stray backtick make)
        # would open a code block in Slack: break it up.
        out.append(_prose_line(lines[i]).replace(FENCE, _BROKEN_FENCE))
        i += 1
    return "\n".join(out)


# --------------------------------------------------------------------------- tables


def _plain_cell(cell: str) -> str:
    """A cell's inline Markdown as the text it shows: Slack renders no markup inside a
    code block, so `**x**` would show its stars."""
    cell = _LINK.sub(lambda m: f"{m.group(2)} ({m.group(3)})" if m.group(2) else m.group(3), cell)
    cell = _CODE_SPAN.sub(lambda m: m.group(2), cell)
    return re.sub(r"\*\*\*|___|\*\*|__|~~", "", cell)


def _table_block(lines: list[str]) -> str:
    """A Markdown table as a code block with aligned columns: Slack has no tables, and
    a monospace grid is what keeps one readable."""
    header, delimiter, body = table_cells(lines[0]), table_cells(lines[1]), lines[2:]
    width = len(header)
    rows = [[_plain_cell(c) for c in header]]
    for line in body:
        cells = [_plain_cell(c) for c in table_cells(line)][:width]
        rows.append(cells + [""] * (width - len(cells)))
    align = [
        "right"
        if d.endswith(":") and not d.startswith(":")
        else "center"
        if d.startswith(":") and d.endswith(":")
        else "left"
        for d in delimiter
    ]
    widths = [max(len(row[col]) for row in rows) for col in range(width)]

    def fmt(row: list[str]) -> str:
        cells = []
        for cell, size, how in zip(row, widths, align, strict=True):
            cells.append(
                cell.rjust(size)
                if how == "right"
                else cell.center(size)
                if how == "center"
                else cell.ljust(size)
            )
        return " | ".join(cells).rstrip()

    grid = [fmt(rows[0]), "-+-".join("-" * size for size in widths)]
    grid += [fmt(row) for row in rows[1:]]
    return _code_block("\n".join(grid))


def _prose_line(line: str) -> str:
    if _RULE.match(line):
        return "──────────"
    if heading := _HEADING.match(line):
        title = _inline(re.sub(r"\*\*|__", "", heading.group(1)))
        return f"*{title}*" if title.strip() else ""
    if quote := _QUOTE.match(line):
        return "> " + _inline(quote.group(1)) if quote.group(1).strip() else ">"
    if bullet := _BULLET.match(line):
        indent, item = bullet.groups()
        item = _TASK.sub(lambda m: "☐ " if m.group(1) == " " else "☑ ", item)
        return f"{indent}• {_inline(item)}"
    return _inline(line)


def _inline(text: str) -> str:
    """One line's inline Markdown: code spans, links, emphasis; the rest escaped."""
    pieces: list[str] = []

    def hole(piece: str) -> str:
        pieces.append(piece)
        return f"{_HOLE_OPEN}{len(pieces) - 1}{_HOLE_CLOSE}"

    def code_span(m: re.Match[str]) -> str:
        return hole("`" + escape(m.group(2).strip()).replace("`", "\u02cb") + "`")

    def link(m: re.Match[str]) -> str:
        label, url = _emphasis(escape(m.group(2).strip())), m.group(3)
        if not _SAFE_URL.match(url):  # javascript: and the like stay visible text
            return hole(f"{label} ({escape(url)})" if label else escape(url))
        url = escape(url)
        return hole(f"<{url}|{label}>" if label and label != url else f"<{url}>")

    def autolink(m: re.Match[str]) -> str:
        return hole(f"<{escape(m.group(1))}>")

    text = _CODE_SPAN.sub(code_span, text)
    text = _LINK.sub(link, text)
    text = _AUTOLINK.sub(autolink, text)
    text = _emphasis(escape(text))
    hole_pattern = re.compile(f"{_HOLE_OPEN}(\\d+){_HOLE_CLOSE}")
    while _HOLE_OPEN in text:  # a link's label may hold a code span's hole
        text = hole_pattern.sub(lambda m: pieces[int(m.group(1))], text)
    return text


def _emphasis(text: str) -> str:
    text = _STRONG_EM.sub(lambda m: f"{_BOLD}_{m.group(2)}_{_BOLD}", text)
    text = _STRONG_IN_EM.sub(lambda m: f"_{_BOLD}{m.group(1)}{_BOLD}{m.group(2)}_", text)
    text = _EM_IN_STRONG.sub(lambda m: f"{_BOLD}_{m.group(1)}_{m.group(2)}{_BOLD}", text)
    text = _STRONG.sub(lambda m: f"{_BOLD}{m.group(2)}{_BOLD}", text)
    text = _STRIKE.sub(r"~\1~", text)
    text = _EM.sub(r"_\1_", text)
    return text.replace(_BOLD, "*")


# --------------------------------------------------------------------------- inbound

_SLACK_MARKUP = re.compile(r"<([^<>]*)>")


def slack_to_plain(text: str, bot_user_id: str | None = None) -> str:
    """A Slack message's text as the person meant it: the bot's own `<@BOT>` mention
    removed, other mentions as `@name`, channels as `#name`, links as `label (url)`,
    entities decoded."""
    gone = "\x00"  # where the bot's mention was; the spaces around it collapse

    def readable(m: re.Match[str]) -> str:
        target, _, label = m.group(1).partition("|")
        if target.startswith("@"):
            if bot_user_id and target[1:] == bot_user_id:
                return gone
            return "@" + (label or target[1:])
        if target.startswith("#"):
            return "#" + (label or target[1:])
        if target.startswith("!"):  # <!here>, <!subteam^S1|@team>, <!date^...|fallback>
            return label or "@" + target[1:].split("^", 1)[0]
        address = target.removeprefix("mailto:")
        if not label or label in (target, address):
            return address
        return f"{label} ({target})"

    plain = _SLACK_MARKUP.sub(readable, text.replace(gone, ""))
    plain = re.sub(f"[ \t]*{gone}[ \t]*", " ", plain)
    return unescape(plain).strip()


# --------------------------------------------------------------------------- splitting


def split_mrkdwn(text: str, limit: int = DEFAULT_PART_CHARS) -> list[str]:
    """`text` (mrkdwn, e.g. from `markdown_to_mrkdwn`) as messages of at most `limit`
    characters; see the module docstring for the promises. Empty text gives no parts."""
    if not MIN_PART_CHARS <= limit <= SLACK_MAX_TEXT:
        raise ValueError(f"limit must be between {MIN_PART_CHARS} and {SLACK_MAX_TEXT}")
    parts: list[str] = []
    current = ""
    for separator, block in _blocks(text):
        for piece in _fit(block, limit):
            if not current:
                current = piece
            elif len(current) + len(separator) + len(piece) <= limit:
                current += separator + piece
            else:
                parts.append(current)
                current = piece
            separator = "\n"  # between the pieces of one block that was cut
    if current:
        parts.append(current)
    return parts


def _blocks(text: str) -> Iterator[tuple[str, str]]:
    """(separator before, block): code blocks whole, prose cut at blank lines."""
    separator = ""
    for is_code, chunk in _mrkdwn_segments(text):
        if is_code:
            yield separator, chunk
            separator = "\n"
            continue
        paragraph: list[str] = []
        for line in chunk.split("\n"):
            if line.strip():
                paragraph.append(line)
                continue
            if paragraph:
                yield separator, "\n".join(paragraph)
                paragraph = []
            separator = "\n\n"
        if paragraph:
            yield separator, "\n".join(paragraph)
            separator = "\n"


def _mrkdwn_segments(text: str) -> Iterator[tuple[bool, str]]:
    """Prose and whole code blocks (fence lines included) of mrkdwn; a line with an odd
    number of fences opens or closes a block."""
    lines = text.split("\n")
    buffer: list[str] = []
    in_code = False
    for line in lines:
        toggles = line.count(FENCE) % 2 == 1
        if not in_code and toggles:
            if buffer:
                yield False, "\n".join(buffer)
            buffer, in_code = [line], True
        elif in_code:
            buffer.append(line)
            if toggles:
                yield True, "\n".join(buffer)
                buffer, in_code = [], False
        else:
            buffer.append(line)
    if buffer:
        if in_code:
            buffer.append(FENCE)
        yield in_code, "\n".join(buffer)


def _fit(block: str, limit: int) -> list[str]:
    """A block as pieces of at most `limit` characters."""
    if len(block) <= limit:
        return [block]
    if block.lstrip().startswith(FENCE):
        return _fit_code(block, limit)
    return _pack(block.split("\n"), "\n", limit, lambda line: _fit_line(line, limit))


def _fit_code(block: str, limit: int) -> list[str]:
    lines = block.split("\n")
    opening, body = lines[0], lines[1:-1] if lines[-1].strip().endswith(FENCE) else lines[1:]
    closing = lines[-1] if len(lines) > 1 and lines[-1].strip().endswith(FENCE) else FENCE
    room = limit - len(opening) - len(closing) - 2
    pieces = _pack(body, "\n", room, lambda line: _hard_cut(line, room))
    return [f"{opening}\n{piece}\n{closing}" for piece in pieces]


def _fit_line(line: str, limit: int) -> list[str]:
    # Words, where a `<link|with a label>` or a `code span` counts as one word.
    tokens = re.findall(r"(?:<[^<>\n]*>|`[^`\n]*`|[^\s<`]|[<`])+|\s+", line)
    words = [t for t in tokens if not t.isspace()]
    return _pack(words, " ", limit, lambda word: _hard_cut(word, limit))


def _pack(units: list[str], joiner: str, limit: int, cut: Callable[[str], list[str]]) -> list[str]:
    """Greedily join `units` into pieces of at most `limit`; a unit longer than that is
    cut by `cut` first."""
    pieces: list[str] = []
    current: str | None = None
    for unit in units:
        for small in cut(unit) if len(unit) > limit else [unit]:
            if current is not None and len(current) + len(joiner) + len(small) <= limit:
                current += joiner + small
            else:
                if current is not None:
                    pieces.append(current)
                current = small
    if current is not None:
        pieces.append(current)
    return pieces


def _hard_cut(text: str, limit: int) -> list[str]:
    """Cut at `limit` characters, but never inside an `&amp;`-style entity."""
    pieces = []
    while len(text) > limit:
        cut = limit
        entity = _ENTITY_START.search(text[:cut])
        if entity is not None and entity.start() > 0:
            cut = entity.start()
        pieces.append(text[:cut])
        text = text[cut:]
    if text:
        pieces.append(text)
    return pieces


def preview(text: str, limit: int = DEFAULT_PART_CHARS) -> str:
    """What a streaming message shows: the first part of the reply so far, with `…`
    when there is more."""
    parts = split_mrkdwn(markdown_to_mrkdwn(text), limit - 2)
    if not parts:
        return "…"
    return parts[0] + (" …" if len(parts) > 1 else "")
