"""Telegram text: LLM Markdown to Telegram's HTML subset, and long replies split into
messages under Telegram's length limit. Pure functions; no python-telegram-bot here.

Telegram counts a message's length in UTF-16 code units *after* parsing the HTML (the
visible text), at most `TELEGRAM_LIMIT`. The two halves work together:

- `split_markdown(text)` cuts the Markdown first, on paragraph, then line, then word
  boundaries (a hard cut only inside a word longer than a message), never inside a
  fenced code block that fits in one message; a block too long for one message is cut
  between its lines and closed and reopened (with its language) around the cut.
- `markdown_to_html(chunk)` then converts each chunk. It never adds visible characters
  (the HTML's visible text is at most as long as the Markdown), so a chunk within the
  limit stays within it, and the Markdown chunk itself is a valid plain-text fallback.

Promises (property-tested in tests/test_telegram_format.py):
- every chunk is at most `limit` UTF-16 units, as Markdown and as visible HTML text;
- the chunks' shares of the text (`plan_chunks`) concatenate to the exact input, in order;
- every fenced code block opened in a chunk is closed in that chunk;
- `markdown_to_html` returns HTML Telegram accepts (balanced, escaped) for any input.
"""

from __future__ import annotations

import bisect
import html
import re
import unicodedata
from dataclasses import dataclass

TELEGRAM_LIMIT = 4096
#: Below this a chunk could not hold a reopened fence, a closing fence and some text.
MIN_LIMIT = 100

_FENCE_OPEN = re.compile(r"( {0,3})(`{3,8}|~{3,8})(.*?)\r?$")
_FENCE_CLOSE = re.compile(r" {0,3}(`{3,}|~{3,})[ \t\r]*$")
_LANGUAGE = re.compile(r"[A-Za-z0-9_+#.\-]{1,32}")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_BULLET = re.compile(r"^([ \t]*)[-*+][ \t]+(?=\S)")
_QUOTE = re.compile(r"^ {0,3}>[> ]*")
_AUTOLINK = re.compile(r"<((?:https?|tg)://[^\s<>]+)>")
_LINK_SCHEMES = ("http://", "https://", "tg://", "mailto:")
_ESCAPABLE = frozenset("\\`*_{}[]()#+-.!|~<>")
_MAX_NESTING = 16


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units, Telegram's unit for limits and entity offsets."""
    return len(text) + sum(1 for char in text if ord(char) > 0xFFFF)


# --------------------------------------------------------------------------- fences


@dataclass(frozen=True, slots=True)
class CodeBlock:
    """A fenced code block at `text[start:end]`: the opening fence line, the body
    `text[body_start:body_end]`, and the closing fence line (absent when `closed` is
    False: the block then runs to the end of the text)."""

    start: int
    body_start: int
    body_end: int
    end: int
    fence: str
    language: str
    closed: bool

    @property
    def reopen(self) -> str:
        """The fence line that reopens this block in a later chunk."""
        return f"{self.fence}{self.language}\n"


def _line_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every line, `end` excluding its "\\n"."""
    spans = []
    start = 0
    while True:
        end = text.find("\n", start)
        if end == -1:
            spans.append((start, len(text)))
            return spans
        spans.append((start, end))
        start = end + 1


def _language(info: str) -> str:
    word = info.strip().split(maxsplit=1)[0] if info.strip() else ""
    return word if _LANGUAGE.fullmatch(word) else ""


def find_code_blocks(text: str) -> list[CodeBlock]:
    """The fenced code blocks of `text`, in order (``` or ~~~, up to three spaces of
    indentation; a closing fence uses the same character, at least as many times)."""
    blocks: list[CodeBlock] = []
    spans = _line_spans(text)
    i = 0
    while i < len(spans):
        start, end = spans[i]
        opener = _FENCE_OPEN.match(text, start, end)
        if opener is None or (opener.group(2)[0] == "`" and "`" in opener.group(3)):
            i += 1
            continue
        fence = opener.group(2)
        body_start = min(end + 1, len(text))
        j = i + 1
        while j < len(spans):
            closer = _FENCE_CLOSE.match(text, *spans[j])
            if closer and closer.group(1)[0] == fence[0] and len(closer.group(1)) >= len(fence):
                break
            j += 1
        if j < len(spans):
            close_start, close_end = spans[j]
            block_end = min(close_end + 1, len(text))
            blocks.append(
                CodeBlock(
                    start,
                    body_start,
                    close_start,
                    block_end,
                    fence,
                    _language(opener.group(3)),
                    True,
                )
            )
        else:
            blocks.append(
                CodeBlock(
                    start,
                    body_start,
                    len(text),
                    len(text),
                    fence,
                    _language(opener.group(3)),
                    False,
                )
            )
        i = j + 1
    return blocks


# --------------------------------------------------------------------------- splitting


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message's share `text[start:end]` of the reply, with the fence line that
    reopens a code block cut before it and the fence that closes one cut after it."""

    start: int
    end: int
    body: str
    reopen: str = ""
    close: str = ""

    def render(self) -> str:
        """The Markdown of this message (at most the limit it was planned for)."""
        body = self.body
        if not self.reopen:
            body = body.lstrip("\n")
        if self.close:
            if not body.endswith("\n"):
                body += "\n"
            return self.reopen + body + self.close
        return (self.reopen + body).rstrip()


_PARAGRAPH, _LINE, _WORD = 0, 1, 2


class _Planner:
    """Greedy cutting of one text; see `plan_chunks`."""

    def __init__(self, text: str, limit: int) -> None:
        self.text = text
        self.limit = limit
        self.prefix = [0]
        for char in text:
            self.prefix.append(self.prefix[-1] + (2 if ord(char) > 0xFFFF else 1))
        self.blocks = find_code_blocks(text)
        self.block_starts = [b.start for b in self.blocks]
        self.candidates: list[list[int]] = [[], [], []]
        self._collect_candidates()

    def units(self, start: int, end: int) -> int:
        return self.prefix[end] - self.prefix[start]

    def block_at(self, pos: int) -> CodeBlock | None:
        """The block whose span holds `pos` strictly after its first character."""
        i = bisect.bisect_left(self.block_starts, pos) - 1
        if i >= 0 and pos < self.blocks[i].end:
            return self.blocks[i]
        return None

    def oversized(self, block: CodeBlock) -> bool:
        closing = 0 if block.closed else 1 + len(block.fence)
        return self.units(block.start, block.end) + closing > self.limit

    def reopen_at(self, pos: int) -> str:
        block = self.block_at(pos)
        if block is not None and block.body_start < pos < block.body_end:
            return block.reopen
        return ""

    def close_at(self, pos: int) -> str:
        block = self.block_at(pos)
        if block is not None and block.body_start < pos < block.body_end:
            return block.fence
        last = self.blocks[-1] if self.blocks else None
        if pos == len(self.text) and last is not None and not last.closed:
            return last.fence
        return ""

    def cost(self, start: int, end: int) -> int:
        close = self.close_at(end)
        return (
            utf16_len(self.reopen_at(start))
            + self.units(start, end)
            + (1 + len(close) if close else 0)
        )

    def _line_kind(self, start: int) -> tuple[str, CodeBlock | None]:
        """What the line at `start` is: "prose", "opener", "code" (body) or "closer"."""
        i = bisect.bisect_right(self.block_starts, start) - 1
        block = self.blocks[i] if i >= 0 else None
        if block is None or start >= block.end:
            return "prose", None
        if start == block.start:
            return "opener", block
        if start < block.body_end or not block.closed:
            return "code", block
        return "closer", block

    def _collect_candidates(self) -> None:
        text = self.text
        para, line, word = self.candidates
        previous_blank = False
        for start, end in _line_spans(text):
            kind, block = self._line_kind(start)
            blank = not text[start:end].strip()
            if kind in ("prose", "opener") and start > 0:
                line.append(start)
                if previous_blank and kind == "prose" and not blank:
                    para.append(start)
            previous_blank = blank and kind == "prose"
            if kind == "prose" or (kind == "code" and block is not None and self.oversized(block)):
                if kind == "code" and block is not None and start > block.body_start:
                    line.append(start)
                for match in re.finditer(r"[ \t]+", text[start:end]):
                    if start + match.end() < end:
                        word.append(start + match.end())
        for block in self.blocks:
            # Cutting before a block that has to be cut anyway would only make a short
            # message of the text before it: that side is a line boundary then.
            sides = (block.end,) if self.oversized(block) else (block.start, block.end)
            para.extend(pos for pos in sides if 0 < pos < len(text))
        for found in self.candidates:
            found[:] = sorted(set(found))

    def allowed_hard(self, pos: int) -> bool:
        block = self.block_at(pos)
        if block is None:
            return True
        return self.oversized(block) and block.body_start < pos < block.body_end

    def next_cut(self, start: int) -> int:
        text = self.text
        budget = self.limit - utf16_len(self.reopen_at(start))
        reach = bisect.bisect_right(self.prefix, self.prefix[start] + budget) - 1
        if reach >= len(text) and self.cost(start, len(text)) <= self.limit:
            return len(text)
        for found in self.candidates:
            i = bisect.bisect_right(found, reach) - 1
            while i >= 0 and found[i] > start:
                if self.cost(start, found[i]) <= self.limit:
                    return found[i]
                i -= 1
        return self._hard_cut(start, min(reach, len(text)))

    def _hard_cut(self, start: int, reach: int) -> int:
        """The furthest position inside a word (prose, or an oversized code block)."""
        pos = reach
        while pos > start + 1 and not (
            self.allowed_hard(pos) and self.cost(start, pos) <= self.limit
        ):
            pos -= 1
        # Keep a character with its combining marks, and an emoji with its joiners.
        keep = pos
        while keep > start + 1 and keep < len(self.text) and _joined(self.text, keep):
            keep -= 1
        if keep != pos and not _joined(self.text, keep) and self.allowed_hard(keep):
            pos = keep
        return max(pos, start + 1)


def _joined(text: str, pos: int) -> bool:
    """Would a cut at `pos` separate a character from the marks or joiners after it?"""
    return bool(
        unicodedata.combining(text[pos]) or text[pos] in "\u200d\ufe0f" or text[pos - 1] == "\u200d"
    )


def plan_chunks(text: str, limit: int = TELEGRAM_LIMIT) -> list[Chunk]:
    """Cut `text` into chunks whose rendered Markdown is at most `limit` UTF-16 units.

    The bodies concatenate to exactly `text`. A cut prefers, from the chunk's end
    backwards, the last paragraph boundary (a blank line, or either side of a code
    block) that fits, then the last line start, then the last word start; a code block
    that fits in one message is never cut.
    """
    if limit < MIN_LIMIT:
        raise ValueError(f"limit must be at least {MIN_LIMIT} UTF-16 units")
    planner = _Planner(text, limit)
    chunks: list[Chunk] = []
    start = 0
    while start < len(text):
        end = planner.next_cut(start)
        chunks.append(
            Chunk(start, end, text[start:end], planner.reopen_at(start), planner.close_at(end))
        )
        start = end
    return chunks


def split_markdown(text: str, limit: int = TELEGRAM_LIMIT) -> list[str]:
    """The messages for one reply, in order: Markdown chunks of at most `limit` UTF-16
    units, blank ones left out (see `plan_chunks`)."""
    rendered = (chunk.render() for chunk in plan_chunks(text, limit))
    return [chunk for chunk in rendered if chunk.strip()]


# --------------------------------------------------------------------------- HTML


def _escape(text: str) -> str:
    return html.escape(text, quote=False)


def html_to_text(markup: str) -> str:
    """The visible text of HTML made by `markdown_to_html` (tags dropped, entities
    decoded): what Telegram shows and counts."""
    return html.unescape(re.sub(r"<[^>]*>", "", markup))


def markdown_to_html(markdown: str) -> str:
    """LLM Markdown as Telegram HTML: **bold**, *italic*, `code`, fenced code (with
    its language), [links](https://...), ~~strikethrough~~, > blockquotes, # headings
    (bold) and bullets; everything else is text, with <, > and & escaped. Unmatched
    markers stay as they are; an unclosed code fence runs to the end."""
    parts: list[str] = []
    position = 0
    for block in find_code_blocks(markdown):
        parts.append(_prose_to_html(markdown[position : block.start]))
        body = markdown[block.body_start : block.body_end]
        if block.closed and body.endswith("\n"):
            body = body[:-1]
        code = _escape(body)
        if block.language:
            parts.append(f'<pre><code class="language-{block.language}">{code}</code></pre>')
        else:
            parts.append(f"<pre>{code}</pre>")
        if block.closed and markdown[block.end - 1 : block.end] == "\n":
            parts.append("\n")
        position = block.end
    parts.append(_prose_to_html(markdown[position:]))
    return "".join(parts)


def _prose_to_html(text: str) -> str:
    if not text:
        return ""
    lines = text.split("\n")
    out: list[str] = []
    quote: list[str] = []

    def flush_quote() -> None:
        if quote:
            out.append("<blockquote>" + "\n".join(quote) + "</blockquote>")
            quote.clear()

    for line in lines:
        quoted = _QUOTE.match(line)
        if quoted:
            quote.append(_inline(line[quoted.end() :]))
            continue
        flush_quote()
        heading = _HEADING.match(line)
        if heading:
            out.append(f"<b>{_inline(heading.group(1))}</b>" if heading.group(1) else "")
            continue
        bullet = _BULLET.match(line)
        if bullet:
            out.append(f"{bullet.group(1)}• {_inline(line[bullet.end() :])}")
            continue
        out.append(_inline(line))
    flush_quote()
    return "\n".join(out)


def _run_length(text: str, i: int) -> int:
    char = text[i]
    j = i
    while j < len(text) and text[j] == char:
        j += 1
    return j - i


def _code_span_end(text: str, i: int) -> int | None:
    """The index after the code span opening at `i` (a run of backticks), or None."""
    n = _run_length(text, i)
    j = i + n
    while True:
        j = text.find("`" * n, j)
        if j == -1:
            return None
        run = _run_length(text, j)
        if run == n:
            return j + n
        j += run


def _can_open(text: str, i: int, width: int) -> bool:
    after = i + width
    if after >= len(text) or text[after].isspace():
        return False
    return i == 0 or not text[i - 1].isalnum()


def _find_closer(text: str, start: int, marker: str) -> int | None:
    """Where `marker` closes an emphasis opened before `start` (None if nowhere):
    after non-space, before a non-alphanumeric, skipping code spans and escapes."""
    width = len(marker)
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "`":
            end = _code_span_end(text, i)
            i = end if end is not None else i + _run_length(text, i)
            continue
        if char == marker[0]:
            run = _run_length(text, i)
            if run == width or (run > width and run >= 3):
                j = i + run - width
                after = j + width
                if (
                    j > start
                    and not text[j - 1].isspace()
                    and (after == len(text) or not text[after].isalnum())
                ):
                    return j
            i += run
            continue
        i += 1
    return None


def _link_at(text: str, i: int) -> tuple[str, str, int] | None:
    """(label, url, index after) for `[label](url)` at `i`, if the URL is one Telegram
    links (http, https, tg, mailto)."""
    depth = 0
    j = i
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == "[":
            depth += 1
        elif text[j] == "]":
            depth -= 1
            if depth == 0:
                break
        j += 1
    if j >= len(text) or not text.startswith("(", j + 1):
        return None
    k = j + 2
    parens = 0
    while k < len(text) and not text[k].isspace():
        if text[k] == "(":
            parens += 1
        elif text[k] == ")":
            if parens == 0:
                break
            parens -= 1
        k += 1
    if k >= len(text) or text[k] != ")":
        return None
    url = text[j + 2 : k]
    if not url.lower().startswith(_LINK_SCHEMES) or len(url) > 2048:
        return None
    return text[i + 1 : j], url, k + 1


_EMPHASIS = (("**", "b"), ("__", "b"), ("~~", "s"), ("*", "i"), ("_", "i"))


def _inline(text: str, depth: int = 0, *, in_link: bool = False) -> str:
    out: list[str] = []
    i = 0
    n = len(text)
    # Where a search for each closing marker last failed: a later opener of the same
    # marker fails too, so a line full of lone `*` stays linear, not quadratic.
    misses: dict[str, int] = {}
    while i < n:
        char = text[i]
        if char == "\\" and i + 1 < n and text[i + 1] in _ESCAPABLE:
            out.append(_escape(text[i + 1]))
            i += 2
            continue
        if char == "`":
            end = _code_span_end(text, i)
            run = _run_length(text, i)
            if end is None:
                out.append(char * run)
                i += run
                continue
            code = text[i + run : end - run]
            if code.strip() and code.startswith(" ") and code.endswith(" "):
                code = code[1:-1]
            out.append(f"<code>{_escape(code)}</code>")
            i = end
            continue
        if char == "[" and not in_link and depth < _MAX_NESTING:
            link = _link_at(text, i)
            if link is not None:
                label, url, i = link
                inner = _inline(label, depth + 1, in_link=True) if label.strip() else _escape(url)
                out.append(f'<a href="{html.escape(url, quote=True)}">{inner}</a>')
                continue
        if char == "<":
            auto = _AUTOLINK.match(text, i)
            if auto is not None:
                out.append(_escape(auto.group(1)))
                i = auto.end()
                continue
        if char in "*_~" and depth < _MAX_NESTING:
            rendered = _emphasis_at(text, i, depth, in_link, misses)
            if rendered is not None:
                html_part, i = rendered
                out.append(html_part)
                continue
            run = _run_length(text, i)
            out.append(_escape(char * run))
            i += run
            continue
        out.append(_escape(char))
        i += 1
    return "".join(out)


def _emphasis_at(
    text: str, i: int, depth: int, in_link: bool, misses: dict[str, int]
) -> tuple[str, int] | None:
    run = _run_length(text, i)
    for marker, tag in _EMPHASIS:
        if not text.startswith(marker, i) or (len(marker) == 1 and run == 2):
            continue
        if marker == "~~" and run != 2:
            continue
        width = len(marker)
        if not _can_open(text, i, width):
            continue
        if i + width >= misses.get(marker, len(text) + 1):
            continue
        closer = _find_closer(text, i + width, marker)
        if closer is None:
            misses[marker] = i + width
            continue
        inner = text[i + width : closer]
        if not inner.strip() or (marker == "__" and inner.isidentifier()):
            continue  # nothing to emphasize, or a Python dunder name (__init__)
        return f"<{tag}>{_inline(inner, depth + 1, in_link=in_link)}</{tag}>", closer + width
    return None
