"""The adapter's pure parts (translation, splitting, signatures), its webhook's first
moments, and the platform's own rules, without a gateway: quick checks beside the kit's
scenarios."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_TO_BOT,
    InboundMessage,
    OutboundMessage,
)
from pydantic import SecretStr

from gateway_channel_example.channel import (
    SIGNATURE_HEADER,
    ExampleChannel,
    signed,
    split_text,
    translate,
)
from gateway_channel_example.platform import MAX_TEXT, ExampleChat, sign
from gateway_channel_example.settings import ExampleSettings

BOT = "examplebot"


def update(text: str, *, conversation: str = "dm-ann", **message: Any) -> dict[str, Any]:
    kind = "dm" if conversation.startswith("dm-") else "group"
    return {
        "update_id": 7,
        "message": {
            "id": "m3",
            "conversation": {"id": conversation, "kind": kind},
            "author": {"id": "ann", "name": "Ann"},
            "text": text,
            "mentions": [],
            "everyone": False,
            "reply_to": None,
            "sent_at": 1.5,
        }
        | message,
    }


def test_a_dm_becomes_a_message_of_its_conversation() -> None:
    message = translate(update("hello"), bot=BOT)
    assert message is not None
    assert (message.session_key, message.message_id, message.sender_id) == (
        "example:dm-ann",
        "m3",
        "ann",
    )
    assert META_IS_GROUP not in message.metadata


def test_a_group_message_says_whether_it_addresses_the_bot() -> None:
    chatter = translate(update("hi all", conversation="g-lobby"), bot=BOT)
    mention = translate(update(f"@{BOT} hi", conversation="g-lobby", mentions=[BOT]), bot=BOT)
    reply = translate(
        update("yes", conversation="g-lobby", reply_to={"id": "m1", "author": BOT}), bot=BOT
    )
    assert chatter is not None and mention is not None and reply is not None
    assert chatter.metadata[META_IS_GROUP] and not chatter.metadata[META_MENTIONED]
    assert mention.metadata[META_MENTIONED] and mention.text == "hi"
    assert reply.metadata[META_REPLY_TO_BOT] and not reply.metadata[META_MENTIONED]


def test_the_bots_own_posts_are_not_taken() -> None:
    assert translate(update("echo", author={"id": BOT, "name": "Bot"}), bot=BOT) is None
    assert translate({"update_id": 8}, bot=BOT) is None


@pytest.mark.parametrize("size", [1, 1999, 2000, 2001, 6500])
def test_a_long_text_is_split_whole_and_in_order(size: int) -> None:
    lines = [f"L{n:05d} is line {n}" for n in range(1, size)]
    text = "\n".join(lines)[:size]
    parts = split_text(text)
    assert all(0 < len(part) <= MAX_TEXT for part in parts)
    assert "\n".join(parts).split() == text.split()


def test_a_text_without_spaces_is_cut_anywhere() -> None:
    assert split_text("x" * 4500) == ["x" * 2000, "x" * 2000, "x" * 500]


def test_a_signature_is_checked_against_the_body() -> None:
    body = b'{"update_id": 1}'
    assert signed("s3cret", body, sign("s3cret", body))
    assert not signed("s3cret", body, sign("guess", body))
    assert not signed("s3cret", body + b" ", sign("s3cret", body))
    assert not signed("s3cret", body, "")


def call(chat: ExampleChat, method: str, path: str, body: object = None) -> tuple[int, Any]:
    request = urllib.request.Request(
        chat.url + path,
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {chat.token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as refused:
        return refused.code, json.load(refused)


def test_the_platform_keeps_an_update_until_a_later_offset_confirms_it() -> None:
    with ExampleChat(token="t").serving() as chat:
        first = chat.write("ann", "dm-ann", "one")["update_id"]
        second = chat.write("ann", "dm-ann", "two")["update_id"]
        assert [u["update_id"] for u in call(chat, "GET", "/updates")[1]["updates"]] == [
            first,
            second,
        ]
        assert chat.pending() == [first, second]  # fetched is not confirmed
        call(chat, "GET", f"/updates?offset={second}")
        assert chat.pending() == [second]
        again = chat.redeliver("m1")
        assert again["message"]["id"] == "m1" and again["update_id"] > second


def test_the_platform_holds_a_post_to_its_rules() -> None:
    with ExampleChat(token="t", bot=BOT).serving() as chat:
        chat.write("ann", "g-lobby", "hi")
        status, _ = call(chat, "POST", "/messages", {"conversation": "g-lobby", "text": "x" * 2001})
        assert status == 400
        assert call(chat, "POST", "/messages", {"conversation": "g-none", "text": "x"})[0] == 404
        loud = {"conversation": "g-lobby", "text": "@everyone @ann look"}
        assert call(chat, "POST", "/messages", loud)[1]["message"]["everyone"] is True
        quiet = call(chat, "POST", "/messages", loud | {"notify": ["users"]})[1]["message"]
        assert (quiet["everyone"], quiet["mentions"]) == (False, ["ann"])
        chat.down()
        assert call(chat, "GET", "/me")[0] == 503


class Taken:
    """The ticket of a message the journal holds."""

    taken = True

    async def reply(self) -> OutboundMessage | None:
        return None


class Routes:
    """The gateway's HTTP server, as far as `ExampleChannel.mount` needs it."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def mount(
        self,
        method: str,
        path: str,
        handler: Callable[[Any], Awaitable[Any]],
        *,
        require_ready: bool = True,
    ) -> None:
        self.app.router.add_route(method, path, handler)


class Live:
    """The channel's task status: set once it says it is live."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def started(self, value: None = None) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_webhook_takes_no_update_before_the_bot_knows_its_handle() -> None:
    """The gateway's port is open before a channel is live. A delivery that comes while
    the channel still asks who it is gets 503 (Example Chat sends it again): read without
    the bot's handle, a mention of the bot would pass for chatter and be settled."""
    asked, answer = anyio.Event(), anyio.Event()

    async def me(request: web.Request) -> web.Response:
        asked.set()
        await answer.wait()
        return web.json_response({"id": BOT, "name": "Example Bot"})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    platform, gateway = web.Application(), web.Application()
    platform.router.add_get("/me", me)
    platform.router.add_put("/webhook", ok)
    submitted: list[InboundMessage] = []

    async def submit(message: InboundMessage) -> Taken:
        submitted.append(message)
        return Taken()

    body = json.dumps(update(f"@{BOT} hi", conversation="g-lobby", mentions=[BOT])).encode()
    headers = {SIGNATURE_HEADER: sign("s3cret", body)}
    async with TestServer(platform) as api:
        settings = ExampleSettings(
            enabled=True,
            api_url=str(api.make_url("")),
            mode="webhook",
            webhook_url="http://127.0.0.1/example/webhook",
            webhook_secret=SecretStr("s3cret"),
        )
        channel = ExampleChannel(settings, token="t")
        channel.mount(Routes(gateway))
        live = Live()
        async with TestClient(TestServer(gateway)) as client, anyio.create_task_group() as tg:
            tg.start_soon(lambda: channel.run(submit, task_status=live))
            await asked.wait()
            early = await client.post("/example/webhook", data=body, headers=headers)
            assert (early.status, submitted) == (503, [])
            answer.set()
            with anyio.fail_after(10):
                await live.wait()
            late = await client.post("/example/webhook", data=body, headers=headers)
            assert late.status == 200
            assert [m.metadata[META_MENTIONED] for m in submitted] == [True]
            tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_an_unreadable_update_is_skipped_not_retried_forever() -> None:
    channel = ExampleChannel(ExampleSettings(enabled=True), token="t")
    broken = {"update_id": 9, "message": {"id": "m9", "text": "no author"}}
    assert await channel._take(broken) is True
