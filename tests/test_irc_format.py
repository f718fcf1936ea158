"""IRC text (channels/irc/format.py): the model's Markdown as lines an IRC client shows,
each within what one PRIVMSG leaves for text, cut on UTF-8 boundaries and words."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.irc.format import (
    BOLD,
    ITALIC,
    MONO,
    markdown_to_lines,
    reply_lines,
    split_line,
    text_budget,
)
from channels.irc.wire import strip_formatting


def test_markdown_becomes_mirc_codes_and_spelled_out_links() -> None:
    lines = markdown_to_lines(
        "# Plan\n\nIt is **done** and *tested*, see `make test` and [the docs](https://x.io/d).\n"
        "\n- one\n* two\n\n```python\nprint('hi')  # **not bold**\n```\n> quoted ~~old~~"
    )
    assert lines == [
        f"{BOLD}Plan{BOLD}",
        f"It is {BOLD}done{BOLD} and {ITALIC}tested{ITALIC}, see {MONO}make test{MONO} and "
        "the docs <https://x.io/d>.",
        "- one",
        "- two",
        "print('hi')  # **not bold**",
        "> quoted \x1eold\x1e",
    ]


def test_without_formatting_the_text_is_plain() -> None:
    assert markdown_to_lines("**b** _i_ `c` ~~s~~", formatting=False) == ["b i c s"]


def test_a_table_is_aligned_columns() -> None:
    assert markdown_to_lines("| name | n |\n|---|---|\n| **alice** | 10 |\n| bob | 2 |") == [
        "name  | n",
        "------+---",
        "alice | 10",
        "bob   | 2",
    ]


def test_control_characters_never_reach_the_wire() -> None:
    lines = markdown_to_lines("hi\x01ACTION dances\x01\x00 and\x07 bell\r\nQUIT :bye")
    assert lines == ["hiACTION dances and bell", "QUIT :bye"]  # two PRIVMSGs, no QUIT


def test_the_budget_is_what_the_relayed_line_leaves() -> None:
    source, target = "bot!~bot@example.org", "#team"
    budget = text_budget(source, target)
    relayed = f":{source} PRIVMSG {target} :" + "x" * budget + "\r\n"
    assert len(relayed.encode()) == 512


def test_a_long_line_is_cut_on_words_and_bold_opens_again() -> None:
    pieces = split_line(f"{BOLD}" + "word " * 40 + f"{BOLD} end", 60)
    assert all(len(p.encode()) <= 60 for p in pieces)
    assert all(p.startswith(BOLD) for p in pieces[:-1])
    assert all(not p.endswith(" ") for p in pieces)
    assert " ".join(strip_formatting(p) for p in pieces).split() == ["word"] * 40 + ["end"]


def test_utf8_is_cut_between_characters() -> None:
    pieces = split_line("日本語のテキスト" * 30, 50)
    assert all(len(p.encode()) <= 50 for p in pieces)
    assert "".join(pieces) == "日本語のテキスト" * 30


def test_a_channel_reply_names_its_addressee_first() -> None:
    assert reply_lines("yes\nand more", 100, lead="alice: ") == ["alice: yes", "and more"]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=2000), st.integers(min_value=32, max_value=500))
def test_every_line_fits_none_is_blank_and_every_word_arrives_in_order(
    markdown: str, budget: int
) -> None:
    lines = reply_lines(markdown, budget)
    for line in lines:
        assert len(line.encode()) <= budget
        assert strip_formatting(line).strip()
        assert not re.search("[\r\n\0\x01]", line)
    # Every word of the plain text is there, in order (cuts may split a long word).
    plain = "".join(strip_formatting(line).replace(" ", "") for line in lines)
    wanted = "".join(
        strip_formatting(line).replace(" ", "") for line in markdown_to_lines(markdown)
    )
    assert plain == wanted
