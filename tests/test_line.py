"""The LINE channel: webhook events as messages (pure), the signature, and replies against
the fake LINE Platform: the reply token while fresh, a push with its retry key after,
each failure by name (an invalid token, the monthly limit, a rate limit, LINE away)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from channels.line.channel import (
    LineChannel,
    LineRefused,
    Pacing,
    retry_key,
    signature_ok,
)
from channels.line.settings import LineSettings
from channels.line.translate import (
    Inbound,
    Notice,
    ReplyContext,
    Skipped,
    translate_event,
    translate_request,
)
from gateway.channel import DeliveryFailed
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from tests.fakes.line_server import MONTHLY_LIMIT, RATE_LIMITED, FakeLine, sign

pytestmark = pytest.mark.anyio

BOT = "U" + "b" * 32
FAST = Pacing(reply_deadline=1.5, backoff=0.05, max_backoff=0.2, loading_grace=0.05)


def event(source: dict[str, Any], message: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "type": "message",
        "mode": "active",
        "timestamp": 1_700_000_000_000,
        "webhookEventId": "01H0000000000000000000000",
        "deliveryContext": {"isRedelivery": False},
        "replyToken": "token-1",
        "source": source,
        "message": {"id": "100", "quoteToken": "q-1", **message},
        **extra,
    }


def inbound(item: object) -> InboundMessage:
    assert isinstance(item, Inbound), item
    return item.message


# -- translation -------------------------------------------------------------------------


def test_a_one_on_one_text_is_keyed_by_the_user_and_carries_its_reply_context() -> None:
    user = "U" + "1" * 32
    message = inbound(
        translate_event(
            event({"type": "user", "userId": user}, {"type": "text", "text": "hi"}),
            bot_user_id=BOT,
            received_at=123.0,
        )
    )
    assert message.session_key == f"line:{user}"
    assert (message.text, message.sender_id, message.message_id) == ("hi", user, "100")
    assert message.metadata[META_IS_GROUP] is False
    assert message.metadata["sent_at"] == 1_700_000_000.0
    context = ReplyContext.from_metadata(message.metadata)
    assert context == ReplyContext("token-1", 123.0, "q-1")
    # The reply carries it, so a reply sent from the outbox after a restart has it too.
    assert ReplyContext.from_metadata(reply_for(message, "answer").metadata) == context


def test_group_and_room_keys_and_mentions() -> None:
    user = "U" + "2" * 32
    group = {"type": "group", "groupId": "C" + "3" * 32, "userId": user}
    mention = {"mentionees": [{"index": 0, "length": 4, "type": "user", "isSelf": True}]}
    said = inbound(
        translate_event(
            event(group, {"type": "text", "text": "@Bot, what time?", "mention": mention}),
            bot_user_id=BOT,
            received_at=1.0,
        )
    )
    assert said.session_key == "line:group:C" + "3" * 32
    assert said.text == "what time?"
    assert said.metadata[META_IS_GROUP] is True and said.metadata[META_MENTIONED] is True
    other = {"mentionees": [{"index": 0, "length": 4, "type": "user", "userId": "U" + "9" * 32}]}
    chatter = inbound(
        translate_event(
            event(group, {"type": "text", "text": "@Ann hi", "mention": other}),
            bot_user_id=BOT,
            received_at=1.0,
        )
    )
    assert chatter.text == "@Ann hi" and chatter.metadata[META_MENTIONED] is False
    everyone = {"mentionees": [{"index": 0, "length": 4, "type": "all"}]}
    assert (
        inbound(
            translate_event(
                event(group, {"type": "text", "text": "@All hi", "mention": everyone}),
                bot_user_id=BOT,
                received_at=1.0,
            )
        ).metadata[META_MENTIONED]
        is False
    )
    room = {"type": "room", "roomId": "R" + "4" * 32, "userId": user}
    quoting = inbound(
        translate_event(
            event(room, {"type": "text", "text": "and?", "quotedMessageId": "555"}),
            bot_user_id=BOT,
            received_at=1.0,
            sent_by_bot={"555"}.__contains__,
        )
    )
    assert quoting.session_key == "line:room:R" + "4" * 32
    assert quoting.metadata[META_REPLY_TO_BOT] is True


def test_media_stickers_and_what_is_skipped() -> None:
    user = {"type": "user", "userId": "U" + "5" * 32}
    image = inbound(
        translate_event(
            event(user, {"type": "image", "contentProvider": {"type": "line"}}),
            bot_user_id=BOT,
            received_at=1.0,
        )
    )
    assert [(a.kind, a.file_id) for a in image.attachments] == [("image", "100")]
    audio = inbound(
        translate_event(
            event(user, {"type": "audio", "duration": 1000}), bot_user_id=BOT, received_at=1.0
        )
    )
    assert audio.attachments[0].kind == "voice"
    pdf = inbound(
        translate_event(
            event(user, {"type": "file", "fileName": "plan.pdf", "fileSize": 10}),
            bot_user_id=BOT,
            received_at=1.0,
        )
    )
    assert (pdf.attachments[0].kind, pdf.attachments[0].mime_type) == (
        "document",
        "application/pdf",
    )
    sticker = inbound(
        translate_event(
            event(user, {"type": "sticker", "keywords": ["happy", "cat"]}),
            bot_user_id=BOT,
            received_at=1.0,
        )
    )
    assert sticker.text == "[The user sent a sticker: happy, cat]"
    video = translate_event(event(user, {"type": "video"}), bot_user_id=BOT, received_at=1.0)
    assert isinstance(video, Notice) and "video" in video.text
    in_group = {"type": "group", "groupId": "C" + "6" * 32, "userId": "U" + "5" * 32}
    skipped = translate_event(event(in_group, {"type": "video"}), bot_user_id=BOT, received_at=1)
    assert isinstance(skipped, Skipped)
    standby = event(user, {"type": "text", "text": "x"}, mode="standby")
    assert isinstance(translate_event(standby, bot_user_id=BOT, received_at=1), Skipped)
    follow = {"type": "follow", "mode": "active", "source": user, "replyToken": "t"}
    assert isinstance(translate_event(follow, bot_user_id=BOT, received_at=1), Skipped)
    assert translate_request({"destination": BOT, "events": []}, bot_user_id=BOT) == []


def test_the_signature_is_the_base64_hmac_of_the_exact_body() -> None:
    body = json.dumps({"destination": BOT, "events": []}).encode()
    assert signature_ok("secret", body, sign("secret", body))
    assert not signature_ok("secret", body, sign("other", body))
    assert not signature_ok("secret", body + b" ", sign("secret", body))
    assert not signature_ok("secret", body, "")


def test_a_reply_has_the_same_retry_keys_in_every_process() -> None:
    reply = OutboundMessage("line", "U1", "hello", "line:U1", reply_to="100")
    assert retry_key(reply, 0) == retry_key(reply, 0) != retry_key(reply, 5)
    assert retry_key(OutboundMessage("line", "U1", "other", "line:U1", reply_to="100"), 0) != (
        retry_key(reply, 0)
    )
    assert retry_key(OutboundMessage("line", "U1", "hello", "line:U1"), 0) is None


# -- replies against the fake ---------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeLine]:
    async with FakeLine() as server:
        yield server


def make_channel(fake: FakeLine, **settings: Any) -> LineChannel:
    section = LineSettings(enabled=True, api_url=fake.url, data_api_url=fake.url, **settings)
    return LineChannel(section, token=fake.token, channel_secret=fake.channel_secret, pacing=FAST)


def received(fake: FakeLine, user: str, text: str = "question", **kwargs: Any) -> InboundMessage:
    payload = fake.text_message(user, text, **kwargs)
    [item] = translate_request(payload, bot_user_id=fake.bot_user_id)
    return inbound(item)


async def test_a_fresh_reply_token_answers_for_free_quoting_in_groups(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    channel = make_channel(fake)
    await channel.send(reply_for(received(fake, ann), "in private"))
    message = received(fake, ann, group=group, mention=True)
    await channel.send(reply_for(message, "in the group"))
    private, public = fake.sent
    assert (private.how, private.chat, private.quoted) == ("reply", ann, None)
    assert (public.how, public.chat, public.quoted) == ("reply", group, message.message_id)
    assert fake.usage == 0 and channel.stats.sent["reply"] == 2
    await channel.api.aclose()


async def test_an_expired_token_is_pushed_once_whatever_the_resends(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    message = received(fake, ann)
    reply = reply_for(message, "late answer")
    late = make_channel(fake, reply_token_seconds=0.001)
    await anyio.sleep(0.01)
    await late.send(reply)
    # A crash after the push, before the mark: the next process sends it again.
    again = make_channel(fake, reply_token_seconds=0.001)
    await again.send(reply)
    assert fake.texts_to(ann) == ["late answer"] and fake.usage == 1
    [first, second] = [c for c in fake.calls if c.method == "POST push"]
    assert (first.status, second.status) == (200, 409)
    assert late.stats.sent["push"] == 1 and late.stats.expired_tokens == 1
    for channel in (late, again):
        await channel.api.aclose()


async def test_an_invalid_reply_token_is_pushed_instead(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann, fake.add_user("Bob")])
    message = received(fake, ann, group=group)
    fake.clock_offset = fake.reply_token_ttl + 1  # LINE's minute is up, ours is not
    channel = make_channel(fake)
    await channel.send(reply_for(message, "pushed"))
    [sent] = fake.sent
    assert (sent.how, sent.chat, sent.quoted) == ("push", group, message.message_id)
    assert fake.usage == 2  # a push to a group counts every member
    await channel.api.aclose()


async def test_the_monthly_limit_gives_the_reply_up_and_lists_it(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    fake.quota = 0
    channel = make_channel(fake, reply_token_seconds=0.001)
    message = received(fake, ann)
    await anyio.sleep(0.01)
    with pytest.raises(LineRefused, match="used up"):
        await channel.send(reply_for(message, "no quota"))
    assert fake.sent == []
    assert channel.stats.refused["monthly_limit"] == 1
    [given_up] = await channel.undeliverable()
    assert given_up.session_key == message.session_key and MONTHLY_LIMIT in given_up.reason
    # The reply token is free: a person who writes again is answered.
    await make_channel(fake).send(reply_for(received(fake, ann), "free"))
    assert fake.texts_to(ann) == ["free"]
    await channel.api.aclose()


async def test_a_rate_limit_is_waited_out(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    fake.fail_next(429, RATE_LIMITED, 2)
    channel = make_channel(fake)
    await channel.send(reply_for(received(fake, ann), "patient"))
    assert fake.texts_to(ann) == ["patient"]
    await channel.api.aclose()


async def test_line_away_is_delivery_failed_and_goes_on_from_the_part_that_failed(
    fake: FakeLine,
) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    long = "\n\n".join(f"part {n} " + "x" * 4900 for n in range(7))  # 7 messages: 5 + 2
    reply = reply_for(received(fake, ann), long)
    fake.fail_next(503, "Service unavailable", 100, only="push")
    with pytest.raises(DeliveryFailed) as failed:
        await channel.send(reply)
    assert failed.value.sent == 5
    assert [s.how for s in fake.sent] == ["reply"] * 5
    fake.heal()  # LINE is back
    await channel.send(reply)
    texts = fake.texts_to(ann)
    assert [t.split(" ", 2)[1] for t in texts] == [str(n) for n in range(7)]
    assert [s.how for s in fake.sent] == ["reply"] * 5 + ["push"] * 2
    await channel.api.aclose()


async def test_a_reply_that_may_have_gone_out_is_not_sent_again(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake)
    fake.fail_next(500, "Internal server error", processed=True)
    with pytest.raises(LineRefused, match="may or may not"):
        await channel.send(reply_for(received(fake, ann), "once"))
    assert fake.texts_to(ann) == ["once"]
    assert [c.method for c in fake.calls] == ["POST reply"]
    await channel.api.aclose()


async def test_names_and_files(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    channel = make_channel(fake)
    enriched = await channel.enrich_for_turn(received(fake, ann, group=group))
    assert enriched.metadata[META_SENDER_NAME] == "Ann"
    message_id = fake.add_content(b"image bytes", "image/jpeg")
    payload = fake.message_event(
        ann, {"type": "image", "id": message_id, "contentProvider": {"type": "line"}}
    )
    [item] = translate_request(payload, bot_user_id=fake.bot_user_id)
    [attachment] = inbound(item).attachments
    assert await channel.fetch_file(attachment, max_bytes=100) == b"image bytes"
    await channel.api.aclose()


# -- the webhook ---------------------------------------------------------------------------


@dataclass
class Ticket:
    taken: bool

    async def reply(self) -> OutboundMessage | None:
        return None


@dataclass
class Routes:
    app: web.Application = field(default_factory=web.Application)

    def mount(
        self,
        method: str,
        path: str,
        handler: Callable[[Any], Awaitable[Any]],
        *,
        require_ready: bool = True,
    ) -> None:
        self.app.router.add_route(method, path, handler)


async def test_the_webhook_answers_200_only_once_the_journal_has_it(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    channel = make_channel(fake, loading_animation=False)
    routes = Routes()
    channel.mount(routes)
    runner = web.AppRunner(routes.app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/line/webhook"
    submitted: list[InboundMessage] = []
    taking = [True]

    async def submit(message: InboundMessage) -> Ticket:
        submitted.append(message)
        return Ticket(taking[0])

    status, _ = await fake.post(url, fake.text_message(ann, "before the start"))
    assert status == 503 and submitted == []
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        forged = await fake.post(url, fake.text_message(ann, "forged"), secret="wrong")
        assert forged[0] == 401 and submitted == []
        assert (await fake.post(url, {"destination": fake.bot_user_id, "events": []}))[0] == 200
        assert (await fake.post(url, fake.text_message(ann, "kept")))[0] == 200
        taking[0] = False
        assert (await fake.post(url, fake.text_message(ann, "not kept")))[0] == 503
        async with aiohttp.ClientSession() as session:
            body = b"not json"
            headers = {"x-line-signature": sign(fake.channel_secret, body)}
            async with session.post(url, data=body, headers=headers) as r:
                assert r.status == 400
        tg.cancel_scope.cancel()
    assert [m.text for m in submitted] == ["kept", "not kept"]
    assert submitted[0].metadata[META_REPLY_CONTEXT]["reply_token"]
    assert channel.bot_user_id == fake.bot_user_id
    await runner.cleanup()


async def test_a_refused_quote_never_costs_the_reply(fake: FakeLine) -> None:
    ann = fake.add_user("Ann")
    group = fake.add_group([ann])
    message = received(fake, ann, group=group, mention=True)
    context = {**message.metadata[META_REPLY_CONTEXT], "quote_token": "unsent-message"}
    reply = reply_for(message, "still answered")
    reply = OutboundMessage(**{**reply.to_dict(), "metadata": {META_REPLY_CONTEXT: context}})
    channel = make_channel(fake)
    await channel.send(reply)
    [sent] = fake.sent
    assert (sent.how, sent.text, sent.quoted) == ("reply", "still answered", None)
    await channel.api.aclose()
