"""The fake OneBot v11 implementation keeps the semantics the gateway's promises rely on,
as the OneBot v11 standard and NapCat's source state them (tests/fakes/onebot_server.py
names them): checked with a plain aiohttp WebSocket client, not with the channel, so a
fake that drifted to suit the channel would fail here."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import pytest

from tests.fakes.onebot_server import DEFAULT_TOKEN, FakeOneBot, parse_cq, short_id, to_cq

pytestmark = pytest.mark.anyio

ALICE, BOB, TOWN = 20001, 20002, 30001


@pytest.fixture
async def fake() -> AsyncIterator[FakeOneBot]:
    async with FakeOneBot(heartbeat_interval=0.2) as server:
        server.add_friend(ALICE, "Alice")
        server.add_group(TOWN, "Town", {ALICE: "Alice", BOB: "Bob"})
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Socket:
    """A bare OneBot client: JSON frames in and out."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.echo = 0

    async def receive(self, seconds: float = 5.0) -> dict[str, Any]:
        frame = await self.ws.receive(timeout=seconds)
        if frame.type is aiohttp.WSMsgType.TEXT:
            return dict(json.loads(frame.data))
        raise ConnectionError(f"closed: {frame.type.name}")

    async def event(self, kind: str = "message", seconds: float = 5.0) -> dict[str, Any]:
        """The next event of `post_type` (or `meta_event_type`) `kind`."""
        with anyio.fail_after(seconds):
            while True:
                found = await self.receive(seconds)
                if kind in (found.get("post_type"), found.get("meta_event_type")):
                    return found

    async def call(self, action: str, **params: Any) -> dict[str, Any]:
        self.echo += 1
        await self.ws.send_json({"action": action, "params": params, "echo": f"e{self.echo}"})
        while True:
            found = await self.receive()
            if found.get("echo") == f"e{self.echo}":
                return found

    async def nothing_for(self, seconds: float) -> bool:
        """True when no message event came for `seconds` (meta events may)."""
        with anyio.move_on_after(seconds):
            while True:
                found = await self.receive(seconds + 1)
                if found.get("post_type") == "message":
                    return False
        return True


async def connect(
    fake: FakeOneBot, http: aiohttp.ClientSession, path: str = "/", token: str = DEFAULT_TOKEN
) -> Socket:
    """A connection to `path`; on an event path, once the fake has said `connect` (from
    then on it writes every event to it)."""
    url = fake.url.replace("http", "ws") + path
    ws = await http.ws_connect(url, headers={"Authorization": f"Bearer {token}"})
    socket = Socket(ws)
    if path not in ("/api", "/api/") and token == DEFAULT_TOKEN:
        assert (await socket.event("lifecycle"))["sub_type"] == "connect"
    return socket


# -- connections and authorization -----------------------------------------------------------


async def test_a_connection_needs_the_access_token_by_header_or_query(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    refused = await connect(fake, http, token="wrong")
    answer = await refused.receive()
    assert answer["status"] == "failed" and answer["retcode"] == 1403
    with pytest.raises(ConnectionError):
        await refused.receive()
    ws = await http.ws_connect(fake.url.replace("http", "ws") + f"/?access_token={DEFAULT_TOKEN}")
    first = await Socket(ws).receive()
    assert first["meta_event_type"] == "lifecycle" and first["sub_type"] == "connect"


async def test_the_universal_path_gets_lifecycle_heartbeats_and_events_api_gets_none(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    universal = await connect(fake, http, "/")
    api = await connect(fake, http, "/api")
    beat = await universal.event("heartbeat")
    assert beat["status"]["online"] is True and beat["interval"] == 200
    fake.user_message(ALICE, "hello")
    event = await universal.event()
    assert event["message_type"] == "private" and event["user_id"] == ALICE
    assert event["self_id"] == fake.self_id and event["message"][0]["data"]["text"] == "hello"
    assert await api.nothing_for(0.5)
    assert (await api.call("get_login_info"))["data"] == {
        "user_id": fake.self_id,
        "nickname": "kit-bot",
    }


async def test_every_event_connection_gets_each_event_once_in_order(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    one, two = await connect(fake, http, "/"), await connect(fake, http, "/event")
    for n in range(5):
        fake.user_message(ALICE, f"m{n}")
    for socket in (one, two):
        texts = [(await socket.event())["message"][0]["data"]["text"] for _ in range(5)]
        assert texts == [f"m{n}" for n in range(5)]
        assert await socket.nothing_for(0.3)


# -- what OneBot keeps: nothing but the history ------------------------------------------------


async def test_events_written_while_no_client_is_connected_are_dropped_but_kept_in_history(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    early = fake.user_message(ALICE, "while away")
    socket = await connect(fake, http, "/")
    assert await socket.nothing_for(0.5)
    history = await socket.call("get_friend_msg_history", user_id=ALICE, count=20)
    assert [m["message_id"] for m in history["data"]["messages"]] == [early.message_id]


async def test_the_history_gives_count_messages_oldest_first_up_to_and_including_an_anchor(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    sent = [fake.user_message(BOB, f"g{n}", group_id=TOWN) for n in range(7)]
    socket = await connect(fake, http, "/api")
    latest = await socket.call("get_group_msg_history", group_id=TOWN, count=3)
    assert [m["message_id"] for m in latest["data"]["messages"]] == [r.message_id for r in sent[4:]]
    napcat = await socket.call(
        "get_group_msg_history", group_id=str(TOWN), message_seq=str(sent[4].message_id), count=3
    )
    assert [m["message_id"] for m in napcat["data"]["messages"]] == [
        r.message_id for r in sent[2:5]
    ]
    lagrange = await socket.call(
        "get_group_msg_history", group_id=TOWN, message_id=sent[1].message_id, count=3
    )
    assert [m["message_id"] for m in lagrange["data"]["messages"]] == [
        r.message_id for r in sent[:2]
    ]
    empty = await socket.call("get_group_msg_history", group_id=TOWN + 1, count=3)
    assert empty["status"] == "failed" and empty["retcode"] == 1200 and "不存在" in empty["message"]


async def test_the_history_holds_the_bots_own_messages(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    fake.user_message(ALICE, "hi")
    socket = await connect(fake, http, "/api")
    await socket.call(
        "send_private_msg", user_id=ALICE, message=[{"type": "text", "data": {"text": "yo"}}]
    )
    history = (await socket.call("get_friend_msg_history", user_id=ALICE, count=5))["data"][
        "messages"
    ]
    assert [(m["user_id"], m["post_type"]) for m in history] == [
        (ALICE, "message"),
        (fake.self_id, "message_sent"),
    ]


async def test_an_implementation_without_history_answers_1404(http: aiohttp.ClientSession) -> None:
    async with FakeOneBot(history=False) as fake:
        socket = await connect(fake, http, "/api")
        answer = await socket.call("get_group_msg_history", group_id=1, count=3)
        assert (
            answer["retcode"] == 1404 and answer["message"] == "不支持的API get_group_msg_history"
        )


async def test_a_message_id_is_the_same_in_the_event_the_history_and_get_msg(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/")
    record = fake.user_message(BOB, "same", group_id=TOWN)
    event = await socket.event()
    history = await socket.call("get_group_msg_history", group_id=TOWN, count=1)
    found = await socket.call("get_msg", message_id=record.message_id)
    assert event["message_id"] == history["data"]["messages"][0]["message_id"] == record.message_id
    assert found["data"]["message_id"] == record.message_id and found["data"]["user_id"] == BOB
    assert record.message_id == short_id(record.internal, 2, TOWN) < 2**31


async def test_redeliver_writes_the_same_message_again(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/")
    record = fake.user_message(ALICE, "twice")
    fake.redeliver(record.message_id)
    first, second = await socket.event(), await socket.event()
    assert first == second and first["message_id"] == record.message_id


# -- calls ------------------------------------------------------------------------------------


async def test_answers_carry_the_echo_and_onebots_retcodes(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/api")
    unknown = await socket.call("no_such_thing")
    assert unknown["status"] == "failed" and unknown["retcode"] == 1404 and unknown["echo"] == "e1"
    missing = await socket.call("send_group_msg", group_id=TOWN)
    assert missing["retcode"] == 1400
    await socket.ws.send_str("{not json")
    bad = await socket.receive()
    assert bad["retcode"] == 1400 and bad["echo"] is None
    ok = await socket.call("get_version_info")
    assert ok["status"] == "ok" and ok["retcode"] == 0 and ok["data"]["protocol_version"] == "v11"


async def test_a_string_message_is_parsed_for_cq_codes_an_array_never_is(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/api")
    await socket.call("send_group_msg", group_id=TOWN, message="hi [CQ:at,qq=all]")
    await socket.call(
        "send_group_msg", group_id=TOWN, message="hi [CQ:at,qq=all]", auto_escape=True
    )
    await socket.call(
        "send_group_msg",
        group_id=TOWN,
        message=[{"type": "text", "data": {"text": "hi [CQ:at,qq=all]"}}],
    )
    parsed, escaped, array = fake.bot_messages()
    assert parsed.pings_everyone and parsed.segments[1] == {"type": "at", "data": {"qq": "all"}}
    assert not escaped.pings_everyone and not array.pings_everyone
    assert array.segments == [{"type": "text", "data": {"text": "hi [CQ:at,qq=all]"}}]


async def test_a_send_answers_its_message_id_and_the_message_is_kept(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/api")
    quoted = fake.user_message(BOB, "q", group_id=TOWN)
    message = [
        {"type": "reply", "data": {"id": str(quoted.message_id)}},
        {"type": "at", "data": {"qq": str(BOB)}},
        {"type": "text", "data": {"text": " answer"}},
    ]
    answer = await socket.call("send_group_msg", group_id=TOWN, message=message)
    sent = fake.bot_messages()[0]
    assert answer["data"] == {"message_id": sent.message_id}
    assert sent.segments == message and fake.records[sent.message_id] is sent
    unknown = [{"type": "reply", "data": {"id": "12345"}}, *message[1:]]
    await socket.call("send_group_msg", group_id=TOWN, message=unknown)
    assert fake.bot_messages()[1].segments == message[1:]  # the quote left out


async def test_qq_refuses_a_muted_bot_a_stranger_and_an_overlong_text_as_napcat_says(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/api")
    fake.mute(TOWN)
    muted = await socket.call("send_group_msg", group_id=TOWN, message="hi")
    stranger = await socket.call("send_private_msg", user_id=BOB, message="hi")
    long = await socket.call(
        "send_private_msg", user_id=ALICE, message="x" * (fake.max_text_chars + 1)
    )
    for answer in (muted, stranger, long):
        assert answer["status"] == "failed" and answer["retcode"] == 1200
        assert answer["message"].startswith("EventChecker Failed")
    assert fake.bot_messages() == []
    temp = await socket.call("send_private_msg", user_id=BOB, group_id=TOWN, message="hi")
    assert temp["status"] == "ok"


async def test_a_cut_call_is_carried_out_and_never_answered(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/api")
    fake.fail_next("send_private_msg", cut=True)
    await socket.ws.send_json(
        {"action": "send_private_msg", "params": {"user_id": ALICE, "message": "hi"}, "echo": "x"}
    )
    with pytest.raises(ConnectionError):
        await socket.receive()
    assert len(fake.bot_messages()) == 1


async def test_a_person_sends_a_picture_that_can_be_downloaded(
    fake: FakeOneBot, http: aiohttp.ClientSession
) -> None:
    socket = await connect(fake, http, "/")
    fake.user_message(ALICE, [fake.image_segment(b"\x89PNG-bytes")])
    event = await socket.event()
    image = event["message"][0]
    assert image["type"] == "image" and image["data"]["file_size"] == "10"
    async with http.get(image["data"]["url"]) as answer:
        assert await answer.read() == b"\x89PNG-bytes"


def test_cq_codes_round_trip_with_their_escapes() -> None:
    segments = [
        {"type": "text", "data": {"text": "a [b] & c"}},
        {"type": "at", "data": {"qq": "123"}},
        {"type": "share", "data": {"title": "x,y", "url": "http://z/?a=1&b=2"}},
    ]
    raw = to_cq(segments)
    assert (
        raw
        == "a &#91;b&#93; &amp; c[CQ:at,qq=123][CQ:share,title=x&#44;y,url=http://z/?a=1&amp;b=2]"
    )
    assert parse_cq(raw) == segments
