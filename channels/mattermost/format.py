"""Mattermost text: the model's Markdown as Mattermost's, with nothing in it that could
notify anyone, and long replies split into posts under the server's length limit. Pure
functions; no network here.

Mattermost renders the model's Markdown as it is (GitHub-flavoured: emphasis, code spans
and fenced blocks with a language, quotes, lists, links, headings, tables), so the only
change is to mentions: outside code, every `@` that starts a word (`@channel`, `@all`,
`@here`, `@someone`) gets a zero-width space after it. The server then finds no mention
(it splits words at that character) and a reader sees the same text. The channel names
a group message's sender itself, at the start of its reply (`mention_line`).

`split_posts` cuts on paragraph, line and word boundaries, never inside a code block that
fits in one post (`channels.telegram.format.split_markdown`, which counts UTF-16 units:
never fewer than Mattermost's count of characters).

Promises (tested in tests/test_mattermost_format.py, partly with hypothesis):
- no post ever holds an `@` that starts a mention outside code (as the server reads
  mentions: `mentioned_names`);
- every post is at most `limit` characters, and every code block opened in one is
  closed in it;
- the posts hold all of the text, in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from channels.mattermost.settings import MAX_POST_CHARS
from channels.telegram.format import split_markdown

ZWSP = "\u200b"

_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
#: An `@` that may start a mention: not after a letter or a digit (`a@b` is an address;
#: after `.`, `-`, `:` or `_` the server still finds one), before a word character.
_MENTION = re.compile(r"(?<![^\W_])@(?=\w)")
#: A username as Mattermost allows it (lower case letters, digits, `.`, `-`, `_`).
USERNAME = re.compile(r"[a-z0-9][a-z0-9._\-]{0,63}", re.IGNORECASE)


def defuse_mentions(text: str) -> str:
    """`text` (prose, no code) with every mention broken by a zero-width space."""
    return _MENTION.sub("@" + ZWSP, text)


def markdown_to_mattermost(markdown: str) -> str:
    """The model's Markdown as Mattermost shows it, notifying no one."""
    text = markdown.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(chunk if is_code else _prose(chunk) for is_code, chunk in _segments(text))


def split_posts(text: str, limit: int = MAX_POST_CHARS) -> list[str]:
    """A reply's text (already converted) as the posts to send, in order, each at most
    `limit` characters; blank ones are left out."""
    return split_markdown(text, limit)


def mattermost_posts(markdown: str, limit: int = MAX_POST_CHARS, *, mention: str = "") -> list[str]:
    """The posts for one reply of the model: converted, with `mention` (a group message's
    sender, `@name `) before the first, then split to `limit`."""
    text = markdown_to_mattermost(markdown)
    if mention and text.strip():
        text = f"{mention}{text}"
    return split_posts(text, limit)


def mention_line(username: str) -> str:
    """What starts a reply in a group: the sender's mention (empty for a name that is no
    username, which could mention someone else)."""
    return f"@{username} " if USERNAME.fullmatch(username) else ""


def mentioned_names(text: str) -> set[str]:
    """The names `text` mentions outside code, lower case, as the server reads them
    (`explicit_mentions.go`): words are split at anything but letters, digits and
    `:.-_@`; a word's leading `:.-_` are dropped; `@name` with a trailing `.`, `-` or `:`
    names `name` too; a word holding `.`, `-` or `:` is split there once more."""
    names: set[str] = set()
    for is_code, chunk in _segments(text):
        if is_code:
            continue
        for raw in re.split(r"[^\w:.\-@]", _without_code_spans(chunk)):
            word = raw.lstrip(":.-_")
            if not word or re.fullmatch(r":[\w+\-]+:", raw):
                continue
            if word.startswith("@"):
                name = word[1:].lower()
                names.add(name)
                if name[-1:] in (".", "-", ":"):
                    names.add(name[:-1])
            elif any(c in word for c in ".-:"):
                for part in re.split(r"[.\-:]", word):
                    if part.startswith("@"):
                        names.add(part[1:].lower())
    names.discard("")
    return names


def mentions_user(text: str, username: str) -> bool:
    """Does `text` mention `@username` outside code, as Mattermost finds mentions (case
    does not matter; a trailing `.`, `-` or `:` does not belong to the name)?"""
    return bool(username) and username.lower() in mentioned_names(text)


def strip_mention(text: str, username: str) -> str:
    """`text` without the bot's own mentions (and a comma or colon after one), as the
    agent should read it; the text as it was when nothing else remains."""
    if not username:
        return text.strip()
    pattern = re.compile(
        rf"(?<![^\W_])@{re.escape(username)}(?![\w\-]|\.\w)[,:]?[ \t]*", re.IGNORECASE
    )
    stripped = pattern.sub("", text).strip()
    return stripped or text.strip()


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
        # Any fence-like line ends the block here, an info string after it or not: a
        # parser that takes "```py" inside a block for a new fence (CommonMark does not)
        # must not find a mention we took for code.
        closing = re.compile(rf"^ {{0,3}}{re.escape(marker[0])}{{{len(marker)},}}")
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
    out: list[str] = []
    position = 0
    for span in _CODE_SPAN.finditer(text):
        out.append(defuse_mentions(text[position : span.start()]))
        out.append(span.group(0))
        position = span.end()
    out.append(defuse_mentions(text[position:]))
    return "".join(out)


def _without_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(" ", text)
