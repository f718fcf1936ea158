"""telegram-test-api (npm), an independent Telegram Bot API emulator, run for tests.

`TelegramEmulator` starts the emulator (``node tests/emulators/telegram/serve.js``) on a
free port on 127.0.0.1 and speaks its own client API: `send_user_message` injects what a
user writes (``POST /sendMessage``), `bot_messages` reads what the bot sent
(``POST /getUpdatesHistory``). scripts/install-emulators.sh installs it (``npm ci`` in
tests/emulators/telegram, pinned by its package-lock.json; `.ci/run` runs it).

`EmulatorBridge` sits between python-telegram-bot and the emulator. It passes every call
through unchanged, except where the emulator departs from the real Bot API in a way that
would stop a correct client (each case is listed in docs/telegram-emulator.md):

- getUpdates: the emulator answers at once (no long polling) and forgets an update as soon
  as it has returned it, whatever the offset. The bridge fetches from the emulator, keeps
  what it fetched until a call's ``offset`` passes it (the real "confirmed" rule), and
  holds a call up to its ``timeout`` while nothing is pending.
- getMe: the emulator's User has no ``is_bot``, which the Bot API always sends (PTB
  refuses the User without it); the bridge adds ``is_bot: true``.
- sendMessage and editMessageText: the emulator's ``date`` is in milliseconds, not Unix
  seconds (PTB cannot build a datetime of year 57000); the bridge divides it by 1000.

The bridge never touches what the gateway sends, only the emulator's answers to it, so
what the emulator records is exactly what the gateway asked for. `replay` hands an
update out again, as the real server does with one whose confirmation never arrived.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from tests.fakes._serving import LocalApiServer, free_port
from tests.fakes.telegram_server import _read_params

EMULATOR_DIR = Path(__file__).resolve().parent / "telegram"
EMULATOR_PACKAGE = EMULATOR_DIR / "node_modules" / "telegram-test-api"
INSTALL_HINT = "bash scripts/install-emulators.sh (.ci/run runs it)"
BOT_USERNAME = "TestNameBot"  # the emulator's getMe answers this, whatever the token
TOKEN = "5555:emulated-bot-token"
# The bridge re-asks the emulator this often while it holds a getUpdates call open.
_FETCH_INTERVAL = 0.05
_MILLISECONDS_THRESHOLD = 10**11  # a Unix time in seconds stays below this until year 5138

Update = dict[str, Any]


def require_emulator() -> str:
    """The path of `node`, once node and the installed emulator are both there. Otherwise
    the test is skipped with the command that installs them, or fails under CI=true
    (CI installs both, so a missing one is a broken CI, not a reason to skip)."""
    node = shutil.which("node")
    missing = []
    if node is None:
        missing.append("node is not on PATH (apt-get install nodejs)")
    if not EMULATOR_PACKAGE.is_dir():
        missing.append(f"telegram-test-api is not installed: {INSTALL_HINT}")
    if missing:
        reason = "; ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Telegram emulator cannot run under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    assert node is not None
    return node


class TelegramEmulator:
    """A running telegram-test-api process and its client API (see the module docstring).
    Use it as a context manager; it stops the process on exit."""

    def __init__(self, node: str, *, start_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log: list[str] = []
        self._proc = subprocess.Popen(
            [node, str(EMULATOR_DIR / "serve.js"), str(self.port)],
            cwd=EMULATOR_DIR,
            stdin=subprocess.PIPE,  # closed at stop: the emulator exits with it
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        listening = threading.Event()
        threading.Thread(target=self._pump, args=(listening,), daemon=True).start()
        if not listening.wait(start_timeout):
            self.stop()
            raise RuntimeError(
                f"telegram-test-api did not start within {start_timeout:g}s: {self.log}"
            )

    def _pump(self, listening: threading.Event) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.log.append(line.rstrip("\n"))
            if "listening on" in line:
                listening.set()

    def __enter__(self) -> TelegramEmulator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)

    # -- the emulator's client API --------------------------------------------------------

    async def _client_call(self, path: str, body: Mapping[str, Any]) -> Any:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.url}{path}", json=dict(body)) as response,
        ):
            answer = await response.json()
        if response.status != 200 or not answer.get("ok"):
            raise RuntimeError(f"the emulator refused {path}: {response.status} {answer}")
        return answer.get("result")

    async def send_user_message(
        self,
        chat_id: int,
        text: str,
        *,
        chat_type: str = "private",
        user_id: int | None = None,
        entities: list[dict[str, Any]] | None = None,
    ) -> None:
        """A user writes `text` in a chat (a private chat with user `chat_id` by default).
        The emulator gives it the next update_id and message_id. It does not detect
        entities in user text the way Telegram does: pass `entities` (a mention, say) as
        the real server would add them."""
        user = {
            "id": user_id if user_id is not None else chat_id,
            "is_bot": False,
            "first_name": "Alice",
            "username": "alice",
        }
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat |= {"first_name": "Alice", "username": "alice"}
        else:
            chat["title"] = "Emulated group"
        message: dict[str, Any] = {
            "botToken": TOKEN,
            "date": int(time.time()),
            "from": user,
            "chat": chat,
            "text": text,
        }
        if entities:
            message["entities"] = entities
        await self._client_call("/sendMessage", message)

    async def history(self) -> list[dict[str, Any]]:
        """Everything the emulator stored for the bot, users' and bot's messages alike,
        oldest first: ``{"updateId", "messageId", "message", ...}`` records."""
        return list(await self._client_call("/getUpdatesHistory", {"token": TOKEN}))

    async def bot_messages(self, chat_id: int) -> list[dict[str, Any]]:
        """The sendMessage calls the bot made to `chat_id`, as the emulator stored them
        (the request's parameters: ``text``, ``parse_mode``, ``reply_parameters``...), in
        the order the emulator received them."""
        sent = [
            record
            for record in await self.history()
            if "chat_id" in record["message"] and str(record["message"]["chat_id"]) == str(chat_id)
        ]
        return [record["message"] for record in sorted(sent, key=lambda r: int(r["messageId"]))]

    async def wait_bot_messages(
        self, chat_id: int, count: int = 1, *, ending: str | None = None, seconds: float = 30.0
    ) -> list[dict[str, Any]]:
        """`bot_messages(chat_id)` once there are at least `count` of them, or, with
        `ending`, up to the first one whose text is `ending`."""

        def done(found: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            if ending is None:
                return found if len(found) >= count else None
            texts = [m.get("text") for m in found]
            return found[: texts.index(ending) + 1] if ending in texts else None

        with anyio.fail_after(seconds):
            # The emulator runs in another process and announces nothing: ask it again.
            while (found := done(await self.bot_messages(chat_id))) is None:  # noqa: ASYNC110
                await anyio.sleep(_FETCH_INTERVAL)
        return found


@dataclass(frozen=True, slots=True)
class BridgedCall:
    """One Bot API call the bridge answered: the method as the client named it, its
    parameters as sent, the HTTP status and body the client got."""

    method: str
    params: Mapping[str, Any]
    status: int
    body: Any


class EmulatorBridge(LocalApiServer[BridgedCall]):
    """Python-telegram-bot's Bot API server in front of a `TelegramEmulator`; see the
    module docstring for the few answers it corrects. ``async with`` it."""

    _thread_name = "emulator-bridge"

    def __init__(self, emulator: TelegramEmulator) -> None:
        super().__init__()
        self.emulator = emulator
        self.token = TOKEN
        self._held: list[Update] = []  # fetched from the emulator, not yet confirmed
        self._confirmed_below = 0
        self._http: aiohttp.ClientSession | None = None

    @property
    def api_url(self) -> str:
        """PTB's ``base_url`` (PTB appends the token)."""
        return f"{self.url}/bot"

    @property
    def file_url(self) -> str:
        return f"{self.url}/file/bot"

    @property
    def confirmed_below(self) -> int:
        """Every update id below this was confirmed by a getUpdates offset."""
        with self._lock:
            return self._confirmed_below

    async def wait_confirmed(self, offset: int) -> None:
        """Wait until a getUpdates call confirmed every update below `offset`; bound it
        with ``anyio.fail_after``."""
        await self._on_server_loop(
            self._until(lambda: True if self.confirmed_below >= offset else None)
        )

    def served(self, update_id: int | None = None) -> list[Update]:
        """Every update getUpdates handed out (only `update_id`, if given), as it was
        handed out, in the order of the answers."""
        return [
            update
            for call in self.calls_to("getUpdates")
            for update in call.body["result"]
            if update_id is None or int(update["update_id"]) == update_id
        ]

    def replay(self, update: Update) -> None:
        """Hand `update` out again on the next getUpdates, as Telegram does with an update
        whose confirmation it never got (the process died before its next poll). An
        update still held is held once."""
        with self._lock:
            if all(int(u["update_id"]) != int(update["update_id"]) for u in self._held):
                self._held = sorted([*self._held, update], key=lambda u: int(u["update_id"]))
        self._notify()

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._api)
        app.cleanup_ctx.append(self._client_session)
        return app

    async def _client_session(self, app: web.Application) -> Any:
        async with aiohttp.ClientSession() as http:
            self._http = http
            yield
            self._http = None

    async def _forward(self, request: web.Request | None, token: str, method: str) -> Any:
        """The emulator's (status, JSON body) for `request` passed on byte for byte (its
        HTTP method, query string, body and content type), or for a bare POST."""
        assert self._http is not None
        url = f"{self.emulator.url}/bot{token}/{method}"
        if request is None:
            sending = self._http.post(url)
        else:
            headers = {"Content-Type": request.content_type} if request.body_exists else {}
            sending = self._http.request(
                request.method,
                url,
                params=request.query,
                data=await request.read(),
                headers=headers,
            )
        async with sending as response:
            return response.status, await response.json(content_type=None)

    async def _api(self, request: web.Request) -> web.Response:
        token, method = request.match_info["token"], request.match_info["method"]
        params = await _read_params(request)
        if method.lower() == "getupdates":
            status, body = 200, {"ok": True, "result": await self._get_updates(token, params)}
        else:
            status, body = await self._forward(request, token, method)
            body = _corrected(method, body)
        self._log_call(BridgedCall(method, params, status, body))
        return web.json_response(body, status=status)

    async def _get_updates(self, token: str, params: Mapping[str, Any]) -> list[Update]:
        offset = int(params.get("offset") or 0)
        limit = min(max(int(params.get("limit") or 100), 1), 100)
        deadline = time.monotonic() + max(int(params.get("timeout") or 0), 0)
        with self._lock:
            if offset > 0:
                self._held = [u for u in self._held if int(u["update_id"]) >= offset]
                self._confirmed_below = max(self._confirmed_below, offset)
        self._notify()
        while True:
            status, body = await self._forward(None, token, "getUpdates")
            if status != 200 or not body.get("ok"):
                raise RuntimeError(f"the emulator's getUpdates failed: {status} {body}")
            with self._lock:
                self._held.extend(body["result"])  # the emulator has forgotten these now
                batch = list(self._held[:limit])
            if batch or time.monotonic() >= deadline:
                return batch
            await anyio.sleep(_FETCH_INTERVAL)


def _corrected(method: str, body: Any) -> Any:
    """The emulator's answer with the departures from the Bot API that stop PTB undone."""
    if not isinstance(body, dict) or not isinstance(body.get("result"), dict):
        return body
    result = dict(body["result"])
    name = method.lower()
    if name == "getme":
        result.setdefault("is_bot", True)
    elif name in ("sendmessage", "editmessagetext"):
        date = result.get("date")
        if isinstance(date, int) and date > _MILLISECONDS_THRESHOLD:
            result["date"] = date // 1000
    return {**body, "result": result}
