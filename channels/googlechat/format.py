"""Google Chat text: the model's Markdown in Chat's own markup, with nothing in it that
could notify anyone or make a link the model did not write as one, split into messages
under the Chat API's size limit. Pure functions; no network here.

Chat's markup (developers.google.com/workspace/chat/format-messages, `MARKUP_SYNTAX_CHAT`,
which every message the channel sends names): `*bold*`, `_italic_`, `~strikethrough~`,
`` `monospace` ``, ```` ``` ```` blocks, `<url|text>` links and `<users/ID>` mentions
(`<users/all>`: everyone in the space). So `**b**` -> `*b*`, `*i*` -> `_i_`, `~~s~~` ->
`~s~`, `[t](u)` -> `<u|t>` (http, https and mailto only), headings -> bold lines,
bullets -> `•`, tables -> code blocks with aligned columns (Chat draws no tables), code
blocks kept without their language tag.

Promises (tested in tests/test_googlechat_format.py, partly with hypothesis):
- no message holds `<users/` (a mention of one person or of everyone): a zero-width
  space after every `<` that starts a word breaks it, in code too; the only mention the
  channel makes is the sender's (`mention`), which it adds itself;
- every message is at most `limit` bytes of UTF-8, and every code block opened in one is
  closed in it;
- the messages hold all of the text, in order.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterator

from channels.googlechat.settings import MAX_MESSAGE_BYTES
from channels.markdown_tables import table_at, table_cells
from channels.slack.format import split_mrkdwn

ZWSP = "\u200b"
FENCE = "```"
_BROKEN_FENCE = "`\u200b`\u200b`"
_BOLD = "\ue000"  # stands for a bold `*` while single `*`s are turned into `_`
_HOLE_OPEN, _HOLE_CLOSE = "\ue001", "\ue002"
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
_STRONG_EM = re.compile(r"(\*\*\*|___)(?=\S)(.+?)(?<=\S)\1")
_STRONG = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1")
_STRIKE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_EM = re.compile(r"(?<![*\w])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![*\w])")
#: A `<` that Chat could read as the start of a link or a mention (`<users/all>`,
#: `<https://...|...>`): before a letter, a digit, `/`, `#`, `@` or `!`.
_ANGLE = re.compile(r"<(?=[\w/#@!])")
#: A user's resource name the channel may mention (the sender of a message in a space).
_USER = re.compile(r"users/\d{1,40}")


def defuse(text: str) -> str:
    """`text` with a zero-width space after every `<` that could open a link or a mention:
    it reads the same, and Chat finds neither in it."""
    return _ANGLE.sub("<" + ZWSP, text)


# --------------------------------------------------------------------------- markup


def markdown_to_chat(markdown: str) -> str:
    """The model's Markdown in Chat's markup (see the module docstring)."""
    text = _PRIVATE.sub("", markdown.replace("\r\n", "\n").replace("\r", "\n"))
    out = [_code_block(chunk) if is_code else _prose(chunk) for is_code, chunk in _segments(text)]
    return "\n".join(out).strip("\n")


def _segments(text: str) -> Iterator[tuple[bool, str]]:
    """(is_code, text) runs of prose lines and fenced code blocks' contents; a fence that
    is never closed runs to the end."""
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
    body = defuse(code).replace(FENCE, _BROKEN_FENCE)
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
        # A backtick run that survived would open a code block in Chat: break it up.
        out.append(_prose_line(lines[i]).replace(FENCE, _BROKEN_FENCE))
        i += 1
    return "\n".join(out)


def _plain_cell(cell: str) -> str:
    """A cell's inline Markdown as the text it shows (Chat renders no markup in code)."""
    cell = _LINK.sub(lambda m: f"{m.group(2)} ({m.group(3)})" if m.group(2) else m.group(3), cell)
    cell = _CODE_SPAN.sub(lambda m: m.group(2), cell)
    return re.sub(r"\*\*\*|___|\*\*|__|~~", "", cell)


def _table_block(lines: list[str]) -> str:
    """A Markdown table as a code block with aligned columns."""
    header, delimiter, body = table_cells(lines[0]), table_cells(lines[1]), lines[2:]
    width = len(header)
    rows = [[_plain_cell(c) for c in header]]
    for line in body:
        cells = [_plain_cell(c) for c in table_cells(line)][:width]
        rows.append(cells + [""] * (width - len(cells)))
    right = [d.endswith(":") and not d.startswith(":") for d in delimiter]
    widths = [max(len(row[col]) for row in rows) for col in range(width)]

    def fmt(row: list[str]) -> str:
        cells = [
            cell.rjust(size) if flush else cell.ljust(size)
            for cell, size, flush in zip(row, widths, right, strict=True)
        ]
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
    """One line's inline Markdown: code spans, links, emphasis; every other `<` that
    could open a link or a mention defused."""
    pieces: list[str] = []

    def hole(piece: str) -> str:
        pieces.append(piece)
        return f"{_HOLE_OPEN}{len(pieces) - 1}{_HOLE_CLOSE}"

    def code_span(m: re.Match[str]) -> str:
        return hole("`" + defuse(m.group(2).strip()).replace("`", "\u02cb") + "`")

    def link(m: re.Match[str]) -> str:
        label = _emphasis(defuse(m.group(2).strip().replace("|", "¦").replace(">", "\u203a")))
        url = m.group(3)
        if not _SAFE_URL.match(url):  # javascript: and the like stay visible text
            return hole(f"{label} ({defuse(url)})" if label else defuse(url))
        return hole(f"<{url}|{label}>" if label and label != url else url)

    def autolink(m: re.Match[str]) -> str:
        return hole(m.group(1))

    text = _CODE_SPAN.sub(code_span, text)
    text = _LINK.sub(link, text)
    text = _AUTOLINK.sub(autolink, text)
    text = _emphasis(defuse(text))
    hole_pattern = re.compile(f"{_HOLE_OPEN}(\\d+){_HOLE_CLOSE}")
    while _HOLE_OPEN in text:  # a link's label may hold a code span's hole
        text = hole_pattern.sub(lambda m: pieces[int(m.group(1))], text)
    return text


def _emphasis(text: str) -> str:
    text = _STRONG_EM.sub(lambda m: f"{_BOLD}_{m.group(2)}_{_BOLD}", text)
    text = _STRONG.sub(lambda m: f"{_BOLD}{m.group(2)}{_BOLD}", text)
    text = _STRIKE.sub(r"~\1~", text)
    text = _EM.sub(r"_\1_", text)
    return text.replace(_BOLD, "*")


# --------------------------------------------------------------------------- messages


def split_messages(text: str, limit: int = MAX_MESSAGE_BYTES) -> list[str]:
    """`text` (Chat markup) as messages of at most `limit` bytes of UTF-8, in order, cut at
    paragraph, line and word boundaries, never inside a code block that fits in one
    (`channels.slack.format.split_mrkdwn`, whose fences are Chat's, counts characters: a
    part over `limit` bytes is cut again, finer)."""
    parts: list[str] = []
    for part in split_mrkdwn(text, limit):
        parts.extend(_fit_bytes(part, limit))
    return parts


def _fit_bytes(part: str, limit: int) -> list[str]:
    size = len(part.encode("utf-8"))
    if size <= limit:
        return [part]
    chars = max(32, min(len(part) - 1, int(len(part) * limit / size * 0.95)))
    found: list[str] = []
    for piece in split_mrkdwn(part, chars):
        found.extend(_fit_bytes(piece, limit))
    return found


def mention_line(user: str) -> str:
    """What starts a reply in a space: the sender's mention (`<users/ID> `); empty for
    anything that is not one person's resource name (`users/all` is everyone)."""
    return f"<{user}> " if _USER.fullmatch(user) else ""


def chat_messages(markdown: str, limit: int = MAX_MESSAGE_BYTES, *, mention: str = "") -> list[str]:
    """The messages for one reply of the model: converted, with `mention` (a space
    message's sender, from `mention_line`) before the first, then split to `limit`."""
    text = markdown_to_chat(markdown)
    if mention and text.strip():
        text = f"{mention}{text}"
    return split_messages(text, limit)


def client_message_id(reply_to: str | None, part: str, text: str) -> str:
    """The `messageId` of one message of a reply: `client-` and 56 hex digits, the same
    for the same text in the same place of the reply to the same message (the Chat API
    refuses a second message with an id it has in the space: 409 ALREADY_EXISTS, so a
    repeat never posts twice); random for a reply to nothing."""
    if not reply_to:
        return f"client-{secrets.token_hex(28)}"
    digest = hashlib.blake2b(f"{reply_to}\0{part}\0{text}".encode(), digest_size=28)
    return f"client-{digest.hexdigest()}"
