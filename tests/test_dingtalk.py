"""The DingTalk channel against the fake DingTalk (tests/fakes/dingtalk_server.py): a
callback acked only once the journal holds it; replies routed by their own message, never
by whichever message came last (QwenPaw #2414); no reply part posted twice (QwenPaw
#2421); an expired session webhook, a rate limit and an expired token handled by name.
The translation and the formatter's pure parts too."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import pytest

from channels.dingtalk.api import NoAnswer
from channels.dingtalk.channel import (
    DingTalkChannel,
    DingTalkSetupError,
    Pacing,
    PossiblySent,
    ack_frame,
    check_credentials,
)
from channels.dingtalk.format import split_parts, title_of
from channels.dingtalk.settings import DingTalkSettings
from channels.dingtalk.translate import ReplyContext, Skip, translate_callback
from gateway.channel import DeliveryFailed
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from tests.fakes.dingtalk_server import FakeDingTalk

FAST = Pacing(retry_window=2.0, retry_backoff=0.05, reconnect_min=0.1)


@dataclass
class Ticket:
    taken: bool

    async def reply(self) -> OutboundMessage | None:
        return None


@dataclass
class Journal:
    """A stand-in for the dispatcher: takes (or refuses) messages, optionally slowly."""

    take: bool = True
    delay: float = 0.0
    taken: list[InboundMessage] = field(default_factory=list)

    async def submit(self, message: InboundMessage) -> Ticket:
        await anyio.sleep(self.delay)
        if self.take:
            self.taken.append(message)
        return Ticket(self.take)


def settings_for(fake: FakeDingTalk, **extra: Any) -> DingTalkSettings:
    return DingTalkSettings(
        enabled=True,
        api_url=fake.url,
        client_id=fake.client_id,
        client_secret=fake.client_secret,
        dm_policy="open",
        group_policy="open",
        **extra,
    )


@asynccontextmanager
async def running(
    fake: FakeDingTalk, journal: Journal, **extra: Any
) -> AsyncIterator[DingTalkChannel]:
    channel = DingTalkChannel(
        settings_for(fake, **extra), client_secret=fake.client_secret, pacing=FAST
    )
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, journal.submit)
        yield channel
        tg.cancel_scope.cancel()


@pytest.fixture
async def fake() -> AsyncIterator[FakeDingTalk]:
    async with FakeDingTalk(retry_delays=(0.3, 0.3, 0.3), ack_timeout=1.0) as server:
        yield server


def callback(fake: FakeDingTalk, conversation: str, user: str, text: str) -> dict[str, Any]:
    data = fake.user_message(conversation, user, text)
    assert data is not None
    return data


# -- translation and format ------------------------------------------------------------


def test_a_one_to_one_message_becomes_an_inbound_message_with_its_reply_context() -> None:
    fake = FakeDingTalk()
    fake._port = 1  # only its callbacks' shape is used
    ann = fake.add_person("Ann")
    data = callback(fake, fake.dm(ann), ann, "hello")
    message = translate_callback(data)
    assert isinstance(message, InboundMessage)
    assert (message.session_key, message.sender_id, message.message_id) == (
        f"dingtalk:{data['conversationId']}",
        ann,
        data["msgId"],
    )
    assert message.text == "hello" and META_IS_GROUP not in message.metadata
    context = message.metadata[META_REPLY_CONTEXT]
    assert context["webhook"] == data["sessionWebhook"] and context["staff_id"] == ann
    assert context["expires_ms"] == data["sessionWebhookExpiredTime"]


def test_a_group_mention_is_marked_and_the_robots_own_message_skipped() -> None:
    fake = FakeDingTalk()
    fake._port = 1
    ann, group = fake.add_person("Ann"), fake.group("team")
    message = translate_callback(callback(fake, group, ann, "question"))
    assert isinstance(message, InboundMessage)
    assert message.metadata[META_IS_GROUP] and message.metadata[META_MENTIONED]
    assert message.text == "question"  # DingTalk's leading space after the cut @ is gone
    own = {**callback(fake, group, ann, "x"), "senderStaffId": "", "senderId": fake.bot_user_id}
    assert isinstance(translate_callback(own), Skip)
    picture = {**callback(fake, group, ann, "x"), "msgtype": "picture"}
    assert isinstance(translate_callback(picture), Skip)


def test_a_reply_context_for_another_conversation_is_ignored() -> None:
    context = {"conversation": "cidA", "group": False, "staff_id": "u1", "webhook": "w"}
    assert ReplyContext.from_metadata({META_REPLY_CONTEXT: context}, "cidA") is not None
    assert ReplyContext.from_metadata({META_REPLY_CONTEXT: context}, "cidB") is None


def test_parts_keep_all_of_the_text_in_order_within_the_limit() -> None:
    text = "\n".join(f"line {n:04d} " + "word " * 20 for n in range(200))
    parts = split_parts(text, 500)
    assert all(len(p) <= 500 for p in parts) and len(parts) > 10
    joined = " ".join(" ".join(parts).split())
    assert joined == " ".join(text.split())
    assert title_of("## Heading here\nbody") == "Heading here"
    assert len(title_of("x" * 100)) == 20


def test_the_ack_names_the_frame() -> None:
    ack = json.loads(ack_frame("m1"))
    assert ack["code"] == 200 and ack["headers"]["messageId"] == "m1"


# -- inbound: journal before confirm ---------------------------------------------------


@pytest.mark.anyio
async def test_a_callback_is_acked_only_once_the_journal_took_it(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    unacked_while_journaling: list[bool] = []

    class Watching(Journal):
        async def submit(self, message: InboundMessage) -> Ticket:
            await anyio.sleep(0.3)
            waiting = [f for c in fake._connections for f in c.pending.values()]
            unacked_while_journaling.append(bool(waiting) and not any(f.done() for f in waiting))
            return await super().submit(message)

    journal = Watching()
    async with running(fake, journal):
        data = callback(fake, fake.dm(ann), ann, "hello")
        delivery = await fake.deliver(data)
    assert delivery.delivered and unacked_while_journaling == [True]
    first = delivery.attempts[0]
    assert first.outcome == "acked"
    assert [m.text for m in journal.taken] == ["hello"]


@pytest.mark.anyio
async def test_a_callback_not_taken_is_left_to_dingtalk_which_pushes_it_again(
    fake: FakeDingTalk,
) -> None:
    ann = fake.add_person("Ann")
    journal = Journal(take=False)
    async with running(fake, journal):
        data = callback(fake, fake.dm(ann), ann, "hello")
        pushing = fake.deliver_soon(data)
        await anyio.sleep(0.5)
        assert not any(a.outcome == "acked" for a in fake.deliveries[0].attempts)
        journal.take = True
        delivery = await anyio.to_thread.run_sync(pushing.result)
        assert delivery.delivered and len(delivery.attempts) >= 2
        # Pushed once more after it was taken: acked at once, not submitted again.
        again = await fake.deliver(data)
        assert again.delivered
    assert len(journal.taken) == 1


@pytest.mark.anyio
async def test_a_draining_channel_acks_nothing(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    journal = Journal()
    async with running(fake, journal) as channel:
        channel.pause_intake()
        delivery = await fake.deliver(callback(fake, fake.dm(ann), ann, "late"))
    assert not delivery.delivered and journal.taken == []


@pytest.mark.anyio
async def test_a_ping_is_answered_and_a_disconnect_reconnects(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    journal = Journal()
    async with running(fake, journal):
        acks = await fake.system("ping")
        assert len(acks) == 1 and acks[0]["code"] == 200
        await fake.system("disconnect")
        delivery = await fake.deliver(callback(fake, fake.dm(ann), ann, "after"))
    assert delivery.delivered and [m.text for m in journal.taken] == ["after"]


@pytest.mark.anyio
async def test_a_refused_secret_stops_the_start_with_what_to_fix(fake: FakeDingTalk) -> None:
    channel = DingTalkChannel(settings_for(fake), client_secret="wrong", pacing=FAST)
    with pytest.raises(DingTalkSetupError, match="CLIENT_SECRET") as raised:
        await channel.run(Journal().submit)
    assert "wrong" not in str(raised.value)


# -- outbound --------------------------------------------------------------------------


async def take_all(
    fake: FakeDingTalk, journal: Journal, *items: tuple[str, str, str]
) -> list[InboundMessage]:
    for conversation, user, text in items:
        assert (await fake.deliver(callback(fake, conversation, user, text))).delivered
    return journal.taken[-len(items) :]


@pytest.mark.anyio
async def test_concurrent_replies_reach_their_own_sender_whatever_came_last(
    fake: FakeDingTalk,
) -> None:
    """QwenPaw #2414: a reply used the webhook of the latest message, so under load Ann's
    answer went to Bob. Here each reply carries its own target."""
    ann, bob = fake.add_person("Ann"), fake.add_person("Bob")
    group = fake.group("team")
    journal = Journal()
    async with running(fake, journal) as channel:
        messages = await take_all(
            fake,
            journal,
            (fake.dm(ann), ann, "from ann"),
            (fake.dm(bob), bob, "from bob"),
            (group, ann, "ann in group"),
            (group, bob, "bob in group"),
        )
        replies = [reply_for(m, f"echo: {m.text}") for m in messages]
        async with anyio.create_task_group() as tg:
            for reply in reversed(replies):  # the last message's reply goes first
                tg.start_soon(channel.send, reply)
    posts = {m.text.split("echo: ")[1]: m for m in fake.bot_messages()}
    assert posts["from ann"].conversation_id == fake.dm(ann)
    assert posts["from bob"].conversation_id == fake.dm(bob)
    assert posts["ann in group"].at_users == (ann,) and posts["bob in group"].at_users == (bob,)
    assert not any(m.at_all for m in fake.bot_messages())


@pytest.mark.anyio
async def test_a_reply_resent_after_a_failure_posts_each_part_once(fake: FakeDingTalk) -> None:
    """QwenPaw #2421: no outbound idempotency. A part DingTalk took is never posted again,
    neither by the resend of a reply cut short nor by a second send of a whole one."""
    ann = fake.add_person("Ann")
    journal = Journal()
    async with running(fake, journal, session_webhook=False, part_chars=200) as channel:
        (message,) = await take_all(fake, journal, (fake.dm(ann), ann, "long please"))
        text = "\n\n".join(f"paragraph {n} " + "word " * 30 for n in range(3))
        reply = reply_for(message, text)
        assert len(split_parts(text, 200)) == 3
        fake.fail_next(503, "ServiceUnavailable", count=1000)
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 0 and fake.bot_messages() == []
        fake.clear_faults()
        await channel.send(reply)
        await channel.send(reply)  # the dispatcher's replay of a reply posted whole
    texts = [m.text for m in fake.bot_messages()]
    assert texts == split_parts(text, 200)


@pytest.mark.anyio
async def test_a_failure_mid_reply_resumes_at_the_part_that_failed(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    journal = Journal()
    async with running(fake, journal, session_webhook=False, part_chars=200) as channel:
        (message,) = await take_all(fake, journal, (fake.dm(ann), ann, "long please"))
        text = "\n\n".join(f"paragraph {n} " + "word " * 30 for n in range(3))
        reply = reply_for(message, text)
        original = channel._require_api().robot_send
        calls = 0

        async def flaky(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                from channels.dingtalk.api import Refused

                raise Refused(503, "ServiceUnavailable", "down")
            return await original(*args, **kwargs)

        channel._require_api().robot_send = flaky  # type: ignore[method-assign]
        slow = replace(FAST, retry_window=0.0)
        channel.pacing = slow
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 1
        await channel.send(reply)
    assert [m.text for m in fake.bot_messages()] == split_parts(text, 200)


@pytest.mark.anyio
async def test_a_send_that_may_have_gone_out_is_never_repeated(fake: FakeDingTalk) -> None:
    channel = DingTalkChannel(settings_for(fake), client_secret=fake.client_secret, pacing=FAST)
    calls = 0

    async def no_answer() -> None:
        nonlocal calls
        calls += 1
        raise NoAnswer("read timeout")

    with pytest.raises(PossiblySent):
        await channel._patiently(no_answer)
    assert calls == 1
    assert not issubclass(PossiblySent, DeliveryFailed)  # the dispatcher does not resend


@pytest.mark.anyio
async def test_an_expired_session_webhook_falls_back_to_the_robot_api(fake: FakeDingTalk) -> None:
    ann, bob = fake.add_person("Ann"), fake.add_person("Bob")
    group = fake.group("team")
    journal = Journal()
    async with running(fake, journal) as channel:
        dm, in_group = await take_all(
            fake, journal, (fake.dm(ann), ann, "hello"), (group, bob, "question")
        )
        fake.expire_webhooks()  # the webhook refuses: errcode 300001
        await channel.send(reply_for(dm, "echo: hello"))
        stale = dict(in_group.metadata[META_REPLY_CONTEXT], expires_ms=1)  # past its time
        late = replace(in_group, metadata={**in_group.metadata, META_REPLY_CONTEXT: stale})
        await channel.send(reply_for(late, "echo: question"))
    posts = fake.bot_messages()
    assert [(m.conversation_id, m.via) for m in posts] == [(fake.dm(ann), "api"), (group, "api")]
    assert posts[1].text.startswith("Bob: ")  # the robot API cannot @: it names the sender
    assert channel.stats.webhook_fallbacks == 2
    webhook_calls = [c for c in fake.calls if c.method == "POST /webhook"]
    assert [c.code for c in webhook_calls] == ["300001"]  # the stale one was not even tried


@pytest.mark.anyio
async def test_an_expired_token_is_renewed_and_a_rate_limit_waited_out(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    journal = Journal()
    async with running(fake, journal, session_webhook=False) as channel:
        (message,) = await take_all(fake, journal, (fake.dm(ann), ann, "hello"))
        await channel.send(reply_for(message, "echo: one"))
        fake.expire_tokens()
        fake.fail_next(429, "Throttling.Api", count=1)
        await channel.send(reply_for(message, "echo: two"))
    assert [m.text for m in fake.bot_messages()] == ["echo: one", "echo: two"]
    codes = [c.code for c in fake.calls if "oToMessages" in c.method]
    assert codes == ["", "InvalidAuthentication", "Throttling.Api", ""]
    assert channel.stats.rate_limited == 1


@pytest.mark.anyio
async def test_a_busy_session_webhook_is_waited_out(fake: FakeDingTalk) -> None:
    ann = fake.add_person("Ann")
    fake.webhook_per_minute = 1
    journal = Journal()
    async with running(fake, journal) as channel:
        (message,) = await take_all(fake, journal, (fake.dm(ann), ann, "hello"))
        await channel.send(reply_for(message, "echo: one"))
        with pytest.raises(DeliveryFailed):  # 130101 for a minute: past the retry window
            await channel.send(reply_for(message, "echo: two"))
    assert [m.text for m in fake.bot_messages()] == ["echo: one"]
    assert channel.stats.rate_limited >= 1


@pytest.mark.anyio
async def test_doctor_says_whether_dingtalk_grants_the_app_a_token(fake: FakeDingTalk) -> None:
    assert fake.client_id in await check_credentials(settings_for(fake), fake.client_secret)
    with pytest.raises(DingTalkSetupError, match="CLIENT_SECRET") as raised:
        await check_credentials(settings_for(fake), "not-the-secret")
    assert "not-the-secret" not in str(raised.value)


@pytest.mark.anyio
async def test_a_long_group_reply_names_its_sender_in_every_part_within_the_limit(
    fake: FakeDingTalk,
) -> None:
    ann, group = fake.add_person("Ann"), fake.group("team")
    journal = Journal()
    async with running(fake, journal, part_chars=300) as channel:
        (message,) = await take_all(fake, journal, (group, ann, "long please"))
        text = "\n".join(f"line {n:03d} " + "word " * 8 for n in range(40))
        await channel.send(reply_for(message, text))
    posts = fake.bot_messages()
    assert len(posts) > 3
    assert all(len(p.text) <= 300 and p.text.startswith(f"@{ann} ") for p in posts)
    assert all(p.at_users == (ann,) and not p.at_all for p in posts)
    body = " ".join(p.text.removeprefix(f"@{ann} ") for p in posts)
    assert " ".join(body.split()) == " ".join(text.split())
