"""LINE's formatter: the model's Markdown as plain text (LINE's text messages have no
markup), and long replies in messages of at most 5,000 characters that hold all of the
text, in order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.line.format import LINE_TEXT_LIMIT, line_messages, markdown_to_line, split_line


def test_markdown_becomes_plain_text() -> None:
    cases = {
        "**bold** and __bold__": "bold and bold",
        "*italic* and _italic_": "italic and italic",
        "***both*** ~~gone~~": "both gone",
        "`code` stays": "code stays",
        "# Title": "Title",
        "### **Already bold**": "Already bold",
        "- one\n* two\n+ three": "• one\n• two\n• three",
        "1. first\n2. second": "1. first\n2. second",
        "> quoted **text**": "> quoted text",
        "[the docs](https://example.org/a_b)": "the docs (https://example.org/a_b)",
        "<https://example.org>": "https://example.org",
        "[https://x.org](https://x.org)": "https://x.org",
        "- [ ] todo\n- [x] done": "• ☐ todo\n• ☑ done",
        "---": "――――――――――",
        "snake_case_name and 2*3*4": "snake_case_name and 2*3*4",
        "`**not bold**`": "**not bold**",
        "@All meet at 5": "@All meet at 5",
    }
    for markdown, expected in cases.items():
        assert markdown_to_line(markdown) == expected, markdown


def test_code_blocks_keep_their_lines_and_tables_their_cells() -> None:
    assert markdown_to_line("Run:\n```python\nx = **1**\n```\ndone") == "Run:\nx = **1**\ndone"
    table = "| a | b |\n|---|:-:|\n| **1** | [x](https://x.org) |"
    assert markdown_to_line(table) == "a | b\n1 | x (https://x.org)"


def test_a_long_reply_is_cut_at_paragraphs_under_the_limit() -> None:
    paragraphs = [f"paragraph {n} " + "word " * 600 for n in range(5)]
    messages = line_messages("\n\n".join(paragraphs))
    assert len(messages) >= 2
    assert all(len(m) <= LINE_TEXT_LIMIT for m in messages)
    assert messages[0].split()[1] == "0"
    assert split_line("") == []


WORDS = st.lists(
    st.one_of(
        st.text(alphabet="abcxyz019 ", min_size=1, max_size=30),
        st.sampled_from(["**", "*", "_", "`", "```", "\n", "\n\n", "# ", "- ", "|", "😀"]),
    ),
    max_size=400,
)


@settings(max_examples=150, deadline=None)
@given(WORDS, st.integers(min_value=100, max_value=400))
def test_messages_are_within_the_limit_never_blank_and_keep_every_word(
    pieces: list[str], limit: int
) -> None:
    text = markdown_to_line("".join(pieces))
    messages = split_line(text, limit)
    assert all(0 < len(m) <= limit and m.strip() for m in messages)
    words = [w for w in text.split() if w.strip("`\u200b")]
    got = [w for w in " ".join(messages).split() if w.strip("`\u200b")]
    assert got == words
