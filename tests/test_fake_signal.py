"""The fake signal-cli keeps the semantics the Signal channel's promise rests on
(tests/fakes/signal_server.py cites signal-cli-jsonrpc(5), signal-cli(1) and the source):
what waits at Signal's server until a `receive` takes it, what `--receive-mode on-start`
drops, a `receive` whose client left taking a message all the same, one receiver at a
time, the JSON-RPC errors, the envelope and the send parameters."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.fakes.signal_server import (
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    RATELIMIT_ERROR,
    RECEIVE_BUSY,
    USER_ERROR,
    FakeSignalCli,
    rate_limited,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def fake() -> AsyncIterator[FakeSignalCli]:
    async with FakeSignalCli() as server:
        yield server


async def rpc(fake: FakeSignalCli, method: str, params: dict[str, Any] | None = None) -> Any:
    """The whole JSON-RPC answer of one request."""
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": 7}
    if params is not None:
        body["params"] = params
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{fake.url}/api/v1/rpc", json=body) as answer,
    ):
        assert answer.status == 200
        return await answer.json()


async def test_messages_wait_at_the_server_until_a_receive_takes_them(
    fake: FakeSignalCli,
) -> None:
    alice = fake.person("Alice")
    first = fake.dm(alice, "one")
    fake.dm(alice, "two")
    await asyncio.sleep(0.2)
    assert fake.waiting() == 2 and fake.handed == []  # manual mode: nobody receives
    answer = await rpc(fake, "receive", {"timeout": 1, "maxMessages": 1})
    assert [r["envelope"]["dataMessage"]["message"] for r in answer["result"]] == ["one"]
    assert answer["result"][0]["account"] == fake.account
    assert answer["result"][0]["envelope"]["timestamp"] == first["timestamp"]
    assert fake.waiting() == 1
    rest = await rpc(fake, "receive", {"timeout": 1})
    assert [r["envelope"]["dataMessage"]["message"] for r in rest["result"]] == ["two"]
    assert fake.waiting() == 0


async def test_receive_waits_up_to_its_timeout_and_zero_returns_at_once(
    fake: FakeSignalCli,
) -> None:
    started = asyncio.get_running_loop().time()
    assert (await rpc(fake, "receive", {"timeout": 0}))["result"] == []
    assert (await rpc(fake, "receive", {"timeout": 0.5}))["result"] == []
    took = asyncio.get_running_loop().time() - started
    assert 0.4 < took < 2
    alice = fake.person("Alice")
    later = asyncio.get_running_loop().call_later(0.3, fake.dm, alice, "late")
    answer = await rpc(fake, "receive", {"timeout": 5, "maxMessages": 1})
    later.cancel()
    assert [r["envelope"]["dataMessage"]["message"] for r in answer["result"]] == ["late"]


async def test_a_receive_whose_client_left_still_takes_the_next_message(
    fake: FakeSignalCli,
) -> None:
    """signal-cli's handler runs to its end when its HTTP client goes away: the message
    it takes meanwhile is acknowledged to Signal and its answer goes nowhere."""
    body = {"jsonrpc": "2.0", "method": "receive", "params": {"timeout": 3, "maxMessages": 1}}
    async with aiohttp.ClientSession() as session:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await session.post(f"{fake.url}/api/v1/rpc", json={**body, "id": 1})
    alice = fake.person("Alice")
    await asyncio.sleep(0.2)
    gone = fake.dm(alice, "written after the client left")
    for _ in range(50):
        if fake.lost_in_transit:
            break
        await asyncio.sleep(0.05)
    assert fake.lost_in_transit == [gone]
    assert fake.waiting() == 0
    assert (await rpc(fake, "receive", {"timeout": 0.2}))["result"] == []


async def test_only_one_receiver_at_a_time(fake: FakeSignalCli) -> None:
    first = asyncio.create_task(rpc(fake, "receive", {"timeout": 1}))
    await asyncio.sleep(0.2)
    second = await rpc(fake, "receive", {"timeout": 1})
    assert second["error"]["code"] == USER_ERROR
    assert second["error"]["message"] == RECEIVE_BUSY
    assert (await first)["result"] == []
    assert (await rpc(fake, "receive", {"timeout": 0.1}))["result"] == []  # free again


async def test_on_start_mode_drops_what_no_events_client_reads() -> None:
    """With the default --receive-mode on-start the daemon receives by itself: a message
    that arrives while no events client listens is gone, and `receive` is refused."""
    async with FakeSignalCli(receive_mode="on-start") as fake:
        alice = fake.person("Alice")
        lost = fake.dm(alice, "nobody listens")
        for _ in range(40):
            if fake.dropped:
                break
            await asyncio.sleep(0.05)
        assert fake.dropped == [lost] and fake.waiting() == 0
        refused = await rpc(fake, "receive", {"timeout": 0.1})
        assert refused["error"]["message"] == RECEIVE_BUSY
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{fake.url}/api/v1/events") as events,
        ):
            assert events.headers["Content-Type"] == "text/event-stream"
            seen = fake.dm(alice, "someone listens")
            lines = []
            while len(lines) < 2:
                line = (await events.content.readline()).decode().strip()
                if line:
                    lines.append(line)
        assert lines[0] == "event:receive"
        assert json.loads(lines[1].removeprefix("data:"))["envelope"] == seen


async def test_an_events_client_makes_a_manual_daemon_receive_while_it_stays(
    fake: FakeSignalCli,
) -> None:
    alice = fake.person("Alice")
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{fake.url}/api/v1/events") as events:
            await asyncio.sleep(0.1)
            assert (await rpc(fake, "receive", {"timeout": 0.1}))["error"]["code"] == USER_ERROR
            fake.dm(alice, "pushed")
            while not (await events.content.readline()).startswith(b"data:"):
                pass
        await asyncio.sleep(0.2)
    fake.dm(alice, "waits again")
    await asyncio.sleep(0.2)
    assert fake.waiting() == 1 and not fake.dropped


async def test_the_json_rpc_errors_are_signal_clis(fake: FakeSignalCli) -> None:
    assert (await rpc(fake, "noSuchMethod"))["error"]["code"] == METHOD_NOT_FOUND
    assert (await rpc(fake, "listAccounts"))["error"] == {
        "code": METHOD_NOT_FOUND,
        "message": "Method not implemented",
        "data": None,
    }
    strict = await rpc(fake, "receive", {"account": fake.account, "timeout": 0})
    assert strict["error"]["code"] == INVALID_REQUEST
    assert 'Unrecognized field "account"' in strict["error"]["message"]
    empty = await rpc(fake, "send", {"recipient": [fake.person("A").uuid]})
    assert empty["error"]["code"] == USER_ERROR and "empty message" in empty["error"]["message"]
    fake.fail_next("send", rate_limited(3))
    limited = await rpc(fake, "send", {"recipient": fake.person("B").uuid, "message": "x"})
    assert limited["error"]["code"] == RATELIMIT_ERROR
    assert limited["error"]["data"]["response"]["results"][0]["retryAfterSeconds"] == 3
    assert (await rpc(fake, "version"))["result"] == {"version": "0.14.6"}


async def test_the_http_endpoint_checks_what_signal_cli_checks() -> None:
    async with FakeSignalCli(pin_host=True) as fake, aiohttp.ClientSession() as session:
        async with session.get(f"{fake.url}/api/v1/rpc") as answer:
            assert answer.status == 405
        async with session.post(f"{fake.url}/api/v1/rpc", data=b"{}") as answer:
            assert answer.status == 415
        body = {"jsonrpc": "2.0", "method": "version"}  # a notification: no answer
        async with session.post(f"{fake.url}/api/v1/rpc", json=body) as answer:
            assert answer.status == 201
        elsewhere = {"Host": "gateway.example:8080"}
        async with session.post(
            f"{fake.url}/api/v1/rpc", json={**body, "id": 1}, headers=elsewhere
        ) as answer:
            assert answer.status == 421
        async with session.get(f"{fake.url}/api/v1/check") as answer:
            assert answer.status == 200


async def test_multi_account_mode_takes_an_account_parameter() -> None:
    async with FakeSignalCli(multi_account=True) as fake:
        assert (await rpc(fake, "listAccounts"))["result"] == [{"number": fake.account}]
        assert (await rpc(fake, "receive", {"account": fake.account, "timeout": 0}))["result"] == []
        other = await rpc(fake, "version", {"account": "+15559999999"})
        assert other["error"]["message"] == "Specified account does not exist"


async def test_group_messages_mentions_quotes_and_edits_look_as_signal_cli_writes_them(
    fake: FakeSignalCli,
) -> None:
    alice, bob = fake.person("Alice"), fake.person("Bob")
    group = fake.group("Team", [alice, bob])
    said = fake.group_message(group, alice, "hi 😀 there", mention_bot=True)
    data = said["dataMessage"]
    assert data["groupInfo"] == {
        "groupId": group.id,
        "groupName": "Team",
        "revision": 1,
        "type": "DELIVER",
    }
    assert data["message"] == "\ufffc hi 😀 there"
    assert data["mentions"] == [
        {"name": fake.account, "number": fake.account, "uuid": fake.me.uuid, "start": 0,
         "length": 1}
    ]  # fmt: skip
    assert said["sourceUuid"] == alice.uuid and said["timestamp"] == data["timestamp"]
    edit = fake.edit(said, "changed")
    assert edit["editMessage"]["targetSentTimestamp"] == said["timestamp"]
    assert edit["timestamp"] > said["timestamp"]
    again = fake.edit(edit, "twice")
    assert again["editMessage"]["targetSentTimestamp"] == said["timestamp"]
    assert len(base64.b64decode(group.id)) == 32
    stamps = [fake.dm(alice, str(n))["timestamp"] for n in range(50)]
    assert len(set(stamps)) == 50 and stamps == sorted(stamps)  # a message's id, per sender


async def test_a_send_is_recorded_with_its_styles_quote_and_attachments(
    fake: FakeSignalCli,
) -> None:
    alice = fake.person("Alice")
    group = fake.group("Team", [alice])
    picture = base64.b64encode(b"\x89PNG...").decode()
    answer = await rpc(
        fake,
        "send",
        {
            "groupId": group.id,
            "message": "bold and code",
            "textStyle": ["0:4:BOLD", "9:4:MONOSPACE"],
            "quoteTimestamp": 123,
            "quoteAuthor": alice.uuid,
            "attachment": f"data:image/png;filename=p.png;base64,{picture}",
        },
    )
    result = answer["result"]
    assert result["results"] == [
        {"recipientAddress": alice.address(), "type": "SUCCESS", "groupId": group.id}
    ]
    sent = fake.sent[-1]
    assert sent.timestamp == result["timestamp"] and sent.group_id == group.id
    assert sent.styles == ((0, 4, "BOLD"), (9, 4, "MONOSPACE"))
    assert sent.quote == (123, alice.uuid)
    assert sent.attachments == (("image/png", "p.png", b"\x89PNG..."),)
    bad = await rpc(fake, "send", {"groupId": group.id, "message": "x", "textStyle": "0:1:LOUD"})
    assert bad["error"]["message"] == "Invalid style: LOUD"
    long = await rpc(fake, "send", {"recipient": alice.uuid, "message": "é" * 1001})
    assert "result" in long and fake.sent[-1].long_text


async def test_receipts_reactions_typing_and_attachments(fake: FakeSignalCli) -> None:
    alice = fake.person("Alice")
    await rpc(fake, "sendReceipt", {"recipient": alice.uuid, "targetTimestamp": [5]})
    await rpc(fake, "sendTyping", {"recipient": [alice.uuid]})
    await rpc(
        fake,
        "sendReaction",
        {"recipient": [alice.uuid], "emoji": "👀", "targetAuthor": alice.uuid,
         "targetTimestamp": 5},
    )  # fmt: skip
    assert fake.receipts == [{"recipient": alice.uuid, "timestamps": [5], "type": "read"}]
    assert fake.reactions[0]["emoji"] == "👀" and len(fake.typing) == 1
    found = fake.add_attachment(b"hello", "text/plain", "a.txt")
    got = await rpc(fake, "getAttachment", {"id": found["id"]})
    assert base64.b64decode(got["result"]["data"]) == b"hello"
    missing = await rpc(fake, "getAttachment", {"id": "nope"})
    assert missing["error"]["message"] == "Could not find attachment with ID: nope"
