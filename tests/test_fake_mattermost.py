"""The fake Mattermost keeps the semantics the gateway's promises rely on, as Mattermost's
API reference and server source state them (tests/fakes/mattermost_server.py names
them): checked with a plain HTTP and WebSocket client, not with the channel, so a fake
that drifted to suit the channel would fail here."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest

from tests.fakes.mattermost_server import (
    DEFAULT_TOKEN,
    MAX_POST_CHARS,
    FakeMattermost,
    mentions_in,
)

pytestmark = pytest.mark.anyio

BOT = {"Authorization": f"Bearer {DEFAULT_TOKEN}"}


@pytest.fixture
async def fake() -> AsyncIterator[FakeMattermost]:
    async with FakeMattermost(bot_username="kit-bot") as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def api(fake: FakeMattermost, path: str) -> str:
    return f"{fake.url}/api/v4{path}"


def as_user(fake: FakeMattermost, user_id: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {fake.token_of(user_id)}"}


class Socket:
    """A bare WebSocket client: JSON frames in and out."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def receive(self, seconds: float = 5.0) -> dict[str, Any]:
        while True:
            frame = await self.ws.receive(timeout=seconds)
            if frame.type is aiohttp.WSMsgType.TEXT:
                return dict(json.loads(frame.data))
            raise ConnectionError(f"closed: {frame.type.name}")

    async def event(self, name: str, seconds: float = 5.0) -> dict[str, Any]:
        while True:
            found = await self.receive(seconds)
            if found.get("event") == name:
                return found

    async def nothing_for(self, seconds: float) -> bool:
        try:
            await self.receive(seconds)
        except TimeoutError:
            return True
        return False


async def connect(fake: FakeMattermost, http: aiohttp.ClientSession, token: str) -> Socket:
    ws = await http.ws_connect(f"{fake.url.replace('http', 'ws')}/api/v4/websocket")
    await ws.send_json({"seq": 1, "action": "authentication_challenge", "data": {"token": token}})
    return Socket(ws)


def world(fake: FakeMattermost) -> tuple[str, str, str]:
    """A person, their DM channel with the bot, and a public channel of both."""
    alice = str(fake.add_user("alice")["id"])
    dm = str(fake.dm_channel(alice, fake.bot_id)["id"])
    town = str(fake.open_channel("town", [alice, fake.bot_id])["id"])
    return alice, dm, town


# -- authentication -----------------------------------------------------------------------


async def test_rest_calls_need_a_bearer_token(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    async with http.get(api(fake, "/users/me")) as answer:
        assert answer.status == 401
        body = await answer.json()
        assert body["id"] == "api.context.session_expired.app_error"
        assert body["status_code"] == 401
    async with http.get(api(fake, "/users/me"), headers=BOT) as answer:
        me = await answer.json()
        assert answer.status == 200 and me["id"] == fake.bot_id and me["is_bot"] is True


async def test_the_websocket_authenticates_by_challenge_then_says_hello(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, DEFAULT_TOKEN)
    first, second = await socket.receive(), await socket.receive()
    assert first == {"status": "OK", "seq_reply": 1}
    assert second["event"] == "hello" and second["seq"] == 0
    assert second["data"]["server_version"] and second["data"]["connection_id"]


async def test_a_wrong_token_closes_the_websocket_without_a_hello(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "not-a-token")
    with pytest.raises(ConnectionError):
        await socket.receive()


async def test_the_upgrade_header_authenticates_too(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    ws = await http.ws_connect(f"{fake.url.replace('http', 'ws')}/api/v4/websocket", headers=BOT)
    assert (await Socket(ws).receive())["event"] == "hello"


# -- what is delivered, to whom, and what is kept ---------------------------------------------


async def test_posted_events_go_to_members_in_order_with_the_post_as_a_json_string(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, town = world(fake)
    outsider = str(fake.add_user("bob")["id"])
    bot = await connect(fake, http, DEFAULT_TOKEN)
    await bot.event("hello")
    theirs = await connect(fake, http, fake.token_of(outsider))
    await theirs.event("hello")
    fake.user_message(dm, alice, "one")
    fake.user_message(town, alice, "two @kit-bot")
    first, second = await bot.event("posted"), await bot.event("posted")
    assert (first["seq"], second["seq"]) == (1, 2)
    assert json.loads(first["data"]["post"])["message"] == "one"
    assert first["data"]["channel_type"] == "D"
    assert second["data"]["channel_type"] == "O"
    assert json.loads(second["data"]["mentions"]) == [fake.bot_id]
    assert second["broadcast"]["channel_id"] == town
    assert await theirs.nothing_for(0.3), "a non-member was told"


async def test_nothing_is_kept_for_a_bot_without_a_connection(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    """Mattermost confirms nothing and replays nothing to a new connection: what was
    posted meanwhile is only in the REST history."""
    alice, dm, _ = world(fake)
    fake.user_message(dm, alice, "while away")
    bot = await connect(fake, http, DEFAULT_TOKEN)
    await bot.event("hello")
    assert await bot.nothing_for(0.3)
    async with http.get(api(fake, f"/channels/{dm}/posts"), headers=BOT) as answer:
        listing = await answer.json()
    assert [listing["posts"][p]["message"] for p in listing["order"]] == ["while away"]


async def test_the_bots_own_posts_come_back_over_its_websocket(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    _, dm, _ = world(fake)
    bot = await connect(fake, http, DEFAULT_TOKEN)
    await bot.event("hello")
    body = {"channel_id": dm, "message": "mine"}
    async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
        assert answer.status == 201
        made = await answer.json()
    assert made["props"]["from_bot"] == "true"
    event = await bot.event("posted")
    assert json.loads(event["data"]["post"])["id"] == made["id"]


async def test_rebroadcast_hands_the_same_post_over_twice(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    bot = await connect(fake, http, DEFAULT_TOKEN)
    await bot.event("hello")
    post = fake.user_message(dm, alice, "twice")
    fake.rebroadcast(post["id"])
    ids = [json.loads((await bot.event("posted"))["data"]["post"])["id"] for _ in range(2)]
    assert ids == [post["id"], post["id"]]


async def test_every_post_moves_its_channels_last_post_at(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    post = fake.user_message(dm, alice, "news")
    path = api(fake, f"/users/{fake.bot_id}/teams/{fake.team_id}/channels")
    async with http.get(path, headers=BOT) as answer:
        channels = {c["id"]: c for c in await answer.json()}
    assert channels[dm]["type"] == "D", "direct messages are listed with the team's channels"
    assert channels[dm]["last_post_at"] == post["create_at"]
    assert channels[dm]["total_msg_count"] == 1


# -- reading a channel back ----------------------------------------------------------------


async def test_after_reads_strictly_later_posts_oldest_pages_first_listed_newest_first(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    fake.freeze_clock(1_000)
    first = fake.user_message(dm, alice, "a")
    same_ms = fake.user_message(dm, alice, "b")
    fake.freeze_clock(2_000)
    later = [fake.user_message(dm, alice, f"c{n}") for n in range(3)]
    params = {"after": first["id"], "per_page": "2", "page": "0"}
    async with http.get(api(fake, f"/channels/{dm}/posts"), params=params, headers=BOT) as answer:
        page0 = await answer.json()
    # A post of the same millisecond as `after` is not "after" it: a reader that starts
    # after the last post it took misses it.
    assert same_ms["id"] not in page0["order"]
    assert page0["order"] == [later[1]["id"], later[0]["id"]]
    assert page0["has_next"] is True
    params["page"] = "1"
    async with http.get(api(fake, f"/channels/{dm}/posts"), params=params, headers=BOT) as answer:
        page1 = await answer.json()
    assert page1["order"] == [later[2]["id"]]
    params = {"after": "nosuchpost" * 2 + "abcdef", "per_page": "10"}
    async with http.get(api(fake, f"/channels/{dm}/posts"), params=params, headers=BOT) as answer:
        assert (await answer.json())["order"] == []


async def test_newest_first_pages_list_ties_in_the_reverse_of_their_making(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    fake.freeze_clock(5_000)
    made = [fake.user_message(dm, alice, f"t{n}")["id"] for n in range(3)]
    async with http.get(api(fake, f"/channels/{dm}/posts"), headers=BOT) as answer:
        listing = await answer.json()
    assert listing["order"] == list(reversed(made))


async def test_since_lists_edited_posts_too(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    fake.freeze_clock(1_000)
    old = fake.user_message(dm, alice, "old")
    fake.freeze_clock(9_000)
    fake.edit_message(old["id"], "old, edited")
    params = {"since": "5000"}
    async with http.get(api(fake, f"/channels/{dm}/posts"), params=params, headers=BOT) as answer:
        listing = await answer.json()
    assert listing["order"] == [old["id"]]


async def test_a_thread_reply_lists_its_root_in_posts_not_in_order(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, _, town = world(fake)
    fake.freeze_clock(1_000)
    root = fake.user_message(town, alice, "root")
    fake.freeze_clock(1_001)
    reply = fake.user_message(town, alice, "reply", root_id=root["id"])
    params = {"after": root["id"]}
    async with http.get(api(fake, f"/channels/{town}/posts"), params=params, headers=BOT) as answer:
        listing = await answer.json()
    assert listing["order"] == [reply["id"]]
    assert root["id"] in listing["posts"]


# -- posting -----------------------------------------------------------------------------


async def test_a_pending_post_id_makes_one_post_within_its_ttl(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    _, dm, _ = world(fake)
    body = {"channel_id": dm, "message": "once", "pending_post_id": "kit:1"}
    made = []
    for _ in range(2):
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            assert answer.status == 201
            made.append((await answer.json())["id"])
    assert made[0] == made[1] and len(fake.bot_posts()) == 1


async def test_a_pending_post_id_past_its_ttl_makes_a_second_post(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeMattermost(pending_ttl=0.2) as fake:
        _, dm, _ = world(fake)
        body = {"channel_id": dm, "message": "again", "pending_post_id": "kit:2"}
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            first = (await answer.json())["id"]
        await anyio.sleep(0.3)
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            second = (await answer.json())["id"]
        assert first != second and len(fake.bot_posts()) == 2


async def test_a_pending_post_id_still_being_made_answers_500(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    _, dm, _ = world(fake)
    fake.post_delay = 0.5
    body = {"channel_id": dm, "message": "slow", "pending_post_id": "kit:3"}

    async def post() -> tuple[int, dict[str, Any]]:
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            return answer.status, await answer.json()

    results: list[tuple[int, dict[str, Any]]] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await post())

        tg.start_soon(run)
        await anyio.sleep(0.1)
        tg.start_soon(run)
    statuses = sorted(status for status, _ in results)
    assert statuses == [201, 500]
    refused = next(body for status, body in results if status == 500)
    assert refused["id"] == "api.post.deduplicate_create_post.pending"
    assert len(fake.bot_posts()) == 1


async def test_a_post_holds_at_most_16383_characters(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    _, dm, _ = world(fake)
    for length, status in ((MAX_POST_CHARS, 201), (MAX_POST_CHARS + 1, 400)):
        body = {"channel_id": dm, "message": "é" * length}
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            assert answer.status == status
            if status == 400:
                assert (await answer.json())["id"] == "model.post.is_valid.msg.app_error"


async def test_a_reply_goes_under_a_root_post_of_the_same_channel_only(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, town = world(fake)
    root = fake.user_message(town, alice, "root")
    reply = fake.user_message(town, alice, "reply", root_id=root["id"])
    for channel, root_id in ((dm, root["id"]), (town, reply["id"])):
        body = {"channel_id": channel, "message": "x", "root_id": root_id}
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            assert answer.status == 400
            assert (await answer.json())["id"] == "api.post.create_post.root_id.app_error"


async def test_only_an_author_edits_a_post_and_members_hear_of_it(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    theirs = fake.user_message(dm, alice, "hers")
    patch = {"message": "mine now"}
    async with http.put(
        api(fake, f"/posts/{theirs['id']}/patch"), json=patch, headers=BOT
    ) as answer:
        assert answer.status == 403
    bot = await connect(fake, http, DEFAULT_TOKEN)
    await bot.event("hello")
    body = {"channel_id": dm, "message": "draft"}
    async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
        mine = await answer.json()
    async with http.put(api(fake, f"/posts/{mine['id']}/patch"), json=patch, headers=BOT) as answer:
        edited = await answer.json()
    assert edited["message"] == "mine now" and edited["edit_at"] > 0
    await bot.event("posted")
    event = await bot.event("post_edited")
    assert json.loads(event["data"]["post"])["message"] == "mine now"


async def test_a_non_member_cannot_post(fake: FakeMattermost, http: aiohttp.ClientSession) -> None:
    alice = str(fake.add_user("alice")["id"])
    carol = str(fake.add_user("carol")["id"])
    theirs = str(fake.dm_channel(alice, carol)["id"])
    body = {"channel_id": theirs, "message": "hi"}
    async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
        assert answer.status == 403


# -- files, typing, limits -------------------------------------------------------------------


async def test_files_are_uploaded_attached_once_and_read_back(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    form = aiohttp.FormData()
    form.add_field("channel_id", dm)
    form.add_field("files", b"PNGDATA", filename="a.png", content_type="image/png")
    async with http.post(api(fake, "/files"), data=form, headers=BOT) as answer:
        assert answer.status == 201
        info = (await answer.json())["file_infos"][0]
    body = {"channel_id": dm, "message": "", "file_ids": [info["id"]]}
    async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
        post = await answer.json()
    assert post["file_ids"] == [info["id"]]
    assert post["metadata"]["files"][0]["mime_type"] == "image/png"
    async with http.get(api(fake, f"/files/{info['id']}"), headers=as_user(fake, alice)) as answer:
        assert await answer.read() == b"PNGDATA"
    async with http.get(api(fake, f"/files/{info['id']}")) as answer:
        assert answer.status == 401


async def test_an_upload_over_the_size_limit_answers_413(http: aiohttp.ClientSession) -> None:
    async with FakeMattermost(max_file_size=10) as fake:
        _, dm, _ = world(fake)
        form = aiohttp.FormData()
        form.add_field("channel_id", dm)
        form.add_field("files", b"x" * 11, filename="big.bin")
        async with http.post(api(fake, "/files"), data=form, headers=BOT) as answer:
            assert answer.status == 413


async def test_typing_is_told_to_the_others(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    alice, dm, _ = world(fake)
    theirs = await connect(fake, http, fake.token_of(alice))
    await theirs.event("hello")
    body = {"channel_id": dm, "parent_id": ""}
    async with http.post(
        api(fake, f"/users/{fake.bot_id}/typing"), json=body, headers=BOT
    ) as answer:
        assert answer.status == 200
    event = await theirs.event("typing")
    assert event["data"]["user_id"] == fake.bot_id
    async with http.post(api(fake, f"/users/{alice}/typing"), json=body, headers=BOT) as answer:
        assert answer.status == 403


async def test_rate_limited_requests_answer_429_with_when_to_come_back(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    fake.rate_limit(1)
    statuses = []
    for _ in range(3):
        async with http.get(api(fake, "/users/me"), headers=BOT) as answer:
            statuses.append(answer.status)
            if answer.status == 429:
                assert answer.headers["Retry-After"] and answer.headers["X-Ratelimit-Reset"]
                assert answer.headers["X-Ratelimit-Remaining"] == "0"
                assert (await answer.text()).strip() == "limit exceeded"
    assert statuses[0] == 200 and 429 in statuses


async def test_the_client_config_says_the_longest_post(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    params = {"format": "old"}
    async with http.get(api(fake, "/config/client"), params=params, headers=BOT) as answer:
        assert (await answer.json())["MaxPostSize"] == str(MAX_POST_CHARS)


async def test_a_cut_after_the_request_carried_it_out(
    fake: FakeMattermost, http: aiohttp.ClientSession
) -> None:
    _, dm, _ = world(fake)
    fake.fail_next("POST /posts", cut_after=True)
    body = {"channel_id": dm, "message": "lost answer"}
    with pytest.raises(aiohttp.ClientError):
        async with http.post(api(fake, "/posts"), json=body, headers=BOT) as answer:
            await answer.read()
    assert [p["message"] for p in fake.bot_posts()] == ["lost answer"]


def test_mentions_are_read_outside_code_and_channel_wide_ones_ping_everyone() -> None:
    assert mentions_in("hi @Alice, and @bob.")[0] >= {"alice", "bob"}
    names, everyone = mentions_in("hi @alice and `@bob` and\n```\n@carol\n```\n@here")
    assert "alice" in names and "bob" not in names and "carol" not in names
    assert everyone
    assert mentions_in("mail me at a@b.org")[0] == set()
    assert mentions_in("@\u200bchannel") == (set(), False)
