"""The Google Chat channel (channels.googlechat): which events it takes and how they are
keyed (pure), the check of Google's bearer tokens and the service account's token, the
endpoint's side of journal-before-200, and how replies go out; the channel against the
fake Google Chat (tests/fakes/googlechat_server.py) behind the gateway's own HTTP server,
a stand-in for the dispatcher whose `submit` the test holds open or refuses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from pydantic import SecretStr

from channels.googlechat import GoogleChatChannel, Pacing, Skip, target_of, translate_event
from channels.googlechat.api import ChatApiError
from channels.googlechat.auth import (
    KEY_REFETCH_SECONDS,
    AccessTokens,
    BearerVerifier,
    Refused,
    ServiceAccount,
    SetupError,
)
from channels.googlechat.channel import GOOGLECHAT_WEBHOOK_PATH, SEND_AGAIN, preview_name
from channels.googlechat.settings import GoogleChatSettings
from channels.googlechat.spec import checks
from channels.googlechat.translate import event_time
from gateway.channel import DeliveryFailed, redelivers
from gateway.config import ConfigError, Settings
from gateway.http import HealthState, HttpServer
from gateway.http.metrics import Metrics
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_POST_ID,
    META_REPLY_CONTEXT,
    META_SENDER_NAME,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
    reply_for,
)
from tests.fakes._serving import free_port
from tests.fakes.googlechat_server import (
    CHAT_CERTS_PATH,
    OIDC_CERTS_PATH,
    FakeGoogleChat,
    mentions_of,
)

pytestmark = pytest.mark.anyio

FAST = Pacing(
    reply_deadline=2.0,
    retry_backoff=0.01,
    retry_backoff_max=0.05,
    request_timeout=5.0,
    stream_interval=0.05,
    stop_timeout=2.0,
)


# -- translation (pure) ---------------------------------------------------------------------


def event(text: str = "hello", *, kind: str = "MESSAGE", **message: Any) -> dict[str, Any]:
    space = message.pop("space", {"name": "spaces/AAA", "spaceType": "DIRECT_MESSAGE"})
    sender = {"name": "users/111", "displayName": "Alice Liddell", "type": "HUMAN"}
    body = {
        "name": "spaces/AAA/messages/T1.T1",
        "sender": sender,
        "createTime": "2024-05-01T10:00:00.123456789Z",
        "text": text,
        "thread": {"name": "spaces/AAA/threads/T1"},
        "threadReply": False,
        "space": space,
        **message,
    }
    return {"type": kind, "space": space, "user": sender, "message": body}


SPACE = {"name": "spaces/AAA", "spaceType": "SPACE", "type": "ROOM", "displayName": "Town"}
BOT = {"name": "users/999", "displayName": "Kit Bot", "type": "BOT"}
MENTION = [{"type": "USER_MENTION", "startIndex": 0, "length": 8, "userMention": {"user": BOT}}]


def test_a_dm_is_its_spaces_session_with_who_wrote_it() -> None:
    message = translate_event(event("hello"))
    assert isinstance(message, InboundMessage)
    assert message.session_key == "googlechat:AAA"
    assert (message.text, message.sender_id) == ("hello", "111")
    assert message.message_id == message.metadata[META_POST_ID] == "spaces/AAA/messages/T1.T1"
    assert message.metadata[META_IS_GROUP] is False
    assert message.metadata[META_SENDER_NAME] == "Alice Liddell"
    assert META_REPLY_CONTEXT not in message.metadata


def test_in_a_space_the_mention_is_cut_said_and_the_reply_will_name_the_sender() -> None:
    message = translate_event(
        event("@Kit Bot what is up?", space=SPACE, argumentText=" what is up?", annotations=MENTION)
    )
    assert isinstance(message, InboundMessage)
    assert message.text == "what is up?"
    assert message.metadata[META_IS_GROUP] is True and message.metadata[META_MENTIONED] is True
    assert message.metadata[META_REPLY_CONTEXT] == {"mention": "users/111"}
    # A link preview reaches the app without a mention: the core's gate screens it.
    preview = translate_event(event("see https://x.example", space=SPACE))
    assert isinstance(preview, InboundMessage) and preview.metadata[META_MENTIONED] is False


def test_a_thread_reply_is_a_session_of_its_own_answered_in_the_thread() -> None:
    message = translate_event(
        event("@Kit Bot more", space=SPACE, threadReply=True, annotations=MENTION)
    )
    assert isinstance(message, InboundMessage)
    assert message.session_key == "googlechat:AAA:thread:T1"
    assert target_of(message.chat_id, message.thread_id) == ("AAA", "spaces/AAA/threads/T1")
    assert target_of("AAA:thread:T1") == ("AAA", "spaces/AAA/threads/T1")
    assert target_of("spaces/AAA") == ("AAA", None)


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (event(kind="REMOVED_FROM_SPACE"), "REMOVED_FROM_SPACE"),
        (event(kind="CARD_CLICKED"), "CARD_CLICKED"),
        ({"type": "ADDED_TO_SPACE", "space": SPACE, "user": {}}, "without a message"),
        (event(sender=BOT), "from an app"),
        (event("  "), "no text"),
    ],
)
def test_what_is_skipped(item: dict[str, Any], reason: str) -> None:
    result = translate_event(item)
    assert isinstance(result, Skip) and reason in result.reason


def test_a_slash_command_keeps_its_name_and_a_dm_mention_is_cut() -> None:
    command = translate_event(
        event(
            "/new please",
            space=SPACE,
            argumentText=" please",
            slashCommand={"commandId": "2"},
            annotations=[{"type": "SLASH_COMMAND", "startIndex": 0, "length": 4}],
        )
    )
    assert isinstance(command, InboundMessage)
    assert command.text == "/new please" and command.metadata[META_MENTIONED] is True
    direct = translate_event(event("@Kit Bot hi", argumentText=" hi", annotations=MENTION))
    assert isinstance(direct, InboundMessage)
    assert direct.text == "hi" and direct.metadata[META_MENTIONED] is False


def test_added_by_a_mention_carries_the_message() -> None:
    message = translate_event(
        event(
            "@Kit Bot hi",
            kind="ADDED_TO_SPACE",
            space=SPACE,
            annotations=MENTION,
            argumentText=" hi",
        )
    )
    assert isinstance(message, InboundMessage) and message.text == "hi"


def test_uploaded_files_are_attachments_and_drive_files_are_named() -> None:
    files = [
        {
            "contentName": "cat.png",
            "contentType": "image/png",
            "attachmentDataRef": {"resourceName": "RES1"},
            "source": "UPLOADED_CONTENT",
        },
        {"contentName": "plan.gdoc", "driveDataRef": {"driveFileId": "D"}, "source": "DRIVE_FILE"},
    ]
    message = translate_event(event("look", attachment=files))
    assert isinstance(message, InboundMessage)
    assert [(a.kind, a.file_id, a.name) for a in message.attachments] == [
        ("image", "RES1", "cat.png")
    ]
    assert "plan.gdoc" in message.text and message.text.startswith("look")


def test_google_times_are_read_to_the_microsecond() -> None:
    assert event_time("2024-05-01T10:00:00.123456789Z") == pytest.approx(1714557600.123456)
    assert event_time("2024-05-01T10:00:00Z") == 1714557600.0
    assert event_time("soon") == 0.0


# -- trust -------------------------------------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeGoogleChat]:
    async with FakeGoogleChat() as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


def verifier_for(fake: FakeGoogleChat, **kwargs: Any) -> BearerVerifier:
    return BearerVerifier(
        fake.audience,
        chat_certs_url=f"{fake.url}{CHAT_CERTS_PATH}",
        google_certs_url=f"{fake.url}{OIDC_CERTS_PATH}",
        **kwargs,
    )


async def test_chats_tokens_verify_and_the_keys_are_fetched_once(
    fake: FakeGoogleChat, session: aiohttp.ClientSession
) -> None:
    verifier = verifier_for(fake)
    for _ in range(5):
        claims = await verifier.verify(f"Bearer {fake.event_token('x')}", session)
    assert claims["iss"] == "chat@system.gserviceaccount.com"
    assert fake.cert_fetches == 1


@pytest.mark.parametrize("how", ["unknown_key", "wrong_audience", "expired", "wrong_issuer"])
async def test_forged_tokens_are_refused(
    fake: FakeGoogleChat, session: aiohttp.ClientSession, how: str
) -> None:
    with pytest.raises(Refused):
        await verifier_for(fake).verify(f"Bearer {fake.forged_token(how)}", session)


@pytest.mark.parametrize("header", ["", "Bearer", "Basic abc", "Bearer not-a-jwt"])
async def test_a_missing_or_malformed_token_is_refused(
    fake: FakeGoogleChat, session: aiohttp.ClientSession, header: str
) -> None:
    with pytest.raises(Refused):
        await verifier_for(fake).verify(header, session)


async def test_an_endpoint_url_audience_takes_googles_id_token_for_chat_only(
    session: aiohttp.ClientSession,
) -> None:
    url = "https://gateway.example/googlechat/events"
    async with FakeGoogleChat(audience=url) as fake:
        verifier = verifier_for(fake)
        assert verifier.form == "url"
        claims = await verifier.verify(f"Bearer {fake.event_token(url)}", session)
        assert claims["email"] == "chat@system.gserviceaccount.com"
        for how in ("unverified_email", "wrong_audience", "unknown_key"):
            with pytest.raises(Refused):
                await verifier.verify(f"Bearer {fake.forged_token(how)}", session)


async def test_a_rotated_key_is_fetched_and_made_up_keys_do_not_hammer_google(
    fake: FakeGoogleChat, session: aiohttp.ClientSession
) -> None:
    now = [1000.0]
    verifier = verifier_for(fake, clock=lambda: now[0])
    await verifier.verify(f"Bearer {fake.event_token('x')}", session)
    now[0] += KEY_REFETCH_SECONDS + 1
    fake.rotate_keys()
    await verifier.verify(f"Bearer {fake.event_token('x')}", session)
    assert fake.cert_fetches == 2
    for _ in range(5):  # forged key ids, right after a fetch: no new fetch
        with pytest.raises(Refused):
            await verifier.verify(f"Bearer {fake.forged_token('unknown_key')}", session)
    assert fake.cert_fetches == 2
    now[0] += 7 * 3600  # past Google's max-age: fetched again
    await verifier.verify(f"Bearer {fake.event_token('x')}", session)
    assert fake.cert_fetches == 3


async def test_the_access_token_is_asked_for_once_and_again_after_a_401(
    fake: FakeGoogleChat, session: aiohttp.ClientSession
) -> None:
    tokens = AccessTokens(ServiceAccount.from_json(json.dumps(fake.service_account_info())))
    first = await tokens.get(session)
    assert await tokens.get(session) == first and tokens.fetched == 1
    tokens.invalidate()
    assert await tokens.get(session) != first and tokens.fetched == 2
    fake.revoke_key()
    tokens.invalidate()
    with pytest.raises(SetupError, match="refused the service account"):
        await tokens.get(session)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("not json", "not JSON"),
        ('{"type": "authorized_user"}', "not a service account"),
        ('{"type": "service_account", "client_email": "a@b"}', "lacks private_key, token_uri"),
    ],
)
def test_a_wrong_key_is_one_line_saying_what_to_do(key: str, says: str) -> None:
    settings = GoogleChatSettings(enabled=True, audience="123", service_account_key=SecretStr(key))
    with pytest.raises(ConfigError, match=says) as caught:
        GoogleChatChannel.from_settings(settings)
    assert "\n" not in str(caught.value)


def test_the_audience_and_the_key_are_needed() -> None:
    with pytest.raises(ConfigError, match="SERVICE_ACCOUNT_KEY_FILE"):
        GoogleChatChannel.from_settings(GoogleChatSettings(enabled=True, audience="123"))
    with pytest.raises(ValueError, match="project number"):
        GoogleChatSettings(audience="my-project")


# -- the channel against the fake ---------------------------------------------------------------


class StubTicket:
    def __init__(self, taken: bool) -> None:
        self.taken = taken

    async def reply(self) -> OutboundMessage | None:
        return None


class GatedSubmit:
    """`submit` held open for chosen texts, refusing others (the journal failed)."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self.hold: dict[str, anyio.Event] = {}
        self.arrived: dict[str, anyio.Event] = {}
        self.refuse: set[str] = set()

    async def submit(self, message: InboundMessage) -> StubTicket:
        self.messages.append(message)
        if message.text in self.arrived:
            self.arrived[message.text].set()
        if message.text in self.hold:
            await self.hold[message.text].wait()
        return StubTicket(taken=message.text not in self.refuse)

    @property
    def texts(self) -> list[str]:
        return [m.text for m in self.messages]


def settings_for(fake: FakeGoogleChat, **extra: Any) -> GoogleChatSettings:
    values: dict[str, Any] = {
        "enabled": True,
        "audience": fake.audience,
        "service_account_key": SecretStr(json.dumps(fake.service_account_info())),
        "api_url": fake.url,
        "chat_certs_url": f"{fake.url}{CHAT_CERTS_PATH}",
        "google_certs_url": f"{fake.url}{OIDC_CERTS_PATH}",
    }
    return GoogleChatSettings(**(values | extra))


@asynccontextmanager
async def wired(
    fake: FakeGoogleChat, *, port: int = 0, pacing: Pacing = FAST, **extra: Any
) -> AsyncIterator[tuple[GoogleChatChannel, GatedSubmit]]:
    settings = settings_for(fake, **extra)
    account = ServiceAccount.from_json(settings.resolved_key() or "")
    channel = GoogleChatChannel(settings, account=account, pacing=pacing)
    health = HealthState()
    http = HttpServer(
        Settings().http.model_copy(update={"port": port}), health=health, metrics=Metrics()
    )
    channel.mount(http)
    gate = GatedSubmit()
    async with anyio.create_task_group() as tg:
        bound = await tg.start(http.run)
        health.set_ready()
        await tg.start(channel.run, gate.submit)
        fake.webhook_url = f"http://127.0.0.1:{bound}{GOOGLECHAT_WEBHOOK_PATH}"
        yield channel, gate
        tg.cancel_scope.cancel()


def people(fake: FakeGoogleChat) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])
    town = fake.create_space("Town", [alice["name"]])
    return alice, dm, town


async def test_the_200_comes_only_after_the_journal_took_the_message(fake: FakeGoogleChat) -> None:
    async with wired(fake) as (_, gate):
        alice, dm, _ = people(fake)
        gate.hold["held"] = anyio.Event()
        fake.user_message(dm["name"], alice["name"], "held")
        gate.arrived["held"] = anyio.Event()
        with anyio.fail_after(10):
            await gate.arrived["held"].wait()
        await anyio.sleep(0.3)
        assert fake.deliveries == []  # Google Chat is still waiting for its answer
        gate.hold["held"].set()
        with anyio.fail_after(10):
            [delivery] = await fake.delivered(1)
        assert (delivery.status, delivery.response) == (200, {})
        assert fake.app_messages() == []  # the answer posts nothing


async def test_a_forged_request_is_refused_and_nothing_is_taken(fake: FakeGoogleChat) -> None:
    async with wired(fake) as (channel, gate):
        alice, dm, _ = people(fake)
        message = fake.user_message(dm["name"], alice["name"], "real")
        with anyio.fail_after(10):
            await fake.delivered(1)
        forged = json.loads(json.dumps(fake.deliveries[0].event))
        forged["message"]["text"] = "forged"
        for how in ("unknown_key", "wrong_audience", "expired"):
            delivery = await fake.deliver(forged, token=fake.forged_token(how))
            assert delivery.status == 401, how
        assert gate.texts == ["real"] and channel.stats.refused == 3
        assert message["name"] == gate.messages[0].message_id


async def test_a_message_not_taken_is_answered_in_place_asking_to_send_it_again(
    fake: FakeGoogleChat,
) -> None:
    async with wired(fake) as (channel, gate):
        alice, _dm, town = people(fake)
        gate.refuse.add("refused")
        root = fake.user_message(town["name"], alice["name"], "a topic")
        fake.user_message(
            town["name"], alice["name"], "refused", mention=True, thread=root["thread"]["name"]
        )
        with anyio.fail_after(10):
            [delivery] = await fake.delivered(1)
        assert delivery.status == 200 and delivery.response == {"text": SEND_AGAIN}
        [posted] = fake.app_messages()
        assert posted["text"] == SEND_AGAIN
        assert posted["thread"]["name"] == root["thread"]["name"]  # in the person's thread
        assert channel.stats.not_taken == 1
        # Chat sends an event once: nothing pauses its intake at a drain, the dispatcher
        # journals what comes for the next start (tests/test_dispatch.py).
        assert redelivers(channel) is False and not hasattr(channel, "pause_intake")


async def test_before_the_channel_runs_a_checked_message_is_asked_to_be_sent_again(
    fake: FakeGoogleChat,
) -> None:
    channel = GoogleChatChannel.from_settings(settings_for(fake))
    health = HealthState()
    http = HttpServer(
        Settings().http.model_copy(update={"port": 0}), health=health, metrics=Metrics()
    )
    channel.mount(http)
    async with anyio.create_task_group() as tg:
        port = await tg.start(http.run)  # starting: the channel does not run yet
        fake.webhook_url = f"http://127.0.0.1:{port}{GOOGLECHAT_WEBHOOK_PATH}"
        alice, dm, _ = people(fake)
        fake.user_message(dm["name"], alice["name"], "too early")
        with anyio.fail_after(10):
            [delivery] = await fake.delivered(1)
        assert (delivery.status, delivery.response) == (200, {"text": SEND_AGAIN})
        forged = await fake.deliver(delivery.event, token=fake.forged_token("unknown_key"))
        assert forged.status == 401
        tg.cancel_scope.cancel()


async def test_replies_go_to_the_space_its_thread_and_name_the_sender_in_a_space(
    fake: FakeGoogleChat,
) -> None:
    async with wired(fake) as (channel, gate):
        alice, dm, town = people(fake)
        root = fake.user_message(town["name"], alice["name"], "topic")
        fake.user_message(dm["name"], alice["name"], "in the dm")
        fake.user_message(town["name"], alice["name"], "top", mention=True)
        fake.user_message(
            town["name"], alice["name"], "thread", mention=True, thread=root["thread"]["name"]
        )
        with anyio.fail_after(10):
            await fake.delivered(3)
        for inbound in gate.messages:
            await channel.send(reply_for(inbound, f"**echo:** {inbound.text}"))
        by_text = {m["text"].split("echo:* ")[-1]: m for m in fake.app_messages()}
        dm_reply, top_reply, thread_reply = by_text["in the dm"], by_text["top"], by_text["thread"]
        assert dm_reply["text"] == "*echo:* in the dm" and mentions_of(dm_reply) == (set(), False)
        alice_id = alice["name"].removeprefix("users/")
        assert top_reply["text"].startswith(f"<{alice['name']}> ")
        assert mentions_of(top_reply) == ({alice_id}, False)
        assert top_reply["threadReply"] is False
        assert thread_reply["thread"]["name"] == root["thread"]["name"]
        assert thread_reply["threadReply"] is True
        assert {fake.markup[m["name"]] for m in fake.app_messages()} == {"MARKUP_SYNTAX_CHAT"}


def dm_reply(
    dm: dict[str, Any], text: str, reply_to: str = "spaces/X/messages/M.M"
) -> OutboundMessage:
    space = dm["name"].removeprefix("spaces/")
    return OutboundMessage(
        channel="googlechat",
        chat_id=space,
        text=text,
        session_key=f"googlechat:{space}",
        reply_to=reply_to,
    )


async def test_a_long_reply_is_split_under_the_size_limit_in_order(fake: FakeGoogleChat) -> None:
    async with wired(fake, max_message_bytes=1000) as (channel, _):
        _, dm, _ = people(fake)
        lines = [f"line {n:04d} " + "é" * 40 for n in range(100)]
        await channel.send(dm_reply(dm, "\n".join(lines)))
        texts = [m["text"] for m in fake.app_messages()]
        assert len(texts) > 5 and all(len(t.encode()) <= 1000 for t in texts)
        assert "\n".join(texts).split("\n") == lines


async def test_a_lost_answer_is_repeated_and_posts_once(fake: FakeGoogleChat) -> None:
    async with wired(fake) as (channel, _):
        _, dm, _ = people(fake)
        fake.fail_next(503, after=True)  # made, then the answer lost
        await channel.send(dm_reply(dm, "once"))
        assert [m["text"] for m in fake.app_messages()] == ["once"]
        assert [c.status for c in fake.calls_to("POST messages")] == [503, 409]
        await channel.send(dm_reply(dm, "once"))  # the outbox sends it again after a crash
        assert [m["text"] for m in fake.app_messages()] == ["once"]


async def test_quotas_and_expired_tokens_are_ridden_out(fake: FakeGoogleChat) -> None:
    async with wired(fake) as (channel, _):
        _, dm, _ = people(fake)
        fake.fail_next(429)
        await channel.send(dm_reply(dm, "after a quota", reply_to="spaces/X/messages/A.A"))
        fake.expire_tokens()
        await channel.send(dm_reply(dm, "after a new token", reply_to="spaces/X/messages/B.B"))
        assert [m["text"] for m in fake.app_messages()] == ["after a quota", "after a new token"]
        assert channel.tokens.fetched == 2 and channel.stats.retries == 1


async def test_an_outage_is_delivery_failed_and_the_reply_goes_on_from_the_failed_part(
    fake: FakeGoogleChat,
) -> None:
    async with wired(fake, max_message_bytes=1000) as (channel, _):
        _, dm, _ = people(fake)
        text = "\n\n".join(f"paragraph {n} " + "x" * 600 for n in range(3))
        reply = dm_reply(dm, text)
        posted_first = [0]

        async def fail_from_the_second() -> None:
            await fake.app_posted(1)
            posted_first[0] = 1
            fake.fail_next(503, count=1000)

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_from_the_second)
            with pytest.raises(DeliveryFailed) as failed:
                await channel.send(reply)
        assert failed.value.sent == 1 and posted_first[0] == 1
        fake.heal()
        await channel.send(reply)
        texts = [m["text"] for m in fake.app_messages()]
        assert [t.split()[1] for t in texts] == ["0", "1", "2"]


async def test_a_space_the_app_left_is_an_error_not_a_delivery_failure(
    fake: FakeGoogleChat,
) -> None:
    async with wired(fake) as (channel, _):
        alice, _, town = people(fake)
        fake.remove_app(town["name"], alice["name"])
        with pytest.raises(ChatApiError) as failed:
            await channel.send(dm_reply(town, "hello?"))
        assert failed.value.status == 404


async def test_an_unreachable_api_is_delivery_failed() -> None:
    async with FakeGoogleChat() as fake:
        dead = f"http://127.0.0.1:{free_port()}"
        async with wired(fake, api_url=dead) as (channel, _):
            _, dm, _ = people(fake)
            with pytest.raises(DeliveryFailed) as failed:
                await channel.send(dm_reply(dm, "nobody hears"))
            assert failed.value.sent == 0


async def test_an_api_that_never_answers_is_delivery_failed_by_the_replys_deadline() -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await anyio.sleep(60)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    slow = Pacing(reply_deadline=1.0, retry_backoff=0.01, request_timeout=30.0, stop_timeout=1)
    try:
        async with FakeGoogleChat() as fake:
            hanging = f"http://127.0.0.1:{runner.addresses[0][1]}"
            async with wired(fake, api_url=hanging, pacing=slow) as (channel, _):
                _, dm, _ = people(fake)
                began = anyio.current_time()
                with pytest.raises(DeliveryFailed, match="no answer before"):
                    await channel.send(dm_reply(dm, "into the void"))
                assert anyio.current_time() - began < 10  # the dispatcher cuts at 60
    finally:
        await runner.cleanup()


async def test_a_streamed_reply_is_one_message_edited_into_the_answer(fake: FakeGoogleChat) -> None:
    async with wired(fake, streaming=True) as (channel, gate):
        alice, dm, _ = people(fake)
        fake.user_message(dm["name"], alice["name"], "tell me")
        with anyio.fail_after(10):
            await fake.delivered(1)
        [inbound] = gate.messages
        for word in ("one ", "two ", "three "):
            await channel.stream_delta(inbound, word)
            await anyio.sleep(0.1)
        with anyio.fail_after(5):
            await fake.app_posted(1)
        await channel.send(reply_for(inbound, "one two three four"))
        [message] = fake.app_messages()
        assert message["text"] == "one two three four"
        assert (
            message["name"]
            == fake._client_ids[
                (
                    dm["name"],
                    preview_name(
                        dm["name"].removeprefix("spaces/"), inbound.message_id or ""
                    ).rsplit("/", 1)[-1],
                )
            ]
        )


async def test_a_preview_left_by_a_crash_is_edited_not_doubled(fake: FakeGoogleChat) -> None:
    async with wired(fake, streaming=True) as (channel, gate):
        alice, dm, _ = people(fake)
        fake.user_message(dm["name"], alice["name"], "tell me")
        with anyio.fail_after(10):
            await fake.delivered(1)
        [inbound] = gate.messages
        await channel.stream_delta(inbound, "half an ans")
        await anyio.sleep(0.1)
        await channel.stream_delta(inbound, "wer")
        with anyio.fail_after(5):
            await fake.app_posted(1)
    async with wired(fake, streaming=True) as (channel, _):  # the next start's outbox
        await channel.send(reply_for(inbound, "the whole answer"))
    assert [m["text"] for m in fake.app_messages()] == ["the whole answer"]


async def test_files_people_upload_are_fetched_and_a_replys_files_are_named(
    fake: FakeGoogleChat,
) -> None:
    async with wired(fake) as (channel, gate):
        alice, dm, _ = people(fake)
        upload = fake.add_media(b"\x89PNG fake", "image/png", "cat.png")
        fake.user_message(dm["name"], alice["name"], "look", attachments=[upload])
        with anyio.fail_after(10):
            await fake.delivered(1)
        [inbound] = gate.messages
        [attachment] = inbound.attachments
        assert await channel.fetch_file(attachment, max_bytes=1000) == b"\x89PNG fake"
        reply = reply_for(inbound, "here", files=(OutboundFile("a.txt", b"x", "text/plain"),))
        await channel.send(reply)
        assert [m["text"] for m in fake.app_messages()] == [
            "here",
            "(Google Chat does not let an app send files; not sent: a.txt)",
        ]


async def test_an_endpoint_url_audience_end_to_end() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}{GOOGLECHAT_WEBHOOK_PATH}"
    async with FakeGoogleChat(audience=url) as fake, wired(fake, port=port) as (_, gate):
        alice, dm, _ = people(fake)
        fake.user_message(dm["name"], alice["name"], "by url")
        with anyio.fail_after(10):
            [delivery] = await fake.delivered(1)
        assert delivery.status == 200 and gate.texts == ["by url"]


async def test_the_doctor_checks_the_key_the_api_and_the_keys(fake: FakeGoogleChat) -> None:
    people(fake)
    found = await checks(settings_for(fake))
    assert [f.status for f in found] == ["ok", "ok"], found
    assert "2 space(s)" in found[1].what
    url_audience = settings_for(fake).model_copy(update={"audience": "https://x.example/hook"})
    assert [f.status for f in await checks(url_audience)][-1] == "warn"
    fake.revoke_key()
    [failure] = await checks(settings_for(fake))
    assert failure.status == "fail" and "refused the service account" in failure.what
    missing = await checks(GoogleChatSettings(enabled=True))
    assert [f.status for f in missing] == ["fail", "fail"]
