"""A fake WeCom (企业微信) for tests: the server API a self-built app calls, and the
callback sender that calls the gateway, written from WeCom's developer documentation:

- "获取access_token" (GET /cgi-bin/gettoken): `corpid` and `corpsecret`; the token lasts
  `expires_in` (7200) seconds, the same one is returned while it lasts;
- "发送应用消息" (POST /cgi-bin/message/send?access_token=): `touser`, `msgtype` text,
  `agentid`, `text.content` (cut at 2,048 bytes), `enable_duplicate_check` and
  `duplicate_check_interval` (default 1800 s, at most 4 hours); `@all` sends to everyone;
- "全局错误码": 40013 invalid corpid, 40001 invalid secret, 40014 invalid access_token,
  42001 access_token expired, 45009 frequency limit (an app may send one member 30
  messages a minute: "每应用对同一个成员不可超过30次/分钟"), 81013 the user is outside
  the app's visible range, 40056 invalid agentid;
- "接收消息与事件" / "回调配置" / "加解密方案说明": the callback URL checked with a GET and
  `echostr`; each message POSTed as `<xml><ToUserName/><AgentID/><Encrypt/></xml>` with
  `msg_signature`, `timestamp` and `nonce` in the query; the signature is the SHA-1 of
  the sorted Token, timestamp, nonce and Encrypt; the Encrypt is AES-256-CBC (the key the
  base64 of EncodingAESKey + "=", the IV its first 16 bytes) over 16 random bytes, the
  length (4 bytes, network order), the XML and the corp id, PKCS#7-padded to 32 bytes;
- "微信服务器在五秒内收不到响应会断掉连接, 并且重新发起请求, 总共重试三次"; "http头部返回200表示
  接收ok, 其他错误码一律当做失败并发起重试"; a retried message keeps its MsgId.

What it keeps (tests/test_fake_wecom.py checks each):

- A callback attempt is delivered by a 200 within `ack_timeout` (5 s); anything else is
  retried after each of `retry_delays` (three: WeCom does not publish when), then given
  up. Every attempt is freshly signed and encrypted (a new nonce); the MsgId stays.
- An access token is refused after `token_ttl` (42001) or once unknown (40014);
  `expire_tokens()` ages every token past its life.
- A text's content past 2,048 bytes is cut there, as WeCom does; an empty content is
  refused (44004). A member is sent at most `per_member_per_minute` messages a minute:
  past that 45009 and nothing is sent. With the duplicate check, the same content to the
  same member within the interval is answered ok and not shown again.
- `fail_next(errcode, count)` scripts the next message/send answers; `processed=True`
  shows the message all the same and answers HTTP 500 (a send that may have gone out).

``with FakeWeCom.in_thread() as fake:`` serves from a background thread; everything is
thread-safe and the coroutine helpers work from any event loop.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import hashlib
import itertools
import os
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from tests.fakes._serving import LocalApiServer, at_least

TEXT_LIMIT_BYTES = 2048
TOKEN_TTL = 7200.0
ACK_TIMEOUT = 5.0
#: WeCom retries an unanswered callback three times; when is not published.
RETRY_DELAYS = (5.0, 10.0, 20.0)
DEFAULT_CORP_ID = "ww5f1b2c3d4e5f6a7b"
DEFAULT_SECRET = "fake-wecom-app-secret-0123456789abcdefghij"
DEFAULT_TOKEN = "fakewecomcallbacktoken"
DEFAULT_AES_KEY = "jWmYm7qr5nMoAUwZRjGtBxmz3KA1tkAj3ykkR6q2B2C"
AGENT_ID = 1000002

Fields = dict[str, str]


def msg_signature(token: str, timestamp: str, nonce: str, encrypted: str) -> str:
    return hashlib.sha1("".join(sorted([token, timestamp, nonce, encrypted])).encode()).hexdigest()


def wecom_encrypt(plain: bytes, encoding_aes_key: str, corp_id: str) -> str:
    key = base64.b64decode(encoding_aes_key + "=")
    data = os.urandom(16) + struct.pack("!I", len(plain)) + plain + corp_id.encode()
    pad = 32 - len(data) % 32
    data += bytes([pad] * pad)
    encryptor = Cipher(algorithms.AES(key), modes.CBC(key[:16])).encryptor()
    return base64.b64encode(encryptor.update(data) + encryptor.finalize()).decode()


def to_xml(fields: Mapping[str, str]) -> bytes:
    """WeCom's flat XML: numbers bare, text in CDATA."""
    parts = []
    for name, value in fields.items():
        shown = (
            value if value.isdigit() else f"<![CDATA[{value.replace(']]>', ']]]]><![CDATA[>')}]]>"
        )
        parts.append(f"<{name}>{shown}</{name}>")
    return ("<xml>" + "".join(parts) + "</xml>").encode()


@dataclass(frozen=True, slots=True)
class ApiCall:
    method: str  # "gettoken", "message/send"
    body: Mapping[str, Any]
    answer: Mapping[str, Any]
    at: float


@dataclass(frozen=True, slots=True)
class Attempt:
    sent_at: float
    answered_at: float
    status: int  # 0: no HTTP answer
    failure: str | None  # None: delivered (a 200 in time)


@dataclass(frozen=True, slots=True)
class Delivery:
    number: int
    fields: Mapping[str, str]
    started_at: float
    attempts: tuple[Attempt, ...] = ()
    finished: bool = False

    @property
    def delivered(self) -> bool:
        return any(a.failure is None for a in self.attempts)


@dataclass(frozen=True, slots=True)
class Sent:
    """A text the app sent, as members see it."""

    msgid: str
    to: str  # the touser value: "ann" or "ann|bob" or "@all"
    text: str
    at: float
    pings_everyone: bool


class FakeWeCom(LocalApiServer[ApiCall]):
    """A scriptable WeCom; see the module docstring."""

    _thread_name = "fake-wecom"

    def __init__(
        self,
        *,
        corp_id: str = DEFAULT_CORP_ID,
        secret: str = DEFAULT_SECRET,
        agent_id: int = AGENT_ID,
        callback_token: str = DEFAULT_TOKEN,
        encoding_aes_key: str = DEFAULT_AES_KEY,
        token_ttl: float = TOKEN_TTL,
        retry_delays: Sequence[float] = RETRY_DELAYS,
        ack_timeout: float = ACK_TIMEOUT,
        per_member_per_minute: int = 30,
    ) -> None:
        super().__init__()
        self.corp_id = corp_id
        self.secret = secret
        self.agent_id = agent_id
        self.callback_token = callback_token
        self.encoding_aes_key = encoding_aes_key
        self.token_ttl = token_ttl
        self.retry_delays = tuple(retry_delays)
        self.ack_timeout = ack_timeout
        self.per_member_per_minute = per_member_per_minute
        self.callback_url: str | None = None
        self.users: dict[str, str] = {}  # UserID -> name
        self._tokens: dict[str, float] = {}  # token -> issued at
        self._current = ""
        self._sent: list[Sent] = []
        self._sends_at: dict[str, list[float]] = {}
        self._faults: list[tuple[int, bool]] = []
        self._deliveries: list[Delivery] = []
        self._tasks: set[asyncio.Future[Any]] = set()
        self._ids = itertools.count(7_000_000_000_000_000_000 + int(time.time() * 1000) % 10**9)

    def _build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/cgi-bin/gettoken", self._gettoken)
        app.router.add_post("/cgi-bin/message/send", self._message_send)
        return app

    # -- scripting --------------------------------------------------------------------

    def add_user(self, name: str) -> str:
        user = f"u{secrets.token_hex(4)}"
        with self._lock:
            self.users[user] = name
        return user

    def fail_next(self, errcode: int, count: int = 1, *, processed: bool = False) -> None:
        """The next `count` message/send calls are answered `errcode` (with `processed`,
        HTTP 500 after the message was shown)."""
        with self._lock:
            self._faults.extend([(errcode, processed)] * count)

    def expire_tokens(self) -> None:
        """Every token issued so far is past its life (WeCom answers 42001)."""
        with self._lock:
            for token in self._tokens:
                self._tokens[token] -= self.token_ttl + 1

    def revoke_tokens(self) -> None:
        """Every token issued so far is unknown (WeCom answers 40014)."""
        with self._lock:
            self._tokens.clear()
            self._current = ""

    @property
    def sent(self) -> list[Sent]:
        with self._lock:
            return list(self._sent)

    def texts_to(self, user: str) -> list[str]:
        return [s.text for s in self.sent if s.to == user]

    async def wait_for_sent(self, count: int) -> list[Sent]:
        return await self._on_server_loop(self._until(at_least(count, lambda: self.sent)))

    # -- the API ----------------------------------------------------------------------

    def _answer(self, method: str, body: Mapping[str, Any], answer: dict[str, Any]) -> web.Response:
        self._log_call(ApiCall(method, dict(body), answer, time.time()))
        return web.json_response(answer)

    async def _gettoken(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        if query.get("corpid") != self.corp_id:
            return self._answer("gettoken", query, {"errcode": 40013, "errmsg": "invalid corpid"})
        if query.get("corpsecret") != self.secret:
            answer = {"errcode": 40001, "errmsg": "invalid credential, hint: [fake]"}
            return self._answer("gettoken", query, answer)
        with self._lock:
            issued = self._tokens.get(self._current)
            now = time.time()
            if issued is None or now - issued >= self.token_ttl:
                self._current = secrets.token_urlsafe(48)
                self._tokens[self._current] = issued = now
            left = int(self.token_ttl - (now - issued))
            answer = {
                "errcode": 0,
                "errmsg": "ok",
                "access_token": self._current,
                "expires_in": left,
            }
        return self._answer("gettoken", {"corpid": query["corpid"]}, answer)

    def _token_error(self, token: str) -> dict[str, Any] | None:
        with self._lock:
            issued = self._tokens.get(token)
        if issued is None:
            return {"errcode": 40014, "errmsg": "invalid access_token"}
        if time.time() - issued >= self.token_ttl:
            return {"errcode": 42001, "errmsg": "access_token expired"}
        return None

    async def _message_send(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return self._answer("message/send", {}, {"errcode": 40035, "errmsg": "invalid args"})
        refused = self._token_error(request.query.get("access_token", ""))
        if refused is not None:
            return self._answer("message/send", body, refused)
        if body.get("agentid") != self.agent_id:
            return self._answer(
                "message/send", body, {"errcode": 40056, "errmsg": "invalid agentid"}
            )
        content = str((body.get("text") or {}).get("content") or "")
        if body.get("msgtype") != "text" or not content:
            return self._answer("message/send", body, {"errcode": 44004, "errmsg": "empty content"})
        to = str(body.get("touser") or "")
        everyone = to == "@all"
        users = list(self.users) if everyone else to.split("|")
        valid = [u for u in users if u in self.users]
        if not valid:
            answer = {"errcode": 81013, "errmsg": "user & party & tag all invalid"}
            return self._answer("message/send", body, answer)
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        text = content.encode()[:TEXT_LIMIT_BYTES].decode("utf-8", "ignore")
        if fault is not None and not fault[1]:
            return self._answer("message/send", body, {"errcode": fault[0], "errmsg": "scripted"})
        now = time.time()
        with self._lock:
            recent = [t for t in self._sends_at.get(to, []) if now - t < 60]
            if len(recent) >= self.per_member_per_minute:
                answer = {"errcode": 45009, "errmsg": "api freq out of limit"}
                return self._answer("message/send", body, answer)
            interval = float(body.get("duplicate_check_interval") or 1800)
            duplicate = bool(body.get("enable_duplicate_check")) and any(
                s.to == to and s.text == text and now - s.at < min(interval, 14400)
                for s in self._sent
            )
            msgid = f"msg{next(self._ids)}"
            if not duplicate:
                self._sends_at[to] = [*recent, now]
                self._sent.append(Sent(msgid, to, text, now, everyone))
        self._notify()
        if fault is not None:
            self._log_call(ApiCall("message/send", dict(body), {"status": 500}, now))
            return web.Response(status=500, text="scripted")
        invalid = "|".join(u for u in users if u not in self.users)
        return self._answer(
            "message/send",
            body,
            {"errcode": 0, "errmsg": "ok", "invaliduser": invalid, "msgid": msgid},
        )

    # -- people's messages and the callbacks ----------------------------------------

    def text_message(self, user: str, text: str) -> Fields:
        return {
            "ToUserName": self.corp_id,
            "FromUserName": user,
            "CreateTime": str(int(time.time())),
            "MsgType": "text",
            "Content": text,
            "MsgId": str(next(self._ids)),
            "AgentID": str(self.agent_id),
        }

    def sealed(
        self, fields: Mapping[str, str], *, token: str | None = None, corp_id: str | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """The body and query of one callback request of `fields` (signed with `token`,
        encrypted for `corp_id`: the fake's own unless given)."""
        encrypted = wecom_encrypt(to_xml(fields), self.encoding_aes_key, corp_id or self.corp_id)
        timestamp, nonce = str(int(time.time())), str(secrets.randbelow(10**10))
        signature = msg_signature(token or self.callback_token, timestamp, nonce, encrypted)
        outer = {"ToUserName": self.corp_id, "AgentID": str(self.agent_id), "Encrypt": encrypted}
        query = {"msg_signature": signature, "timestamp": timestamp, "nonce": nonce}
        return to_xml(outer), query

    async def post(self, url: str, fields: Mapping[str, str], **seal: Any) -> tuple[int, str]:
        """POST one callback request once; its status and body."""
        body, query = self.sealed(fields, **seal)
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, params=query) as response,
        ):
            return response.status, await response.text()

    async def verify_url(self, url: str, *, token: str | None = None) -> tuple[bool, str]:
        """The console's check of a callback URL: whether the answer is the echostr's
        plaintext, and the answer."""
        echo = str(secrets.randbelow(10**18))
        encrypted = wecom_encrypt(echo.encode(), self.encoding_aes_key, self.corp_id)
        timestamp, nonce = str(int(time.time())), str(secrets.randbelow(10**10))
        query = {
            "msg_signature": msg_signature(
                token or self.callback_token, timestamp, nonce, encrypted
            ),
            "timestamp": timestamp,
            "nonce": nonce,
            "echostr": encrypted,
        }
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, params=query) as response,
        ):
            text = await response.text()
            return response.status == 200 and text == echo, text

    async def deliver(self, fields: Mapping[str, str], url: str | None = None) -> Delivery:
        """Deliver one message the way WeCom does (see the module docstring); returns the
        finished delivery. Runs in the caller's event loop (any loop)."""
        target = url or self.callback_url
        if target is None:
            raise RuntimeError("FakeWeCom.callback_url is not set")
        with self._lock:
            number = len(self._deliveries)
            self._deliveries.append(Delivery(number, dict(fields), time.time()))
        self._notify()
        task = asyncio.current_task()
        if task is not None and asyncio.get_running_loop() is self._loop:
            self._tasks.add(task)
        try:
            for attempt_number in itertools.count():
                attempt = await self._attempt(target, fields)
                self._update(number, attempt)
                if attempt.failure is None or attempt_number >= len(self.retry_delays):
                    break
                await asyncio.sleep(self.retry_delays[attempt_number])
        finally:
            self._update(number, None)
            if task is not None:
                self._tasks.discard(task)
        return self.deliveries[number]

    def deliver_soon(self, fields: Mapping[str, str]) -> concurrent.futures.Future[Delivery]:
        """`deliver` on the fake's own loop (from any thread)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("FakeWeCom is not running")
        return asyncio.run_coroutine_threadsafe(self.deliver(fields), loop)

    async def _attempt(self, url: str, fields: Mapping[str, str]) -> Attempt:
        body, query = self.sealed(fields)
        sent_at = time.time()
        status, failure = 0, None
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                asyncio.timeout(self.ack_timeout),
                session.post(url, data=body, params=query) as response,
            ):
                status = response.status
                await response.read()
            failure = None if status == 200 else f"HTTP {status}"
        except TimeoutError:
            failure = "timeout"
        except aiohttp.ClientError as exc:
            failure = type(exc).__name__
        return Attempt(sent_at, time.time(), status, failure)

    def _update(self, number: int, attempt: Attempt | None) -> None:
        with self._lock:
            delivery = self._deliveries[number]
            if attempt is None:
                delivery = dataclasses.replace(delivery, finished=True)
            else:
                delivery = dataclasses.replace(delivery, attempts=(*delivery.attempts, attempt))
            self._deliveries[number] = delivery
        self._notify()

    @property
    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    async def stop(self) -> None:
        pending = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await super().stop()
