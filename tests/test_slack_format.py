"""Markdown to Slack mrkdwn, Slack markup to plain text, and splitting replies."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.slack.format import (
    FENCE,
    MIN_PART_CHARS,
    markdown_to_mrkdwn,
    preview,
    slack_to_plain,
    split_mrkdwn,
)


@pytest.mark.parametrize(
    ("markdown", "mrkdwn"),
    [
        ("**bold** and __also__", "*bold* and *also*"),
        ("*italic* and _too_", "_italic_ and _too_"),
        ("~~gone~~", "~gone~"),
        ("***both***", "*_both_*"),
        ("___both___", "*_both_*"),
        ("a ***b*** c **d** *e*", "a *_b_* c *d* _e_"),
        ("***bold** then italic*", "_*bold* then italic_"),
        ("***italic* then bold**", "*_italic_ then bold*"),
        ("**_x_** and _**y**_", "*_x_* and _*y*_"),
        ("2 * 3 * 4 = 24", "2 * 3 * 4 = 24"),
        ("snake_case_name", "snake_case_name"),
        ("[docs](https://example.com/a?b=1&c=2)", "<https://example.com/a?b=1&amp;c=2|docs>"),
        ("[**bold link**](https://x.io)", "<https://x.io|*bold link*>"),
        ("see <https://x.io/path>", "see <https://x.io/path>"),
        ("![a cat](https://x.io/cat.png)", "<https://x.io/cat.png|a cat>"),
        ("[click](javascript:alert(1))", "[click](javascript:alert(1))"),
        ("[mail](mailto:a@b.c)", "<mailto:a@b.c|mail>"),
        ("# Title", "*Title*"),
        ("### A **bold** heading ###", "*A bold heading*"),
        ("- one\n* two\n  + three", "• one\n• two\n  • three"),
        ("- [ ] todo\n- [x] done", "• ☐ todo\n• ☑ done"),
        ("1. first\n2. second", "1. first\n2. second"),
        ("> quoted **text**", "> quoted *text*"),
        ("a\n\n---\n\nb", "a\n\n──────────\n\nb"),
        ("`a < b` and **x**", "`a &lt; b` and *x*"),
        ("a & b <c> d", "a &amp; b &lt;c&gt; d"),
        ("<@U123> <!channel> <!here>", "&lt;@U123&gt; &lt;!channel&gt; &lt;!here&gt;"),
        ("```python\nif a < b:\n    **not bold**\n```", "```\nif a &lt; b:\n    **not bold**\n```"),
        ("~~~\ncode\n~~~", "```\ncode\n```"),
        ("text\n```\nnever closed", "text\n```\nnever closed\n```"),
        ("```\nhas ``` inside\n```", "```\nhas `\u200b`\u200b` inside\n```"),
        ("", ""),
    ],
)
def test_markdown_to_mrkdwn(markdown: str, mrkdwn: str) -> None:
    assert markdown_to_mrkdwn(markdown) == mrkdwn


def test_a_table_becomes_a_code_block_with_aligned_columns() -> None:
    markdown = (
        "Results:\n\n"
        "| Name | Score | Link |\n"
        "|:-----|------:|------|\n"
        "| **Ann** | 10 | [docs](https://x.io) |\n"
        "| Bob | 7 |\n"
        "| `a<b` | 100 | x \\| y |\n"
        "\nAfter."
    )
    assert markdown_to_mrkdwn(markdown) == (
        "Results:\n\n"
        "```\n"
        "Name | Score | Link\n"
        "-----+-------+--------------------\n"
        "Ann  |    10 | docs (https://x.io)\n"
        "Bob  |     7 |\n"
        "a&lt;b  |   100 | x | y\n"  # Slack shows `&lt;` as one character
        "```\n\n"
        "After."
    )


@pytest.mark.parametrize(
    "markdown",
    ["a | b", "a | b\nnot a delimiter", "| a | b |\n|---|\n| 1 | 2 |", "x\n---\ny"],
)
def test_text_with_pipes_that_is_not_a_table_stays_prose(markdown: str) -> None:
    assert FENCE not in markdown_to_mrkdwn(markdown)


def test_the_model_cannot_write_slack_control_sequences() -> None:
    hostile = "hi <!channel> <@U0BOSS01> <https://evil.example|bank> &lt;!here&gt;"
    out = markdown_to_mrkdwn(hostile)
    assert "<!" not in out and "<@" not in out and "|bank>" not in out
    # Escaped text shows in Slack exactly as the model wrote it.
    assert out.startswith("hi &lt;!channel&gt; &lt;@U0BOSS01&gt;")


@pytest.mark.parametrize(
    ("slack", "plain"),
    [
        ("<@U0BOT> what's up?", "what's up?"),
        ("hey <@U0BOT> there", "hey there"),
        ("ask <@U0BOB|bob> and <@U0ANN>", "ask @bob and @U0ANN"),
        ("in <#C0GEN|general> <!here> <!subteam^S1|@devs>", "in #general @here @devs"),
        (
            "<https://a.io|site> and <https://b.io> and <mailto:x@y.z|x@y.z>",
            "site (https://a.io) and https://b.io and x@y.z",
        ),
        ("a &lt;b&gt; &amp;amp;", "a <b> &amp;"),
        ("<@U0BOT>", ""),
    ],
)
def test_slack_to_plain(slack: str, plain: str) -> None:
    assert slack_to_plain(slack, "U0BOT") == plain


def test_short_text_is_one_part_and_empty_is_none() -> None:
    assert split_mrkdwn("hello") == ["hello"]
    assert split_mrkdwn("") == []
    with pytest.raises(ValueError):
        split_mrkdwn("x", MIN_PART_CHARS - 1)


def test_split_prefers_paragraphs_and_keeps_code_blocks_whole() -> None:
    code = FENCE + "\n" + "\n".join(f"line {i}" for i in range(8)) + "\n" + FENCE
    text = "first paragraph here\n\nsecond one\n\n" + code + "\n\nlast words"
    assert split_mrkdwn(text, 80) == [
        "first paragraph here\n\nsecond one",
        code + "\n\nlast words",
    ]
    assert split_mrkdwn(text, len(code) + 2) == [
        "first paragraph here\n\nsecond one",
        code,
        "last words",
    ]


def test_a_code_block_longer_than_a_part_is_split_into_closed_blocks() -> None:
    code = FENCE + "\n" + "\n".join(f"print({i})" for i in range(100)) + "\n" + FENCE
    parts = split_mrkdwn(code, 200)
    assert len(parts) > 1
    for part in parts:
        assert part.startswith(FENCE + "\n") and part.endswith("\n" + FENCE)
        assert len(part) <= 200
    lines = [line for part in parts for line in part.split("\n") if line != FENCE]
    assert lines == [f"print({i})" for i in range(100)]


def test_links_and_entities_are_not_cut() -> None:
    link = "<https://example.com/some/long/path|a label with several words>"
    text = " ".join(["word"] * 30 + [link] + ["&amp;"] * 30)
    for part in split_mrkdwn(text, 70):
        assert part.count("<") == part.count(">")
        assert re.search(r"&(?!amp;)", part) is None


def test_preview_shows_the_first_part_with_an_ellipsis() -> None:
    assert preview("**hi**") == "*hi*"
    long = "\n\n".join(["para " * 20] * 5)
    shown = preview(long, 200)
    assert shown.endswith(" …") and len(shown) <= 200
    assert preview("```py\nopen code") == "```\nopen code\n```"


# Text made of the pieces that matter for splitting: words, long words, blank lines,
# fences, links and entities.
_PIECES = st.sampled_from(
    [
        "word",
        "a" * 90,
        " ",
        "\n",
        "\n\n",
        "```\n",
        "\n```\n",
        "`x`",
        "**b**",
        "<",
        "&",
        "[l](https://x.io)",
    ]
)
_TEXT = st.lists(_PIECES, max_size=80).map("".join)


def _content(text: str) -> str:
    return re.sub(r"\s|```", "", text)


@settings(max_examples=300, deadline=None)
@given(_TEXT, st.integers(min_value=MIN_PART_CHARS, max_value=400))
def test_split_keeps_everything_in_order_within_the_limit(markdown: str, limit: int) -> None:
    mrkdwn = markdown_to_mrkdwn(markdown)
    parts = split_mrkdwn(mrkdwn, limit)
    assert all(0 < len(part) <= limit for part in parts)
    assert _content("".join(parts)) == _content(mrkdwn)
    for part in parts:
        fences = sum(line.count(FENCE) for line in part.split("\n"))
        assert fences % 2 == 0, part  # every code block closed in its own message


_MARKUP = st.lists(
    st.sampled_from(
        [*"ab `*_~<>&|[]()#-\n!:/.@", "https://", "mailto:", FENCE, "](", "<@U1>", "<!here>"]
    ),
    max_size=150,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=300), _MARKUP))
def test_any_text_converts_to_closed_escaped_mrkdwn(markdown: str) -> None:
    mrkdwn = markdown_to_mrkdwn(markdown)
    assert mrkdwn.count(FENCE) % 2 == 0
    # Only links the converter made: every `<` opens one, every `>` closes one or
    # marks a quote line.
    unquoted = re.sub(r"(?m)^>", "", mrkdwn)
    link = r"<(?:https?://|mailto:)[^<>\s|]+(?:\|[^<>]*)?>"
    assert re.fullmatch(rf"(?:[^<>]|{link})*", unquoted, re.S), mrkdwn
