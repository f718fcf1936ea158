"""QQ's text (channels.qq.format): the model's Markdown as the plain text a QQ message
shows, and long replies split under the length limit, all of it, in order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.qq.format import MENTION_RESERVE, markdown_to_qq, qq_messages, split_messages


def test_markup_goes_and_structure_stays() -> None:
    markdown = "\n".join(
        [
            "# Plan",
            "",
            "Some **bold**, *italic*, ~~struck~~ and `code` text.",
            "",
            "- one",
            "- two",
            "  - nested **deep**",
            "",
            "1. first",
            "2. second",
            "",
            "> quoted",
            "> still",
            "",
            "```python",
            "def f():",
            "    return '**not bold**'",
            "```",
            "",
            "| a | b |",
            "|---|---|",
            "| 1 | 2 |",
        ]
    )
    assert markdown_to_qq(markdown) == "\n".join(
        [
            "Plan",
            "",
            "Some bold, italic, struck and code text.",
            "",
            "- one",
            "- two",
            "  - nested deep",
            "",
            "1. first",
            "2. second",
            "",
            "> quoted",
            "> still",
            "",
            "def f():",
            "    return '**not bold**'",
            "",
            "a | b",
            "1 | 2",
        ]
    )


def test_links_keep_their_address_once() -> None:
    text = "See [the docs](https://x.org/a), <https://y.org> and ![chart](https://z.org/c.png)."
    assert markdown_to_qq(text) == (
        "See the docs (https://x.org/a), https://y.org and chart (https://z.org/c.png)."
    )


def test_cq_codes_and_mentions_the_model_writes_stay_text() -> None:
    # The channel sends text segments, which OneBot never parses: this is only text.
    assert markdown_to_qq("[CQ:at,qq=all] @all [CQ:image,file=x]") == (
        "[CQ:at,qq=all] @all [CQ:image,file=x]"
    )


def test_a_reply_that_mentions_its_sender_leaves_room_for_the_at() -> None:
    parts = qq_messages("word " * 1000, 500, mention=True)
    assert len(parts) > 1 and all(len(p) <= 500 - MENTION_RESERVE for p in parts)


def test_empty_and_blank_replies_give_no_message() -> None:
    assert qq_messages("") == [] and qq_messages("\n\n  \n") == []


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
            st.sampled_from(["\n", "\n\n", "- item\n", "```\ncode\n```\n", "# head\n", "> q\n"]),
        ),
        max_size=30,
    ),
    st.integers(min_value=100, max_value=600),
)
def test_every_message_fits_and_together_they_hold_the_text_in_order(
    pieces: list[str], limit: int
) -> None:
    text = markdown_to_qq("".join(pieces))
    parts = split_messages(text, limit)
    assert all(len(p) <= limit for p in parts)
    # Whitespace at a cut goes (each message is trimmed), a word cut only where it is
    # longer than a message: every other character is kept, in order.
    assert "".join("".join(parts).split()) == "".join(text.split())
