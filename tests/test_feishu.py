"""The Feishu / Lark channel: its pure parts (events translated, Markdown formatted, frames
encoded, callbacks opened) and the adapter against the fake Feishu
(tests/fakes/feishu_server.py): an event is answered only once it is journaled, the
webhook refuses what is not signed and encrypted, replies land in their place, a failed
reply goes on from its part without posting one twice."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.feishu import crypto
from channels.feishu.channel import (
    FEISHU_EVENTS_PATH,
    FeishuChannel,
    Pacing,
)
from channels.feishu.format import (
    defuse_mentions,
    feishu_parts,
    markdown_to_feishu,
    post_content,
    post_text,
)
from channels.feishu.frames import Frame
from channels.feishu.settings import FeishuSettings
from channels.feishu.translate import Skip, translate_event
from gateway.channel import DeliveryFailed
from gateway.media import MediaError
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_CONTEXT,
    META_REPLY_TO_BOT,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
    reply_for,
)
from tests.fakes.feishu_server import FakeFeishu, PbFrame, encrypt, make_frame

BOT = "ou_" + "b" * 32
ANN = "ou_" + "a" * 32


# -- translation -------------------------------------------------------------------------


def envelope(message: dict[str, Any], sender: str = ANN) -> dict[str, Any]:
    base = {
        "message_id": "om_1",
        "chat_id": "oc_chat",
        "chat_type": "p2p",
        "message_type": "text",
        "content": json.dumps({"text": "hello"}),
        "create_time": "1700000000000",
    }
    return {
        "schema": "2.0",
        "header": {"event_id": "e1", "event_type": "im.message.receive_v1", "token": "t"},
        "event": {
            "sender": {"sender_id": {"open_id": sender}, "sender_type": "user"},
            "message": {**base, **message},
        },
    }


def mention(n: int, open_id: str, name: str) -> dict[str, Any]:
    return {"key": f"@_user_{n}", "id": {"open_id": open_id}, "name": name}


def test_a_direct_message_is_keyed_by_its_chat_and_named_by_its_own_id() -> None:
    found = translate_event(envelope({}), bot_open_id=BOT)
    assert isinstance(found, InboundMessage)
    assert found.session_key == "feishu:oc_chat"
    assert found.message_id == "om_1" and found.sender_id == ANN and found.text == "hello"
    assert found.metadata[META_IS_GROUP] is False
    assert found.metadata["sent_at"] == 1_700_000_000


def test_a_group_mention_of_the_bot_addresses_it_and_leaves_its_placeholder_out() -> None:
    text = json.dumps({"text": "@_user_1 ask @_user_2 about it"})
    message = {
        "chat_type": "group",
        "content": text,
        "mentions": [mention(1, BOT, "Bot"), mention(2, "ou_" + "c" * 32, "Cid")],
    }
    found = translate_event(envelope(message), bot_open_id=BOT)
    assert isinstance(found, InboundMessage)
    assert found.metadata[META_MENTIONED] is True
    assert found.text == "ask @Cid about it"


def test_a_group_message_for_someone_else_does_not_address_the_bot() -> None:
    message = {
        "chat_type": "group",
        "content": json.dumps({"text": "@_user_1 hi"}),
        "mentions": [mention(1, "ou_" + "c" * 32, "Cid")],
    }
    found = translate_event(envelope(message), bot_open_id=BOT)
    assert isinstance(found, InboundMessage)
    assert found.metadata[META_MENTIONED] is False
    assert found.metadata[META_REPLY_TO_BOT] is False


def test_a_reply_to_the_bot_addresses_it_and_a_thread_is_a_session_of_its_own() -> None:
    message = {"chat_type": "group", "parent_id": "om_bot", "thread_id": "omt_7"}
    found = translate_event(envelope(message), bot_open_id=BOT, sent_by_bot={"om_bot"}.__contains__)
    assert isinstance(found, InboundMessage)
    assert found.metadata[META_REPLY_TO_BOT] is True
    assert found.session_key == "feishu:oc_chat:thread:omt_7"


def test_images_files_and_posts_become_attachments() -> None:
    image = translate_event(
        envelope({"message_type": "image", "content": json.dumps({"image_key": "img_1"})}),
        bot_open_id=BOT,
    )
    assert isinstance(image, InboundMessage)
    assert [(a.kind, a.file_id) for a in image.attachments] == [("image", "om_1:image:img_1")]
    document = translate_event(
        envelope(
            {
                "message_type": "file",
                "content": json.dumps({"file_key": "file_1", "file_name": "a.pdf"}),
            }
        ),
        bot_open_id=BOT,
    )
    assert isinstance(document, InboundMessage)
    assert [(a.kind, a.name) for a in document.attachments] == [("document", "a.pdf")]
    post = {
        "title": "Plan",
        "content": [
            [{"tag": "text", "text": "see "}, {"tag": "a", "text": "this", "href": "https://x"}],
            [{"tag": "img", "image_key": "img_2"}],
        ],
    }
    rich = translate_event(
        envelope({"message_type": "post", "content": json.dumps(post)}), bot_open_id=BOT
    )
    assert isinstance(rich, InboundMessage)
    assert rich.text == "Plan\nsee this"
    assert [a.file_id for a in rich.attachments] == ["om_1:image:img_2"]


def test_what_the_gateway_cannot_read_is_named_and_the_rest_skipped() -> None:
    sticker = translate_event(
        envelope({"message_type": "sticker", "content": json.dumps({"file_key": "s"})}),
        bot_open_id=BOT,
    )
    assert isinstance(sticker, InboundMessage) and "sticker" in sticker.text
    own = translate_event(envelope({}, sender=BOT), bot_open_id=BOT)
    assert isinstance(own, Skip)
    other = dict(envelope({}))
    other["header"] = {**other["header"], "event_type": "im.chat.member.bot.added_v1"}
    assert isinstance(translate_event(other, bot_open_id=BOT), Skip)


# -- formatting ----------------------------------------------------------------------------


def test_markdown_becomes_what_a_post_draws() -> None:
    out = markdown_to_feishu("# Title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n<at id=all></at> hi")
    assert out.startswith("**Title**")
    assert "```\na | b\n--+--\n1 | 2\n```" in out
    assert "<at" not in out and "hi" in out
    body = json.loads(post_content("**x**"))
    assert body["zh_cn"]["content"] == [[{"tag": "md", "text": "**x**"}]]
    assert post_text(body) == ("**x**", [])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["word", "<at id=all></at>", '<AT user_id="ou_1">', "```", "\n", " ", "|", "#"]
        ),
        max_size=400,
    )
)
def test_no_part_notifies_anyone_and_each_fits(pieces: list[str]) -> None:
    text = "".join(pieces)
    parts = feishu_parts(text, 200)
    for part in parts:
        assert "<at" not in part.lower()
        assert len(part) <= 200
    assert sum(part.count("word") for part in parts) == text.count("word")  # nothing lost
    assert defuse_mentions("<at id=all>") != "<at id=all>"


# -- the wire format -----------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**64 - 1),
    st.integers(-(2**31), 2**31 - 1),
    st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=5),
    st.binary(max_size=64),
)
def test_frames_agree_with_the_protobuf_runtime(
    seq: int, service: int, headers: list[tuple[str, str]], payload: bytes
) -> None:
    ours = Frame(seq_id=seq, service=service, method=1, headers=tuple(headers), payload=payload)
    theirs = PbFrame()
    theirs.ParseFromString(ours.encode())
    assert (theirs.SeqID, theirs.service, theirs.payload) == (seq, service, payload)
    assert [(h.key, h.value) for h in theirs.headers] == headers
    back = make_frame(1, service, dict(headers), payload)
    back.SeqID = seq
    decoded = Frame.decode(back.SerializeToString())
    assert (decoded.seq_id, decoded.service, decoded.payload) == (seq, service, payload)


def test_a_callback_opens_with_the_encrypt_key_only() -> None:
    sealed = encrypt(b'{"a": 1}', "key-1")
    assert crypto.decrypt(sealed, "key-1") == b'{"a": 1}'
    with pytest.raises(crypto.NotDecryptable):
        crypto.decrypt(sealed, "key-2")
    with pytest.raises(crypto.NotDecryptable):
        crypto.decrypt("not base64!", "key-1")


# -- the adapter against the fake ------------------------------------------------------------

FAST = Pacing(retry_window=5.0, retry_backoff=0.05, chat_interval=0.0, stream_interval=0.1)


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


def settings_for(fake: FakeFeishu, **extra: Any) -> FeishuSettings:
    return FeishuSettings(
        enabled=True,
        api_url=fake.url,
        app_id=fake.app_id,
        app_secret=fake.app_secret,
        dm_policy="open",
        group_policy="open",
        **extra,
    )


@asynccontextmanager
async def running(fake: FakeFeishu, journal: Journal, **extra: Any) -> AsyncIterator[FeishuChannel]:
    channel = FeishuChannel(settings_for(fake, **extra), app_secret=fake.app_secret, pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, journal.submit)
        yield channel
        tg.cancel_scope.cancel()


@pytest.fixture
async def fake() -> AsyncIterator[FakeFeishu]:
    async with FakeFeishu(retry_delays=(0.3, 0.6, 0.9, 1.2), ack_timeout=1.0) as server:
        yield server


@pytest.mark.anyio
async def test_an_event_is_answered_only_once_the_journal_holds_it(fake: FakeFeishu) -> None:
    ann = fake.add_person("ann")
    journal = Journal(delay=0.5)
    async with running(fake, journal):
        delivery = await fake.deliver(fake.user_message(fake.p2p_chat(ann), ann, "hello"))
    assert delivery.delivered and len(delivery.attempts) == 1
    attempt = delivery.attempts[0]
    assert attempt.answered_at - attempt.sent_at >= 0.5  # after submit returned
    assert [m.text for m in journal.taken] == ["hello"]


@pytest.mark.anyio
async def test_an_event_not_taken_is_left_to_feishu_which_pushes_it_again(
    fake: FakeFeishu,
) -> None:
    ann = fake.add_person("ann")
    journal = Journal(take=False)
    event = fake.user_message(fake.p2p_chat(ann), ann, "hello")
    async with running(fake, journal) as channel:
        pending = fake.deliver_soon(event)
        with anyio.fail_after(5):
            while not fake.deliveries or len(fake.deliveries[0].attempts) < 2:  # noqa: ASYNC110 (polling the fake's log)
                await anyio.sleep(0.02)
        journal.take = True
        with anyio.fail_after(10):
            while not pending.done():  # noqa: ASYNC110 (a future of another loop)
                await anyio.sleep(0.02)
        delivery = pending.result()
        assert delivery.delivered
        assert delivery.attempts[0].outcome == "no answer within 3 s"
        # Pushed once more after it was taken: confirmed at once, not submitted again.
        await fake.deliver(event)
        assert channel.stats.repushes == 1
    assert len(journal.taken) == 1


@pytest.mark.anyio
async def test_a_draining_gateway_leaves_events_with_feishu(fake: FakeFeishu) -> None:
    ann = fake.add_person("ann")
    journal = Journal()
    async with running(fake, journal) as channel:
        channel.pause_intake()
        fake.retry_delays = ()
        delivery = await fake.deliver(fake.user_message(fake.p2p_chat(ann), ann, "late"))
    assert not delivery.delivered and journal.taken == []


@pytest.mark.anyio
async def test_a_payload_split_over_frames_is_taken_whole(fake: FakeFeishu) -> None:
    fake.frame_parts = 4
    ann = fake.add_person("ann")
    journal = Journal()
    async with running(fake, journal):
        delivery = await fake.deliver(fake.user_message(fake.p2p_chat(ann), ann, "x" * 500))
    assert delivery.delivered and journal.taken[0].text == "x" * 500


@pytest.mark.anyio
async def test_the_long_connection_comes_back_after_feishu_drops_it(fake: FakeFeishu) -> None:
    ann = fake.add_person("ann")
    journal = Journal()
    async with running(fake, journal):
        await fake.drop_connections()
        delivery = await fake.deliver(fake.user_message(fake.p2p_chat(ann), ann, "again"))
    assert delivery.delivered
    assert [m.text for m in journal.taken] == ["again"]


# -- webhook mode ------------------------------------------------------------------------


class Port:
    """The gateway's HTTP port, reduced to a mount point."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.url = ""

    def mount(
        self,
        method: str,
        path: str,
        handler: Callable[[Any], Awaitable[Any]],
        *,
        require_ready: bool = True,
    ) -> None:
        self.app.router.add_route(method, path, handler)


@pytest.mark.anyio
async def test_the_webhook_refuses_what_is_not_signed_and_encrypted_and_confirms_after_the_journal(
    fake: FakeFeishu,
) -> None:
    ann = fake.add_person("ann")
    journal = Journal()
    port = Port()
    channel = FeishuChannel(
        settings_for(
            fake,
            mode="webhook",
            encrypt_key=fake.encrypt_key,
            verification_token=fake.verification_token,
        ),
        app_secret=fake.app_secret,
        pacing=FAST,
    )
    assert channel.mount(port)
    runner = web.AppRunner(port.app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}{FEISHU_EVENTS_PATH}"
    fake.mode, fake.webhook_url = "webhook", url
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, journal.submit)
            event = fake.user_message(fake.p2p_chat(ann), ann, "hello")
            body, headers = fake.callback_request(event)
            forged = {**headers, "X-Lark-Signature": "0" * 64}
            assert (await fake.post_callback(url, body, forged))[0] == 401
            unsigned = {k: v for k, v in headers.items() if k != "X-Lark-Signature"}
            assert (await fake.post_callback(url, body, unsigned))[0] == 401
            wrong_key, wrong_headers = fake.callback_request(event, encrypt_key="other")
            assert (await fake.post_callback(url, wrong_key, wrong_headers))[0] == 401
            plain = json.dumps(event).encode()
            assert (await fake.post_callback(url, plain, {}))[0] == 401
            assert journal.taken == []
            status, text, challenge = await fake.url_verification(url)
            assert status == 200 and json.loads(text) == {"challenge": challenge}
            journal.take = False
            assert (await fake.post_callback(url, body, headers))[0] == 503
            journal.take = True
            delivery = await fake.deliver(event)
            assert delivery.delivered and [m.text for m in journal.taken] == ["hello"]
            assert channel.stats.bad_signatures == 4
            tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()


# -- replies -------------------------------------------------------------------------------


def inbound_of(event: dict[str, Any], bot: str) -> InboundMessage:
    """The message as the channel submits it (with its reply context)."""
    found = translate_event(event, bot_open_id=bot)
    assert isinstance(found, InboundMessage)
    context = {"chat_type": found.metadata["feishu_chat_type"]}
    return replace(found, metadata={**found.metadata, META_REPLY_CONTEXT: context})


@pytest.mark.anyio
async def test_replies_quote_in_groups_stay_in_threads_and_go_plain_in_direct_chats(
    fake: FakeFeishu,
) -> None:
    ann = fake.add_person("ann")
    group = fake.group_chat("team", [ann])
    async with running(fake, Journal()) as channel:
        asked = fake.user_message(group, ann, "q", mention=[fake.bot_open_id])
        message = inbound_of(asked, fake.bot_open_id)
        await channel.send(reply_for(message, "**answer**"))
        threaded = fake.user_message(group, ann, "t", thread_of=message.message_id)
        await channel.send(reply_for(inbound_of(threaded, fake.bot_open_id), "in thread"))
        direct = inbound_of(fake.user_message(fake.p2p_chat(ann), ann, "d"), fake.bot_open_id)
        await channel.send(reply_for(direct, "plain <at id=all></at>"))
    quoted, in_thread, plain = fake.bot_messages()
    assert quoted.parent_id == message.message_id and not quoted.thread_id
    assert FakeFeishu.rendered(quoted) == "**answer**"
    assert in_thread.thread_id == threaded["event"]["message"]["thread_id"]
    assert plain.chat_id == direct.chat_id and not plain.parent_id
    assert FakeFeishu.notifies(plain) == (frozenset(), False)


@pytest.mark.anyio
async def test_a_reply_cut_short_goes_on_from_its_part_and_posts_none_twice(
    fake: FakeFeishu,
) -> None:
    ann = fake.add_person("ann")
    direct = inbound_of(fake.user_message(fake.p2p_chat(ann), ann, "d"), fake.bot_open_id)
    text = "\n\n".join(f"paragraph {n} " + "x" * 150 for n in range(6))
    parts = feishu_parts(text, 400)
    assert len(parts) >= 3
    reply = reply_for(direct, text)
    async with running(fake, Journal(), part_chars=400) as channel:
        channel.pacing = Pacing(retry_window=0.3, retry_backoff=0.05, chat_interval=0.0)
        fake.fail_next(503, 1, count=100, after=1)  # part 0 goes out, then Feishu is down
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 1
        fake.fail_next(0, 0, count=0, clear=True)
        await channel.send(reply)  # the dispatcher's resend: from part 1 on
    assert [FakeFeishu.rendered(m) for m in fake.bot_messages()] == parts
    # A replay after a crash sends the whole reply again, from a fresh process: every
    # part carries the uuid it had, and Feishu keeps one message per uuid.
    async with running(fake, Journal(), part_chars=400) as again:
        await again.send(reply)
    assert [FakeFeishu.rendered(m) for m in fake.bot_messages()] == parts


@pytest.mark.anyio
async def test_rate_limits_and_an_expired_token_are_waited_out(fake: FakeFeishu) -> None:
    ann = fake.add_person("ann")
    direct = inbound_of(fake.user_message(fake.p2p_chat(ann), ann, "d"), fake.bot_open_id)
    fake.chat_qps = 2
    async with running(fake, Journal()) as channel:
        for n in range(4):
            await channel.send(reply_for(direct, f"answer {n}"))
        fake.expire_tokens()
        await channel.send(reply_for(direct, "after expiry"))
        assert channel.stats.rate_limited >= 1
    assert [FakeFeishu.rendered(m) for m in fake.bot_messages()] == [
        "answer 0",
        "answer 1",
        "answer 2",
        "answer 3",
        "after expiry",
    ]


@pytest.mark.anyio
async def test_files_go_out_after_the_text_and_come_in_with_the_apps_token(
    fake: FakeFeishu,
) -> None:
    ann = fake.add_person("ann")
    chat = fake.p2p_chat(ann)
    direct = inbound_of(fake.user_message(chat, ann, "d"), fake.bot_open_id)
    image = OutboundFile("chart.png", b"\x89PNG...", "image/png", caption="the chart")
    document = OutboundFile("report.pdf", b"%PDF-1.4", "application/pdf")
    async with running(fake, Journal()) as channel:
        await channel.send(reply_for(direct, "here", files=(image, document)))
        sent = fake.image_message(chat, ann, b"picture bytes")
        picture = inbound_of(sent, fake.bot_open_id).attachments[0]
        assert await channel.fetch_file(picture, max_bytes=1000) == b"picture bytes"
        with pytest.raises(MediaError):
            await channel.fetch_file(picture, max_bytes=5)
    kinds = [m.msg_type for m in fake.bot_messages()]
    assert kinds == ["post", "image", "post", "file"]
    image_key = json.loads(fake.bot_messages()[1].content)["image_key"]
    assert fake.uploaded(image_key) == b"\x89PNG..."


@pytest.mark.anyio
async def test_a_streamed_reply_is_one_message_edited_into_the_answer(fake: FakeFeishu) -> None:
    ann = fake.add_person("ann")
    direct = inbound_of(fake.user_message(fake.p2p_chat(ann), ann, "d"), fake.bot_open_id)
    async with running(fake, Journal(), streaming=True) as channel:
        for word in ("one ", "two ", "three "):
            await channel.stream_delta(direct, word)
            await anyio.sleep(0.15)
        await channel.send(reply_for(direct, "one two three four"))
    [message] = fake.bot_messages()
    assert FakeFeishu.rendered(message) == "one two three four" and message.edits >= 1


# -- the declaration -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_doctor_names_what_is_missing_and_asks_feishu_for_the_bot(
    fake: FakeFeishu,
) -> None:
    from channels.feishu.spec import checks

    [missing] = await checks(FeishuSettings(enabled=True, app_id="cli_x"))
    assert missing.status == "fail" and "App Secret" in missing.what
    webhook = await checks(FeishuSettings(enabled=True, mode="webhook", app_id="cli_x"))
    assert {f.what.split(" without ")[1] for f in webhook} == {
        "an App Secret",
        "an Encrypt Key",
        "a Verification Token",
    }
    [ok] = await checks(settings_for(fake))
    assert ok.status == "ok" and fake.bot_open_id in ok.what
    wrong = settings_for(fake).model_copy(update={"app_id": "cli_wrong"})
    [refused] = await checks(wrong)
    assert refused.status == "fail" and "refused" in refused.what


def test_webhook_mode_without_its_keys_is_a_configuration_error() -> None:
    from gateway.config import ConfigError

    settings = FeishuSettings(enabled=True, mode="webhook", app_id="cli_x", app_secret="s")
    with pytest.raises(ConfigError, match="ENCRYPT_KEY"):
        FeishuChannel(settings, app_secret="s")
