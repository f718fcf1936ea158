"""The fake Google Chat keeps the semantics the gateway's promises rely on, as Google's
documentation states them (tests/fakes/googlechat_server.py names the pages): checked with
plain HTTP clients and PyJWT, not with the channel, so a fake that drifted to suit the
channel would fail here.

What the promise depends on: when Google Chat sends an event (a DM always, a space only
on a mention) and that it never sends it again; what it signs (the bearer token of
either audience form, the keys it publishes); that a client-assigned message id is
refused the second time (what makes a reply's repeat harmless); the token endpoint's
rules; the per-space write quota."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import jwt
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.fakes.googlechat_server import (
    CHAT_BOT_SCOPE,
    CHAT_CERTS_PATH,
    CHAT_ISSUER,
    JWT_BEARER,
    MAX_MESSAGE_BYTES,
    OIDC_CERTS_PATH,
    REPLY_OR_FAIL,
    REPLY_OR_NEW_THREAD,
    TOKEN_PATH,
    FakeGoogleChat,
    mentions_of,
)

pytestmark = pytest.mark.anyio


class Endpoint:
    """A stand-in for an app's endpoint: records every request, answers as told."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.status = 200
        self.answer: dict[str, Any] = {}
        self.delay = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((dict(request.headers), await request.json()))
        if self.delay:
            await anyio.sleep(self.delay)
        return web.json_response(self.answer, status=self.status)

    async def __aenter__(self) -> Endpoint:
        app = web.Application()
        app.router.add_post("/googlechat/events", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}/googlechat/events"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[FakeGoogleChat]:
    async with FakeGoogleChat(response_timeout=2.0) as server:
        yield server


@pytest.fixture
async def endpoint(fake: FakeGoogleChat) -> AsyncIterator[Endpoint]:
    async with Endpoint() as app:
        fake.webhook_url = app.url
        yield app


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def assertion(fake: FakeGoogleChat, **claims: Any) -> str:
    info = fake.service_account_info()
    now = int(time.time())
    body = {
        "iss": info["client_email"],
        "scope": CHAT_BOT_SCOPE,
        "aud": info["token_uri"],
        "iat": now,
        "exp": now + 3600,
    } | claims
    return jwt.encode(body, info["private_key"], algorithm="RS256")


async def grant(
    http: aiohttp.ClientSession, fake: FakeGoogleChat, token: str, grant_type: str = JWT_BEARER
) -> tuple[int, dict[str, Any]]:
    form = {"grant_type": grant_type, "assertion": token}
    async with http.post(f"{fake.url}{TOKEN_PATH}", data=form) as answer:
        return answer.status, await answer.json()


async def app_headers(http: aiohttp.ClientSession, fake: FakeGoogleChat) -> dict[str, str]:
    status, answer = await grant(http, fake, assertion(fake))
    assert status == 200, answer
    return {"Authorization": f"Bearer {answer['access_token']}"}


async def create(
    http: aiohttp.ClientSession,
    fake: FakeGoogleChat,
    space: str,
    body: dict[str, Any],
    **params: str,
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        f"{fake.url}/v1/{space}/messages",
        json=body,
        params=params,
        headers=await app_headers(http, fake),
    ) as answer:
        return answer.status, await answer.json()


# -- the service account's token --------------------------------------------------------------


async def test_the_jwt_bearer_grant_gives_a_token_for_an_hour(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    status, answer = await grant(http, fake, assertion(fake))
    assert status == 200
    assert answer["token_type"] == "Bearer" and answer["expires_in"] == 3600
    assert answer["access_token"].startswith("ya29.")


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"aud": "https://elsewhere.example/token"}, "invalid_grant"),
        ({"iss": "someone@else.iam.gserviceaccount.com"}, "invalid_grant"),
        ({"exp": int(time.time()) + 7200}, "invalid_grant"),  # longer than an hour
        ({"scope": ""}, "invalid_scope"),
    ],
)
async def test_the_token_endpoint_refuses_a_wrong_assertion(
    fake: FakeGoogleChat, http: aiohttp.ClientSession, change: dict[str, Any], error: str
) -> None:
    status, answer = await grant(http, fake, assertion(fake, **change))
    assert (status, answer["error"]) == (400, error)
    assert answer["error_description"]


async def test_a_deleted_key_or_a_foreign_signature_is_an_invalid_grant(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = jwt.encode({"iss": fake.client_email}, stranger, algorithm="RS256")
    assert (await grant(http, fake, forged))[1]["error"] == "invalid_grant"
    assert (await grant(http, fake, assertion(fake), grant_type="password"))[1]["error"] == (
        "unsupported_grant_type"
    )
    fake.revoke_key()
    status, answer = await grant(http, fake, assertion(fake))
    assert (status, answer["error"]) == (400, "invalid_grant")


async def test_the_api_takes_only_a_current_access_token(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    async with http.get(f"{fake.url}/v1/spaces") as answer:
        assert answer.status == 401
        assert (await answer.json())["error"]["status"] == "UNAUTHENTICATED"
    headers = await app_headers(http, fake)
    async with http.get(f"{fake.url}/v1/spaces", headers=headers) as answer:
        assert answer.status == 200
    fake.expire_tokens()
    async with http.get(f"{fake.url}/v1/spaces", headers=headers) as answer:
        assert answer.status == 401


# -- what Google Chat signs ---------------------------------------------------------------------


async def certificates(http: aiohttp.ClientSession, url: str) -> tuple[dict[str, Any], str]:
    async with http.get(url) as answer:
        return await answer.json(), answer.headers["Cache-Control"]


async def test_a_project_number_token_is_chats_signed_by_a_published_key(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    certs, cache = await certificates(http, f"{fake.url}{CHAT_CERTS_PATH}")
    assert "max-age=" in cache
    token = fake.event_token("https://gateway.example/googlechat/events")
    kid = jwt.get_unverified_header(token)["kid"]
    key = x509.load_pem_x509_certificate(certs[kid].encode()).public_key()
    claims = jwt.decode(
        token, key, algorithms=["RS256"], audience=fake.project_number, issuer=CHAT_ISSUER
    )
    assert claims["exp"] - claims["iat"] == 3600


async def test_an_endpoint_url_audience_gets_a_google_id_token_naming_chat(
    http: aiohttp.ClientSession,
) -> None:
    url = "https://gateway.example/googlechat/events"
    async with FakeGoogleChat(audience=url) as fake:
        certs, _ = await certificates(http, f"{fake.url}{OIDC_CERTS_PATH}")
        token = fake.event_token(url)
        key = x509.load_pem_x509_certificate(
            certs[jwt.get_unverified_header(token)["kid"]].encode()
        ).public_key()
        claims = jwt.decode(
            token, key, algorithms=["RS256"], audience=url, issuer="https://accounts.google.com"
        )
        assert claims["email"] == CHAT_ISSUER and claims["email_verified"] is True
        chat_certs, _ = await certificates(http, f"{fake.url}{CHAT_CERTS_PATH}")
        assert jwt.get_unverified_header(token)["kid"] not in chat_certs


async def test_rotated_keys_sign_from_then_on_and_the_old_stay_published(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    before = jwt.get_unverified_header(fake.event_token("x"))["kid"]
    fake.rotate_keys()
    after = jwt.get_unverified_header(fake.event_token("x"))["kid"]
    certs, _ = await certificates(http, f"{fake.url}{CHAT_CERTS_PATH}")
    assert before != after and {before, after} <= set(certs)


# -- when Google Chat sends an event ----------------------------------------------------------


async def test_a_dm_is_always_sent_and_a_space_only_on_a_mention(
    fake: FakeGoogleChat, endpoint: Endpoint
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])
    town = fake.create_space("Town", [alice["name"]])
    fake.user_message(dm["name"], alice["name"], "hello")
    fake.user_message(town["name"], alice["name"], "just chatting")
    mention = fake.user_message(town["name"], alice["name"], "what is up?", mention=True)
    with anyio.fail_after(10):
        await fake.delivered(2)
    await anyio.sleep(0.2)
    assert len(fake.deliveries) == 2  # the chatter never reached the app
    headers, first = endpoint.requests[0]
    assert headers["User-Agent"] == "Google-Dynamite"
    assert headers["Authorization"].startswith("Bearer ")
    assert first["type"] == "MESSAGE" and first["space"]["spaceType"] == "DIRECT_MESSAGE"
    assert first["message"]["text"] == "hello" and first["user"]["name"] == alice["name"]
    _, second = endpoint.requests[1]
    message = second["message"]
    assert message["name"] == mention["name"] and second["space"]["spaceType"] == "SPACE"
    assert message["text"] == "@Kit Bot what is up?"
    assert message["argumentText"] == " what is up?"
    user = message["annotations"][0]["userMention"]["user"]
    assert user["type"] == "BOT" and user["name"] == fake.app_user["name"]
    assert message["threadReply"] is False and message["thread"]["name"].startswith(town["name"])


async def test_a_thread_reply_names_its_thread(fake: FakeGoogleChat, endpoint: Endpoint) -> None:
    alice, bob = fake.add_user("Alice"), fake.add_user("Bob")
    town = fake.create_space("Town", [alice["name"], bob["name"]])
    root = fake.user_message(town["name"], bob["name"], "a topic")
    reply = fake.user_message(
        town["name"], alice["name"], "about it", mention=True, thread=root["thread"]["name"]
    )
    with anyio.fail_after(10):
        await fake.delivered(1)
    event = endpoint.requests[0][1]
    assert event["message"]["name"] == reply["name"]
    assert event["message"]["threadReply"] is True
    assert event["message"]["thread"]["name"] == root["thread"]["name"]


async def test_an_event_is_sent_once_and_never_again_whatever_the_answer(
    fake: FakeGoogleChat, endpoint: Endpoint
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])
    endpoint.status = 503
    fake.user_message(dm["name"], alice["name"], "first")
    with anyio.fail_after(10):
        await fake.delivered(1)
    endpoint.status, endpoint.delay = 200, 3.0  # past the response time limit (2 s here)
    fake.user_message(dm["name"], alice["name"], "second")
    with anyio.fail_after(15):
        await fake.delivered(2)
    await anyio.sleep(1.5)
    failures = [d.failure for d in fake.deliveries]
    assert failures == ["HTTP 503", "timeout"]
    assert len(endpoint.requests) == 2  # no retry
    fake.webhook_url = "http://127.0.0.1:9/nothing-listens"
    fake.user_message(dm["name"], alice["name"], "third")
    with anyio.fail_after(10):
        await fake.delivered(3)
    assert fake.deliveries[-1].failure == "ClientConnectorError"


async def test_a_space_s_events_go_one_at_a_time_in_order(
    fake: FakeGoogleChat, endpoint: Endpoint
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])
    endpoint.delay = 0.05
    for n in range(6):
        fake.user_message(dm["name"], alice["name"], f"m{n}")
    with anyio.fail_after(10):
        await fake.delivered(6)
    assert [body["message"]["text"] for _, body in endpoint.requests] == [f"m{n}" for n in range(6)]
    spans = sorted((d.sent_at, d.answered_at) for d in fake.deliveries)
    assert all(spans[i][1] <= spans[i + 1][0] + 0.01 for i in range(5))


async def test_a_synchronous_answer_is_posted_in_the_messages_thread(
    fake: FakeGoogleChat, endpoint: Endpoint
) -> None:
    alice = fake.add_user("Alice")
    town = fake.create_space("Town", [alice["name"]])
    root = fake.user_message(town["name"], alice["name"], "topic")
    endpoint.answer = {"text": "said at once"}
    fake.user_message(
        town["name"], alice["name"], "hi", mention=True, thread=root["thread"]["name"]
    )
    with anyio.fail_after(10):
        await fake.delivered(1)
    endpoint.answer = {}
    fake.user_message(town["name"], alice["name"], "again", mention=True)
    with anyio.fail_after(10):
        await fake.delivered(2)
    posted = fake.app_messages()
    assert [m["text"] for m in posted] == ["said at once"]
    assert posted[0]["thread"]["name"] == root["thread"]["name"] and posted[0]["threadReply"]


async def test_redeliver_hands_the_same_event_over_again(
    fake: FakeGoogleChat, endpoint: Endpoint
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])
    message = fake.user_message(dm["name"], alice["name"], "once")
    fake.redeliver(message["name"])
    with anyio.fail_after(10):
        await fake.delivered(2)
    first, second = (body for _, body in endpoint.requests)
    assert first == second


# -- the Chat API -------------------------------------------------------------------------------


async def test_a_client_message_id_makes_a_message_once(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])["name"]
    status, first = await create(http, fake, dm, {"text": "hi"}, messageId="client-abc-1")
    assert status == 200 and first["clientAssignedMessageId"] == "client-abc-1"
    status, again = await create(http, fake, dm, {"text": "hi"}, messageId="client-abc-1")
    assert status == 409 and again["error"]["status"] == "ALREADY_EXISTS"
    for bad in ("abc", "client-UPPER", "client-" + "a" * 57):
        status, _ = await create(http, fake, dm, {"text": "x"}, messageId=bad)
        assert status == 400, bad
    headers = await app_headers(http, fake)
    async with http.get(f"{fake.url}/v1/{dm}/messages/client-abc-1", headers=headers) as r:
        assert (await r.json())["name"] == first["name"]
    assert [m["text"] for m in fake.app_messages()] == ["hi"]


async def test_a_request_id_returns_the_message_it_made(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])["name"]
    _, first = await create(http, fake, dm, {"text": "hi"}, requestId="r-1")
    status, again = await create(http, fake, dm, {"text": "hi"}, requestId="r-1")
    assert status == 200 and again["name"] == first["name"]
    assert len(fake.app_messages()) == 1


async def test_the_size_limit_is_32000_bytes_and_a_message_has_text(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])["name"]
    assert (await create(http, fake, dm, {"text": "a" * MAX_MESSAGE_BYTES}))[0] == 200
    status, answer = await create(http, fake, dm, {"text": "é" * (MAX_MESSAGE_BYTES // 2 + 1)})
    assert (status, answer["error"]["status"]) == (400, "INVALID_ARGUMENT")
    assert (await create(http, fake, dm, {"text": ""}))[0] == 400


async def test_threads_follow_the_message_reply_option(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    town = fake.create_space("Town", [alice["name"]])["name"]
    root = fake.user_message(town, alice["name"], "topic")
    thread = {"name": root["thread"]["name"]}
    _, ignored = await create(http, fake, town, {"text": "a", "thread": thread})
    assert ignored["thread"]["name"] != thread["name"] and ignored["threadReply"] is False
    _, reply = await create(
        http, fake, town, {"text": "b", "thread": thread}, messageReplyOption=REPLY_OR_NEW_THREAD
    )
    assert reply["thread"]["name"] == thread["name"] and reply["threadReply"] is True
    gone = {"name": f"{town}/threads/nope"}
    _, fallback = await create(
        http, fake, town, {"text": "c", "thread": gone}, messageReplyOption=REPLY_OR_NEW_THREAD
    )
    assert fallback["thread"]["name"] != gone["name"] and fallback["threadReply"] is False
    status, answer = await create(
        http, fake, town, {"text": "d", "thread": gone}, messageReplyOption=REPLY_OR_FAIL
    )
    assert (status, answer["error"]["status"]) == (404, "NOT_FOUND")
    keyed = {"threadKey": "daily"}
    _, one = await create(
        http, fake, town, {"text": "e", "thread": keyed}, messageReplyOption=REPLY_OR_NEW_THREAD
    )
    _, two = await create(
        http, fake, town, {"text": "f", "thread": keyed}, messageReplyOption=REPLY_OR_NEW_THREAD
    )
    assert one["thread"]["name"] == two["thread"]["name"] and two["threadReply"] is True


async def test_the_app_edits_only_its_own_messages_by_name_or_custom_id(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])["name"]
    theirs = fake.user_message(dm, alice["name"], "mine")
    _, ours = await create(http, fake, dm, {"text": "draft"}, messageId="client-draft")
    headers = await app_headers(http, fake)
    url = f"{fake.url}/v1/{dm}/messages/client-draft"
    body = {"text": "final", "markupSyntax": "MARKUP_SYNTAX_CHAT"}
    async with http.patch(url, json=body, params={"updateMask": "text"}, headers=headers) as r:
        assert r.status == 200 and (await r.json())["text"] == "final"
    assert fake.messages[ours["name"]]["text"] == "final"
    assert fake.markup[ours["name"]] == "MARKUP_SYNTAX_CHAT"
    async with http.patch(url, json=body, headers=headers) as r:
        assert r.status == 400  # no updateMask
    async with http.patch(
        f"{fake.url}/v1/{theirs['name']}", json=body, params={"updateMask": "text"}, headers=headers
    ) as r:
        assert (r.status, (await r.json())["error"]["status"]) == (403, "PERMISSION_DENIED")


async def test_a_space_takes_so_many_writes_a_minute(http: aiohttp.ClientSession) -> None:
    async with FakeGoogleChat(writes_per_minute=3) as fake:
        alice = fake.add_user("Alice")
        dm = fake.dm_space(alice["name"])["name"]
        other = fake.dm_space(fake.add_user("Bob")["name"])["name"]
        statuses = [(await create(http, fake, dm, {"text": f"{n}"}))[0] for n in range(4)]
        assert statuses == [200, 200, 200, 429]
        assert (await create(http, fake, other, {"text": "elsewhere"}))[0] == 200


async def test_mentions_in_the_text_are_annotated(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    town = fake.create_space("Town", [alice["name"]])["name"]
    _, message = await create(http, fake, town, {"text": f"<{alice['name']}> hi <users/all>"})
    people, everyone = mentions_of(message)
    assert people == {alice["name"].removeprefix("users/")} and everyone
    _, defused = await create(http, fake, town, {"text": "hi <\u200busers/all>"})
    assert mentions_of(defused) == (set(), False)


async def test_the_app_posts_only_in_spaces_it_is_in(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    closed = fake.create_space("Closed", [alice["name"]], app=False)["name"]
    status, answer = await create(http, fake, closed, {"text": "hi"})
    assert (status, answer["error"]["status"]) == (404, "NOT_FOUND")


async def test_uploaded_files_download_with_the_apps_token(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    attachment = fake.add_media(b"%PDF-1.4 fake", "application/pdf", "report.pdf")
    resource = attachment["attachmentDataRef"]["resourceName"]
    url = f"{fake.url}/v1/media/{resource}"
    async with http.get(url, params={"alt": "media"}) as r:
        assert r.status == 401
    headers = await app_headers(http, fake)
    async with http.get(url, params={"alt": "media"}, headers=headers) as r:
        assert r.status == 200 and await r.read() == b"%PDF-1.4 fake"


async def test_a_scripted_failure_after_the_request_was_carried_out(
    fake: FakeGoogleChat, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("Alice")
    dm = fake.dm_space(alice["name"])["name"]
    headers = await app_headers(http, fake)
    fake.fail_next(503, after=True)
    async with http.post(
        f"{fake.url}/v1/{dm}/messages",
        json={"text": "hi"},
        params={"messageId": "client-x"},
        headers=headers,
    ) as r:
        assert r.status == 503
    assert [m["text"] for m in fake.app_messages()] == ["hi"]  # it went out all the same
    status, _ = await create(http, fake, dm, {"text": "hi"}, messageId="client-x")
    assert status == 409
