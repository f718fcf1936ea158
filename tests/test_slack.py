"""The Slack adapter against the fake Slack, with the real bolt and slack-sdk: event
translation, replies (formatting, splitting, retries, never twice), streaming, tokens."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from pydantic import SecretStr

from channels.slack import (
    RetryPolicy,
    Skipped,
    SlackChannel,
    SlackCredentialsError,
    address_of,
    check_credentials,
    translate_event,
)
from channels.slack.settings import SlackSettings
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_REPLY_TO_BOT,
    META_SENT_AT,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from tests.fakes.slack_server import FakeSlack, _SlackError

pytestmark = pytest.mark.anyio

CHANNEL = "C0GENERAL01"
ALICE = "U0ALICE001"
BOT = "U0FAKEBOT01"
FAST = RetryPolicy(attempts=3, backoff=0.01, max_backoff=0.05, reply_deadline=10)
BUILDER = FakeSlack()  # event builders only; never started


# --------------------------------------------------------------------------- translation


def translate(body: dict[str, Any], reply_mode: str = "thread") -> InboundMessage | Skipped:
    return translate_event(body, bot_user_id=BOT, reply_mode=reply_mode)  # type: ignore[arg-type]


def test_a_top_level_mention_in_thread_mode_starts_its_thread_session() -> None:
    body = BUILDER.app_mention(CHANNEL, ALICE, "what's up?")
    msg = translate(body)
    assert isinstance(msg, InboundMessage)
    ts = body["event"]["ts"]
    assert msg.session_key == f"slack:{CHANNEL}:thread:{ts}"
    assert (msg.chat_id, msg.thread_id, msg.sender_id) == (CHANNEL, ts, ALICE)
    assert msg.text == "what's up?"  # the bot's mention is gone
    assert msg.message_id == body["event_id"]
    assert msg.metadata[META_IS_GROUP] is True and msg.metadata[META_MENTIONED] is True
    # A follow-up in that thread lands in the same session.
    follow_up = translate(BUILDER.app_mention(CHANNEL, ALICE, "and?", thread_ts=ts))
    assert isinstance(follow_up, InboundMessage) and follow_up.session_key == msg.session_key


def test_channel_mode_answers_top_level_mentions_in_the_channel() -> None:
    msg = translate(BUILDER.app_mention(CHANNEL, ALICE, "hi"), "channel")
    assert isinstance(msg, InboundMessage)
    assert msg.session_key == f"slack:{CHANNEL}" and msg.thread_id is None
    in_thread = translate(
        BUILDER.app_mention(CHANNEL, ALICE, "hi", thread_ts="1712345678.000100"), "channel"
    )
    assert isinstance(in_thread, InboundMessage)
    assert in_thread.session_key == f"slack:{CHANNEL}:thread:1712345678.000100"


def test_direct_messages_are_their_own_conversation() -> None:
    dm = translate(BUILDER.dm_message(ALICE, "hello &lt;3"))
    assert isinstance(dm, InboundMessage)
    assert dm.session_key == "slack:D0ALICE001" and dm.thread_id is None
    assert dm.text == "hello <3"
    assert dm.metadata[META_IS_GROUP] is False and dm.metadata[META_MENTIONED] is False
    threaded = translate(BUILDER.dm_message(ALICE, "more", thread_ts="1712345678.000100"))
    assert isinstance(threaded, InboundMessage)
    assert threaded.session_key == "slack:D0ALICE001:thread:1712345678.000100"


def test_a_mention_under_the_bots_message_counts_as_a_reply_to_it() -> None:
    own = BUILDER.bot_message(CHANNEL, "earlier answer")
    msg = translate(BUILDER.app_mention(CHANNEL, ALICE, "thanks", thread_ts=own["event"]["ts"]))
    assert isinstance(msg, InboundMessage) and msg.metadata[META_REPLY_TO_BOT] is True


def _unfurled() -> dict[str, Any]:
    return BUILDER.message_changed(
        BUILDER.dm_message(ALICE, "see https://x.org"), "see https://x.org"
    )


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (BUILDER.bot_message(CHANNEL, "my own reply"), "bot"),
        (BUILDER.bot_message("D0ALICE001", "another bot", bot_id="B0OTHER001"), "subtype"),
        (_unfurled(), "unfurl"),
        (BUILDER.message_changed(BUILDER.channel_message(CHANNEL, ALICE, "a"), "b"), "only"),
        (BUILDER.message_changed(BUILDER.bot_message("D0ALICE001", "streamed"), "more"), "bot"),
        (BUILDER.channel_message(CHANNEL, ALICE, "chatter"), "mentions only"),
        (BUILDER.app_mention("D0ALICE001", ALICE, "hi"), "message.im"),
        (BUILDER.app_mention(CHANNEL, ALICE, ""), "no text"),
        (BUILDER.dm_message(BOT, "me, myself"), "own message"),
        (BUILDER.event_callback({"type": "reaction_added", "channel": CHANNEL}), "not handled"),
    ],
)
def test_what_is_not_answered(body: dict[str, Any], reason: str) -> None:
    skipped = translate(body)
    assert isinstance(skipped, Skipped) and reason in skipped.reason


def test_an_edit_in_a_dm_names_the_message_it_changes() -> None:
    original = BUILDER.dm_message(ALICE, "whats 2+3")
    first = translate(original)
    edit = translate(BUILDER.message_changed(original, "what's 2+2"))
    assert isinstance(first, InboundMessage) and isinstance(edit, InboundMessage)
    assert edit.text == "what's 2+2" and edit.sender_id == ALICE
    assert edit.session_key == first.session_key == "slack:D0ALICE001"
    # Its own id (the event's, for dedupe); it names the original as the person sees it.
    assert edit.message_id != first.message_id
    assert edit.metadata[META_EDIT_OF] == first.metadata[META_POST_ID]
    assert edit.metadata[META_EDIT_OF] == f"D0ALICE001:{original['event']['ts']}"
    assert edit.metadata[META_SENT_AT] > first.metadata[META_SENT_AT] > 0


def test_an_edited_mention_is_an_edit_of_it() -> None:
    """Slack sends an edited mention again as an `app_mention` with `edited` and a fresh
    event_id: it is an edit of the mention, in the mention's conversation (it was taken
    for a new mention, and the edited question was answered beside the original)."""
    original = BUILDER.app_mention(CHANNEL, ALICE, "whats 2+3")
    first = translate(original)
    edit = translate(BUILDER.edited_mention(original, "what's 2+2"))
    assert isinstance(first, InboundMessage) and isinstance(edit, InboundMessage)
    assert edit.text == "what's 2+2" and edit.session_key == first.session_key
    assert edit.message_id != first.message_id
    assert edit.metadata[META_EDIT_OF] == first.metadata[META_POST_ID]
    assert edit.metadata[META_SENT_AT] > first.metadata[META_SENT_AT] > 0
    assert META_EDIT_OF not in first.metadata


def test_replies_are_addressed_by_chat_and_thread() -> None:
    def out(chat_id: str, thread_id: str | None = None) -> OutboundMessage:
        return OutboundMessage("slack", chat_id, "x", "slack:x", thread_id=thread_id)

    assert address_of(out(CHANNEL)) == (CHANNEL, None)
    assert address_of(out(CHANNEL, "17.1")) == (CHANNEL, "17.1")
    # A heartbeat's deliver_to "slack:C1:thread:17.2" arrives as that chat id.
    assert address_of(out(f"{CHANNEL}:thread:17.2")) == (CHANNEL, "17.2")


# --------------------------------------------------------------------------- tokens


@pytest.mark.parametrize(
    ("mode", "tokens", "says"),
    [
        ("socket", {"bot_token": ""}, "BOT_TOKEN"),
        ("socket", {"bot_token": "xapp-1-x"}, "app-level token"),
        ("socket", {"bot_token": "xoxb-1"}, "APP_TOKEN"),
        ("socket", {"bot_token": "xoxb-1", "app_token": "xoxb-2"}, "xapp-"),
        ("http", {"bot_token": "xoxb-1"}, "SIGNING_SECRET"),
    ],
)
def test_unusable_tokens_are_config_errors(mode: str, tokens: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        SlackChannel(SlackSettings(mode=mode), **tokens)  # type: ignore[arg-type]


def test_from_settings_takes_the_tokens_from_the_secrets() -> None:
    settings = SlackSettings(bot_token=SecretStr("xoxb-1"), app_token=SecretStr("xapp-1-x"))
    assert SlackChannel.from_settings(settings).mode == "socket"
    with pytest.raises(ConfigError, match="APP_TOKEN"):
        SlackChannel.from_settings(SlackSettings(bot_token=SecretStr("xoxb-1")))


async def test_check_credentials(fake: FakeSlack) -> None:
    settings = SlackSettings(base_url=fake.api_url)
    said = await check_credentials(settings, fake.bot_token, app_token=fake.app_token)
    assert "U0FAKEBOT01" in said and "Fake Workspace" in said and "Socket Mode ok" in said
    with pytest.raises(SlackCredentialsError, match="BOT_TOKEN"):
        await check_credentials(settings, "xoxb-wrong")
    with pytest.raises(SlackCredentialsError, match="xoxb"):
        await check_credentials(settings, fake.app_token)
    with pytest.raises(SlackCredentialsError, match="APP_TOKEN"):
        await check_credentials(settings, fake.bot_token, app_token="xapp-wrong")
    with pytest.raises(SlackCredentialsError, match="cannot reach"):
        await check_credentials(SlackSettings(base_url="http://127.0.0.1:9/api/"), "xoxb-1")


# --------------------------------------------------------------------------- fakes


@pytest.fixture
async def fake() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as server:
        yield server


class FakeSlackWithHistory(FakeSlack):
    """The fake plus conversations.history/replies (the adapter reads them back after
    an ambiguous failure) and a scripted "posted, but answered internal_error"."""

    def __init__(self) -> None:
        super().__init__()
        self.post_then_fail = 0
        post = self._methods["chat.postMessage"][1]

        async def post_maybe_failing(params: dict[str, Any]) -> dict[str, Any]:
            answer = await post(params)
            if self.post_then_fail:
                self.post_then_fail -= 1
                raise _SlackError("internal_error", 500)
            return answer

        self._methods["chat.postMessage"] = ("bot", post_maybe_failing)
        self._methods["conversations.history"] = ("bot", self._history)
        self._methods["conversations.replies"] = ("bot", self._replies)

    def stored(self, channel: str) -> list[dict[str, Any]]:
        with self._lock:
            found = [m for (c, _), m in self._messages.items() if c == channel]
        return sorted(found, key=lambda m: float(m["ts"]))

    async def _history(self, params: dict[str, Any]) -> dict[str, Any]:
        oldest = float(params.get("oldest") or 0)
        messages = [
            m
            for m in self.stored(str(params["channel"]))
            if float(m["ts"]) >= oldest and m.get("thread_ts") in (None, m["ts"])
        ]
        return {"messages": messages[::-1], "has_more": False}

    async def _replies(self, params: dict[str, Any]) -> dict[str, Any]:
        root, oldest = str(params["ts"]), float(params.get("oldest") or 0)
        messages = [
            m
            for m in self.stored(str(params["channel"]))
            if (m["ts"] == root or m.get("thread_ts") == root) and float(m["ts"]) >= oldest
        ]
        return {"messages": messages, "has_more": False}


def channel_for(fake: FakeSlack, *, part_chars: int = 3_500, **settings: Any) -> SlackChannel:
    return SlackChannel(
        SlackSettings(base_url=fake.api_url, **settings),
        bot_token=fake.bot_token,
        app_token=fake.app_token,
        signing_secret=fake.signing_secret,
        retry=FAST,
        part_chars=part_chars,
        stream_interval=0.05,
    )


def reply(text: str, chat_id: str = CHANNEL, thread_id: str | None = None) -> OutboundMessage:
    return OutboundMessage(
        "slack", chat_id, text, f"slack:{chat_id}", reply_to="Ev1", thread_id=thread_id
    )


class Recorder:
    """A stand-in for the dispatcher's submit."""

    def __init__(self, taken: bool = True) -> None:
        self.messages: list[InboundMessage] = []
        self.taken = taken

    async def __call__(self, message: InboundMessage) -> Recorder:
        self.messages.append(message)
        return self

    async def reply(self) -> None:
        return None


# --------------------------------------------------------------------------- intake


async def test_socket_mode_submits_acks_and_closes_on_cancel(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    recorder = Recorder()
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, recorder)
        with anyio.fail_after(5):
            await fake.wait_for_socket()
        assert channel.live and channel.identity is not None
        mention = fake.app_mention(CHANNEL, ALICE, "hi <@U0BOB01|bob>")
        envelope = await fake.socket_event(mention)
        own = await fake.socket_event(fake.bot_message(CHANNEL, "my reply"))
        with anyio.fail_after(5):
            ack = await fake.wait_for_ack(envelope["envelope_id"])
            await fake.wait_for_ack(own["envelope_id"])
        tg.cancel_scope.cancel()
    assert ack.latency is not None and ack.latency < 1
    [msg] = recorder.messages
    assert msg.text == "hi @bob" and msg.message_id == mention["event_id"]
    assert not channel.live
    with anyio.fail_after(5):
        while fake.open_sockets:  # noqa: ASYNC110 (the fake sees the close a moment later)
            await anyio.sleep(0.01)


async def test_an_event_the_gateway_did_not_keep_is_not_acknowledged(fake: FakeSlack) -> None:
    """Journal before confirm: an event whose message was not taken (the journal
    failed), or that arrives while the gateway drains, gets no ack, so Slack sends it
    again; a taken one is acked."""
    channel = channel_for(fake)
    refusing = Recorder(taken=False)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, refusing)
        with anyio.fail_after(5):
            await fake.wait_for_socket()
        kept_out = await fake.socket_event(fake.app_mention(CHANNEL, ALICE, "not kept"))
        with anyio.fail_after(5):
            while not refusing.messages:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        refusing.taken = True
        taken = await fake.socket_event(fake.app_mention(CHANNEL, ALICE, "kept"))
        with anyio.fail_after(5):
            await fake.wait_for_ack(taken["envelope_id"])
        channel.pause_intake()
        paused = await fake.socket_event(fake.app_mention(CHANNEL, ALICE, "draining"))
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()
    acked = {ack.envelope_id for ack in fake.acks}
    assert taken["envelope_id"] in acked
    assert kept_out["envelope_id"] not in acked and paused["envelope_id"] not in acked
    assert [m.text for m in refusing.messages] == ["not kept", "kept"]


async def test_a_refused_bot_token_fails_run_with_what_to_fix(fake: FakeSlack) -> None:
    channel = SlackChannel(
        SlackSettings(base_url=fake.api_url), bot_token="xoxb-nope", app_token=fake.app_token
    )
    with pytest.raises(SlackCredentialsError, match="BOT_TOKEN"):
        await channel.run(Recorder())


# --------------------------------------------------------------------------- replies


async def test_a_reply_is_mrkdwn_in_its_thread(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    await channel.send(reply("**Done** — see [docs](https://x.io)", thread_id="1712345678.000100"))
    [post] = fake.calls_to("chat.postMessage")
    assert post.params == {
        "channel": CHANNEL,
        "text": "*Done* — see <https://x.io|docs>",
        "thread_ts": "1712345678.000100",
    }


async def test_a_long_reply_is_split_in_order(fake: FakeSlack) -> None:
    channel = channel_for(fake, part_chars=200)
    paragraphs = [f"Paragraph {i}: " + "words " * 20 for i in range(6)]
    await channel.send(reply("\n\n".join(paragraphs)))
    texts = [m["text"] for m in fake.posted_messages(CHANNEL)]
    assert len(texts) == 6 and all(len(t) <= 200 for t in texts)
    assert [t.split(":")[0] for t in texts] == [f"Paragraph {i}" for i in range(6)]


ROOT = BUILDER.channel_message(CHANNEL, "U0BOB00001", "plans for friday")


@pytest.mark.parametrize(
    ("body", "reply_mode", "named"),
    [
        # A thread someone else opened, the channel itself: several people talk there.
        (BUILDER.app_mention(CHANNEL, ALICE, "q", thread_ts=ROOT["event"]["ts"]), "thread", True),
        (BUILDER.app_mention(CHANNEL, ALICE, "q"), "channel", True),
        # Under the mention itself (the thread it opens), and in a DM: no need.
        (BUILDER.app_mention(CHANNEL, ALICE, "q"), "thread", False),
        (BUILDER.dm_message(ALICE, "q"), "thread", False),
    ],
)
async def test_a_reply_not_under_its_message_names_its_sender(
    fake: FakeSlack, body: dict[str, Any], reply_mode: str, named: bool
) -> None:
    """Slack has no reply to one message inside a conversation several people share: a
    reply posted there begins with a mention of whom it answers (found by the
    conformance kit: answers in a busy thread said nothing of whom they answered)."""
    channel = channel_for(fake, part_chars=60)
    inbound = translate(body, reply_mode)
    assert isinstance(inbound, InboundMessage)
    await channel.send(reply_for(inbound, "**Yes**: " + "a few words " * 10))
    texts = [m["text"] for m in fake.posted_messages()]
    first = texts[0].removeprefix(f"<@{ALICE}> ")
    assert len(texts) > 1 and first.startswith("*Yes*: a few words")
    assert (first != texts[0]) is named
    assert not any("<@" in text for text in texts[1:])


async def test_rate_limits_wait_for_retry_after(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    fake.fail_next("chat.postMessage", retry_after=1)
    fake.fail_next("chat.postMessage", retry_after=0, count=3)
    await channel.send(reply("patience"))
    calls = fake.calls_to("chat.postMessage")
    assert [c.status for c in calls] == [429, 429, 429, 429, 200]
    assert calls[1].timestamp - calls[0].timestamp >= 0.95  # Retry-After: 1 honoured
    assert [m["text"] for m in fake.posted_messages()] == ["patience"]


async def test_failures_slack_did_not_act_on_are_retried_with_backoff(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    fake.fail_next("chat.postMessage", "service_unavailable", status=503, count=2)
    await channel.send(reply("eventually"))
    assert [c.status for c in fake.calls_to("chat.postMessage")] == [503, 503, 200]
    assert [m["text"] for m in fake.posted_messages()] == ["eventually"]


async def test_retries_are_bounded_and_a_refusal_is_not_retried(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    fake.fail_next("chat.postMessage", "service_unavailable", status=503, count=10)
    with pytest.raises(DeliveryFailed):  # the dispatcher sends it again later
        await channel.send(reply("not yet"))
    assert len(fake.calls_to("chat.postMessage")) == FAST.attempts
    fake.reset()
    await channel.send(reply("nowhere", chat_id="C0NOTTHERE1:thread:17.1"))
    await channel.send(reply("x", chat_id="general"))
    errors = [c.error for c in fake.calls_to("chat.postMessage")]
    assert errors == ["invalid_thread_ts", "channel_not_found"]


async def test_a_long_retry_after_past_the_deadline_gives_up(fake: FakeSlack) -> None:
    channel = SlackChannel(
        SlackSettings(base_url=fake.api_url),
        bot_token=fake.bot_token,
        app_token=fake.app_token,
        retry=RetryPolicy(reply_deadline=0.5),
    )
    fake.fail_next("chat.postMessage", retry_after=30)
    started = time.monotonic()
    with pytest.raises(DeliveryFailed):  # rate limited past what the channel waits
        await channel.send(reply("too late"))
    assert time.monotonic() - started < 2 and fake.posted_messages() == []


async def test_a_reply_that_certainly_did_not_go_out_is_sent_again_from_its_failed_part(
    fake: FakeSlack,
) -> None:
    """Slack down (5xx it did not act on) or unreachable past the channel's retries:
    `DeliveryFailed`, so the dispatcher sends the reply again later instead of marking
    its message answered with the reply lost; sent again, it goes on from the part that
    failed. A refused part is still given up."""
    channel = channel_for(fake, part_chars=60)
    text = "\n\n".join(f"paragraph {n} " + "x" * 40 for n in range(4))
    post = fake._methods["chat.postMessage"][1]
    down = True

    async def down_after_the_first_part(params: dict[str, Any]) -> dict[str, Any]:
        if down and fake.posted_messages():
            raise _SlackError("service_unavailable", 503)
        return await post(params)

    fake._methods["chat.postMessage"] = ("bot", down_after_the_first_part)
    cut = reply(text)
    with pytest.raises(DeliveryFailed) as failed:
        await channel.send(cut)
    assert failed.value.sent == len(fake.posted_messages()) == 1
    assert len(fake.calls_to("chat.postMessage")) == 1 + FAST.attempts
    down = False
    await channel.send(cut)  # sent again: only what had not gone out
    assert [m["text"].split()[1] for m in fake.posted_messages()] == ["0", "1", "2", "3"]
    fake.reset()
    fake.fail_next("chat.postMessage", "channel_not_found")
    await channel.send(reply("gone"))  # refused: logged, never sent again
    assert fake.posted_messages() == []
    # Unreachable: the connection refused is certainly not a post either.
    away = SlackChannel(
        SlackSettings(base_url="http://127.0.0.1:9/api/"),
        bot_token="xoxb-1",
        app_token=fake.app_token,
        retry=FAST,
    )
    with pytest.raises(DeliveryFailed, match="not posted"):
        await away.send(reply("nobody home"))


async def test_a_maybe_posted_part_is_not_sent_twice_when_it_cannot_be_checked(
    fake: FakeSlack,
) -> None:
    channel = channel_for(fake, part_chars=40)
    fake.fail_next("chat.postMessage", "internal_error", status=500)
    await channel.send(reply("first part is here.\n\nsecond part is here."))
    # The fake has no conversations.history: the first part is not re-sent blindly,
    # the second still goes out.
    assert [c.status for c in fake.calls_to("chat.postMessage")] == [500, 200]
    assert [m["text"] for m in fake.posted_messages()] == ["second part is here."]


async def test_after_an_ambiguous_failure_the_conversation_is_read_back() -> None:
    fake = FakeSlackWithHistory()
    async with fake:
        channel = channel_for(fake)
        # Posted, but the answer was lost: found in the thread, not re-sent.
        fake.post_then_fail = 1
        await channel.send(reply("landed anyway", thread_id="1712345678.000100"))
        assert [m["text"] for m in fake.stored(CHANNEL)] == ["landed anyway"]
        assert [c.method for c in fake.calls][-1] == "conversations.replies"
        # Not posted: the read-back finds nothing, so it is sent again, once.
        fake.fail_next("chat.postMessage", "internal_error", status=500)
        await channel.send(reply("second try"))
        assert [m["text"] for m in fake.stored(CHANNEL)] == ["landed anyway", "second try"]
        assert "conversations.history" in [c.method for c in fake.calls]


# --------------------------------------------------------------------------- streaming


async def test_streaming_posts_once_edits_sparingly_and_send_finalizes(fake: FakeSlack) -> None:
    channel = channel_for(fake, streaming=True)
    inbound = InboundMessage("slack", CHANNEL, "q", message_id="Ev1", thread_kind="thread",
                             thread_id="1712345678.000100")  # fmt: skip
    started = time.monotonic()
    for i in range(40):
        await channel.stream_delta(inbound, f"word{i} ")
        await anyio.sleep(0.005)
    streamed_for = time.monotonic() - started
    await channel.send(reply("**final** answer", thread_id="1712345678.000100"))
    [post] = fake.calls_to("chat.postMessage")
    assert post.params["thread_ts"] == "1712345678.000100"
    updates = fake.calls_to("chat.update")
    # At most one edit per stream_interval (0.05 s) while streaming, plus the final one.
    assert 1 < len(updates) <= streamed_for / 0.05 + 2
    assert updates[-1].params == {
        "channel": CHANNEL,
        "ts": post.response["ts"],
        "text": "*final* answer",
    }
    assert fake.posted_messages()[-1]["text"] == "*final* answer"


async def test_a_streamed_long_reply_updates_the_first_part_and_posts_the_rest(
    fake: FakeSlack,
) -> None:
    channel = channel_for(fake, streaming=True, part_chars=100)
    inbound = InboundMessage("slack", CHANNEL, "q", message_id="Ev1")
    await channel.stream_delta(inbound, "start of it")
    final = "\n\n".join(f"part {i} " + "x" * 60 for i in range(3))
    await channel.send(reply(final))
    assert len(fake.calls_to("chat.postMessage")) == 3  # the streamed one + two more
    assert fake.calls_to("chat.update")[-1].params["text"].startswith("part 0")
    assert [m["text"][:6] for m in fake.posted_messages()] == [
        "start ", "part 0", "part 1", "part 2"
    ]  # fmt: skip


async def test_streaming_off_means_no_early_message(fake: FakeSlack) -> None:
    channel = channel_for(fake)
    await channel.stream_delta(InboundMessage("slack", CHANNEL, "q", message_id="Ev1"), "hi")
    assert fake.calls == []
