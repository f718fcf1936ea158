"""The fake Teams (tests/fakes/teams_server.py) has the semantics the delivery promise and the
channel's checks depend on: what it signs and how (keys listed at the metadata's jwks_uri,
endorsed per channel), when it considers an activity delivered, how it retries one that
was not (once, then never), what its connector refuses, and what a post notifies."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import aiohttp
import anyio
import jwt
import pytest
from aiohttp import web

from tests.fakes.teams_server import (
    APP_ID,
    APP_PASSWORD,
    ISSUER,
    SCOPE,
    FakeTeams,
)

pytestmark = pytest.mark.anyio


class Bot:
    """A bot endpoint on 127.0.0.1 whose answers the test chooses."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, Any], str]] = []
        self.status = 200
        self.delay = 0.0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.got.append((await request.json(), request.headers.get("Authorization", "")))
        if self.delay:
            await anyio.sleep(self.delay)
        return web.Response(status=self.status)


@pytest.fixture
async def world() -> AsyncIterator[tuple[FakeTeams, Bot]]:
    bot = Bot()
    app = web.Application()
    app.router.add_post("/api/messages", bot.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    bot.url = f"http://127.0.0.1:{runner.addresses[0][1]}/api/messages"
    async with FakeTeams(retry_delay=0.2, ack_timeout=1.0) as fake:
        fake.bot_url = bot.url
        yield fake, bot
    await runner.cleanup()


async def get_json(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        body: dict[str, Any] = await response.json()
        return body


async def token_for(fake: FakeTeams, **form: str) -> tuple[int, dict[str, Any]]:
    data = {
        "grant_type": "client_credentials",
        "client_id": APP_ID,
        "client_secret": APP_PASSWORD,
        "scope": SCOPE,
    } | form
    async with (
        aiohttp.ClientSession() as session,
        session.post(fake.token_url, data=data) as response,
    ):
        return response.status, await response.json()


async def test_activities_are_signed_with_a_listed_key_endorsed_for_teams(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, bot = world
    metadata = await get_json(fake.openid_metadata_url)
    assert metadata["issuer"] == ISSUER
    assert metadata["id_token_signing_alg_values_supported"] == ["RS256"]
    keys = (await get_json(metadata["jwks_uri"]))["keys"]
    person = fake.add_person("Ada")
    chat = fake.personal_chat(person)
    delivery = await fake.deliver(fake.message(person, chat, "hello"))
    assert delivery.delivered and len(delivery.attempts) == 1
    activity, authorization = bot.got[0]
    token = authorization.removeprefix("Bearer ")
    kid = jwt.get_unverified_header(token)["kid"]
    [listed] = [k for k in keys if k["kid"] == kid]
    assert "msteams" in listed["endorsements"]
    claims = jwt.decode(
        token, jwt.PyJWK(listed).key, algorithms=["RS256"], audience=APP_ID, issuer=ISSUER
    )
    assert claims["serviceurl"] == activity["serviceUrl"] == fake.service_url
    assert claims["exp"] > time.time()
    assert activity["channelId"] == "msteams"
    assert activity["conversation"] == {
        "conversationType": "personal",
        "tenantId": fake.tenant_id,
        "id": chat.id,
    }


async def test_the_token_endpoint_answers_as_entra_id_does(world: tuple[FakeTeams, Bot]) -> None:
    fake, _ = world
    status, body = await token_for(fake)
    assert status == 200 and body["token_type"] == "Bearer" and body["expires_in"] > 3000
    status, body = await token_for(fake, client_secret="the secret's id")
    assert status == 401 and body["error"] == "invalid_client"
    assert body["error_description"].startswith("AADSTS7000215")
    status, body = await token_for(fake, client_id="00000000-0000-0000-0000-000000000000")
    assert status == 400 and body["error"] == "unauthorized_client"
    status, body = await token_for(fake, scope="https://graph.microsoft.com/.default")
    assert status == 400 and body["error"] == "invalid_scope"


async def call(
    fake: FakeTeams, method: str, path: str, body: dict[str, Any], token: str | None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, f"{fake.service_url}{path}", json=body, headers=headers) as r,
    ):
        return r.status, await r.json(), dict(r.headers)


async def test_the_connector_takes_only_the_bots_token_and_known_places(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, _ = world
    person = fake.add_person("Ada")
    team = fake.team_channel([person])
    post = fake.message(person, team, "a post", mention_bot=True)
    thread = post["conversation"]["id"]
    assert thread == f"{team.id};messageid={post['id']}"
    encoded = quote(thread, safe="")
    path = f"v3/conversations/{encoded}/activities/{post['id']}"
    message = {"type": "message", "text": "hi"}
    assert (await call(fake, "POST", path, message, None))[0] == 401
    _, body = await token_for(fake)
    token = body["access_token"]
    status, answer, _ = await call(fake, "POST", path, message, token)
    assert status == 201 and answer["id"]
    [posted] = fake.posts()
    assert posted.conversation == thread and posted.reply_to == post["id"]
    missing = f"v3/conversations/{quote('19:nope@thread.v2', safe='')}/activities"
    status, answer, _ = await call(fake, "POST", missing, message, token)
    assert status == 404 and answer["error"]["code"] == "ConversationNotFound"
    fake.expire_tokens()
    assert (await call(fake, "POST", path, message, token))[0] == 401
    status, body = await token_for(fake)
    token = body["access_token"]
    fake.fail_next(429, retry_after=2)
    status, answer, headers = await call(fake, "POST", path, message, token)
    assert status == 429 and answer["error"]["code"] == "Throttled"
    assert headers["Retry-After"] == "2"
    huge = {"type": "message", "text": "x" * 60_000}  # 120 KB in UTF-16
    status, answer, _ = await call(fake, "POST", path, huge, token)
    assert status == 413 and answer["error"]["code"] == "MessageSizeTooBig"
    update = f"v3/conversations/{encoded}/activities/{posted.id}"
    status, _, _ = await call(fake, "PUT", update, {"type": "message", "text": "edited"}, token)
    assert status == 200
    [posted] = fake.posts()
    assert posted.text == "edited" and posted.updates == 1


async def test_a_failed_delivery_is_retried_once_and_then_dropped(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, bot = world
    person = fake.add_person("Ada")
    chat = fake.personal_chat(person)
    bot.status = 503
    delivery = await fake.deliver(fake.message(person, chat, "lost"))
    assert [a.status for a in delivery.attempts] == [503, 503]
    assert delivery.dropped and len(bot.got) == 2
    bot.status = 200
    delivery = await fake.deliver(fake.message(person, chat, "kept"))
    assert delivery.delivered and len(delivery.attempts) == 1


async def test_no_answer_within_the_ack_timeout_is_retried_so_the_bot_gets_it_twice(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, bot = world
    person = fake.add_person("Ada")
    chat = fake.personal_chat(person)
    bot.delay = 1.5  # past the fake's 1 s (Teams: 15 s)
    delivery = await fake.deliver(fake.message(person, chat, "slow"))
    assert [a.failure for a in delivery.attempts] == ["no answer within 1s"] * 2
    assert [g["id"] for g, _ in bot.got] == [delivery.activity["id"]] * 2


async def test_an_unreachable_bot_loses_the_activity_after_the_retry(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, _ = world
    fake.bot_url = "http://127.0.0.1:9/api/messages"
    person = fake.add_person("Ada")
    delivery = await fake.deliver(fake.message(person, fake.personal_chat(person), "gone"))
    assert len(delivery.attempts) == 2 and delivery.dropped
    assert all(a.status == 0 for a in delivery.attempts)


async def test_one_conversation_is_delivered_in_order_one_at_a_time(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, bot = world
    person = fake.add_person("Ada")
    chat = fake.personal_chat(person)
    bot.delay = 0.2
    first = fake.message(person, chat, "one")
    second = fake.message(person, chat, "two")
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.deliver, first)
        await anyio.sleep(0.05)
        tg.start_soon(fake.deliver, second)
    assert [g["text"] for g, _ in bot.got] == ["one", "two"]
    [a], [b] = (d.attempts for d in fake.deliveries)
    assert b.sent_at >= a.answered_at


async def test_channels_reach_the_bot_only_when_mentioned_unless_it_reads_them_all(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, _ = world
    person = fake.add_person("Ada")
    quiet = fake.team_channel([person])
    assert not fake.reaches_bot(fake.message(person, quiet, "chatter"))
    assert fake.reaches_bot(fake.message(person, quiet, "hey", mention_bot=True))
    everything = fake.team_channel([person], rsc=True)
    assert fake.reaches_bot(fake.message(person, everything, "chatter"))
    reply = fake.message(person, everything, "in a thread", thread="1700000000000")
    assert reply["conversation"]["id"].endswith(";messageid=1700000000000")


async def test_a_mention_notifies_only_with_an_entity_whose_text_is_in_the_message(
    world: tuple[FakeTeams, Bot],
) -> None:
    fake, _ = world
    person = fake.add_person("Ada")
    team = fake.team_channel([person], rsc=True)
    post = fake.message(person, team, "hi", mention_bot=True)
    _, body = await token_for(fake)
    thread = quote(post["conversation"]["id"], safe="")
    ada = {"type": "mention", "text": "<at>Ada</at>", "mentioned": {"id": person["id"]}}
    channel = {"type": "mention", "text": "<at>General</at>", "mentioned": {"id": team.id}}
    for text, entities in (
        ("<at>Ada</at> hello", [ada]),
        ("hello", [ada]),
        ("<at>General</at> everyone", [channel]),
        ("@everyone <at>everyone</at>", []),
    ):
        await call(
            fake,
            "POST",
            f"v3/conversations/{thread}/activities",
            {"type": "message", "text": text, "entities": entities},
            body["access_token"],
        )
    assert [fake.mentioned(p) for p in fake.posts()] == [
        ({person["id"]}, False),
        (set(), False),
        (set(), True),
        (set(), False),
    ]


async def test_an_edit_is_a_message_update_with_the_same_id(world: tuple[FakeTeams, Bot]) -> None:
    fake, _ = world
    person = fake.add_person("Ada")
    team = fake.team_channel([person])
    post = fake.message(person, team, "first", mention_bot=True)
    edited = fake.edit(post, "second")
    assert edited["type"] == "messageUpdate" and edited["id"] == post["id"]
    assert edited["channelData"]["eventType"] == "editMessage"
    assert edited["text"] == f"<at>{fake.bot_name}</at> second"
    assert edited["timestamp"] >= post["timestamp"]
