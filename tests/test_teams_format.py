"""Teams text (channels/teams/format.py): the model's Markdown as a Teams text message shows
it, with no `<at>` outside code (a mention the bot did not mean), every message within the
limit with its code blocks closed, and all of the text, in order. Partly property-tested
with hypothesis."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.teams.format import (
    ZWSP,
    markdown_to_teams,
    mention_entity,
    mention_prefix,
    teams_messages,
)

FENCE = re.compile(r"^ {0,3}(`{3,}(?=[^`\n]*$)|~{3,})", re.MULTILINE)


def outside_code(text: str) -> str:
    """`text` without its fenced blocks and code spans."""
    text = re.sub(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[ \t]*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def test_what_teams_cannot_show_becomes_what_it_can() -> None:
    text = markdown_to_teams(
        "# Title\n\nSome *text* and ![a chart](https://x.example/c.png)\n\n---\n\n"
        "| a | bb |\n|---|---|\n| 1 | 2 |\n"
    )
    assert text.startswith("**Title**\n")
    assert "[a chart](https://x.example/c.png)" in text and "![" not in text
    assert "---\n" not in text.split("```")[0]
    assert "```\na | bb\n--+---\n1 | 2\n```" in text


def test_mentions_in_prose_are_defused_and_code_is_left_alone() -> None:
    text = markdown_to_teams("hi <at>everyone</at> `<at>x</at>`\n```\n<at>y</at>\n```")
    assert f"<{ZWSP}at>everyone<{ZWSP}/at>" in text
    assert "`<at>x</at>`" in text and "\n<at>y</at>\n" in text


def test_a_group_reply_names_its_sender_with_an_entity() -> None:
    [first] = teams_messages("answer", 1000, mention=mention_prefix("Ada <Ops>"))
    entity = mention_entity("29:ada", "Ada <Ops>")
    assert first == "<at>Ada &lt;Ops&gt;</at> answer"
    assert entity["text"] in first and entity["mentioned"] == {"id": "29:ada", "name": "Ada <Ops>"}


markdownish = st.lists(
    st.one_of(
        st.text(min_size=0, max_size=80),
        st.sampled_from(
            ["<at>all</at>", "</at>", "<AT>", "```", "```py", "~~~", "`x`", "# h", "| a |", "\n\n"]
        ),
    ),
    max_size=40,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(markdownish, st.integers(min_value=1000, max_value=3000))
def test_messages_hold_no_mention_stay_in_the_limit_and_keep_everything(
    markdown: str, limit: int
) -> None:
    messages = teams_messages(markdown, limit)
    for message in messages:
        assert len(message) <= limit
        assert fences_closed(message), message
        assert not re.search(r"<\s*/?at\b", outside_code(message), re.IGNORECASE), message
    # All of the text, in order (fences the split closes and reopens aside).
    assert squeeze("\n".join(messages)) == squeeze(markdown_to_teams(markdown))


def fences_closed(text: str) -> bool:
    """Does every code block `text` opens end in it? CommonMark's rule: a block opened by
    a fence of backticks or tildes ends at a fence of the same character, at least as
    long, with nothing after it; any other fence line inside is the block's text."""
    opened: str | None = None
    for line in text.split("\n"):
        found = FENCE.match(line)
        if found is None:
            continue
        fence = found.group(1)
        if opened is None:
            opened = fence
        elif fence[0] == opened[0] and len(fence) >= len(opened) and not line.strip(fence[0] + " "):
            opened = None
    return opened is None


def squeeze(text: str) -> str:
    """`text` without fence lines and whitespace."""
    kept = [line for line in text.split("\n") if not FENCE.match(line)]
    return re.sub(r"\s", "", "".join(kept))
