"""The Signal formatter (channels/signal/format.py): the model's Markdown as a plain body
with Signal's text styles in UTF-16 units, and long replies split under 2,000 bytes."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.signal.format import (
    SIGNAL_BODY_BYTES,
    Style,
    Styled,
    markdown_to_signal,
    signal_messages,
    utf16_len,
)


def styled_parts(styled: Styled) -> list[tuple[str, str]]:
    """(style, the text it covers), read back through UTF-16 as Signal's apps do."""
    units = styled.text.encode("utf-16-le")
    return [
        (s.style, units[2 * s.start : 2 * (s.start + s.length)].decode("utf-16-le"))
        for s in styled.styles
    ]


def test_emphasis_code_and_spoilers_become_styles() -> None:
    styled = markdown_to_signal("Say **loud**, *soft*, ~~gone~~, `x = 1` and ||hidden||.")
    assert styled.text == "Say loud, soft, gone, x = 1 and hidden."
    assert styled_parts(styled) == [
        ("BOLD", "loud"),
        ("ITALIC", "soft"),
        ("STRIKETHROUGH", "gone"),
        ("MONOSPACE", "x = 1"),
        ("SPOILER", "hidden"),
    ]
    assert styled.params()[0] == "4:4:BOLD"


def test_offsets_count_utf16_units() -> None:
    styled = markdown_to_signal("😀 **bold 😀** end")
    assert styled.text == "😀 bold 😀 end"
    assert styled.styles == (Style(3, 7, "BOLD"),)
    assert styled_parts(styled) == [("BOLD", "bold 😀")]


def test_blocks_headings_lists_quotes_code_and_tables() -> None:
    markdown = (
        "# Plan\n\nFirst:\n\n- one\n- two\n  1. inner\n\n> quoted\n> line\n\n"
        "```python\nprint('hi')\n```\n\n| a | bb |\n|---|---|\n| 1 | 2 |\n\n---\n\nEnd"
    )
    styled = markdown_to_signal(markdown)
    assert styled.text.split("\n") == [
        "Plan",
        "",
        "First:",
        "",
        "• one",
        "• two",
        "  1. inner",
        "",
        "> quoted",
        "> line",
        "",
        "print('hi')",
        "",
        "a | bb",
        "--+---",
        "1 | 2",
        "",
        "―" * 10,
        "",
        "End",
    ]
    parts = styled_parts(styled)
    assert ("BOLD", "Plan") in parts
    assert ("MONOSPACE", "print('hi')") in parts
    assert ("MONOSPACE", "a | bb\n--+---\n1 | 2") in parts


def test_links_are_spelled_out_and_nothing_is_markup() -> None:
    styled = markdown_to_signal(
        "See [the docs](https://example.org/d) or <https://example.org>; **[b](https://x.y)**"
    )
    assert (
        styled.text
        == "See the docs (https://example.org/d) or https://example.org; b (https://x.y)"
    )
    assert markdown_to_signal("<b>not html</b> & 1 < 2").text == "<b>not html</b> & 1 < 2"


def test_plain_words_stay_as_they_are() -> None:
    assert markdown_to_signal("echo: m00042 kit words") == Styled("echo: m00042 kit words")


def test_a_long_reply_is_split_under_the_body_limit_in_order() -> None:
    lines = [f"L{n:05d} " + "word " * 12 for n in range(400)]
    messages = signal_messages("\n".join(lines))
    assert len(messages) > 2
    assert all(len(m.text.encode()) <= SIGNAL_BODY_BYTES for m in messages)
    found = [x for m in messages for x in re.findall(r"L\d{5}", m.text)]
    assert found == [f"L{n:05d}" for n in range(400)]


def test_wide_characters_are_split_by_bytes() -> None:
    messages = signal_messages("漢" * 3000)
    assert all(0 < len(m.text.encode()) <= SIGNAL_BODY_BYTES for m in messages)
    assert "".join(m.text for m in messages) == "漢" * 3000


def test_a_code_block_cut_in_two_stays_monospace_in_both() -> None:
    code = "\n".join(f"line {n} " + "x" * 40 for n in range(80))
    messages = signal_messages(f"Here:\n\n```\n{code}\n```")
    assert len(messages) >= 2
    assert all(any(s.style == "MONOSPACE" for s in m.styles) for m in messages[1:])
    assert not any("```" in m.text for m in messages)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=3000))
def test_any_text_gives_bodies_within_the_limit_and_styles_within_them(text: str) -> None:
    for message in signal_messages(text):
        assert message.text.strip()
        assert len(message.text.encode()) <= SIGNAL_BODY_BYTES
        for style in message.styles:
            assert style.length > 0 and style.start >= 0
            assert style.start + style.length <= utf16_len(message.text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.from_regex(r"[a-z]{1,12}", fullmatch=True), min_size=1, max_size=600))
def test_every_word_arrives_once_in_order(words: list[str]) -> None:
    messages = signal_messages(" ".join(words))
    assert " ".join(m.text for m in messages).split() == words
