"""The /admin page over HTTP: the real daemon in this process (its HTTP server, stores,
access gate and agent) answering through the fake OpenAI server; requests from aiohttp's
client. The browser tests (test_admin_browser.py) drive the same pages in Chromium."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest

from gateway.access.protocol import PendingRequest
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.http.admin.auth import COOKIE_NAME, AdminKeys
from gateway.http.admin.views import TurnWindow
from gateway.llm.types import LLMMessage
from gateway.memory.facts import NewFact, Origin
from gateway.messages import OutboundMessage
from tests.fakes.openai_server import FakeOpenAI

pytestmark = pytest.mark.anyio

TOKEN = "http-token-for-admin-tests-0123456789"
ADMIN_TOKEN = "admin-only-token-abcdefghijklmnop"
HOSTILE = "<script>document.title='pwned'</script>\u202etxt.exe <img src=x onerror=alert(1)>"


@dataclass
class Admin:
    daemon: Daemon
    url: str
    http: aiohttp.ClientSession
    cookie: str = ""
    csrf: str = ""

    async def get(self, path: str, **kw: Any) -> tuple[int, str]:
        headers = {"Cookie": f"{COOKIE_NAME}={self.cookie}"} if self.cookie else {}
        async with self.http.get(
            self.url + path, headers=headers | kw.pop("headers", {}), allow_redirects=False, **kw
        ) as r:
            return r.status, await r.text()

    async def post(self, path: str, data: dict[str, str], **kw: Any) -> tuple[int, str]:
        headers = {"Cookie": f"{COOKIE_NAME}={self.cookie}"} if self.cookie else {}
        async with self.http.post(
            self.url + path,
            data=data,
            headers=headers | kw.pop("headers", {}),
            allow_redirects=False,
            **kw,
        ) as r:
            return r.status, await r.text()

    async def login(self, token: str = TOKEN) -> aiohttp.ClientResponse:
        async with self.http.post(
            self.url + "/admin/login", data={"token": token}, allow_redirects=False
        ) as r:
            await r.read()
        if r.status == 303:
            self.cookie = r.cookies[COOKIE_NAME].value
            _, page = await self.get("/admin")
            match = re.search(r'name="csrf" value="([^"]+)"', page)
            assert match is not None
            self.csrf = match.group(1)
        return r

    async def chat(self, session: str, text: str, token: str = TOKEN) -> dict[str, Any]:
        async with self.http.post(
            self.url + "/api/chat",
            json={"session": session, "text": text},
            headers={"Authorization": f"Bearer {token}"},
        ) as r:
            assert r.status == 200, await r.text()
            body: dict[str, Any] = await r.json()
            return body


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[Admin]:
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        port = await tg.start(daemon.run)
        try:
            yield Admin(daemon, f"http://127.0.0.1:{port}", http)
        finally:
            daemon.stop()


@pytest.fixture
def settings_for(
    make_settings: Callable[..., Settings], fake_openai: FakeOpenAI
) -> Callable[..., Settings]:
    def make(**overrides: Any) -> Settings:
        options: dict[str, Any] = {"http__port": 0, "http__token": TOKEN, "llm__temperature": 0}
        return make_settings(fake_openai, **(options | overrides))

    return make


# --------------------------------------------------------------------------- access


async def test_the_page_is_off_without_a_token(settings_for: Callable[..., Settings]) -> None:
    async with running(settings_for(http__token="")) as admin:
        status, page = await admin.get("/admin")
        assert status == 503
        assert "GATEWAY_HTTP__TOKEN" in page
        status, _ = await admin.post("/admin/login", {"token": ""})
        assert status == 503


async def test_login_sets_a_strict_httponly_secure_cookie(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        status, _ = await admin.get("/admin/sessions")
        assert status == 303  # to the login form
        wrong = await admin.login("not-the-token")
        assert wrong.status == 401 and not admin.cookie
        ok = await admin.login()
        assert ok.status == 303 and ok.headers["Location"] == "/admin"
        set_cookie = ok.headers["Set-Cookie"]
        for attribute in ("HttpOnly", "Secure", "SameSite=Strict", "Path=/admin"):
            assert attribute in set_cookie
        assert TOKEN not in set_cookie
        status, page = await admin.get("/admin/sessions")
        assert status == 200 and "Sessions" in page


async def test_off_this_machine_the_login_needs_https(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        # A browser would drop the Secure cookie over plain HTTP: say so, set none.
        elsewhere = {"Host": "gateway.example.org"}
        async with admin.http.post(
            admin.url + "/admin/login",
            data={"token": TOKEN},
            headers=elsewhere,
            allow_redirects=False,
        ) as r:
            assert r.status == 400 and "HTTPS" in await r.text()
            assert COOKIE_NAME not in r.cookies
        behind_tls = elsewhere | {"X-Forwarded-Proto": "https"}
        async with admin.http.post(
            admin.url + "/admin/login",
            data={"token": TOKEN},
            headers=behind_tls,
            allow_redirects=False,
        ) as r:
            assert r.status == 303 and COOKIE_NAME in r.cookies


async def _login_from(admin: Admin, address: str, token: str) -> aiohttp.ClientResponse:
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.post(admin.url + "/admin/login", data={"token": token}, allow_redirects=False) as r,
    ):
        await r.read()
        return r


async def test_guessing_the_token_locks_out_that_address_only(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        throttle = admin.daemon.http.auth_throttle
        now = [1000.0]
        throttle._clock = lambda: now[0]
        for _ in range(throttle.max_failures):
            assert (await admin.login("guess")).status == 401
        locked = await admin.login()  # even the right token, for now
        assert locked.status == 429 and int(locked.headers["Retry-After"]) == 60
        assert "Too many wrong tokens from your address" in await locked.text()
        # The operator, at another address, still logs in (127.0.0.2 is this machine too).
        assert (await _login_from(admin, "127.0.0.2", TOKEN)).status == 303
        # The same address's bearer header on a page is refused as well, unchecked.
        status, _ = await admin.get("/admin", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 429
        now[0] += throttle.window + 1
        assert (await admin.login()).status == 303


async def test_wrong_bearer_headers_on_the_pages_count_as_guesses(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for(http__auth_max_failures=3)) as admin:
        for n in range(3):
            status, _ = await admin.get("/admin", headers={"Authorization": f"Bearer no-{n}"})
            assert status == 401
        status, page = await admin.get("/admin", headers={"Authorization": "Bearer no-4"})
        assert status == 429 and "wait 60 s" in page
        # One count for the chat API and the page: the API refuses this address too.
        async with admin.http.post(
            admin.url + "/api/chat",
            json={"session": "s", "text": "hi"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "60"


async def test_forged_and_altered_cookies_are_refused(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        good = admin.cookie
        body, _, signature = good.rpartition(".")
        _, expires, nonce = body.split(".")
        for forged in (
            f"v1.{int(expires) + 999999}.{nonce}.{signature}",  # extended by hand
            good[:-2] + ("AA" if not good.endswith("AA") else "BB"),
            "v1.9999999999.x.y",
            "",
        ):
            admin.cookie = forged
            status, _ = await admin.get("/admin/pairing")
            assert status == 303, forged


def test_a_cookie_expires_and_dies_with_the_token() -> None:
    now = [1000.0]
    keys = AdminKeys("token-one", clock=lambda: now[0])
    cookie = keys.new_cookie()
    login = keys.check_cookie(cookie)
    assert login is not None and login.csrf == keys.csrf_for(cookie)
    assert AdminKeys("token-two", clock=lambda: now[0]).check_cookie(cookie) is None
    now[0] += 12 * 3600 + 1
    assert keys.check_cookie(cookie) is None
    assert not AdminKeys.csrf_ok(login, None)
    assert not AdminKeys.csrf_ok(login, "x" * len(login.csrf))
    assert AdminKeys.csrf_ok(login, login.csrf)


async def test_the_bearer_header_opens_the_pages_and_needs_no_csrf(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        status, page = await admin.get("/admin/cache", headers=bearer)
        assert status == 200 and "Response cache" in page
        status, page = await admin.post(
            "/admin/cache/invalidate", {"what": "shared"}, headers=bearer
        )
        assert status == 200 and "Removed 0 cache entries" in page
        status, _ = await admin.get("/admin/cache", headers={"Authorization": "Bearer wrong"})
        assert status == 401


async def _pending(admin: Admin, sender: str = "777") -> PendingRequest:
    now = time.time()
    request = PendingRequest("telegram", sender, "ABCD2345", now, now + 3600, chat_id=sender)
    recorded = await anyio.to_thread.run_sync(
        lambda: admin.daemon.pairing.add_pending(request, max_pending=10)
    )
    assert recorded is request
    return request


async def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        await _pending(admin)
        form = {"channel": "telegram", "code": "ABCD2345"}
        status, page = await admin.post("/admin/pairing/approve", form)
        assert status == 403 and "security token" in page
        status, _ = await admin.post("/admin/pairing/approve", form | {"csrf": "forged"})
        assert status == 403
        # The right token from a foreign site (a browser names the Origin): refused too.
        status, _ = await admin.post(
            "/admin/pairing/approve",
            form | {"csrf": admin.csrf},
            headers={"Origin": "https://evil.example"},
        )
        assert status == 403
        assert not admin.daemon.pairing.is_approved("telegram", "777")
        status, page = await admin.post("/admin/pairing/approve", form | {"csrf": admin.csrf})
        assert status == 200 and "Approved 777 on telegram" in page
        assert admin.daemon.pairing.is_approved("telegram", "777")


async def test_approving_tells_the_sender_and_revoking_withdraws(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        sent: list[OutboundMessage] = []

        async def deliver(message: OutboundMessage) -> None:
            sent.append(message)

        admin.daemon.admin.sources.deliver = deliver
        await admin.login()
        await _pending(admin, "888")
        status, page = await admin.get("/admin/pairing")
        assert "ABCD2345" in page and "888" in page
        status, page = await admin.post(
            "/admin/pairing/approve",
            {"channel": "telegram", "code": "abcd-2345", "csrf": admin.csrf},
        )
        assert status == 200
        assert [(m.channel, m.chat_id) for m in sent] == [("telegram", "888")]
        status, page = await admin.post(
            "/admin/pairing/approve",
            {"channel": "telegram", "code": "ZZZZ9999", "csrf": admin.csrf},
        )
        assert status == 400 and "No live request" in page
        status, page = await admin.post(
            "/admin/pairing/revoke", {"channel": "telegram", "sender": "888", "csrf": admin.csrf}
        )
        assert status == 200 and "Revoked 888" in page
        assert not admin.daemon.pairing.is_approved("telegram", "888")


async def test_with_an_admin_token_chat_api_clients_cannot_open_the_page(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for(http__admin_token=ADMIN_TOKEN)) as admin:
        status, _ = await admin.get("/admin", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 401
        assert (await admin.login(TOKEN)).status == 401
        assert (await admin.login(ADMIN_TOKEN)).status == 303
        # ...and the admin token is no key to the chat API, nor the cookie.
        async with admin.http.post(
            admin.url + "/api/chat",
            json={"session": "x", "text": "hi"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        ) as r:
            assert r.status == 401
        async with admin.http.post(
            admin.url + "/api/chat",
            json={"session": "x", "text": "hi"},
            headers={"Cookie": f"{COOKIE_NAME}={admin.cookie}"},
        ) as r:
            assert r.status == 401


async def test_a_chat_cannot_reach_the_page_through_the_chat_api(
    settings_for: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    async with running(settings_for()) as admin:
        await _pending(admin, "999")
        # Whatever a chat says, and whichever session it names, it is a chat turn in
        # the api: namespace: the pairing request stays pending.
        for text in ("/approve telegram ABCD2345", "/admin/pairing/approve ABCD2345"):
            reply = await admin.chat("work", text)
            assert reply["session"] == "api:work"
        async with admin.http.post(
            admin.url + "/api/chat",
            json={"session": "telegram:999", "text": "/admin"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            assert r.status == 400
        assert not admin.daemon.pairing.is_approved("telegram", "999")
        # No tool the model may call reaches pairing, the cache or this page either.
        names = [spec.name for spec in admin.daemon.gateway.agent.tools.specs()]
        assert not [n for n in names if any(w in n for w in ("pair", "admin", "cache"))]


# --------------------------------------------------------------------------- pages


async def test_hostile_content_is_escaped_on_every_page(
    settings_for: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        huge = "A" * 50_000
        # The chat API refuses such a name; a terminal session (`--session`) may hold it.
        key = "cli:<b>bold</b>\u202eevil"
        session = admin.daemon.gateway.sessions.get_or_create(key)
        session.add_message(LLMMessage(role="user", content=HOSTILE))
        session.add_message(LLMMessage(role="assistant", content=huge))
        _, listing = await admin.get("/admin/sessions")
        status, page = await admin.get("/admin/session", params={"key": key})
        assert status == 200
        for html in (listing, page):
            assert "<b>bold</b>" not in html and "&lt;b&gt;bold&lt;/b&gt;" in html
            assert "\u202e" not in html and "U+202E" in html
        assert "<script>document" not in page and "<img src=x" not in page
        assert "&lt;script&gt;document.title=" in page
        assert "more characters" in page and huge not in page
        assert (
            "script-src 'self'"
            in (await _headers(admin, "/admin/sessions"))["Content-Security-Policy"]
        )


async def _headers(admin: Admin, path: str) -> dict[str, str]:
    async with admin.http.get(
        admin.url + path, headers={"Cookie": f"{COOKIE_NAME}={admin.cookie}"}
    ) as r:
        return dict(r.headers)


async def test_no_page_reveals_a_secret(
    settings_for: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    telegram_token = "123456:SECRET-telegram-token-never-shown"
    settings = settings_for(
        channels__telegram__enabled="false", channels__telegram__token=telegram_token
    )
    async with running(settings) as admin:
        await admin.login()
        await admin.chat("s1", "hello")
        secrets = [TOKEN, telegram_token, fake_openai.api_key or "unset"]
        pages = [
            "/admin",
            "/admin/live",
            "/admin/sessions",
            "/admin/session?key=api:s1",
            "/admin/memory?key=api:s1",
            "/admin/pairing",
            "/admin/cache",
            "/admin/login",
        ]
        for path in pages:
            status, page = await admin.get(path)
            assert status == 200, path
            for secret in secrets:
                assert secret not in page, path


async def test_sessions_are_searched_sorted_and_counted(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        for name in ("alpha", "beta", "gamma"):
            await admin.chat(name, f"hi from {name}")
        await admin.chat("alpha", "alpha again")  # alpha is now the most recent
        _, page = await admin.get("/admin/sessions")
        assert "3 sessions" in page and "3 active in the last hour" in page
        order = re.findall(r"key=api%3A(\w+)", page)
        assert order == ["alpha", "gamma", "beta"]
        _, page = await admin.get("/admin/sessions", params={"sort": "key"})
        assert re.findall(r"key=api%3A(\w+)", page) == ["alpha", "beta", "gamma"]
        _, page = await admin.get("/admin/sessions", params={"q": "ET"})
        assert re.findall(r"key=api%3A(\w+)", page) == ["beta"] and "1 match" in page


async def test_a_session_shows_its_tree_and_the_transcript_of_its_branch(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        await admin.chat("tree", "first question")
        await admin.chat("tree", "second question")
        session = admin.daemon.gateway.sessions.get("api:tree")
        assert session is not None
        first_reply = session.get_branch()[1]
        session.label(first_reply.id, "checkpoint")
        session.branch(first_reply.id)  # move back: the next turn forks the tree
        await admin.chat("tree", "another way")
        leaf = session.leaf_id
        branch = session.get_branch()
        session.compact("they asked twice", first_kept_entry_id=branch[-2].id)
        status, page = await admin.get("/admin/session", params={"key": "api:tree"})
        assert status == 200
        assert "branches: 2" in page and "checkpoint" in page
        assert "kind-compaction" in page and "they asked twice" in page
        transcript = page.split('id="transcript"', 1)[1]
        assert "another way" in transcript and "second question" not in transcript
        assert "second question" in page  # still in the tree, off the branch
        assert leaf is not None
        status, page = await admin.get("/admin/session", params={"key": "api:nope"})
        assert status == 404


async def test_a_long_session_shows_its_newest_part_and_says_so(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        session = admin.daemon.gateway.sessions.get_or_create("cli:long")
        for n in range(300):
            session.add_message(LLMMessage(role="user", content=f"question {n}"))
            session.add_message(LLMMessage(role="assistant", content=f"answer {n}"))
        _, page = await admin.get("/admin/session", params={"key": "cli:long"})
        assert "600 entries" in page
        assert "The first 100 entries are not shown" in page
        assert "400 earlier messages are not shown" in page
        tree, transcript = page.split('id="transcript"', 1)
        assert tree.count("<li class=") == 500
        assert transcript.count("<article") == 200
        assert "answer 299" in transcript and "question 200<" in transcript
        assert "question 199<" not in transcript


async def test_the_memory_page_shows_facts_history_and_knowledge(
    settings_for: Callable[..., Settings],
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        memory = admin.daemon.gateway.memory
        assert memory is not None

        def remember() -> list[str]:
            scope = memory.for_session("telegram:42")
            scope.record_consolidation(
                [("user_preference", "likes green tea"), ("learned_fact", HOSTILE)],
                "talked about tea and the weather",
            )
            scope.append_history("planned a trip to Lisbon")
            scope.append_facts(
                [NewFact("learned_fact", "owns a kayak", Origin("telegram:42", "e1"))]
            )
            scope.flush()
            return [fact.id for fact in scope.list_facts()]

        ids = await anyio.to_thread.run_sync(remember)
        status, page = await admin.get("/admin/memory", params={"key": "telegram:42"})
        assert status == 200
        # Each fact with its id, and where it came from when known.
        assert all(f"<code>{ident}</code>" in page for ident in ids) and len(ids) == 3
        assert "owns a kayak" in page and "from telegram:42 entry <code>e1</code>" in page
        assert "likes green tea" in page and "user_preference" in page
        assert "Lisbon" in page and "tea and the weather" in page
        assert "<script>document" not in page
        _, page = await admin.get("/admin/memory", params={"key": "telegram:42", "q": "Lisbon"})
        history = page.split('id="history"', 1)[1].split("</ul>", 1)[0]
        assert "Lisbon" in history and "weather" not in history
        _, page = await admin.get("/admin/memory", params={"key": "telegram:43"})
        assert "Nothing is remembered" in page
        # Past messages too, when searched: with their time, session, speaker and entry.
        await admin.chat("mem", "my canoe is kept in Porto")
        await anyio.to_thread.run_sync(lambda: memory.for_session("api:mem").append_history("x"))
        _, page = await admin.get("/admin/memory", params={"key": "api:mem", "q": "canoe"})
        said = page.split('id="messages"', 1)[1].split("</ul>", 1)[0]
        assert "my canoe is kept in Porto" in said and "api:mem" in said and "user" in said


async def test_a_cached_answer_is_invalidated_from_its_transcript(
    settings_for: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        await admin.chat("one", "What is the capital of France?")
        calls = len(fake_openai.chat_requests)
        await admin.chat("two", "What is the capital of France?")
        assert len(fake_openai.chat_requests) == calls  # served from the cache
        _, page = await admin.get("/admin/session", params={"key": "api:two"})
        match = re.search(
            r'name="what" value="key"><input type="hidden" name="value" value="(\w+)"', page
        )
        assert match is not None and "from cache" in page
        _, before = await admin.get("/admin/cache")
        assert 'id="cache-entries">1<' in before
        status, page = await admin.post(
            "/admin/cache/invalidate", {"what": "key", "value": match.group(1), "csrf": admin.csrf}
        )
        assert status == 200 and "Removed 1 cache entry" in page
        assert 'id="cache-entries">0<' in page
        await admin.chat("three", "What is the capital of France?")
        assert len(fake_openai.chat_requests) == calls + 1  # asked the model again


async def test_the_live_view_counts_turns_latency_and_errors(
    settings_for: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    async with running(settings_for()) as admin:
        await admin.login()
        await admin.chat("live", "one")
        await admin.chat("live", "two")
        fake_openai.add_error(500, "boom")
        await admin.chat("live", "three")
        status, page = await admin.get("/admin/live")
        assert status == 200
        assert 'id="total-turns">3<' in page
        assert 'id="errors">1<' in page
        assert re.search(r'id="latency-p50">\d+\.\d\d s<', page)
        assert "api 3" in page  # turns by channel
        _, overview = await admin.get("/admin")
        assert 'hx-get="/admin/live"' in overview and 'hx-trigger="every 2s"' in overview
        # Once the login is gone, the next poll sends the whole page to the login form.
        admin.cookie = ""
        async with admin.http.get(
            admin.url + "/admin/live", headers={"HX-Request": "true"}, allow_redirects=False
        ) as r:
            assert r.status == 401 and r.headers["HX-Redirect"] == "/admin/login"


def test_the_turn_window_forgets_old_turns() -> None:
    now = [0.0]
    window = TurnWindow(60, clock=lambda: now[0])
    ok = OutboundMessage("api", "x", "fine", "api:x")
    bad = OutboundMessage("api", "x", "sorry", "api:x", is_error=True)
    for seconds in (1.0, 2.0, 3.0):
        now[0] += 10
        window.record(ok, seconds)
    now[0] += 10
    window.record(bad, 10.0)
    snap = window.snapshot()
    assert (snap.turns, snap.errors, snap.p50_seconds, snap.p95_seconds) == (4, 1, 2.0, 10.0)
    assert snap.turns_per_second == pytest.approx(4 / 40)
    now[0] += 55  # the first three are now older than a minute
    snap = window.snapshot()
    assert (snap.turns, snap.total_turns, snap.errors) == (1, 4, 1)


# --------------------------------------------------------------------------- shared


async def test_in_the_shared_mode_every_replica_shows_the_same(
    settings_for: Callable[..., Settings], migrated_pg_url: str, tmp_path: Any
) -> None:
    from tests.local_redis import REDIS_URL, drop_namespace, require_redis

    require_redis()
    namespace = f"gwtest:{uuid.uuid4().hex[:10]}:"
    shared = {
        "storage__url": migrated_pg_url,
        "cache__url": REDIS_URL,
        "cache__namespace": namespace,
    }
    try:
        async with (
            running(settings_for(**shared, workspace=str(tmp_path / "a"))) as one,
            running(settings_for(**shared, workspace=str(tmp_path / "b"))) as two,
        ):
            await one.chat("shared", "hello from replica one")
            await _pending(one, "555")
            assert one.daemon.gateway.memory is not None
            await anyio.to_thread.run_sync(
                lambda: one.daemon.gateway.memory.for_session("api:shared").append_history(
                    "remembered on replica one"
                )
            )
            await two.login()
            _, page = await two.get("/admin/sessions")
            assert "key=api%3Ashared" in page
            _, page = await two.get("/admin/session", params={"key": "api:shared"})
            assert "hello from replica one" in page
            _, page = await two.get("/admin/memory", params={"key": "api:shared"})
            assert "remembered on replica one" in page
            _, page = await two.get("/admin/pairing")
            assert "ABCD2345" in page
            status, _ = await two.post(
                "/admin/pairing/approve",
                {"channel": "telegram", "code": "ABCD2345", "csrf": two.csrf},
            )
            assert status == 200
            assert await anyio.to_thread.run_sync(one.daemon.pairing.is_approved, "telegram", "555")
            _, page = await two.get("/admin")
            assert "shared, postgresql://" in page
    finally:
        drop_namespace(namespace)


def test_message_lines_keep_their_role() -> None:
    from gateway.http.admin.views import entry_view
    from gateway.sessions.entries import MessageEntry

    entry = MessageEntry(
        id="e1",
        parent_id=None,
        timestamp=1.0,
        message=LLMMessage(role="assistant", content="hi"),
        meta={"cached": True, "cache_key": "k1"},
    )
    view = entry_view(entry)
    assert (view.role, view.text, view.cache_key) == ("assistant", "hi", "k1")


async def test_every_page_names_its_icon_and_fits_its_placeholders(
    settings_for: Callable[..., Settings],
) -> None:
    """A browser asks for the page's icon (a 404 in its console without one), and a
    placeholder wider than its input is cut off mid-word."""
    async with running(settings_for()) as admin:
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        _, login = await admin.get("/admin/login")
        pages = [login]
        for path in (
            "/admin",
            "/admin/sessions",
            "/admin/memory",
            "/admin/pairing",
            "/admin/cache",
        ):
            status, page = await admin.get(path, headers=bearer)
            assert status == 200, path
            pages.append(page)
        for page in pages:
            icon = re.search(r'<link rel="icon" href="([^"]+)"', page)
            assert icon is not None
            async with admin.http.get(admin.url + icon.group(1)) as r:
                assert r.status == 200 and r.content_type == "image/svg+xml"
                assert (await r.text()).startswith("<svg")
            for tag in re.findall(r"<input [^>]*placeholder=[^>]*>", page):
                placeholder = re.search(r'placeholder="([^"]*)"', tag)
                size = re.search(r'size="(\d+)"', tag)
                assert placeholder is not None and size is not None, tag
                assert int(size.group(1)) > len(placeholder.group(1)), tag
