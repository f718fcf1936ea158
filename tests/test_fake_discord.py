"""The fake Discord keeps the semantics the gateway's promises rely on, as Discord's
developer documentation states them (tests/fakes/discord_server.py names the pages):
checked with a plain WebSocket and HTTP client, not with discord.py, so a fake that
drifted to suit discord.py would fail here."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest

from tests.fakes.discord_server import (
    DIRECT_MESSAGES,
    GUILD_MESSAGES,
    GUILDS,
    MESSAGE_CONTENT,
    FakeDiscord,
    zlib_stream_decoder,
)

pytestmark = pytest.mark.anyio

INTENTS = GUILDS | GUILD_MESSAGES | DIRECT_MESSAGES | MESSAGE_CONTENT


@pytest.fixture
async def fake() -> AsyncIterator[FakeDiscord]:
    async with FakeDiscord(heartbeat_interval_ms=5000, resume_window=30) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Gateway:
    """A bare Gateway client: JSON payloads in and out, optionally zlib-stream."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, *, compressed: bool) -> None:
        self.ws = ws
        self.decode = zlib_stream_decoder() if compressed else None
        self.frames: list[bytes] = []

    async def receive(self, seconds: float = 5.0) -> dict[str, Any]:
        while True:
            frame = await self.ws.receive(timeout=seconds)
            if frame.type is aiohttp.WSMsgType.TEXT:
                return dict(json.loads(frame.data))
            if frame.type is aiohttp.WSMsgType.BINARY:
                self.frames.append(frame.data)
                assert self.decode is not None
                text = self.decode(frame.data)
                if text is not None:
                    return dict(json.loads(text))
                continue
            raise ConnectionError(f"closed: {frame.type.name} {self.ws.close_code}")

    async def until(self, event: str, seconds: float = 5.0) -> dict[str, Any]:
        while True:
            payload = await self.receive(seconds)
            if payload.get("t") == event:
                return payload

    async def send(self, op: int, data: Any) -> None:
        await self.ws.send_str(json.dumps({"op": op, "d": data}))

    async def identify(self, token: str, intents: int = INTENTS) -> dict[str, Any]:
        await self.send(2, {"token": token, "intents": intents, "properties": {}})
        return await self.until("READY")

    async def closed_with(self) -> int | None:
        with anyio.fail_after(5):
            while True:
                frame = await self.ws.receive()
                if frame.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                    return self.ws.close_code


async def connect(
    http: aiohttp.ClientSession, url: str, *, query: str = "v=10&encoding=json"
) -> Gateway:
    ws = await http.ws_connect(f"{url}?{query}")
    return Gateway(ws, compressed="zlib-stream" in query)


def api(fake: FakeDiscord, path: str) -> str:
    return f"{fake.api_url}{path}"


def auth(fake: FakeDiscord) -> dict[str, str]:
    return {"Authorization": f"Bot {fake.token}"}


# -- the Gateway: opening, heartbeats, identifying ------------------------------------


async def test_hello_comes_first_and_heartbeats_are_acknowledged_before_identify(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    gw = await connect(http, fake.gateway_url)
    hello = await gw.receive()
    assert hello["op"] == 10 and hello["d"] == {"heartbeat_interval": 5000}
    assert hello["s"] is None and hello["t"] is None
    await gw.send(1, None)
    assert (await gw.receive())["op"] == 11


async def test_zlib_stream_frames_end_in_the_sync_flush_suffix_and_share_one_context(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    gw = await connect(http, fake.gateway_url, query="v=10&encoding=json&compress=zlib-stream")
    assert (await gw.receive())["op"] == 10
    ready = await gw.identify(fake.token)
    assert ready["d"]["session_id"]
    assert gw.frames and all(f.endswith(b"\x00\x00\xff\xff") for f in gw.frames)
    # One context per connection: a later frame does not decode on a fresh inflater.
    import zlib

    if len(gw.frames) > 1:
        with pytest.raises(zlib.error):
            zlib.decompressobj().decompress(gw.frames[-1])


@pytest.mark.parametrize(
    ("query", "code"),
    [("v=9&encoding=json", 4012), ("v=10&encoding=etf", 4002)],
)
async def test_a_wrong_version_or_encoding_is_closed(
    fake: FakeDiscord, http: aiohttp.ClientSession, query: str, code: int
) -> None:
    gw = await connect(http, fake.gateway_url, query=query)
    assert await gw.closed_with() == code


async def test_identify_refusals_have_discords_close_codes(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    cases: list[tuple[int, Any, int]] = [
        (2, {"token": "wrong", "intents": INTENTS, "properties": {}}, 4004),
        (2, {"token": fake.token, "intents": 1 << 30, "properties": {}}, 4013),
        (3, {"status": "online"}, 4003),  # anything but a heartbeat before identifying
    ]
    for op, data, code in cases:
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        await gw.send(op, data)
        assert await gw.closed_with() == code, (op, data)
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.identify(fake.token)
    await gw.send(2, {"token": fake.token, "intents": INTENTS, "properties": {}})
    assert await gw.closed_with() == 4005


async def test_a_privileged_intent_the_app_has_not_enabled_is_closed_4014(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeDiscord(application_flags=0) as fake:
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        await gw.send(2, {"token": fake.token, "intents": INTENTS, "properties": {}})
        assert await gw.closed_with() == 4014
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        ready = await gw.identify(fake.token, INTENTS & ~MESSAGE_CONTENT)
        assert ready["d"]["application"]["flags"] == 0


async def test_ready_then_one_guild_create_per_guild_with_sequences_counting_up(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    guild = fake.add_guild("Acme")
    channel = fake.add_text_channel(guild, "general")
    thread = fake.add_thread(channel, "plans")
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    ready = await gw.identify(fake.token)
    assert ready["s"] == 1 and ready["op"] == 0
    data = ready["d"]
    assert data["v"] == 10 and data["user"]["id"] == str(fake.bot_id) and data["user"]["bot"]
    assert data["guilds"] == [{"id": str(guild), "unavailable": True}]
    assert data["resume_gateway_url"] == fake.resume_gateway_url
    assert data["application"]["id"] == str(fake.application_id)
    created = await gw.until("GUILD_CREATE")
    assert created["s"] == 2
    assert [c["id"] for c in created["d"]["channels"]] == [str(channel)]
    [listed] = created["d"]["threads"]
    assert listed["id"] == str(thread) and listed["type"] == 11
    assert listed["parent_id"] == str(channel)


# -- dispatches and intents -----------------------------------------------------------


async def test_message_events_follow_the_intents_and_message_content(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    guild = fake.add_guild()
    channel = fake.add_text_channel(guild)
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.identify(fake.token, GUILDS | GUILD_MESSAGES | DIRECT_MESSAGES)  # no content
    await gw.until("GUILD_CREATE")
    fake.user_message(channel, alice, "chatter", attachments=[fake.add_attachment("a.txt", b"x")])
    fake.user_message(channel, alice, f"<@{fake.bot_id}> hi", mentions=[fake.bot_id])
    fake.user_message(dm, alice, "private")
    seen = [await gw.until("MESSAGE_CREATE") for _ in range(3)]
    chatter, mention, private = (m["d"] for m in seen)
    assert chatter["content"] == "" and chatter["attachments"] == []
    assert mention["content"] == f"<@{fake.bot_id}> hi"
    assert private["content"] == "private"
    assert chatter["guild_id"] == str(guild) and "member" in chatter
    assert "guild_id" not in private
    assert [m["s"] for m in seen] == sorted(m["s"] for m in seen)
    # Without DIRECT_MESSAGES no DM arrives; the guild's messages still do.
    gw2 = await connect(http, fake.gateway_url)
    await gw2.receive()
    await gw2.identify(fake.token, GUILDS | GUILD_MESSAGES)
    fake.user_message(dm, alice, "unseen")
    fake.user_message(channel, alice, "seen")
    assert (await gw2.until("MESSAGE_CREATE"))["d"]["channel_id"] == str(channel)


# -- resuming ---------------------------------------------------------------------------


async def test_resume_replays_what_was_missed_in_order_then_resumed(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    ready = await gw.identify(fake.token)
    session, seq = ready["d"]["session_id"], ready["s"]
    fake.user_message(dm, alice, "one")
    seq = (await gw.until("MESSAGE_CREATE"))["s"]
    fake.drop_connections()
    with pytest.raises(ConnectionError):
        await gw.receive()
    fake.user_message(dm, alice, "two")
    fake.user_message(dm, alice, "three")
    back = await connect(http, fake.resume_gateway_url)
    await back.receive()
    await back.send(6, {"token": fake.token, "session_id": session, "seq": seq})
    replayed = [await back.receive() for _ in range(3)]
    assert [p["t"] for p in replayed] == ["MESSAGE_CREATE", "MESSAGE_CREATE", "RESUMED"]
    assert [p["d"].get("content") for p in replayed[:2]] == ["two", "three"]
    assert [p["s"] for p in replayed] == [seq + 1, seq + 2, seq + 3]


async def test_a_resume_of_an_ended_or_expired_session_is_refused(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeDiscord(resume_window=0.3) as fake:
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        ready = await gw.identify(fake.token)
        session, seq = ready["d"]["session_id"], ready["s"]
        fake.drop_connections()
        await anyio.sleep(0.6)  # past the resume window
        back = await connect(http, fake.gateway_url)
        await back.receive()
        await back.send(6, {"token": fake.token, "session_id": session, "seq": seq})
        refused = await back.receive()
        assert refused["op"] == 9 and refused["d"] is False
        # A client closing with 1000 ends its session at once.
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        ready = await gw.identify(fake.token)
        await gw.ws.close(code=1000)
        await anyio.sleep(0.1)
        back = await connect(http, fake.gateway_url)
        await back.receive()
        await back.send(6, {"token": fake.token, "session_id": ready["d"]["session_id"], "seq": 1})
        assert (await back.receive())["d"] is False


async def test_a_resume_from_a_sequence_never_reached_is_closed_4007(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    ready = await gw.identify(fake.token)
    fake.drop_connections()
    back = await connect(http, fake.gateway_url)
    await back.receive()
    await back.send(6, {"token": fake.token, "session_id": ready["d"]["session_id"], "seq": 999})
    assert await back.closed_with() == 4007


async def test_reconnect_and_invalid_session_are_sent_as_the_docs_say(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.identify(fake.token)
    fake.reconnect()
    assert (await gw.receive())["op"] == 7
    assert await gw.closed_with() == 4000
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    ready = await gw.identify(fake.token)
    fake.invalidate(resumable=False)
    invalid = await gw.receive()
    assert invalid["op"] == 9 and invalid["d"] is False
    back = await connect(http, fake.gateway_url)
    await back.receive()
    await back.send(6, {"token": fake.token, "session_id": ready["d"]["session_id"], "seq": 1})
    assert (await back.receive())["d"] is False


async def test_a_silent_connection_is_closed_and_its_session_stays_resumable(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeDiscord(heartbeat_interval_ms=300) as fake:
        gw = await connect(http, fake.gateway_url)
        await gw.receive()
        ready = await gw.identify(fake.token)
        started = time.monotonic()
        assert await gw.closed_with() == 4000  # no heartbeat for 1.5 intervals
        assert 0.4 < time.monotonic() - started < 3
        back = await connect(http, fake.gateway_url)
        await back.receive()
        resume = {"token": fake.token, "session_id": ready["d"]["session_id"], "seq": ready["s"]}
        await back.send(6, resume)
        assert (await back.until("RESUMED"))["op"] == 0


async def test_zombie_mode_sends_no_heartbeat_ack(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    fake.ack_heartbeats = False
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.send(1, None)
    with pytest.raises(TimeoutError):
        await gw.receive(seconds=0.5)


# -- the HTTP API -----------------------------------------------------------------------


async def test_the_api_wants_the_bot_token_and_answers_plain_application_json(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    async with http.get(api(fake, "/users/@me")) as response:
        assert response.status == 401
        assert (await response.json())["message"] == "401: Unauthorized"
    async with http.get(api(fake, "/users/@me"), headers=auth(fake)) as response:
        assert response.headers["Content-Type"] == "application/json"  # no charset
        assert (await response.json())["id"] == str(fake.bot_id)
    async with http.get(api(fake, "/oauth2/applications/@me"), headers=auth(fake)) as response:
        assert (await response.json())["flags"] == fake.application_flags


async def test_history_after_gives_the_next_messages_newest_first_within_limits(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    ids = [int(fake.user_message(dm, alice, f"m{i}")["id"]) for i in range(7)]
    url = api(fake, f"/channels/{dm}/messages")
    async with http.get(url, params={"after": ids[1], "limit": 3}, headers=auth(fake)) as r:
        page = await r.json()
    assert [m["content"] for m in page] == ["m4", "m3", "m2"]  # the next 3, newest first
    async with http.get(url, params={"before": ids[3], "limit": 2}, headers=auth(fake)) as r:
        assert [m["content"] for m in await r.json()] == ["m2", "m1"]
    async with http.get(url, headers=auth(fake)) as r:
        assert len(await r.json()) == 7  # default limit 50
    for bad in ({"limit": 0}, {"limit": 101}, {"after": ids[0], "before": ids[3]}):
        async with http.get(url, params=bad, headers=auth(fake)) as r:
            assert r.status == 400 and (await r.json())["code"] == 50035, bad
    async with http.get(api(fake, f"/channels/{dm}/messages/1"), headers=auth(fake)) as r:
        assert r.status == 404 and (await r.json())["code"] == 10008


async def test_creating_messages_checks_what_discord_checks(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    url = api(fake, f"/channels/{dm}/messages")
    for body, status, code in (
        ({"content": "x" * 2001}, 400, 50035),
        ({"content": "  "}, 400, 50006),
        ({"content": "hi", "nonce": "n" * 26}, 400, 50035),
        ({"content": "hi", "message_reference": {"message_id": "1"}}, 400, 50035),
    ):
        async with http.post(url, json=body, headers=auth(fake)) as r:
            assert (r.status, (await r.json())["code"]) == (status, code), body
    body = {
        "content": "x" * 2000,
        "message_reference": {"message_id": "1", "fail_if_not_exists": False},
    }
    async with http.post(url, json=body, headers=auth(fake)) as r:
        assert r.status == 200 and "message_reference" not in await r.json()


async def test_enforce_nonce_returns_the_first_message_instead_of_a_second(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    url = api(fake, f"/channels/{dm}/messages")
    body = {"content": "once", "nonce": "abc", "enforce_nonce": True}
    async with http.post(url, json=body, headers=auth(fake)) as r:
        first = await r.json()
    async with http.post(url, json=body, headers=auth(fake)) as r:
        second = await r.json()
    assert first["id"] == second["id"] and first["nonce"] == "abc"
    async with http.post(url, json={"content": "once", "nonce": "abc"}, headers=auth(fake)) as r:
        third = await r.json()  # without enforce_nonce the nonce is only echoed
    assert third["id"] != first["id"]
    assert [m["content"] for m in fake.bot_messages(dm)] == ["once", "once"]


async def test_allowed_mentions_decide_who_is_pinged(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    guild = fake.add_guild(members=[alice])
    channel = fake.add_text_channel(guild)
    asked = fake.user_message(channel, alice, "question")
    url = api(fake, f"/channels/{channel}/messages")
    text = f"@everyone <@{alice}> <@&{guild}>"
    async with http.post(url, json={"content": text}, headers=auth(fake)) as r:
        default = await r.json()
    assert default["mention_everyone"] and default["mentions"][0]["id"] == str(alice)
    quiet = {
        "content": text,
        "allowed_mentions": {"parse": [], "replied_user": True},
        "message_reference": {"message_id": asked["id"]},
    }
    async with http.post(url, json=quiet, headers=auth(fake)) as r:
        answer = await r.json()
    pings = fake.pings[int(answer["id"])]
    assert pings["everyone"] is False and pings["roles"] == []
    assert pings["users"] == [alice]  # only as the author of the message replied to
    both = {"content": text, "allowed_mentions": {"parse": ["users"], "users": [str(alice)]}}
    async with http.post(url, json=both, headers=auth(fake)) as r:
        assert r.status == 400  # parse and users are mutually exclusive


async def test_files_come_in_multipart_with_payload_json_and_are_served(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    form = aiohttp.FormData()
    form.add_field("payload_json", json.dumps({"content": "here", "attachments": [{"id": 0}]}))
    form.add_field("files[0]", b"hello file", filename="a.txt")
    async with http.post(api(fake, f"/channels/{dm}/messages"), data=form, headers=auth(fake)) as r:
        message = await r.json()
    [attachment] = message["attachments"]
    assert attachment["filename"] == "a.txt" and attachment["size"] == 10
    async with http.get(attachment["url"]) as r:
        assert await r.read() == b"hello file"
    big = aiohttp.FormData()
    big.add_field("payload_json", json.dumps({"content": "big"}))
    big.add_field("files[0]", b"x" * (fake.file_size_limit + 1), filename="big.bin")
    async with http.post(api(fake, f"/channels/{dm}/messages"), data=big, headers=auth(fake)) as r:
        assert r.status == 413 and (await r.json())["code"] == 40005


async def test_only_the_bots_own_messages_can_be_edited_and_edits_are_dispatched(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    theirs = fake.user_message(dm, alice, "mine")
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.identify(fake.token)
    async with http.post(
        api(fake, f"/channels/{dm}/messages"), json={"content": "v1"}, headers=auth(fake)
    ) as r:
        ours = await r.json()
    assert (await gw.until("MESSAGE_CREATE"))["d"]["id"] == ours["id"]  # the bot's own too
    url = api(fake, f"/channels/{dm}/messages/{theirs['id']}")
    async with http.patch(url, json={"content": "x"}, headers=auth(fake)) as r:
        assert r.status == 403 and (await r.json())["code"] == 50005
    url = api(fake, f"/channels/{dm}/messages/{ours['id']}")
    async with http.patch(url, json={"content": "v2"}, headers=auth(fake)) as r:
        assert (await r.json())["edited_timestamp"] is not None
    assert (await gw.until("MESSAGE_UPDATE"))["d"]["content"] == "v2"


async def test_rate_limits_answer_headers_and_429s_as_discord_does(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeDiscord(message_limit=2, message_window=5.0, global_limit=10) as fake:
        alice = fake.add_user("alice")
        dm = fake.dm_channel(alice)
        url = api(fake, f"/channels/{dm}/messages")
        statuses = []
        for n in range(3):
            async with http.post(url, json={"content": f"m{n}"}, headers=auth(fake)) as r:
                statuses.append(r.status)
                headers, body = r.headers, await r.json()
                if n == 0:
                    assert headers["X-RateLimit-Limit"] == "2"
                    assert headers["X-RateLimit-Remaining"] == "1"
                    assert float(headers["X-RateLimit-Reset-After"]) > 4
                    assert headers["X-RateLimit-Bucket"]
        assert statuses == [200, 200, 429]
        assert body["global"] is False and 0 < body["retry_after"] <= 5
        assert headers["X-RateLimit-Scope"] == "user" and headers["Via"]
        assert int(headers["Retry-After"]) >= body["retry_after"]
        # The global limit: every route together.
        for _ in range(12):
            async with http.get(api(fake, "/users/@me"), headers=auth(fake)) as r:
                last, body, headers = r.status, await r.json(), r.headers
        assert last == 429 and body["global"] is True
        assert headers["X-RateLimit-Global"] == "true" and headers["X-RateLimit-Scope"] == "global"


async def test_scripted_failures(fake: FakeDiscord, http: aiohttp.ClientSession) -> None:
    alice = fake.add_user("alice")
    dm = fake.dm_channel(alice)
    url = api(fake, f"/channels/{dm}/messages")
    route = "POST /channels/{channel_id}/messages"
    fake.fail_next(route, 429, retry_after=0.25, is_global=True)
    async with http.post(url, json={"content": "a"}, headers=auth(fake)) as r:
        assert r.status == 429 and (await r.json()) == {
            "message": "You are being rate limited.",
            "retry_after": 0.25,
            "global": True,
        }
    fake.fail_next(route, 502)
    async with http.post(url, json={"content": "b"}, headers=auth(fake)) as r:
        assert r.status == 502
    assert fake.bot_messages(dm) == []
    fake.fail_next(route, cut_after=True)
    with pytest.raises(aiohttp.ClientError):
        async with http.post(url, json={"content": "c"}, headers=auth(fake)) as r:
            await r.read()
    assert [m["content"] for m in fake.bot_messages(dm)] == ["c"]  # it was carried out


async def test_threads_are_channels_of_their_own(
    fake: FakeDiscord, http: aiohttp.ClientSession
) -> None:
    guild = fake.add_guild()
    channel = fake.add_text_channel(guild)
    alice = fake.add_user("alice")
    gw = await connect(http, fake.gateway_url)
    await gw.receive()
    await gw.identify(fake.token)
    thread = fake.add_thread(channel, "plans")
    created = await gw.until("THREAD_CREATE")
    assert created["d"]["id"] == str(thread) and created["d"]["newly_created"] is True
    fake.user_message(thread, alice, "in the thread")
    message = (await gw.until("MESSAGE_CREATE"))["d"]
    assert message["channel_id"] == str(thread) and message["guild_id"] == str(guild)
    async with http.get(api(fake, f"/channels/{thread}"), headers=auth(fake)) as r:
        described = await r.json()
    assert described["type"] == 11 and described["parent_id"] == str(channel)
