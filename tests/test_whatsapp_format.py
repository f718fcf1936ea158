"""WhatsApp's formatter: the model's Markdown as WhatsApp's own markers, and long replies
in messages of at most 4,096 characters that hold all of the text, in order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.whatsapp.format import (
    WHATSAPP_LIMIT,
    markdown_to_whatsapp,
    plain_line,
    split_whatsapp,
)


def test_markdown_becomes_whatsapp_markers() -> None:
    cases = {
        "**bold** and __bold__": "*bold* and *bold*",
        "*italic* and _italic_": "_italic_ and _italic_",
        "***both***": "*_both_*",
        "~~gone~~": "~gone~",
        "`code` stays": "`code` stays",
        "# Title": "*Title*",
        "### **Already bold**": "*Already bold*",
        "- one\n* two\n+ three": "- one\n- two\n- three",
        "1. first\n2. second": "1. first\n2. second",
        "> quoted **text**": "> quoted *text*",
        "[the docs](https://example.org/a_b)": "the docs (https://example.org/a_b)",
        "<https://example.org>": "https://example.org",
        "[https://x.org](https://x.org)": "https://x.org",
        "- [ ] todo\n- [x] done": "- ☐ todo\n- ☑ done",
        "---": "――――――――――",
    }
    for markdown, expected in cases.items():
        assert markdown_to_whatsapp(markdown) == expected, markdown


def test_code_blocks_lose_their_language_and_tables_become_monospace() -> None:
    assert markdown_to_whatsapp("```python\nx = **1**\n```") == "```\nx = **1**\n```"
    table = "| name | qty |\n|---|--:|\n| apple | 3 |\n| **kiwi** | 12 |"
    assert markdown_to_whatsapp(table) == (
        "```\nname  | qty\n------+----\napple | 3\nkiwi  | 12\n```"
    )
    # An unclosed fence runs to the end and is closed.
    assert markdown_to_whatsapp("see\n```\nopen") == "see\n```\nopen\n```"
    # Backtick runs inside a block cannot close it early.
    assert "```" not in markdown_to_whatsapp("```\na ``` b\n```").strip("`\n")


def test_a_template_parameter_is_one_short_line() -> None:
    assert plain_line("a\n\nb\t c     d", 100) == "a b c d"
    cut = plain_line("word " * 100, 20)
    assert len(cut) <= 20 and cut.endswith("…")


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
            st.just("```py\n" + "code line\n" * 40 + "```"),
            st.just("**bold words** " * 30),
        ),
        max_size=40,
    ),
    st.integers(min_value=200, max_value=WHATSAPP_LIMIT),
)
def test_split_messages_fit_and_hold_everything_in_order(pieces: list[str], limit: int) -> None:
    text = markdown_to_whatsapp("\n\n".join(pieces))
    messages = split_whatsapp(text, limit)
    assert all(len(m) <= limit and m.strip() for m in messages)
    for message in messages:  # every block opened in a message is closed in it
        fences = [line for line in message.split("\n") if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, message
    fence_free = [line for m in messages for line in m.split("\n") if not line.startswith("```")]
    original = [line for line in text.split("\n") if not line.startswith("```")]
    assert " ".join(fence_free).split() == " ".join(original).split()
