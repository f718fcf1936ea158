"""Matrix text: the model's Markdown as an `m.room.message` content, its Markdown as the
plain `body` and HTML (`org.matrix.custom.html`) as the `formatted_body`, split into events
under Matrix's size limit. Pure functions; no matrix-nio here.

The HTML comes from markdown-it-py (CommonMark, as Matrix clients themselves render
Markdown), with raw HTML from the model escaped, line breaks kept (`<br>`), tables and
strikethrough on, and links only of the schemes markdown-it trusts. Splitting reuses the
Telegram formatter's Markdown planner (paragraph, line, word boundaries; code blocks
closed and reopened around a cut).

Promises (tested in tests/test_matrix_format.py):
- every event's content serializes to at most `MAX_CONTENT_BYTES` (the homeserver refuses
  events over 65,536 bytes, signatures and envelope included);
- the pieces, in order, carry the whole reply; none is blank;
- `formatted_body` never holds markup the model wrote: its `<`, `>` and `&` are escaped;
- what the bot writes mentions nobody (`m.mentions` is empty), so the homeserver never
  reads an "@room" or a name in its text as a ping (Matrix 1.7's intentional mentions:
  with the key present, the body-based push rules do not apply).
"""

from __future__ import annotations

import json
from typing import Any

from markdown_it import MarkdownIt

from channels.telegram.format import MIN_LIMIT, split_markdown

#: Markdown per event (UTF-16 units) before the byte check; long enough that a reply is
#: rarely split, short enough to read as one message.
MATRIX_LIMIT = 16_000
#: The largest content an event carries here: Matrix's 65,536-byte limit on the whole
#: event, less room for the envelope (ids, relations, signatures, hashes).
MAX_CONTENT_BYTES = 48_000
HTML_FORMAT = "org.matrix.custom.html"

_MARKDOWN = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(
    ["table", "strikethrough"]
)
# Matrix's HTML subset names strikethrough <del> (markdown-it writes <s>).
_MARKDOWN.add_render_rule("s_open", lambda *_: "<del>")
_MARKDOWN.add_render_rule("s_close", lambda *_: "</del>")


def markdown_to_html(markdown: str) -> str:
    """The HTML of `markdown` for `formatted_body` (one paragraph loses its <p>, as
    Element's own messages do)."""
    html = str(_MARKDOWN.render(markdown)).strip()
    if html.startswith("<p>") and html.endswith("</p>") and html.count("<p>") == 1:
        html = html[3:-4]
    return html


#: Whom the bot's messages mention: nobody. Without the key, the homeserver's legacy push
#: rules read the body, and an "@room" the model wrote would notify the whole room.
NO_MENTIONS: dict[str, Any] = {"m.mentions": {}}


def text_content(markdown: str) -> dict[str, Any]:
    """An `m.text` content: the Markdown as `body`, its HTML as `formatted_body`; it
    mentions nobody."""
    return {
        "msgtype": "m.text",
        "body": markdown,
        "format": HTML_FORMAT,
        "formatted_body": markdown_to_html(markdown),
        **NO_MENTIONS,
    }


def notice_content(text: str) -> dict[str, Any]:
    """An `m.notice` (what bots say that is not an answer: refusals, "can't open this");
    it mentions nobody."""
    return {"msgtype": "m.notice", "body": text, **NO_MENTIONS}


def content_bytes(content: dict[str, Any]) -> int:
    """The size of `content` as the homeserver counts it (JSON, UTF-8)."""
    return len(json.dumps(content, ensure_ascii=False).encode())


def split_reply(markdown: str, limit: int = MATRIX_LIMIT) -> list[str]:
    """The Markdown of each event of one reply, in order: pieces of at most `limit`
    UTF-16 units whose content (`text_content`) fits in `MAX_CONTENT_BYTES`; a piece
    whose HTML is too large is split again at half the limit."""
    pieces: list[str] = []
    for piece in split_markdown(markdown, limit):
        if content_bytes(text_content(piece)) <= MAX_CONTENT_BYTES or limit // 2 < MIN_LIMIT:
            pieces.append(piece)
        else:
            pieces.extend(split_reply(piece, limit // 2))
    return pieces


def edit_content(event_id: str, content: dict[str, Any]) -> dict[str, Any]:
    """An `m.replace` edit of `event_id` to `content` (with the "* " fallback older
    clients show)."""
    fallback = dict(content)
    fallback["body"] = "* " + str(content.get("body", ""))
    if "formatted_body" in content:
        fallback["formatted_body"] = "* " + str(content["formatted_body"])
    fallback["m.new_content"] = content
    fallback["m.relates_to"] = {"rel_type": "m.replace", "event_id": event_id}
    return fallback


def strip_reply_fallback(body: str) -> str:
    """A reply's `body` without the quoted lines older clients put first ("> <@a:b> ...",
    then a blank line)."""
    if not body.startswith("> "):
        return body
    lines = body.split("\n")
    index = 0
    while index < len(lines) and lines[index].startswith(">"):
        index += 1
    if index < len(lines) and lines[index] == "":
        return "\n".join(lines[index + 1 :])
    return body
