"""The conformance kit itself (`gateway.testing`): its model answers as documented, through
the real `openai` client; its tally finds each way a channel can break the promise; its
requirements skip what a platform lacks; and a scenario does fail on a channel that loses
a reply or pings everyone."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements, suite
from gateway.testing import kit as kit_module
from gateway.testing.kit import Kit
from gateway.testing.model import LONG_LINE, KitModel, answer_for, long_text
from gateway.testing.plugin import needs
from gateway.testing.tally import TOKEN, Said, Tally, answered_token
from tests.conformance.telegram_driver import GROUP, TelegramDriver

# -- the model --------------------------------------------------------------------------


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_the_model_echoes_the_last_user_message() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        user("m00001 first"),
        {"role": "assistant", "content": "echo: m00001 first"},
        {"role": "user", "content": [{"type": "text", "text": "m00002 "}, {"type": "text"}]},
    ]
    assert answer_for(messages).text == "echo: m00002 "
    assert answer_for(messages, delay=0.5).delay == 0.5


def test_the_echo_is_one_line() -> None:
    """A group message reaches the model after a header naming its sender, on a line of
    its own: the echo keeps it on the answer's one line, so a platform whose posts are
    lines (IRC) has each answer in one post, token and all."""
    said = user('[from "person0"]\nm00001 kit:slow=3\r\n  and more')
    assert answer_for([said]).text == 'echo: [from "person0"] m00001 kit:slow=3 and more'
    long = answer_for([user("m00001\nkit:long=100")]).text
    assert long.startswith("echo: m00001 kit:long=100\n\nL00001 ")


def test_words_in_the_message_steer_the_model() -> None:
    assert answer_for([user("m00001 kit:slow=2.5")]).delay == 2.5
    pinged = answer_for([user("m00001 kit:everyone")], everyone_text="@everyone")
    assert pinged.text == "echo: m00001 kit:everyone @everyone"
    assert answer_for([user("m00001 kit:everyone")]).text == "echo: m00001 kit:everyone"
    long = answer_for([user("m00001 kit:long=5000")]).text
    assert long.startswith("echo: m00001 kit:long=5000\n\nL00001 ")
    lines = LONG_LINE.findall(long)
    assert len(long) > 5000
    assert lines == [f"{n:05d}" for n in range(1, len(lines) + 1)]


def test_a_long_text_is_numbered_lines_of_at_least_the_length() -> None:
    for size in (1, 100, 9999):
        text = long_text(size)
        assert len(text) >= size - 1
        assert len(long_text(size + 200)) > len(text)


def test_the_real_openai_client_talks_to_the_model() -> None:
    with KitModel.running(delay=0.01) as model:
        client = openai.OpenAI(base_url=model.base_url, api_key=model.api_key, max_retries=0)
        plain = client.chat.completions.create(
            model=model.model, messages=[{"role": "user", "content": "m00001 hi"}]
        )
        assert plain.choices[0].message.content == "echo: m00001 hi"
        assert plain.usage is not None and plain.usage.total_tokens > 0
        stream = client.chat.completions.create(
            model=model.model,
            messages=[{"role": "user", "content": "m00002 kit:long=300"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces) == answer_for([user("m00002 kit:long=300")]).text
        assert len(pieces) > 2
        assert [m.id for m in client.models.list()] == [model.model]
        assert [r.stream for r in model.requests] == [False, True]
        assert model.requests[0].last_user_text == "m00001 hi"
        assert model.asked(LONG_LINE) == set()
        wrong = openai.OpenAI(base_url=model.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()


# -- the tally --------------------------------------------------------------------------

DM = Place("dm-1")
OTHER_DM = Place("dm-2")
ROOM = Place("room")


def dm(token: str, place: Place = DM) -> Said:
    return Said(token, MessageRef(f"id-{token}", place, f"sender-{place.conversation}"))


def in_room(token: str, sender: str, *, mention: bool) -> Said:
    ref = MessageRef(f"id-{token}", ROOM, sender)
    return Said(token, ref, addressed=mention, in_group=True)


def echo(
    said: Said, place: Place | None = None, *, to_sender: bool = True, pings: bool = False
) -> Post:
    """The bot's answer to `said`: in a group, a reply to it."""
    reply_to = said.ref.id if said.in_group and to_sender else None
    return Post(place or said.ref.place, f"echo: {said.token}", reply_to, pings_everyone=pings)


def tally(
    said: list[Said],
    posts: list[Post],
    *,
    stored: list[str] | None = None,
    answers: list[str] | None = None,
    model: frozenset[str] = frozenset(),
    kills: int = 0,
    lost_allowed: int = 0,
    exit_code: int | None = 0,
) -> Tally:
    return Tally(
        channel="fake",
        scenario="unit",
        said=said,
        posts=posts,
        user_entries=Counter(stored if stored is not None else [s.token for s in said]),
        assistant_entries=Counter(answers if answers is not None else [s.token for s in said]),
        model_saw=model,
        kills=kills,
        lost_allowed=lost_allowed,
        exit_code=exit_code,
    )


def test_a_promise_kept_has_no_problems() -> None:
    a, b, c = dm("m00001"), dm("m00002"), dm("m00003", OTHER_DM)
    mention, chatter = (
        in_room("m00004", "ann", mention=True),
        in_room("m00005", "bob", mention=False),
    )
    said = [a, b, c, mention, chatter]
    counted = tally(
        said,
        [echo(a), echo(c), echo(b), echo(mention)],
        stored=["m00001", "m00002", "m00003", "m00004"],
    )
    assert counted.problems() == []
    assert counted.summary().startswith("KIT fake unit: sent=5 addressed=4 lost=0 ")


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("lost", "1 lost"),
        ("unanswered", "1 never answered"),
        ("stored twice", "1 stored twice"),
        ("turn twice", "answered by the model twice"),
        ("sent twice", "1 replies sent twice"),
        ("out of order", "answered out of order"),
        ("wrong place", "replies in the wrong place"),
        ("not to sender", "answer neither the message nor its sender"),
        ("bystander answered", "posts to people who never addressed the bot"),
        ("bystander replied to", "posts to people who never addressed the bot"),
        ("chatter stored", "unaddressed messages stored"),
        ("chatter to model", "unaddressed messages that reached the model"),
        ("ping", "1 posts ping everyone"),
        ("stray post", "posts that answer no message"),
        ("bad exit", "exited with 1"),
    ],
)
def test_each_broken_promise_is_found(case: str, expected: str) -> None:
    a, b = dm("m00001"), dm("m00002")
    mention, chatter = (
        in_room("m00003", "ann", mention=True),
        in_room("m00004", "bob", mention=False),
    )
    said = [a, b, mention, chatter]
    posts = [echo(a), echo(b), echo(mention)]
    stored = ["m00001", "m00002", "m00003"]
    answers = list(stored)
    model: frozenset[str] = frozenset(stored)
    exit_code = 0
    if case == "lost":
        posts, stored = [echo(b), echo(mention)], stored[1:]
    elif case == "unanswered":
        posts = [echo(b), echo(mention)]
    elif case == "stored twice":
        stored.append("m00002")
    elif case == "turn twice":
        answers.append("m00002")
    elif case == "sent twice":
        posts.append(echo(b))
    elif case == "out of order":
        posts = [echo(b), echo(a), echo(mention)]
    elif case == "wrong place":
        posts[1] = echo(b, OTHER_DM)
    elif case == "not to sender":
        posts[2] = echo(mention, to_sender=False)
    elif case == "bystander answered":
        posts.append(echo(chatter))
    elif case == "bystander replied to":
        posts.append(Post(ROOM, "please wait", reply_to=chatter.ref.id))
    elif case == "chatter stored":
        stored.append("m00004")
    elif case == "chatter to model":
        model = model | {"m00004"}
    elif case == "ping":
        posts[0] = echo(a, pings=True)
    elif case == "stray post":
        posts.append(Post(DM, "Something went wrong"))
    elif case == "bad exit":
        exit_code = 1
    counted = tally(said, posts, stored=stored, answers=answers, model=model, exit_code=exit_code)
    problems = counted.problems()
    # The broken part first (a notice to a bystander is a stray post as well).
    assert problems and expected in problems[0], problems
    assert len(problems) == 1 or case == "bystander replied to", problems


def test_kills_allow_one_extra_reply_per_message_and_conversation_each() -> None:
    a, b, c = dm("m00001"), dm("m00002"), dm("m00003", OTHER_DM)
    once_each = [echo(a), echo(a), echo(b), echo(c), echo(c)]
    assert tally([a, b, c], once_each, kills=1).problems() == []
    twice_in_one_dm = [echo(a), echo(a), echo(b), echo(b), echo(c)]
    problems = tally([a, b, c], twice_in_one_dm, kills=1).problems()
    assert len(problems) == 1 and "a conversation got 2 repeated replies in 1 kills" in problems[0]
    thrice = [echo(a), echo(a), echo(a), echo(b), echo(c)]
    problems = tally([a, b, c], thrice, kills=1).problems()
    assert "a message was answered 2 extra times in 1 kills" in problems[0]


def test_a_strangers_pairing_code_may_reply_to_their_message_but_not_answer_it() -> None:
    """A stranger wrote to the bot in a DM: a pairing code threaded under their message
    (as a mail is) tells a person who addressed the bot, no bystander. Echoing what they
    wrote still breaks the promise. (The kit counted the code as a post to a bystander,
    found by the email driver.)"""
    a = dm("m00001")
    stranger = Said("m00002", MessageRef("id-m00002", OTHER_DM, "stranger"), addressed=False)
    code = Post(OTHER_DM, "Your pairing code is QX7KD2PA", reply_to=stranger.ref.id)
    counted = tally([a, stranger], [echo(a), code], stored=["m00001"])
    assert counted.bystanders_told == []
    assert counted.problems() == [
        "1 posts that answer no message, e.g. ['Your pairing code is QX7KD2PA']"
    ]
    answered = tally([a, stranger], [echo(a), echo(stranger)], stored=["m00001"])
    assert answered.bystanders_told == ["answered m00002"]


def test_a_kill_repeats_at_most_the_replies_of_the_turns_running_at_once() -> None:
    """Nine conversations each answered once more after one kill: each within its own
    bound, yet more than the eight turns the gateway runs at once could have had on
    their way (the bound the kill tests of tests/test_kill_delivery.py hold)."""
    said = [dm(f"m{n:05d}", Place(f"dm-{n}")) for n in range(1, 10)]
    posts = [post for s in said for post in (echo(s), echo(s))]
    assert tally(said[:8], posts[:16], kills=1).problems() == []
    problems = tally(said, posts, kills=1).problems()
    assert problems == [
        "9 repeated replies in 1 kills (at most 8 per kill: the replies of the turns "
        "running at once)"
    ]


def test_a_platform_that_loses_messages_when_cut_is_allowed_that_many_and_no_more() -> None:
    """`Requirements.lost_when_cut`: a platform that hands a killed gateway's request a
    message it cannot hand over again (signal-cli's `receive`) may lose that many per kill
    or cut; one more is a broken promise."""
    a, b, c = dm("m00001"), dm("m00002"), dm("m00003", OTHER_DM)
    one_lost = tally([a, b, c], [echo(a), echo(c)], stored=["m00001", "m00003"], kills=1,
                     lost_allowed=1)  # fmt: skip
    assert one_lost.problems() == []
    two_lost = tally([a, b, c], [echo(a)], stored=["m00001"], kills=1, lost_allowed=1)
    problems = two_lost.problems()
    assert len(problems) == 1 and "2 lost" in problems[0] and "1 allowed" in problems[0]
    assert tally([a, b, c], [echo(a), echo(c)], stored=["m00001", "m00003"]).problems()
    assert Requirements().lost_when_cut == 0


def test_a_post_answers_the_last_token_it_echoes() -> None:
    group = Post(ROOM, 'echo: [from "Ann"]\n[in reply to "Bot": "echo: m00001"]\nm00002')
    assert answered_token(group) == "m00002"
    long = Post(DM, "echo: m00003 kit:long=900\n\nL00001 is line 1")
    assert answered_token(long) == "m00003"
    assert answered_token(Post(DM, "Your pairing code is 4821 (m00004 is not echoed)")) is None


# -- requirements -----------------------------------------------------------------------


def test_requirements_name_what_a_platform_lacks() -> None:
    dms_only = Requirements()
    assert dms_only.lacking(("catch_up", "groups", "threads")) == ["groups", "threads"]
    assert Requirements(groups=True, threads=True).lacking(("groups", "threads")) == []
    with pytest.raises(ValueError, match="no such requirement: group"):
        dms_only.lacking(("group",))
    with pytest.raises(ValueError, match="no such requirement"):
        needs("catchup")


def test_the_suite_exports_every_scenario_it_defines() -> None:
    defined = {name for name in vars(suite) if name.startswith("test_")}
    assert set(suite.__all__) == defined


def test_the_sdk_page_tells_what_every_scenario_does() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "channel-sdk.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", page, re.MULTILINE))
    missing = {name.removeprefix("test_") for name in suite.__all__} - rows
    assert not missing, f"docs/channel-sdk.md's scenario table lacks {sorted(missing)}"


# -- a scenario can fail ------------------------------------------------------------------


class LosesAReply(TelegramDriver):
    """The platform loses the bot's second post."""

    def bot_posts(self) -> list[Post]:
        posts = super().bot_posts()
        return posts[:1] + posts[2:]


class PingsEveryone(TelegramDriver):
    """A platform where ``@everyone`` in a post pings everyone, and a channel that sends
    it as it is (Telegram's channel has no reason to defuse it)."""

    requirements = Requirements(groups=True, mentions=True, mass_pings=True)

    def ping_everyone_text(self) -> str:
        return "@everyone"

    def bot_posts(self) -> list[Post]:
        return [
            Post(p.place, p.text, p.reply_to, p.mentions, "@everyone" in p.text)
            for p in super().bot_posts()
        ]


class ThreadPerMention(TelegramDriver):
    """A platform where a mention in a group opens a thread of its own, where its answers
    go (Slack, with `reply_mode = "thread"`), played on Telegram: each group message is in
    a place named after it, and so is each post that answers it (or its edit)."""

    requirements = Requirements(groups=True, mentions=True, edits=True)

    def __init__(self) -> None:
        super().__init__()
        self._places: dict[str, Place] = {}  # a message's token: its place

    def _own_place(self, ref: MessageRef, text: str, place: Place | None = None) -> MessageRef:
        if ref.place != Place(str(GROUP)):
            return ref
        place = place or Place(str(GROUP), ref.id)
        self._places.update(dict.fromkeys(TOKEN.findall(text), place))
        return MessageRef(ref.id, place, ref.sender, ref.event)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        return self._own_place(super().group_message(person, text, mention=mention), text)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        return self._own_place(super().edit(ref, text), text, ref.place)

    def bot_posts(self) -> list[Post]:
        posts = []
        for post in super().bot_posts():
            place = self._places.get(answered_token(post) or "")
            if post.place == Place(str(GROUP)) and place is not None:
                post = Post(place, post.text, post.reply_to, post.mentions)
            posts.append(post)
        return posts


@pytest.fixture
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    driver: ChannelDriver = request.param()
    return driver


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A lost answer is given up on after 2 s without posts, not 10."""
    monkeypatch.setattr(kit_module, "STALL", 2.0)
    yield


@pytest.mark.conformance
@pytest.mark.parametrize("channel_driver", [LosesAReply], indirect=True)
def test_a_lost_reply_fails_one_reply_per_message(kit: Kit, quick: None) -> None:
    with pytest.raises(AssertionError, match="1 never answered") as failed:
        suite.test_one_reply_per_direct_message(kit)
    assert "every gateway's log and the platform's record" in str(failed.value)


@pytest.mark.conformance
@pytest.mark.parametrize("channel_driver", [PingsEveryone], indirect=True)
def test_a_reply_that_pings_everyone_fails(kit: Kit, quick: None) -> None:
    with pytest.raises(AssertionError, match="2 posts ping everyone"):
        suite.test_no_reply_pings_everyone(kit)


@pytest.mark.conformance
@pytest.mark.parametrize("channel_driver", [ThreadPerMention], indirect=True)
def test_an_edit_is_judged_in_its_place_when_the_next_answer_goes_elsewhere(kit: Kit) -> None:
    """The edit scenario counts what the edited mention got in its own place, also where
    the next mention is answered in a thread of its own (it failed Slack's driver: the
    edit's answer was taken for the next message's)."""
    suite.test_edit_is_handled_once(kit)
