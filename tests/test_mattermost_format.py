"""Mattermost text (channels.mattermost.format): the model's Markdown kept as it is, every
mention defused outside code, long replies split under the post limit; and how a post
is read for the bot's mention. Partly property-tested with hypothesis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from channels.mattermost.format import (
    USERNAME,
    ZWSP,
    defuse_mentions,
    markdown_to_mattermost,
    mattermost_posts,
    mention_line,
    mentions_user,
    split_posts,
    strip_mention,
)
from tests.fakes.mattermost_server import mentions_in

# The server's reading of mentions (the fake's) is what a post is held to; the channel's
# own reading (`mentioned_names`) must agree with it.


def test_mentions_are_defused_but_read_the_same() -> None:
    text = markdown_to_mattermost("Hey @channel, @all and @here: ask @alice.smith or mail a@b.org")
    assert (
        text.replace(ZWSP, "") == "Hey @channel, @all and @here: ask @alice.smith or mail a@b.org"
    )
    assert mentions_in(text) == (set(), False)
    assert "a@b.org" in text


def test_code_is_left_alone() -> None:
    text = "run `@channel` and\n```\n@here stays\n```\nthen @here"
    converted = markdown_to_mattermost(text)
    assert "`@channel`" in converted and "\n@here stays\n" in converted
    assert converted.endswith(f"@{ZWSP}here")


def test_markdown_mattermost_draws_is_kept() -> None:
    text = (
        "# Title\n\n**bold** _it_ ~~no~~\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n- [x](https://e.org)"
    )
    assert markdown_to_mattermost(text) == text


def test_a_group_reply_names_its_sender_first_and_only_a_username() -> None:
    posts = mattermost_posts("hi @channel", mention=mention_line("alice"))
    assert posts == [f"@alice hi @{ZWSP}channel"]
    assert mention_line("not a name!") == ""
    assert mattermost_posts("", mention="@alice ") == []


def test_the_bots_mention_is_found_and_cut_as_mattermost_reads_it() -> None:
    assert mentions_user("@Kit-Bot: hello", "kit-bot")
    assert mentions_user("thanks @kit-bot.", "kit-bot")
    assert not mentions_user("@kit-bot.two hi", "kit-bot")
    assert not mentions_user("@kit-bots hi", "kit-bot")
    assert not mentions_user("mail kit-bot@example.com", "kit-bot")
    assert not mentions_user("`@kit-bot` in code", "kit-bot")
    assert not mentions_user("```\n@kit-bot\n```", "kit-bot")
    assert strip_mention("@kit-bot, what now?", "kit-bot") == "what now?"
    assert strip_mention("@kit-bot", "kit-bot") == "@kit-bot"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "@channel",
                "@all",
                "@here",
                "@alice",
                "@",
                "word",
                " ",
                "\n",
                "\n\n",
                "```",
                "```py\n",
                "`",
                "**",
                "x" * 300,
                "é",
                "😀",
                ".",
                "a@b",
                "-@here",
            ]
        ),
        max_size=60,
    )
)
def test_any_text_gives_posts_that_notify_no_one_and_fit(parts: list[str]) -> None:
    for post in mattermost_posts("".join(parts), 1000):
        assert len(post) <= 1000
        names, everyone = mentions_in(post)
        people = {n for n in names if USERNAME.fullmatch(n)}  # "@" is nobody's name
        assert not everyone and not people, post


@given(st.text(max_size=3000))
@settings(max_examples=200, deadline=None)
def test_defusing_keeps_every_visible_character(text: str) -> None:
    assert defuse_mentions(text).replace(ZWSP, "") == text.replace(ZWSP, "")


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
            st.just("```py\n" + "code line\n" * 120 + "```"),
            st.just("**bold words** " * 60),
        ),
        max_size=40,
    ),
    st.integers(min_value=200, max_value=16383),
)
def test_split_posts_hold_everything_in_order_with_their_code_blocks_closed(
    pieces: list[str], limit: int
) -> None:
    text = markdown_to_mattermost("\n\n".join(pieces))
    posts = split_posts(text, limit)
    assert all(len(p) <= limit and p.strip() for p in posts)
    for post in posts:  # every block opened in a post is closed in it
        fences = [line for line in post.split("\n") if line.lstrip().startswith("```")]
        assert len(fences) % 2 == 0, post
    fence_free = [line for p in posts for line in p.split("\n") if not line.startswith("```")]
    original = [line for line in text.split("\n") if not line.startswith("```")]
    assert " ".join(fence_free).split() == " ".join(original).split()


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="@abc.-_: \n`\u200b", max_size=40))
def test_the_channel_reads_mentions_as_the_server_does(text: str) -> None:
    from channels.mattermost.format import mentioned_names

    assert mentioned_names(text) == mentions_in(text)[0]
