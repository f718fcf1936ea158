"""The model's Markdown as Discord messages: nothing that pings, Discord's limit, all of
the text in order (channels.discord.format)."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.discord.format import (
    DISCORD_LIMIT,
    ZWSP,
    defuse_mentions,
    discord_messages,
    markdown_to_discord,
    split_discord,
)

_PINGS = re.compile(r"@everyone|@here|<@", re.IGNORECASE)


def outside_code(text: str) -> str:
    """`text` without fenced code blocks and inline code spans."""
    text = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?(^ {0,3}\1[ \t]*$|\Z)", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def test_mentions_are_defused_but_read_the_same() -> None:
    text = "Hi @everyone, @Here and <@123>, <@!45> and <@&67>; mail me@example.org"
    out = markdown_to_discord(text)
    assert _PINGS.search(outside_code(out)) is None
    assert out.replace(ZWSP, "") == text


def test_code_is_left_alone() -> None:
    text = "run `@everyone` then\n```py\nprint('<@1>')  # @here\n```"
    assert markdown_to_discord(text) == text


def test_what_discord_does_not_draw_is_converted() -> None:
    out = markdown_to_discord(
        "#### Details\n__strong__ and snake__case__name\n![a chart](https://x.org/c.png)\n"
        "| name | n |\n|---|--:|\n| apples | 3 |\n| kiwis | 12 |"
    )
    lines = out.split("\n")
    assert lines[0] == "**Details**"
    assert lines[1] == "**strong** and snake__case__name"
    assert lines[2] == "[a chart](https://x.org/c.png)"
    assert lines[3:] == [
        "```",
        "name   | n",
        "-------+---",
        "apples | 3",
        "kiwis  | 12",
        "```",
    ]
    assert markdown_to_discord("# Title\n### Sub") == "# Title\n### Sub"  # Discord has these


def test_a_long_reply_is_split_under_the_limit_and_code_blocks_stay_closed() -> None:
    prose = "\n\n".join(f"Paragraph {i}. " + "word " * 60 for i in range(12))
    code = "```python\n" + "\n".join(f"x{i} = {i}" for i in range(400)) + "\n```"
    messages = discord_messages(prose + "\n\n" + code)
    assert len(messages) > 3
    assert all(len(m) <= DISCORD_LIMIT for m in messages)
    for message in messages:
        assert message.count("```") % 2 == 0, message[:80]
    # The code continues in the same language after a cut.
    assert sum(m.startswith("```python") for m in messages) >= 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "@everyone",
                "@here",
                "<@12>",
                "<@&3>",
                "word",
                " ",
                "\n",
                "\n\n",
                "```",
                "```py\n",
                "`",
                "**",
                "__",
                "#### ",
                "| a | b |\n|---|---|\n",
                "x" * 300,
                "é",
                "😀",
            ]
        ),
        max_size=60,
    )
)
def test_any_text_gives_messages_that_cannot_ping_and_fit(parts: list[str]) -> None:
    text = "".join(parts)
    messages = discord_messages(text)
    for message in messages:
        assert len(message) <= DISCORD_LIMIT
        assert _PINGS.search(outside_code(message)) is None, message


@given(st.text(max_size=3000))
@settings(max_examples=200, deadline=None)
def test_defusing_keeps_every_visible_character(text: str) -> None:
    assert defuse_mentions(text).replace(ZWSP, "") == text.replace(ZWSP, "")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
            st.just("```py\n" + "code line\n" * 120 + "```"),
            st.just("**bold words** " * 60),
            st.just("| a | b |\n|---|---|\n| 1 | 2 |"),
        ),
        max_size=40,
    ),
    st.integers(min_value=200, max_value=DISCORD_LIMIT),
)
def test_split_messages_hold_everything_in_order_with_their_code_blocks_closed(
    pieces: list[str], limit: int
) -> None:
    text = markdown_to_discord("\n\n".join(pieces))
    messages = split_discord(text, limit)
    assert all(len(m) <= limit and m.strip() for m in messages)
    for message in messages:  # every block opened in a message is closed in it
        fences = [line for line in message.split("\n") if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, message
    fence_free = [line for m in messages for line in m.split("\n") if not line.startswith("```")]
    original = [line for line in text.split("\n") if not line.startswith("```")]
    assert " ".join(fence_free).split() == " ".join(original).split()


def test_a_rule_under_a_line_holding_a_pipe_is_not_a_table() -> None:
    """A `---` rule under prose that happens to hold a `|` stays prose (GFM's table needs
    a delimiter row with pipes and the header's columns), as Slack and WhatsApp read it."""
    text = "Pipe it: ls | wc -l\n---\nNext part"
    assert markdown_to_discord(text) == text
    table = markdown_to_discord("| a | b |\n|---|---|\n| 1 | 2 |")
    assert table.startswith("```") and "a | b" in table
