"""The Teams channel against the fake Teams: the activities it takes and their session keys,
the checks of every activity's token, journal before the 200, replies in their place
(resumed at the part that failed), throttling, streaming by updates, files and the doctor.
The dispatcher is replaced by a stand-in whose `submit` the test holds open or refuses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from channels.teams.auth import AuthError, ConnectorKeys, verify_activity
from channels.teams.channel import Pacing, TeamsChannel, TeamsSetupError, check_credentials
from channels.teams.settings import TeamsSettings
from channels.teams.spec import checks
from channels.teams.translate import Skip, join_conversation, translate_activity
from gateway.channel import DeliveryFailed, redelivers
from gateway.config import Settings
from gateway.http import HealthState, HttpServer
from gateway.http.metrics import Metrics
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_SENDER_NAME,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
    reply_for,
)
from tests.fakes.teams_server import APP_ID, APP_PASSWORD, FakeTeams, new_signing_key

pytestmark = pytest.mark.anyio


def settings_for(fake: FakeTeams, **changes: Any) -> TeamsSettings:
    given: dict[str, Any] = {
        "enabled": True,
        "app_id": APP_ID,
        "app_password": APP_PASSWORD,
        "openid_metadata_url": fake.openid_metadata_url,
        "token_url": fake.token_url,
    }
    return TeamsSettings(**(given | changes))


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
        self.refuse: set[str] = set()

    @property
    def texts(self) -> list[str]:
        return [m.text for m in self.messages]

    async def submit(self, message: InboundMessage) -> StubTicket:
        self.messages.append(message)
        if message.text in self.hold:
            await self.hold[message.text].wait()
        return StubTicket(taken=message.text not in self.refuse)


@dataclass
class World:
    fake: FakeTeams
    channel: TeamsChannel
    gate: GatedSubmit
    ada: dict[str, Any]
    bea: dict[str, Any]


FAST = Pacing(retry_window=1.0, retry_backoff=0.05, retry_backoff_max=0.1, stream_interval=0.1)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with FakeTeams(retry_delay=0.2, ack_timeout=2.0) as fake:
        channel = TeamsChannel(settings_for(fake), password=APP_PASSWORD, pacing=FAST)
        health = HealthState()
        http = HttpServer(
            Settings().http.model_copy(update={"port": 0}), health=health, metrics=Metrics()
        )
        channel.mount(http)
        gate = GatedSubmit()
        async with anyio.create_task_group() as tg:
            port = await tg.start(http.run)
            health.set_ready()
            await tg.start(channel.run, gate.submit)
            fake.bot_url = f"http://127.0.0.1:{port}/api/messages"
            yield World(fake, channel, gate, fake.add_person("Ada"), fake.add_person("Bea"))
            tg.cancel_scope.cancel()


# --------------------------------------------------------------------------- translation


def test_keys_for_personal_chats_group_chats_and_channel_threads() -> None:
    fake = FakeTeams()
    fake._port = 1  # addresses only; not served
    ada = fake.add_person("Ada")
    personal = fake.personal_chat(ada)
    group = fake.group_chat([ada], rsc=True)
    team = fake.team_channel([ada])
    dm = translate_activity(fake.message(ada, personal, "hi"))
    chat = translate_activity(fake.message(ada, group, "hi", mention_bot=True))
    post = fake.message(ada, team, "hi", mention_bot=True)
    reply = fake.message(ada, team, "again", mention_bot=True, thread=post["id"])
    first, second = translate_activity(post), translate_activity(reply)
    assert isinstance(dm, InboundMessage) and dm.session_key == f"teams:{personal.id}"
    assert not dm.metadata[META_IS_GROUP]
    assert isinstance(chat, InboundMessage) and chat.session_key == f"teams:{group.id}"
    assert chat.metadata[META_IS_GROUP] and chat.metadata[META_MENTIONED]
    assert isinstance(first, InboundMessage) and isinstance(second, InboundMessage)
    assert first.session_key == second.session_key == f"teams:{team.id}:thread:{post['id']}"
    assert ";" not in first.session_key
    assert first.chat_id == team.id and first.thread_id == post["id"]
    assert join_conversation(first.chat_id, first.thread_id) == post["conversation"]["id"]
    assert join_conversation(f"{team.id}:thread:{post['id']}", None) == post["conversation"]["id"]
    assert first.message_id != second.message_id
    assert dm.sender_id == ada["aadObjectId"] and dm.metadata[META_SENDER_NAME] == "Ada"


def test_the_bots_mention_is_taken_out_and_only_an_entity_addresses_it() -> None:
    fake = FakeTeams()
    fake._port = 1
    ada, bea = fake.add_person("Ada"), fake.add_person("Bea")
    group = fake.group_chat([ada, bea], rsc=True)
    mentioned = fake.message(ada, group, "what is 2+2 &amp; more?", mention_bot=True)
    mentioned["entities"].append(
        {"type": "mention", "text": "<at>Bea</at>", "mentioned": {"id": bea["id"]}}
    )
    mentioned["text"] += " ask <at>Bea</at>"
    message = translate_activity(mentioned)
    assert isinstance(message, InboundMessage)
    assert message.text == "what is 2+2 & more? ask @Bea"
    assert message.metadata[META_MENTIONED]
    # The bot's name typed as text, without the entity, addresses nothing.
    forged = fake.message(ada, group, f"<at>{fake.bot_name}</at> hi")
    typed = translate_activity(forged)
    assert isinstance(typed, InboundMessage) and not typed.metadata[META_MENTIONED]


def test_what_is_not_taken() -> None:
    fake = FakeTeams()
    fake._port = 1
    ada = fake.add_person("Ada")
    chat = fake.personal_chat(ada)
    own = fake.message(ada, chat, "echo")
    own["from"] = own["recipient"]
    webchat = fake.message(ada, chat, "hi") | {"channelId": "webchat"}
    typing = fake.message(ada, chat, "") | {"type": "typing"}
    empty = fake.message(ada, chat, "   ")
    for activity in (own, webchat, typing, empty):
        assert isinstance(translate_activity(activity), Skip)


def test_an_edit_names_the_message_it_changes_and_a_file_is_an_attachment() -> None:
    fake = FakeTeams()
    fake._port = 1
    ada = fake.add_person("Ada")
    chat = fake.personal_chat(ada)
    original = fake.message(ada, chat, "first")
    first = translate_activity(original)
    edit = translate_activity(fake.edit(original, "second"))
    assert isinstance(first, InboundMessage) and isinstance(edit, InboundMessage)
    assert edit.metadata[META_EDIT_OF] == first.message_id != edit.message_id
    assert edit.text == "second"
    with_file = fake.message(
        ada,
        chat,
        "",
        attachments=[
            {
                "contentType": "application/vnd.microsoft.teams.file.download.info",
                "name": "notes.pdf",
                "content": {"downloadUrl": "https://x.example/dl", "fileType": "pdf"},
            },
            {"contentType": "image/png", "contentUrl": "https://smba.example/img"},
            {"contentType": "text/html", "content": "<p>hi</p>"},
        ],
    )
    message = translate_activity(with_file)
    assert isinstance(message, InboundMessage)
    assert [(a.kind, a.name, a.url) for a in message.attachments] == [
        ("document", "notes.pdf", "https://x.example/dl"),
        ("image", "image", "https://smba.example/img"),
    ]


# --------------------------------------------------------------------------- tokens


async def test_every_check_of_an_activitys_token(world: World) -> None:
    fake = world.fake
    keys = world.channel.keys
    activity = fake.message(world.ada, fake.personal_chat(world.ada), "hi")

    async def refused(token: str, which: dict[str, Any] = activity) -> int:
        try:
            await verify_activity(f"Bearer {token}", which, keys, APP_ID)
        except AuthError as exc:
            return exc.status
        return 200

    assert await refused(fake.sign(activity)) == 200
    assert await refused("not-a-jwt") == 401
    assert await refused(fake.sign(activity, claims={"aud": "someone-else"})) == 401
    assert await refused(fake.sign(activity, claims={"iss": "https://evil.example"})) == 401
    expired = {"exp": int(time.time()) - 600, "nbf": int(time.time()) - 4000}
    assert await refused(fake.sign(activity, claims=expired)) == 401
    assert await refused(fake.sign(activity, key=new_signing_key("x", ["msteams"]))) == 401
    other_service = {"serviceurl": "https://smba.example/emea/"}
    assert await refused(fake.sign(activity, claims=other_service)) == 403
    webchat_only = new_signing_key("webchat-only", ["webchat"])
    fake.keys.append(webchat_only)
    await keys.refresh()
    assert await refused(fake.sign(activity, key=webchat_only)) == 403
    with pytest.raises(AuthError):
        await verify_activity("Basic abc", activity, keys, APP_ID)


async def test_an_unknown_key_reads_the_keys_again_at_most_once_a_while(world: World) -> None:
    fake = world.fake
    now = [1000.0]
    keys = ConnectorKeys(fake.openid_metadata_url, world.channel._http, clock=lambda: now[0])
    await keys.refresh()
    rotated = new_signing_key("rotated", ["msteams"])
    fake.keys.append(rotated)
    assert await keys.key("rotated") is None  # read a moment ago
    now[0] += 301
    assert await keys.key("rotated") is not None
    assert await keys.key("made-up") is None
    calls = len([c for c in fake.calls if "keys" in c.path])
    assert calls == 0  # the key documents are not in the connector's log
    assert keys.count("msteams") == 2 and keys.count() == 2


# --------------------------------------------------------------------------- the webhook


async def test_the_200_waits_for_the_journal_and_a_refusal_is_sent_again(world: World) -> None:
    fake, gate = world.fake, world.gate
    chat = fake.personal_chat(world.ada)
    gate.hold["one"] = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.deliver, fake.message(world.ada, chat, "one"))
        with anyio.fail_after(5):
            while gate.texts != ["one"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await anyio.sleep(0.3)
        [delivery] = fake.deliveries
        assert not delivery.attempts  # no answer yet: not journaled
        gate.hold["one"].set()
    gate.refuse.add("two")
    refused = await fake.deliver(fake.message(world.ada, chat, "two"))
    assert [a.status for a in refused.attempts] == [503, 503] and refused.dropped
    assert gate.texts == ["one", "two", "two"]


async def test_a_forged_activity_is_refused_before_anything_is_read(world: World) -> None:
    fake, gate = world.fake, world.gate
    fake.keys[0] = new_signing_key("fake-teams-key-1", ["msteams"])  # the gateway knows the old
    delivery = await fake.deliver(fake.message(world.ada, fake.personal_chat(world.ada), "x"))
    assert {a.status for a in delivery.attempts} == {401}
    assert gate.texts == [] and world.channel.stats.refused["401"] == 2


async def test_a_stopping_gateway_still_takes_activities(world: World) -> None:
    """Teams sends an activity again about once and never to a later start, so nothing
    pauses its intake at a drain: the channel says its platform does not redeliver, and
    the dispatcher journals what comes for the next start (tests/test_dispatch.py)."""
    assert redelivers(world.channel) is False
    assert not hasattr(world.channel, "pause_intake")
    fake = world.fake
    delivery = await fake.deliver(fake.message(world.ada, fake.personal_chat(world.ada), "x"))
    assert {a.status for a in delivery.attempts} == {200} and world.gate.texts == ["x"]


# --------------------------------------------------------------------------- replies


async def inbound(world: World, text: str, *, group: bool = False) -> InboundMessage:
    fake = world.fake
    if group:
        team = fake.team_channel([world.ada])
        activity = fake.message(world.ada, team, text, mention_bot=True)
    else:
        activity = fake.message(world.ada, fake.personal_chat(world.ada), text)
    await fake.deliver(activity)
    return world.gate.messages[-1]


async def test_a_reply_in_a_channel_thread_names_its_sender(world: World) -> None:
    message = await inbound(world, "hello", group=True)
    await world.channel.send(reply_for(message, "**hi** <at>everyone</at>"))
    [post] = world.fake.posts()
    assert post.conversation == join_conversation(message.chat_id, message.thread_id)
    assert post.reply_to == message.thread_id
    assert post.text.startswith("<at>Ada</at> **hi**")
    assert world.fake.mentioned(post) == ({world.ada["id"]}, False)


async def test_a_long_reply_is_resumed_at_the_part_that_failed(world: World) -> None:
    message = await inbound(world, "long please")
    text = "\n\n".join(f"paragraph {n} " + "x" * 900 for n in range(30))
    channel, fake = world.channel, world.fake
    channel.settings = channel.settings.model_copy(update={"max_message_chars": 5000})
    # One 503 ridden out; two parts go out; then the connector fails past the window.
    fake.fail_next(503)
    fake.fail_next(502, count=1000, after=2)
    reply = reply_for(message, text)
    with pytest.raises(DeliveryFailed) as failed:
        await channel.send(reply)
    assert failed.value.sent == 2 and len(fake.posts()) == 2
    fake._scripted.clear()
    await channel.send(reply)
    texts = [p.text for p in fake.posts()]
    assert len(texts) >= 6 and all(len(t) <= 5000 for t in texts)
    assert "".join(texts).count("paragraph 29 ") == 1
    assert [n for t in texts for n in range(30) if f"paragraph {n} " in t] == list(range(30))


async def test_a_throttled_send_waits_its_retry_after(world: World) -> None:
    message = await inbound(world, "hi")
    world.fake.fail_next(429, retry_after=0.3)
    began = time.monotonic()
    await world.channel.send(reply_for(message, "answer"))
    assert time.monotonic() - began >= 0.3
    assert [p.text for p in world.fake.posts()] == ["answer"]
    assert world.channel.stats.throttled == 1


async def test_a_500_is_not_repeated_and_is_no_delivery_failure(world: World) -> None:
    message = await inbound(world, "hi")
    world.fake.fail_next(500)
    with pytest.raises(Exception) as raised:
        await world.channel.send(reply_for(message, "answer"))
    assert not isinstance(raised.value, DeliveryFailed)
    assert world.fake.posts() == []


async def test_an_expired_token_is_asked_for_again(world: World) -> None:
    message = await inbound(world, "hi")
    world.fake.expire_tokens()
    before = world.fake.token_requests
    await world.channel.send(reply_for(message, "answer"))
    assert world.fake.token_requests == before + 1
    assert [p.text for p in world.fake.posts()] == ["answer"]


async def test_a_refused_secret_says_what_to_fix(world: World) -> None:
    message = await inbound(world, "hi")
    world.fake.app_password = "rotated"
    world.fake.expire_tokens()
    world.channel.token.forget()
    with pytest.raises(TeamsSetupError, match="APP_PASSWORD") as raised:
        await world.channel.send(reply_for(message, "answer"))
    assert "rotated" not in str(raised.value) and APP_PASSWORD not in str(raised.value)


async def test_a_reply_to_nothing_goes_to_the_conversation(world: World) -> None:
    message = await inbound(world, "hi")
    proactive = OutboundMessage("teams", message.chat_id, "reminder", message.session_key)
    await world.channel.send(proactive)
    [post] = world.fake.posts()
    assert post.reply_to is None and post.text == "reminder"


async def test_images_go_inline_and_other_files_are_named(world: World) -> None:
    message = await inbound(world, "hi")
    png = OutboundFile("chart.png", b"\x89PNG fake", "image/png", "the chart")
    pdf = OutboundFile("report.pdf", b"%PDF", "application/pdf")
    await world.channel.send(reply_for(message, "here", files=(png, pdf)))
    _, image, named = world.fake.posts()
    assert image.attachments[0]["contentUrl"].startswith("data:image/png;base64,")
    assert "report.pdf not sent" in named.text


async def test_streaming_updates_one_message(world: World) -> None:
    world.channel.settings = world.channel.settings.model_copy(update={"streaming": True})
    message = await inbound(world, "hi")
    await world.channel.stream_delta(message, "Hel")
    await anyio.sleep(0.15)
    await world.channel.stream_delta(message, "lo")
    with anyio.fail_after(3):
        while not world.fake.posts():  # noqa: ASYNC110
            await anyio.sleep(0.02)
    await world.channel.send(reply_for(message, "Hello, world"))
    [post] = world.fake.posts()
    assert post.text == "Hello, world" and post.updates >= 1


async def test_a_pasted_image_is_fetched_with_the_bots_token(world: World) -> None:
    await inbound(world, "hi")  # the connector's address is known from an activity
    url = world.fake.add_attachment(b"image bytes", "image/png")
    activity = world.fake.message(
        world.ada,
        world.fake.personal_chat(world.ada),
        "",
        attachments=[{"contentType": "image/png", "contentUrl": url}],
    )
    message = translate_activity(activity)
    assert isinstance(message, InboundMessage)
    data = await world.channel.fetch_file(message.attachments[0], max_bytes=1000)
    assert data == b"image bytes"


async def test_typing_shows_while_a_turn_runs(world: World) -> None:
    class Slow:
        taken = True

        async def reply(self) -> None:
            await anyio.sleep(1.2)

    fake = world.fake
    activity = fake.message(world.ada, fake.personal_chat(world.ada), "hi")
    world.channel._remember_service_url(activity)
    where = (fake.service_url, activity["conversation"]["id"])
    await world.channel._typing_while_pending(Slow(), where)
    await anyio.sleep(0.1)
    typing = [c for c in fake.calls if c.body.get("type") == "typing"]
    assert typing and typing[0].status == 200


# --------------------------------------------------------------------------- the doctor


async def test_the_doctor_checks_keys_and_credentials() -> None:
    async with FakeTeams() as fake:
        found = await check_credentials(settings_for(fake), APP_PASSWORD)
        assert found.endorsed == 1 and found.keys == 1
        lines = await checks(settings_for(fake))
        assert [f.status for f in lines] == ["ok", "ok", "ok"]
        wrong = settings_for(fake, app_password="the secret id")
        [failed] = await checks(wrong)
        assert failed.status == "fail" and "invalid_client" in failed.what
        assert "the secret id" not in failed.what
    [missing] = await checks(TeamsSettings(enabled=True, app_id=APP_ID))
    assert missing.status == "fail" and "APP_PASSWORD" in missing.fix


def test_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="GUID"):
        TeamsSettings(tenant_id="contoso.onmicrosoft.com")
    single = TeamsSettings(tenant_id="72f988bf-86f1-41af-91ab-2d7cd011db47")
    assert single.resolved_token_url() == (
        "https://login.microsoftonline.com/72f988bf-86f1-41af-91ab-2d7cd011db47/oauth2/v2.0/token"
    )
    assert TeamsSettings().resolved_token_url().endswith("/botframework.com/oauth2/v2.0/token")


async def test_build_mounts_the_endpoint_and_counts_on_metrics() -> None:
    from channels.teams.spec import SPEC
    from gateway.registry import ChannelServices

    async with FakeTeams() as fake:
        metrics = Metrics()
        http = HttpServer(
            Settings().http.model_copy(update={"port": 0}), health=HealthState(), metrics=metrics
        )

        async def no_access(message: InboundMessage) -> None:
            return None

        services = ChannelServices(
            http=http,
            storage=None,  # type: ignore[arg-type]
            metrics=metrics.for_channel("teams"),
            admin=None,  # type: ignore[arg-type]
            access_check=no_access,
        )
        channel = SPEC.build(settings_for(fake), services)
        assert isinstance(channel, TeamsChannel)
        channel.stats.refused["403"] = 2
        channel.stats.throttled = 3
        body, _ = await metrics.collect()
        text = body.decode()
        assert 'gateway_teams_refused_activities_total{status="403"} 2.0' in text
        assert "gateway_teams_throttled_total 3.0" in text
