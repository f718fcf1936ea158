"""The web chat's HTTP side (channels/webchat/channel.py) in one process: the channel mounted
on an aiohttp app, a recording `submit` in place of the dispatcher, browsers played by
tests/webchat_client.py. What each test holds is the channel's docstring promise it names.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from channels.webchat.channel import Pacing, WebChatChannel
from channels.webchat.settings import WebChatSettings
from channels.webchat.store import STORE_FILE, FileWebChatStore
from gateway.channel import DeliveryFailed
from gateway.messages import Attachment, InboundMessage, OutboundFile, OutboundMessage, reply_for
from tests.webchat_client import API, Browser

pytestmark = pytest.mark.anyio


@dataclass
class Ticket:
    taken: bool = True
    status: str = "accepted"

    async def reply(self) -> OutboundMessage | None:
        return None


@dataclass
class Dispatcher:
    """What the channel submits; `take` says whether the journal keeps the next one."""

    submitted: list[InboundMessage] = field(default_factory=list)
    take: bool = True

    async def __call__(self, message: InboundMessage) -> Ticket:
        self.submitted.append(message)
        return Ticket(taken=self.take, status="accepted" if self.take else "retry_later")


class AppMount:
    def __init__(self) -> None:
        self.app = web.Application()

    def mount(self, method: str, path: str, handler: Any, *, require_ready: bool = True) -> None:
        self.app.router.add_route(method, path, handler)


@dataclass
class Chat:
    channel: WebChatChannel
    dispatcher: Dispatcher
    url: str
    browsers: list[Browser]

    async def browser(self, **kwargs: Any) -> Browser:
        browser = Browser(self.url, **kwargs)
        self.browsers.append(browser)
        await browser.load_state(wait=False)
        return browser

    async def say(
        self, browser: Browser, text: str, message_id: str = ""
    ) -> tuple[int, dict[str, Any]]:
        body = {"id": message_id or uuid.uuid4().hex, "text": text, "files": []}
        status, answer, _ = await browser.request("POST", f"{API}/messages", json=body)
        return status, answer

    async def reply_to(self, message: InboundMessage, text: str, **kwargs: Any) -> None:
        await self.channel.send(reply_for(message, text, **kwargs))


Factory = Callable[..., Awaitable[Chat]]


@pytest.fixture
async def chat_with(tmp_path: Path) -> AsyncIterator[Factory]:
    """Runs channels with the given settings (each on its own store); yields a factory."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**settings: Any) -> Chat:
            section = WebChatSettings(enabled=True, **{"dm_policy": "open", **settings})
            store = FileWebChatStore(tmp_path / f"{uuid.uuid4().hex}-{STORE_FILE}")
            channel = WebChatChannel(section, store=store, pacing=Pacing(heartbeat=0.5))
            mount = AppMount()
            channel.mount(mount)
            server = TestServer(mount.app, host="127.0.0.1")
            await server.start_server()
            stack.push_async_callback(server.close)
            dispatcher = Dispatcher()
            tg = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(tg.cancel_scope.cancel)  # first: the channel stops, then its group
            await tg.start(channel.run, dispatcher)
            chat = Chat(channel, dispatcher, str(server.make_url("")).rstrip("/"), [])

            async def close_browsers() -> None:
                for browser in chat.browsers:
                    await browser.close()

            stack.push_async_callback(close_browsers)
            return chat

        yield start


async def read_stream(
    browser: Browser, after: int, count: int, *, last_event_id: bool = False
) -> list[tuple[str, dict[str, Any]]]:
    """The first `count` events (kind, data) of a stream opened after `after`."""
    params = {} if last_event_id else {"after": str(after)}
    headers = browser.headers({"Last-Event-ID": str(after)} if last_event_id else None)
    found: list[tuple[str, dict[str, Any]]] = []
    with anyio.fail_after(10):
        async with browser.session.get(
            f"{browser.base_url}{API}/events", params=params, headers=headers
        ) as answer:
            assert answer.status == 200
            assert answer.headers["Content-Type"].startswith("text/event-stream")
            buffer = b""
            async for chunk in answer.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    kind, data = "", None
                    for line in block.decode().split("\n"):
                        if line.startswith("event:"):
                            kind = line[6:].strip()
                        elif line.startswith("data:"):
                            data = json.loads(line[5:])
                    if data is not None:
                        found.append((kind, data))
                        if len(found) >= count:
                            return found
    return found


# ----------------------------------------------------------------------------- pages


async def test_the_page_and_its_files_carry_the_strict_csp(chat_with: Factory) -> None:
    chat = await chat_with()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{chat.url}/webchat/") as page:
            assert page.status == 200
            policy = page.headers["Content-Security-Policy"]
            assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy
            assert page.headers["X-Frame-Options"] == "DENY"
            html = await page.text()
            assert '<script src="/webchat/static/chat.js" defer></script>' in html
            assert "onclick" not in html and "style=" not in html  # nothing inline
        for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
            async with http.get(f"{chat.url}/webchat/static/{name}") as static:
                assert static.status == 200 and static.content_type == kind
        async with http.get(f"{chat.url}/webchat/widget.js") as widget:
            assert widget.headers["Cross-Origin-Resource-Policy"] == "cross-origin"
        async with http.get(f"{chat.url}/webchat", allow_redirects=False) as bare:
            assert bare.status == 308 and bare.headers["Location"] == "/webchat/"


async def test_the_frame_is_only_for_allowed_sites(chat_with: Factory) -> None:
    chat = await chat_with(allowed_origins=["https://shop.example"])
    async with aiohttp.ClientSession() as http:
        frame = f"{chat.url}/webchat/frame"
        async with http.get(frame, params={"origin": "https://shop.example"}) as allowed:
            assert allowed.status == 200
            policy = allowed.headers["Content-Security-Policy"]
            assert "frame-ancestors https://shop.example;" in policy
            assert "X-Frame-Options" not in allowed.headers
            assert 'data-embed="1"' in await allowed.text()
        for params, headers in (
            ({"origin": "https://evil.example"}, {}),
            ({}, {}),
            ({"origin": "https://shop.example"}, {"Referer": "https://evil.example/page"}),
        ):
            async with http.get(frame, params=params, headers=headers) as refused:
                assert refused.status == 403
                assert "frame-ancestors 'none'" in refused.headers["Content-Security-Policy"]
    chat = await chat_with()
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{chat.url}/webchat/frame", params={"origin": "https://shop.example"}) as off,
    ):
        assert off.status == 404


# ----------------------------------------------------------------------------- who


async def test_a_new_visitor_gets_a_signed_cookie_only_for_the_chat(chat_with: Factory) -> None:
    chat = await chat_with()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{chat.url}{API}/state") as answer:
            assert answer.status == 200
            cookie = answer.cookies["gateway_webchat"]
            assert cookie["httponly"] and cookie["secure"] and cookie["path"] == "/webchat"
            assert cookie["samesite"] == "Strict"
            body = await answer.json()
            assert body["csrf"] and body["last"] == 0 and body["conversation"] == 1
        async with http.get(f"{chat.url}{API}/state", headers={"X-Webchat-Embed": "1"}) as framed:
            cookie = framed.cookies["gateway_webchat_embed"]
            assert cookie["samesite"] == "None" and cookie["secure"]
            assert "Partitioned" in framed.headers["Set-Cookie"]


async def test_forged_cookies_and_missing_tokens_are_refused_and_nothing_is_taken(
    chat_with: Factory,
) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    body = {"id": uuid.uuid4().hex, "text": "transfer everything", "files": []}
    async with aiohttp.ClientSession() as forger:
        cookie = f"v1.{ann.visitor}.9999999999.{'A' * 43}"
        async with forger.post(
            f"{chat.url}{API}/messages",
            json=body,
            headers={"Cookie": f"gateway_webchat={cookie}", "X-CSRF-Token": ann.csrf},
        ) as answer:
            assert answer.status == 401
    # Ann's own cookie, as a page of another site can make her browser send it:
    status, _, _ = await ann.request(
        "POST", f"{API}/messages", json=body, headers={"X-CSRF-Token": "not-hers"}
    )
    assert status == 403
    status, _, _ = await ann.request(
        "POST", f"{API}/messages", json=body, headers={"Origin": "https://evil.example"}
    )
    assert status == 403
    assert chat.dispatcher.submitted == []
    assert await chat.channel._store.events_after(ann.visitor, 0, 10) == []


async def test_one_visitor_never_reads_another(chat_with: Factory) -> None:
    chat = await chat_with()
    ann, bob = await chat.browser(), await chat.browser()
    assert ann.visitor != bob.visitor
    status, upload, _ = await ann.request(
        "POST", f"{API}/uploads", data=b"ann's notes", headers={"Content-Type": "text/plain"}
    )
    assert status == 200
    assert (await chat.say(ann, "my secret plan"))[0] == 200
    status, _, _ = await bob.request("GET", f"{API}/files/{upload['id']}")
    assert status == 404
    status, history, _ = await bob.request("GET", f"{API}/history?conversation=1")
    assert status == 200 and history["events"] == []
    # Bob's stream holds only his own: his message comes first, not Ann's.
    assert (await chat.say(bob, "hello"))[0] == 200
    [(kind, event)] = await read_stream(bob, 0, 1)
    assert kind == "log" and event["text"] == "hello"
    # A file of Ann's named in Bob's message is refused too.
    body = {"id": uuid.uuid4().hex, "text": "see", "files": [upload["id"]]}
    status, _, _ = await bob.request("POST", f"{API}/messages", json=body)
    assert status == 400


async def test_a_password_makes_every_browser_the_owner(chat_with: Factory) -> None:
    chat = await chat_with(password="correct horse battery", owner="me")
    async with aiohttp.ClientSession() as http, http.get(f"{chat.url}{API}/state") as answer:
        assert answer.status == 401 and (await answer.json())["login"] == "password"
        assert "Set-Cookie" not in answer.headers
    wrong = Browser(chat.url, password="guess")
    chat.browsers.append(wrong)
    with pytest.raises(RuntimeError):
        await wrong.load_state(wait=False)
    phone, laptop = (
        await chat.browser(password="correct horse battery"),
        await chat.browser(password="correct horse battery"),
    )
    assert phone.visitor == laptop.visitor == "me"
    assert (await chat.say(phone, "from the phone"))[0] == 200
    assert chat.dispatcher.submitted[-1].session_key == "web:me"
    [(_, event)] = await read_stream(laptop, 0, 1)
    assert event["text"] == "from the phone"


async def test_wrong_passwords_are_counted_per_address(chat_with: Factory) -> None:
    chat = await chat_with(password="correct horse battery")
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(12):
            async with http.post(f"{chat.url}{API}/login", json={"password": "guess"}) as answer:
                statuses.append(answer.status)
        assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
        async with http.post(
            f"{chat.url}{API}/login", json={"password": "correct horse battery"}
        ) as right:
            assert right.status == 429  # not even the right one, until the window passes


# ----------------------------------------------------------------------------- messages


async def test_journal_before_confirm_and_a_message_posted_again_is_one(chat_with: Factory) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    chat.dispatcher.take = False  # the journal cannot keep it yet
    status, _ = await chat.say(ann, "hello", "msg-0000001")
    assert status == 503
    chat.dispatcher.take = True
    for text in ("hello", "hello", "edited in another tab"):  # posted again until a 200
        status, answer = await chat.say(ann, text, "msg-0000001")
        assert status == 200 and answer == {"id": "msg-0000001", "event": 1}
    message = chat.dispatcher.submitted[-1]
    assert message.text == "hello"  # the message is the one logged under its id
    assert message.session_key == f"web:{ann.visitor}" and message.message_id == "msg-0000001"
    assert message.sender_id == message.chat_id == ann.visitor
    events = await chat.channel._store.events_after(ann.visitor, 0, 10)
    assert [(e.kind, e.message_id) for e in events] == [("message", "msg-0000001")]
    chat.channel.pause_intake()  # draining: kept in the browser for the next start
    assert (await chat.say(ann, "later"))[0] == 503


async def test_a_reply_is_logged_once_and_read_from_any_position(chat_with: Factory) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    await chat.say(ann, "**hello**", "msg-0000001")
    asked = chat.dispatcher.submitted[-1]
    await chat.reply_to(asked, "echo: **hello** <script>x</script>")
    await chat.reply_to(asked, "echo: **hello** <script>x</script>")  # sent again after a crash
    events = await read_stream(ann, 0, 2)
    assert [(k, e["id"], e["kind"]) for k, e in events] == [
        ("log", 1, "message"),
        ("log", 2, "reply"),
    ]
    reply = events[1][1]
    assert reply["message_id"] == "msg-0000001"
    assert reply["html"] == "<p>echo: <strong>hello</strong> &lt;script&gt;x&lt;/script&gt;</p>\n"
    assert [e["id"] for _, e in await read_stream(ann, 1, 1)] == [2]
    assert [e["id"] for _, e in await read_stream(ann, 1, 1, last_event_id=True)] == [2]
    # A stream open before the reply gets it as it is written.
    await chat.say(ann, "again", "msg-0000002")
    async with anyio.create_task_group() as tg:
        got: list[tuple[str, dict[str, Any]]] = []

        async def read() -> None:
            got.extend(await read_stream(ann, 3, 1))

        tg.start_soon(read)
        await anyio.sleep(0.3)
        await chat.reply_to(chat.dispatcher.submitted[-1], "echo: again")
    assert got[0][1]["text"] == "echo: again" and got[0][1]["id"] == 4


async def test_a_reply_the_log_cannot_take_is_delivery_failed(chat_with: Factory) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    await chat.say(ann, "hello")

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    chat.channel._store.add_reply = broken  # type: ignore[method-assign]
    with pytest.raises(DeliveryFailed):
        await chat.reply_to(chat.dispatcher.submitted[-1], "echo: hello")


async def test_new_starts_a_conversation_and_history_reads_the_earlier_one(
    chat_with: Factory,
) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    await chat.say(ann, "plan a trip")
    first = chat.dispatcher.submitted[-1]
    await chat.say(ann, "/new")
    await chat.reply_to(first, "echo: plan a trip")
    state = await ann.load_state()
    assert state["conversation"] == 2
    assert [c["title"] for c in state["conversations"]] == ["", "plan a trip"]
    assert [e["text"] for e in state["events"]] == ["/new"]
    _status, history, _ = await ann.request("GET", f"{API}/history?conversation=1")
    assert [e["text"] for e in history["events"]] == ["plan a trip", "echo: plan a trip"]


async def test_rate_limits_refuse_before_anything_is_kept(chat_with: Factory) -> None:
    chat = await chat_with(visitor_messages_per_minute=2, address_new_visitors_per_hour=2)
    ann = await chat.browser()
    assert (await chat.say(ann, "one", "msg-0000001"))[0] == 200
    assert (await chat.say(ann, "two", "msg-0000002"))[0] == 200
    status, answer, headers = await ann.request(
        "POST", f"{API}/messages", json={"id": "msg-0000003", "text": "three", "files": []}
    )
    assert status == 429 and int(headers["Retry-After"]) >= 1 and "slow down" in answer["error"]
    assert len(chat.dispatcher.submitted) == 2
    assert len(await chat.channel._store.events_after(ann.visitor, 0, 10)) == 2
    # A message posted again is no new message: never refused for the limit.
    assert (await chat.say(ann, "two", "msg-0000002"))[0] == 200
    await chat.browser()  # the address's second new visitor
    third = Browser(chat.url)
    chat.browsers.append(third)
    status, _, _ = await third.request("GET", f"{API}/state")
    assert status == 429


# ----------------------------------------------------------------------------- files


async def test_uploads_reach_the_media_pipeline_and_come_back_safely(chat_with: Factory) -> None:
    chat = await chat_with(max_upload_mb=0.01)
    ann = await chat.browser()
    status, _, _ = await ann.request(
        "POST", f"{API}/uploads", data=b"x" * 20_000, headers={"Content-Type": "image/png"}
    )
    assert status == 413
    status, image, _ = await ann.request(
        "POST",
        f"{API}/uploads",
        data=b"\x89PNG fake",
        headers={"Content-Type": "image/png", "X-Filename": "my%20cat.png"},
    )
    assert status == 200 and image["name"] == "my cat.png" and image["inline"]
    status, page, _ = await ann.request(
        "POST",
        f"{API}/uploads",
        data=b"<script>alert(1)</script>",
        headers={"Content-Type": "text/html"},
    )
    assert status == 200 and not page["inline"]
    body = {"id": "msg-0000001", "text": "look", "files": [image["id"], page["id"]]}
    assert (await ann.request("POST", f"{API}/messages", json=body))[0] == 200
    message = chat.dispatcher.submitted[-1]
    assert message.attachments == (
        Attachment("image", image["id"], "my cat.png", "image/png", 9),
        Attachment("document", page["id"], "file", "text/html", 25),
    )
    fetched = await chat.channel.fetch_file(message.attachments[0], max_bytes=1000)
    assert fetched == b"\x89PNG fake"
    async with ann.session.get(f"{chat.url}{API}/files/{page['id']}", headers=ann.headers()) as r:
        assert r.status == 200 and r.content_type == "application/octet-stream"
        assert r.headers["Content-Disposition"].startswith("attachment")
        assert "sandbox" in r.headers["Content-Security-Policy"]
    async with ann.session.get(f"{chat.url}{API}/files/{image['id']}", headers=ann.headers()) as r:
        assert r.content_type == "image/png" and r.headers["Content-Disposition"].startswith(
            "inline"
        )
    # A reply's file goes into the log with it.
    await chat.reply_to(
        message, "here is a chart", files=(OutboundFile("chart.png", b"\x89PNG", "image/png"),)
    )
    [(_, reply)] = [e for e in await read_stream(ann, 1, 1)]
    assert reply["files"][0]["name"] == "chart.png" and reply["files"][0]["inline"]


# ----------------------------------------------------------------------------- news


async def test_a_reply_being_written_reaches_open_pages_as_drafts(chat_with: Factory) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    await chat.say(ann, "tell me")
    asked = chat.dispatcher.submitted[-1]
    got: list[tuple[str, dict[str, Any]]] = []

    async def read() -> None:
        got.extend(await read_stream(ann, 1, 2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.3)
        await chat.channel.stream_delta(asked, "**a story")
        await anyio.sleep(0.2)
        await chat.channel.stream_delta(asked, " of old**")
    news = [data for kind, data in got if kind == "news" and data["type"] == "draft"]
    assert news and news[0]["reply_to"] == asked.message_id
    assert news[0]["html"].startswith("<p>")


# ----------------------------------------------------------------------------- doctor


async def test_doctor_says_who_may_talk_and_what_is_weak() -> None:
    from channels.webchat.spec import checks

    lines = [(f.status, f.what) for f in await checks(WebChatSettings(enabled=True))]
    assert lines == [
        (
            "ok",
            "web: the chat is at /webchat/ on the HTTP port, for visitors an operator approved "
            "(`gateway pairing approve web CODE`)",
        )
    ]
    open_unbounded = WebChatSettings(
        enabled=True,
        dm_policy="open",
        visitor_messages_per_minute=0,
        allowed_origins=["https://shop.example"],
    )
    found = [(f.status, f.what) for f in await checks(open_unbounded)]
    assert ("warn", "web: open to everyone with no bound on visitor_messages_per_minute") in found
    assert ("ok", "web: the widget may be embedded by https://shop.example") in found
    short = await checks(WebChatSettings(enabled=True, password="hunter2"))
    assert short[0].status == "warn" and "7 characters" in short[0].what
    assert "web:owner" in short[1].what


def test_allowed_origins_are_origins() -> None:
    from pydantic import ValidationError

    for bad in (
        "shop.example",
        "https://shop.example/",
        "https://shop.example/page",
        "http://shop.example",
        "HTTPS://Shop.example",
    ):
        with pytest.raises(ValidationError):
            WebChatSettings(allowed_origins=[bad])
    assert WebChatSettings(allowed_origins=["http://localhost:8000", "https://a.example:8443"])


async def test_a_position_past_the_end_of_the_log_tells_the_page_to_start_again(
    chat_with: Factory,
) -> None:
    chat = await chat_with()
    ann = await chat.browser()
    await chat.say(ann, "hello")
    [(kind, news)] = await read_stream(ann, 7, 1)  # the page holds 7; the log has 1
    assert (kind, news) == ("news", {"type": "reset"})
