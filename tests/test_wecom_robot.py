"""WeCom's intelligent robot over its long connection: the fake's rules (the
subscription, one connection per robot, what is pushed and what is not, what a reply by
req_id needs), and the robot channel against it (messages in order with their keys,
replies by req_id, by send_msg after a reconnect naming the sender in a group, split at
20,480 bytes; a wrong Secret refused; no connection: DeliveryFailed)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest

from channels.wecom.channel import WeComRefused, WeComSetupError
from channels.wecom.robot import Pacing, WeComRobotChannel, split_content
from channels.wecom.settings import WeComSettings
from gateway.channel import DeliveryFailed
from gateway.messages import META_IS_GROUP, META_MENTIONED, InboundMessage, reply_for
from tests.fakes.wecom_robot_server import CONTENT_LIMIT, FakeWeComRobot

pytestmark = pytest.mark.anyio

FAST = Pacing(heartbeat=0.2, answer_timeout=2.0, reconnect=0.05, max_reconnect=0.2)


@pytest.fixture
async def fake() -> AsyncIterator[FakeWeComRobot]:
    async with FakeWeComRobot() as server:
        yield server


async def subscribe(
    session: aiohttp.ClientSession, fake: FakeWeComRobot, secret: str | None = None
) -> tuple[aiohttp.ClientWebSocketResponse, dict[str, Any]]:
    ws = await session.ws_connect(fake.ws_url)
    body = {"bot_id": fake.bot_id, "secret": secret or fake.secret}
    await ws.send_json({"cmd": "aibot_subscribe", "headers": {"req_id": "s1"}, "body": body})
    return ws, await ws.receive_json()


# -- the fake ------------------------------------------------------------------------------


async def test_the_fake_takes_one_subscribed_connection_per_robot(fake: FakeWeComRobot) -> None:
    async with aiohttp.ClientSession() as session:
        ws, answer = await subscribe(session, fake, secret="wrong")
        assert answer["errcode"] != 0 and answer["headers"]["req_id"] == "s1"
        assert (await ws.receive()).type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        first, answer = await subscribe(session, fake)
        assert answer["errcode"] == 0
        await first.send_json({"cmd": "ping", "headers": {"req_id": "p1"}})
        assert (await first.receive_json())["errcode"] == 0
        second, _ = await subscribe(session, fake)
        kicked = await first.receive_json()
        assert kicked["cmd"] == "aibot_event_callback"
        assert kicked["body"]["event"]["eventtype"] == "disconnected_event"
        assert fake.connections == 2
        await second.close()


async def test_the_fake_pushes_dms_and_mentions_only_while_connected(
    fake: FakeWeComRobot,
) -> None:
    async with aiohttp.ClientSession() as session:
        missed = await fake.push(
            {"msgid": "m0", "from": {"userid": "ann"}, "text": {"content": "x"}}
        )
        assert missed.req_id is None  # no connection: nothing kept for later
        ws, _ = await subscribe(session, fake)
        await fake.push(
            {
                "msgid": "m1",
                "chattype": "single",
                "from": {"userid": "ann"},
                "text": {"content": "hi"},
            }
        )
        pushed = await ws.receive_json()
        assert pushed["cmd"] == "aibot_msg_callback" and pushed["body"]["msgid"] == "m1"
        req_id = pushed["headers"]["req_id"]
        chatter = {"msgid": "m2", "chatid": "g1", "chattype": "group", "from": {"userid": "bob"}}
        unaddressed = await fake.push({**chatter, "text": {"content": "hey all"}}, addressed=False)
        assert unaddressed.req_id is None
        # A reply by req_id: too long is refused, a finished stream shows once.
        long = {
            "msgtype": "stream",
            "stream": {"id": "s", "finish": True, "content": "x" * (CONTENT_LIMIT + 1)},
        }
        await ws.send_json(
            {"cmd": "aibot_respond_msg", "headers": {"req_id": req_id}, "body": long}
        )
        assert (await ws.receive_json())["errcode"] != 0
        ok = {"msgtype": "stream", "stream": {"id": "s", "finish": True, "content": "hello"}}
        for _ in range(2):
            await ws.send_json(
                {"cmd": "aibot_respond_msg", "headers": {"req_id": req_id}, "body": ok}
            )
            assert (await ws.receive_json())["errcode"] == 0
        assert [(s.chat, s.text, s.reply_to) for s in fake.sent] == [("ann", "hello", "m1")]
        # After a reconnect the old req_id is refused; send_msg reaches the chat.
        await ws.close()
        ws, _ = await subscribe(session, fake)
        await ws.send_json({"cmd": "aibot_respond_msg", "headers": {"req_id": req_id}, "body": ok})
        assert (await ws.receive_json())["errcode"] != 0
        markdown = {"chatid": "g1", "msgtype": "markdown", "markdown": {"content": "<@bob> hi"}}
        await ws.send_json({"cmd": "aibot_send_msg", "headers": {"req_id": "x"}, "body": markdown})
        assert (await ws.receive_json())["errcode"] == 0
        assert fake.sent[-1].mentions == {"bob"} and fake.sent[-1].reply_to is None
        await ws.close()


# -- the channel -----------------------------------------------------------------------------


async def eventually(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110 (state of another thread's fake)
            await anyio.sleep(0.02)


@dataclass
class Ticket:
    taken: bool = True

    async def reply(self) -> None:
        return None


def robot(fake: FakeWeComRobot, secret: str | None = None) -> WeComRobotChannel:
    section = WeComSettings(enabled=True, mode="robot", bot_id=fake.bot_id, ws_url=fake.ws_url)
    return WeComRobotChannel(section, bot_secret=secret or fake.secret, pacing=FAST)


async def test_the_robot_takes_messages_in_order_and_replies_by_req_id(
    fake: FakeWeComRobot,
) -> None:
    channel = robot(fake)
    submitted: list[InboundMessage] = []

    async def submit(message: InboundMessage) -> Ticket:
        submitted.append(message)
        return Ticket()

    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        await fake.wait_connected()
        await fake.push(
            {
                "msgid": "d1",
                "chattype": "single",
                "from": {"userid": "ann"},
                "msgtype": "text",
                "text": {"content": "one"},
            }
        )
        group = {"chatid": "g1", "chattype": "group", "from": {"userid": "bob"}, "msgtype": "text"}
        await fake.push({**group, "msgid": "g1m", "text": {"content": "@GatewayBot two"}})
        await eventually(lambda: len(submitted) >= 2)
        dm, mention = submitted
        assert (dm.session_key, dm.text, dm.message_id) == ("wecom:ann", "one", "d1")
        assert mention.session_key == "wecom:group:g1" and mention.text == "two"
        assert mention.metadata[META_IS_GROUP] and mention.metadata[META_MENTIONED]
        await channel.send(reply_for(dm, "answer one"))
        await channel.send(reply_for(mention, "answer " + "y" * 30000))
        sent = fake.sent
        assert [(s.chat, s.reply_to, s.how) for s in sent][:2] == [
            ("ann", "d1", "respond"),
            ("g1", "g1m", "respond"),
        ]
        assert sent[1].text == "answer" and "".join(s.text for s in sent[2:]) == "y" * 30000
        assert all(len(s.text.encode()) <= CONTENT_LIMIT for s in sent)
        # After the connection drops, a reply goes by send_msg, naming the sender.
        await fake.drop_connection()
        await eventually(lambda: channel.connections >= 2 and fake.connected)
        await channel.send(reply_for(mention, "late"))
        late = fake.sent[-1]
        assert (late.how, late.chat, late.mentions, late.text) == (
            "send",
            "g1",
            {"bob"},
            "@bob late",
        )
        tg.cancel_scope.cancel()


async def test_a_wrong_secret_stops_the_robot_and_no_connection_is_delivery_failed(
    fake: FakeWeComRobot,
) -> None:
    async def submit(message: InboundMessage) -> Ticket:
        return Ticket()

    wrong = robot(fake, secret="wrong")
    with pytest.raises(WeComSetupError, match="BOT_SECRET"):
        await wrong.run(submit)
    idle = robot(fake)
    message = InboundMessage("wecom", "ann", "hi", "ann", "m1")
    with pytest.raises(DeliveryFailed):
        await idle.send(reply_for(message, "nobody to carry it"))


async def test_a_connection_that_answers_no_ping_is_made_again(fake: FakeWeComRobot) -> None:
    section = WeComSettings(enabled=True, mode="robot", bot_id=fake.bot_id, ws_url=fake.ws_url)
    pacing = Pacing(heartbeat=0.1, answer_timeout=0.3, reconnect=0.05)
    channel = WeComRobotChannel(section, bot_secret=fake.secret, pacing=pacing)

    async def submit(message: InboundMessage) -> Ticket:
        return Ticket()

    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, submit)
        await anyio.sleep(0.5)
        assert channel.connections == 1  # pings answered: the connection stays
        fake.answer_pings = False
        await eventually(lambda: channel.connections >= 2)
        tg.cancel_scope.cancel()


def test_content_is_split_under_20480_bytes() -> None:
    parts = split_content("字" * 10000)
    assert len(parts) == 2 and all(len(p.encode()) <= 20480 for p in parts)
    assert "".join(parts) == "字" * 10000
    assert split_content("  ") == [] and split_content("short") == ["short"]
    assert json.dumps(WeComRefused.__name__)


async def test_the_doctor_subscribes_the_robot(fake: FakeWeComRobot) -> None:
    from pydantic import SecretStr

    from channels.wecom.spec import checks

    missing = await checks(WeComSettings(enabled=True, mode="robot"))
    assert {f.what.split(" without ")[1] for f in missing} == {
        "the robot's BotID",
        "the robot's Secret",
    }
    section = WeComSettings(
        enabled=True,
        mode="robot",
        bot_id=fake.bot_id,
        bot_secret=SecretStr(fake.secret),
        ws_url=fake.ws_url,
    )
    [ok] = await checks(section)
    assert ok.status == "ok" and fake.bot_id in ok.what
    [refused] = await checks(section.model_copy(update={"bot_secret": SecretStr("nope")}))
    assert refused.status == "fail" and "BOT_SECRET" in refused.what
    assert fake.secret not in refused.what
