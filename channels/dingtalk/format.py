"""DingTalk text: the model's Markdown as a `markdown` robot message, split into parts.
Pure functions.

DingTalk draws a subset of Markdown (headings, bold, italic, links, lists, quotes,
images); a table becomes a code block of aligned columns. A message notifies people only
through its `at` field (`atUserIds`, `isAtAll`), never through its text, and the channel
sets no `isAtAll` and no one but the sender, so nothing the model writes pings anyone.

Promises (tested in tests/test_dingtalk.py): every part is at most `limit` characters;
the parts hold all of the text, in order; a title is one line of at most 20 characters.
"""

from __future__ import annotations

from channels.telegram.format import split_markdown

#: A markdown message's title: shown in notifications and the chat list.
TITLE_CHARS = 20


def split_parts(text: str, limit: int) -> list[str]:
    """The reply as the parts to send, in order, each at most `limit` characters."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [part for part in split_markdown(text, limit) if part.strip()]


def title_of(text: str) -> str:
    """A part's title: its first line without Markdown marks, at most 20 characters."""
    for line in text.splitlines():
        words = line.strip().lstrip("#>*-+` ").strip()
        if words:
            return words[:TITLE_CHARS]
    return "reply"


def with_mention(part: str, staff_id: str) -> str:
    """A group part naming its sender: DingTalk draws `@<userId>` as the mention of the
    person `atUserIds` lists."""
    return f"@{staff_id} {part}" if staff_id else part
