"""Google Chat's text (channels.googlechat.format): the model's Markdown in Chat's markup,
nothing in it that mentions anyone or makes a link the model did not write as one, and
replies split into messages under the Chat API's 32,000 bytes, every code block closed,
all of the text kept in order. Partly with hypothesis."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.googlechat.format import (
    ZWSP,
    chat_messages,
    client_message_id,
    defuse,
    markdown_to_chat,
    mention_line,
    split_messages,
)
from tests.fakes.googlechat_server import _MENTION


@pytest.mark.parametrize(
    ("markdown", "chat"),
    [
        ("**bold** and *italic* and ~~gone~~", "*bold* and _italic_ and ~gone~"),
        ("__bold__ and _italic_", "*bold* and _italic_"),
        ("***both***", "*_both_*"),
        ("`code` stays", "`code` stays"),
        ("[the docs](https://example.com/a?b=c)", "<https://example.com/a?b=c|the docs>"),
        ("<https://example.com>", "https://example.com"),
        ("[https://x.example](https://x.example)", "https://x.example"),
        ("# Title", "*Title*"),
        ("- one\n* two\n+ three", "• one\n• two\n• three"),
        ("- [ ] todo\n- [x] done", "• ☐ todo\n• ☑ done"),
        ("> quoted **words**", "> quoted *words*"),
        ("---", "──────────"),
        ("```python\nprint('hi')\n```", "```\nprint('hi')\n```"),
        ("2 * 3 * 4", "2 * 3 * 4"),
        ("snake_case_name", "snake_case_name"),
    ],
)
def test_markdown_to_chat(markdown: str, chat: str) -> None:
    assert markdown_to_chat(markdown) == chat


def test_a_table_becomes_a_code_block_with_aligned_columns() -> None:
    table = "| name | n |\n|---|--:|\n| **a** | 1 |\n| bb | 22 |"
    assert markdown_to_chat(table) == "```\nname |  n\n-----+---\na    |  1\nbb   | 22\n```"


def test_no_mention_and_no_raw_link_survives_in_prose_or_code() -> None:
    text = markdown_to_chat(
        "hi <users/all> and <users/123>\n`<users/all>`\n```\n<users/all>\n```\n"
        "<https://evil.example|Click here> and [x](javascript:void)"
    )
    assert not _MENTION.search(text), text
    assert "<https://evil" not in text and "<javascript" not in text
    assert "x (javascript:void)" in text
    assert text.replace(ZWSP, "").count("<users/all>") == 3  # it reads the same


def test_a_link_label_cannot_break_out_of_its_link() -> None:
    text = markdown_to_chat("[a|b>c](https://example.com)")
    assert text.startswith("<https://example.com|") and text.count("|") == 1
    assert text.count(">") == 1


def test_the_reply_names_only_a_person() -> None:
    assert mention_line("users/1234567") == "<users/1234567> "
    assert mention_line("users/all") == "" and mention_line("spaces/x") == ""
    parts = chat_messages("hello <users/all>", mention="<users/42> ")
    assert parts == [f"<users/42> hello <{ZWSP}users/all>"]
    assert chat_messages("   ", mention="<users/42> ") == []


def test_a_long_reply_is_split_under_the_byte_limit_with_code_blocks_closed() -> None:
    code = "```\n" + "\n".join(f"line {n} é" for n in range(400)) + "\n```"
    text = "\n\n".join(["intro " * 200, code, "outro"])
    parts = split_messages(markdown_to_chat(text), 1000)
    assert len(parts) > 5
    for part in parts:
        assert len(part.encode()) <= 1000
        assert part.count("```") % 2 == 0


def test_multibyte_text_is_cut_by_bytes_not_characters() -> None:
    parts = split_messages("😀" * 2000, 1000)  # 8,000 bytes in 2,000 characters
    assert all(len(p.encode()) <= 1000 for p in parts)
    assert "".join(parts) == "😀" * 2000


def test_a_part_s_message_id_is_the_same_for_the_same_part_and_a_valid_custom_id() -> None:
    one = client_message_id("spaces/A/messages/B.B", "part 0", "hello")
    assert one == client_message_id("spaces/A/messages/B.B", "part 0", "hello")
    assert one != client_message_id("spaces/A/messages/B.B", "part 1", "hello")
    assert one != client_message_id("spaces/A/messages/B.B", "part 0", "hello!")
    assert re.fullmatch(r"client-[a-z0-9-]{1,56}", one) and len(one) <= 63
    assert client_message_id(None, "part 0", "x") != client_message_id(None, "part 0", "x")


_PIECES = st.sampled_from(
    [
        "<users/all>",
        "<users/123>",
        "<",
        ">",
        "users/all",
        "<https://x.example|y>",
        "[a](https://b.example)",
        "word",
        " ",
        "\n",
        "\n\n",
        "```",
        "```py\n",
        "`",
        "**",
        "*",
        "_",
        "~~",
        "|",
        "x" * 300,
        "é",
        "😀",
        "| a | b |\n|---|---|\n| 1 | 2 |\n",
    ]
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_PIECES, max_size=60), st.integers(min_value=200, max_value=4000))
def test_any_text_gives_messages_that_mention_no_one_and_fit(pieces: list[str], limit: int) -> None:
    for part in chat_messages("".join(pieces), limit):
        assert len(part.encode()) <= limit
        assert not _MENTION.search(part), part
        assert part.count("```") % 2 == 0, part


@given(st.text(max_size=3000))
@settings(max_examples=200, deadline=None)
def test_defusing_keeps_every_visible_character(text: str) -> None:
    assert defuse(text).replace(ZWSP, "") == text.replace(ZWSP, "")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
            st.just("```py\n" + "code line é\n" * 120 + "```"),
            st.just("**bold words** " * 60),
        ),
        max_size=40,
    ),
    st.integers(min_value=300, max_value=32000),
)
def test_split_messages_hold_everything_in_order_with_their_code_blocks_closed(
    pieces: list[str], limit: int
) -> None:
    text = markdown_to_chat("\n\n".join(pieces))
    parts = split_messages(text, limit)
    assert all(len(p.encode()) <= limit and p.strip() for p in parts)
    for part in parts:
        fences = [line for line in part.split("\n") if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, part
    fence_free = [line for p in parts for line in p.split("\n") if not line.startswith("```")]
    original = [line for line in text.split("\n") if not line.startswith("```")]
    assert "".join(" ".join(fence_free).split()) == "".join(" ".join(original).split())
