"""WeCom text: the model's Markdown as plain text, and long replies split into text
messages under WeCom's 2,048-byte limit. Pure functions; no HTTP here.

A text message of an app (`msgtype: text`) shows its text as it is, and WeCom cuts a
`content` longer than 2,048 bytes (UTF-8) without saying so ("发送应用消息": 最长不超过
2048个字节, 超过将截断). So the Markdown becomes plain text as for LINE
(`channels.line.format.markdown_to_line`: markers go, links show their URL), and the
text is split on paragraph, line and word boundaries into parts of at most 2,048 bytes:
a Chinese character is three of them.

Promises (tested in tests/test_wecom.py):
- every part is at most `TEXT_LIMIT_BYTES` bytes of UTF-8 and none is blank;
- the parts hold all of the text's words, in order.
"""

from __future__ import annotations

from channels.line.format import markdown_to_line
from channels.telegram.format import split_markdown

#: The most bytes (UTF-8) of a text message's content ("发送应用消息", 文本消息).
TEXT_LIMIT_BYTES = 2048


def split_bytes(text: str, limit: int = TEXT_LIMIT_BYTES) -> list[str]:
    """`text` as parts of at most `limit` bytes of UTF-8, in order; empty text gives none."""
    parts: list[str] = []
    for part in split_markdown(text, limit):
        size = len(part.encode())
        if size <= limit:
            parts.append(part)
            continue
        # Cut by characters in proportion to the bytes they take, until each part fits.
        chars = max(1, len(part) * limit // size - 1)
        parts.extend(split_bytes_by(part, limit, chars))
    return [p for p in parts if p.strip()]


def split_bytes_by(text: str, limit: int, chars: int) -> list[str]:
    out: list[str] = []
    for part in split_markdown(text, chars):
        if len(part.encode()) <= limit or chars == 1:
            out.append(part)
        else:
            out.extend(split_bytes_by(part, limit, max(1, chars // 2)))
    return out


def wecom_texts(markdown: str, limit: int = TEXT_LIMIT_BYTES) -> list[str]:
    """The texts of the messages one reply becomes."""
    return split_bytes(markdown_to_line(markdown), limit)
