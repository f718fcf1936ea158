"""A fake Mattermost server (the REST API v4 and the WebSocket) that speaks the real wire
protocol, for tests: an aiohttp server on 127.0.0.1 at a free port, `/api/v4/...` and
`/api/v4/websocket`, that the gateway's channel reaches as it reaches a real server.

Written from Mattermost's API reference (the OpenAPI source in mattermost/mattermost,
api/v4/source: introduction.yaml for authentication, errors, rate limiting and the
WebSocket; posts.yaml, channels.yaml, users.yaml, files.yaml, system.yaml), and, where
the reference is silent, from the server's source it links to (server/channels/app/
post.go `deduplicateCreatePost`; store/sqlstore/post_store.go `getPostsAround`,
`GetPostsSince`; server/public/model/post.go `PostMessageMaxRunesV2`; app/
web_conn.go and wsapi's `authentication_challenge`). What it keeps, each checked by
tests/test_fake_mattermost.py with a plain HTTP and WebSocket client:

Authentication and errors
- Every REST call needs `Authorization: Bearer <token>` (a bot's access token or a
  person's); else 401 with Mattermost's error body {id, message, detailed_error,
  request_id, status_code}.
- The WebSocket authenticates by that header at the upgrade, or by a first
  `{"seq": n, "action": "authentication_challenge", "data": {"token": ...}}`, answered
  `{"status": "OK", "seq_reply": n}`; a wrong token closes the connection without a
  close frame (as the server's `conn.WebSocket.Close()` does). Once authenticated the
  server sends the `hello` event (`server_version`, `connection_id`).

What Mattermost confirms and keeps
- Nothing is acknowledged by a client: an event is written to the WebSockets open at that
  moment, each with its own `seq` (0 for hello, then counting up per connection), to the
  connections of the channel's members (the bot's own posts included), and to no one
  else. A post made while a user has no connection reaches them only through the REST
  API's history: a new connection gets no replay.
- `posted`: data {channel_display_name, channel_name, channel_type, post (the post as a
  JSON string), sender_name, team_id, set_online, mentions (a JSON string array of the
  members the post mentions, only when there are some)}; `post_edited`: {post}. Every
  post bumps its channel's `last_post_at` and `total_msg_count`.
- `rebroadcast` sends a post's event again (what a reconnect's replay or a cluster peer
  does): the same post reaches the bot twice.

Posts
- `POST /posts` (201): `channel_id`, `message` at most `max_post_chars` characters (16,383,
  `PostMessageMaxRunesV2`; else 400 model.post.is_valid.msg.app_error), `root_id` a root
  post of the same channel (else 400 api.post.create_post.root_id.app_error),
  `file_ids` (at most 5, uploaded by the caller, attached to one post only), `props`;
  a bot account's post gets `props.from_bot = "true"`; not a member: 403.
  `pending_post_id`: a post with an id seen in the last `pending_ttl` seconds (30) is not
  made again, the post made for it is answered (201); one still being made answers 500
  api.post.deduplicate_create_post.pending; after the TTL a new post is made.
- `PUT /posts/{id}/patch` (200): the author's own posts only (else 403), the same length
  rule; sets `edit_at` and `update_at`, sends `post_edited`.
- `GET /posts/{id}`, `GET /channels/{id}/posts`: `page`, `per_page` (default 60, at most
  200), and one of `after`, `before` (a post id: posts with `create_at` strictly after
  or before that post's, so posts of the same millisecond are left out; an unknown id
  gives none), or `since` (posts updated after a time, deleted ones too, at most 1000).
  The answer is a PostList {order (newest first), posts (the listed posts and the roots
  of listed replies), next_post_id, prev_post_id, has_next}. `create_at` is the server's
  clock in milliseconds: two posts may share one; such ties are listed in the order the
  posts were made, and newest-first lists reverse that order exactly (what PostgreSQL's
  b-tree index on (ChannelId, DeleteAt, CreateAt) gives a forward and a backward scan).

The rest
- `GET /users/me`, `/users/{id}`, `/users/{id}/teams`, `/users/{id}/teams/{team}/channels`
  (the team's channels the user is in, and their direct and group messages), `/channels/
  {id}`, `POST /users/{id}/typing` (the caller only; a `typing` event to the others),
  `POST /files` (multipart `channel_id` and `files`; over `max_file_size`: 413), `GET
  /files/{id}`, `GET /config/client?format=old` (`MaxPostSize`), `GET /system/ping`.
- Rate limiting (off by default, as on a fresh server; `rate_limit`): past `limit` requests
  per second a request answers 429 with `X-Ratelimit-Limit`, `X-Ratelimit-Remaining`,
  `X-Ratelimit-Reset` and `Retry-After`, body "limit exceeded".
- Scripted failures (`fail_next`): an error answer before anything is done, or the
  connection cut after the request was carried out (`cut_after`); `drop_websockets` cuts
  every WebSocket without a close frame.

Scripting, in the running event loop or from a test thread (``FakeMattermost.in_thread()``)::

    with FakeMattermost.in_thread() as fake:
        alice = fake.add_user("alice")
        town = fake.open_channel("town-square", [alice["id"], fake.bot_id])
        dm = fake.dm_channel(alice["id"], fake.bot_id)
        fake.user_message(dm["id"], alice["id"], "hello")
        fake.user_message(town["id"], alice["id"], "@kit-bot hi")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes._serving import LocalApiServer

API = "/api/v4"
DEFAULT_TOKEN = "kitbottokenkitbottokenkitbo"  # 26 characters, as Mattermost's are
MAX_POST_CHARS = 16383
PENDING_TTL = 30.0
MAX_FILE_SIZE = 100 * 1024 * 1024
MAX_FILES_PER_POST = 5
SERVER_VERSION = "9.11.0"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
CHANNEL_WIDE = frozenset({"channel", "all", "here"})

Payload = dict[str, Any]


def new_id() -> str:
    """An id as Mattermost makes them (`model.NewId`): 26 lower-case base32 characters."""
    return base64.b32encode(secrets.token_bytes(16)).decode().lower().rstrip("=")[:26]


class MattermostError(Exception):
    """An error answer as Mattermost words it."""

    def __init__(self, status: int, error_id: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error_id, self.message = status, error_id, message

    def response(self) -> web.Response:
        body = {
            "id": self.error_id,
            "message": self.message,
            "detailed_error": "",
            "request_id": new_id(),
            "status_code": self.status,
        }
        return web.json_response(body, status=self.status)


@dataclass(frozen=True, slots=True)
class Call:
    """One REST call the fake answered: `method` is ``VERB /route`` (ids as `{id}`)."""

    method: str
    path: str
    status: int
    params: dict[str, str]
    body: Any
    user_id: str
    at: float


@dataclass
class _Fault:
    route: str
    status: int
    count: int
    cut_after: bool = False
    retry_after: float | None = None
    skip: int = 0


@dataclass
class _Conn:
    ws: web.WebSocketResponse
    connection_id: str
    transport: asyncio.BaseTransport | None = None
    user_id: str = ""
    seq: int = 0
    queue: asyncio.Queue[Payload] = field(default_factory=asyncio.Queue)


def mentions_in(message: str) -> tuple[set[str], bool]:
    """The names a message mentions and whether it mentions everyone (`@channel`, `@all`,
    `@here`), outside code, as the server's `explicit_mentions.go` reads them: words
    split at anything but letters, digits and `:.-_@`; leading `:.-_` dropped; `@name`
    with a trailing `.`, `-` or `:` names `name`; a word holding `.`, `-` or `:` split
    there again."""
    names: set[str] = set()
    in_fence = False
    for line in message.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for raw in re.split(r"[^\w:.\-@]", _CODE_SPAN.sub(" ", line)):
            word = raw.lstrip(":.-_")
            if not word or re.fullmatch(r":[\w+\-]+:", raw):
                continue
            if word.startswith("@"):
                name = word[1:].lower()
                names.update({name, name[:-1] if name[-1:] in (".", "-", ":") else name})
            elif any(c in word for c in ".-:"):
                names.update(p[1:].lower() for p in re.split(r"[.\-:]", word) if p.startswith("@"))
    names.discard("")
    return names, bool(names & CHANNEL_WIDE)


class FakeMattermost(LocalApiServer[Call]):
    """A Mattermost server for tests (see the module docstring)."""

    _thread_name = "fake-mattermost"

    def __init__(
        self,
        *,
        bot_username: str = "kit-bot",
        token: str = DEFAULT_TOKEN,
        max_post_chars: int = MAX_POST_CHARS,
        pending_ttl: float = PENDING_TTL,
        max_file_size: int = MAX_FILE_SIZE,
    ) -> None:
        super().__init__()
        self.max_post_chars = max_post_chars
        self.pending_ttl = pending_ttl
        self.max_file_size = max_file_size
        self.users: dict[str, Payload] = {}
        self.tokens: dict[str, str] = {}
        self.teams: dict[str, Payload] = {}
        self.team_members: dict[str, set[str]] = {}
        self.channels: dict[str, Payload] = {}
        self.members: dict[str, set[str]] = {}
        self.posts: dict[str, Payload] = {}
        self._order: list[str] = []  # every post id, in the order made
        self.files: dict[str, tuple[Payload, bytes]] = {}
        self._pending: dict[str, tuple[str, float]] = {}  # pending_post_id -> (post id, expiry)
        self._conns: list[_Conn] = []
        self._faults: list[_Fault] = []
        self._clock_ms: int | None = None
        self._last_ms = 0
        self.rate_limit_per_second: int | None = None
        self._window: tuple[int, int] = (0, 0)
        #: Seconds `POST /posts` waits between claiming a `pending_post_id` and saving.
        self.post_delay = 0.0
        self.events_sent: list[tuple[str, str, Payload]] = []  # (user id, event, payload)
        bot = self.add_user(bot_username, is_bot=True, token=token)
        self.bot_id = str(bot["id"])
        self.bot_token = token
        team = self.add_team("kit")
        self.team_id = str(team["id"])
        self.add_to_team(self.team_id, self.bot_id)

    # -- the world ---------------------------------------------------------------------

    def now_ms(self) -> int:
        """The server's clock (ms); `freeze_clock` holds it, so posts share a millisecond."""
        if self._clock_ms is not None:
            return self._clock_ms
        return int(time.time() * 1000)

    def freeze_clock(self, at_ms: int | None) -> None:
        self._clock_ms = at_ms

    def add_user(
        self, username: str, *, is_bot: bool = False, token: str | None = None, first_name: str = ""
    ) -> Payload:
        with self._lock:
            user_id = new_id()
            now = self.now_ms()
            user = {
                "id": user_id,
                "create_at": now,
                "update_at": now,
                "delete_at": 0,
                "username": username,
                "first_name": first_name,
                "last_name": "",
                "nickname": "",
                "email": f"{username}@example.com",
                "roles": "system_user",
                "locale": "en",
                "is_bot": is_bot,
            }
            self.users[user_id] = user
            self.tokens[token or new_id()] = user_id
            return dict(user)

    def token_of(self, user_id: str) -> str:
        return next(t for t, u in self.tokens.items() if u == user_id)

    def add_team(self, name: str) -> Payload:
        with self._lock:
            team = {"id": new_id(), "name": name, "display_name": name.title(), "type": "O"}
            self.teams[team["id"]] = team
            self.team_members[team["id"]] = set()
            return dict(team)

    def add_to_team(self, team_id: str, user_id: str) -> None:
        with self._lock:
            self.team_members[team_id].add(user_id)

    def _channel(self, kind: str, name: str, members: list[str], team_id: str) -> Payload:
        with self._lock:
            now = self.now_ms()
            channel = {
                "id": new_id(),
                "create_at": now,
                "update_at": now,
                "delete_at": 0,
                "team_id": team_id,
                "type": kind,
                "display_name": name,
                "name": name,
                "header": "",
                "purpose": "",
                "last_post_at": 0,
                "last_root_post_at": 0,
                "total_msg_count": 0,
                "creator_id": members[0] if members else "",
            }
            self.channels[channel["id"]] = channel
            self.members[channel["id"]] = set(members)
            return dict(channel)

    def open_channel(self, name: str, members: list[str], *, private: bool = False) -> Payload:
        """A public (or private) channel of the team; its members join the team too."""
        for member in members:
            self.add_to_team(self.team_id, member)
        return self._channel("P" if private else "O", name, members, self.team_id)

    def dm_channel(self, user_a: str, user_b: str) -> Payload:
        """The direct channel of two users (made once; named `<id>__<id>`, sorted)."""
        name = "__".join(sorted((user_a, user_b)))
        with self._lock:
            for channel in self.channels.values():
                if channel["type"] == "D" and channel["name"] == name:
                    return dict(channel)
            return self._channel("D", name, [user_a, user_b], "")

    def group_channel(self, members: list[str]) -> Payload:
        return self._channel("G", "-".join(sorted(members))[:64], members, "")

    # -- people's posts ----------------------------------------------------------------

    def user_message(
        self,
        channel_id: str,
        user_id: str,
        text: str,
        *,
        root_id: str = "",
        file_ids: list[str] | None = None,
    ) -> Payload:
        """`user_id` posts `text` in a channel (in thread `root_id`), as their client would."""
        body: Payload = {"channel_id": channel_id, "message": text, "root_id": root_id}
        if file_ids:
            body["file_ids"] = file_ids
        return self._create_post(user_id, body)

    def upload_as(
        self, user_id: str, channel_id: str, name: str, data: bytes, mime: str
    ) -> Payload:
        return self._store_file(user_id, channel_id, name, data, mime)

    def edit_message(self, post_id: str, text: str) -> Payload:
        """The author edits a post (what `PUT /posts/{id}/patch` does)."""
        with self._lock:
            author = str(self.posts[post_id]["user_id"])
        return self._patch_post(author, post_id, {"message": text})

    def rebroadcast(self, post_id: str) -> None:
        """Send a post's last event again (`posted`, or `post_edited` once edited)."""
        with self._lock:
            post = self.posts[post_id]
            kind = "post_edited" if post["edit_at"] else "posted"
            self._broadcast_post(kind, post)

    def sent_by(self, user_id: str) -> list[Payload]:
        """Every post of `user_id`, as it is now (edits applied), oldest first."""
        with self._lock:
            return [dict(self.posts[p]) for p in self._order if self.posts[p]["user_id"] == user_id]

    def bot_posts(self) -> list[Payload]:
        return self.sent_by(self.bot_id)

    def mentioned_users(self, post: Payload) -> tuple[set[str], bool]:
        """The user ids a post notifies by name (members of its channel), and whether it
        notifies everyone in it."""
        names, everyone = mentions_in(str(post.get("message") or ""))
        with self._lock:
            members = self.members.get(str(post["channel_id"]), set())
            ids = {u for u in members if str(self.users[u]["username"]).lower() in names}
        return ids, everyone

    # -- scripting faults ----------------------------------------------------------------

    def fail_next(
        self,
        route: str,
        status: int = 500,
        *,
        count: int = 1,
        cut_after: bool = False,
        retry_after: float | None = None,
        skip: int = 0,
    ) -> None:
        """The next `count` calls of `route` (``POST /posts``), after `skip` that go
        through, answer `status` without doing anything; with `cut_after`, they are
        carried out and the connection is cut before the answer."""
        with self._lock:
            self._faults.append(_Fault(route, status, count, cut_after, retry_after, skip))

    def rate_limit(self, per_second: int | None) -> None:
        with self._lock:
            self.rate_limit_per_second = per_second

    def drop_websockets(self) -> None:
        """Cut every WebSocket connection without a close frame."""
        loop = self._loop
        if loop is None:
            return

        def drop() -> None:
            for conn in list(self._conns):
                if isinstance(conn.transport, asyncio.Transport):
                    conn.transport.abort()

        loop.call_soon_threadsafe(drop)

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(1 for c in self._conns if c.user_id)

    # -- the server ----------------------------------------------------------------------

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_file_size + 1024 * 1024)
        app.router.add_get(f"{API}/websocket", self._websocket)
        app.router.add_route("*", API + "/{tail:.*}", self._rest)
        return app

    async def _rest(self, request: web.Request) -> web.StreamResponse:
        path = "/" + request.match_info["tail"]
        route = _route_of(request.method, path)
        user_id = self._authenticated(request.headers.get("Authorization", ""))
        params = dict(request.query)
        body: Any = None
        status = 500
        try:
            if user_id is None:
                raise MattermostError(
                    401,
                    "api.context.session_expired.app_error",
                    "Invalid or expired session, please login again.",
                )
            limited = self._rate_limited()
            if limited is not None:
                status = 429
                return limited
            fault = self._take_fault(route)
            if fault is not None and not fault.cut_after:
                if fault.status == 429:
                    status = 429
                    return _too_many(fault.retry_after or 1.0, 10)
                raise MattermostError(fault.status, "fake.scripted", "a scripted failure")
            response, body = await self._answer(request, route, path, user_id)
            status = response.status
            if fault is not None:  # carried out; the answer never arrives
                transport = request.transport
                if transport is not None:
                    transport.abort()
                raise ConnectionResetError("cut after the request was carried out")
            return response
        except MattermostError as exc:
            status = exc.status
            return exc.response()
        finally:
            self._log_call(Call(route, path, status, params, body, user_id or "", time.time()))

    def _authenticated(self, header: str) -> str | None:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return None
        with self._lock:
            return self.tokens.get(token.strip())

    def _rate_limited(self) -> web.Response | None:
        with self._lock:
            limit = self.rate_limit_per_second
            if limit is None:
                return None
            second = int(time.time())
            start, used = self._window
            if start != second:
                start, used = second, 0
            used += 1
            self._window = (start, used)
            if used <= limit:
                return None
        return _too_many(1.0, limit)

    def _take_fault(self, route: str) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.route == route and fault.count > 0:
                    if fault.skip > 0:
                        fault.skip -= 1
                        return None
                    fault.count -= 1
                    if fault.count == 0:
                        self._faults.remove(fault)
                    return fault
        return None

    async def _answer(
        self, request: web.Request, route: str, path: str, user_id: str
    ) -> tuple[web.StreamResponse, Any]:
        parts = path.strip("/").split("/")
        query = request.query
        if route == "GET /system/ping":
            return web.json_response({"status": "OK"}), None
        if route == "GET /config/client":
            config = {
                "Version": SERVER_VERSION,
                "SiteName": "Fake Mattermost",
                "MaxPostSize": str(self.max_post_chars),
            }
            return web.json_response(config), None
        if route == "GET /users/{id}":
            return web.json_response(self._user(_me(parts[1], user_id))), None
        if route == "GET /users/{id}/teams":
            return web.json_response(self._teams_of(_me(parts[1], user_id), user_id)), None
        if route == "GET /users/{id}/teams/{id}/channels":
            who = _me(parts[1], user_id)
            return web.json_response(self._channels_of(who, parts[3], user_id)), None
        if route == "GET /channels/{id}":
            return web.json_response(self._readable_channel(parts[1], user_id)), None
        if route == "GET /channels/{id}/posts":
            return web.json_response(self._channel_posts(parts[1], user_id, query)), None
        if route == "GET /posts/{id}":
            return web.json_response(self._get_post(parts[1], user_id)), None
        if route == "POST /posts":
            body = await _json(request)
            if self.post_delay:
                post = await self._create_post_slowly(user_id, body)
            else:
                post = self._create_post(user_id, body)
            return web.json_response(post, status=201), body
        if route == "PUT /posts/{id}/patch":
            body = await _json(request)
            return web.json_response(self._patch_post(user_id, parts[1], body)), body
        if route == "POST /users/{id}/typing":
            body = await _json(request)
            self._typing(_me(parts[1], user_id), user_id, body)
            return web.json_response({"status": "OK"}), body
        if route == "POST /files":
            return await self._upload(request, user_id), None
        if route == "GET /files/{id}":
            info, data = self._file(parts[1], user_id)
            return web.Response(body=data, content_type=str(info["mime_type"])), None
        raise MattermostError(
            404, "api.context.404.app_error", "Sorry, we could not find the page."
        )

    # -- REST: reading -------------------------------------------------------------------

    def _user(self, user_id: str) -> Payload:
        with self._lock:
            user = self.users.get(user_id)
            if user is None:
                raise MattermostError(
                    404, "app.user.missing_account.const", "Unable to find the user."
                )
            return dict(user)

    def _teams_of(self, who: str, caller: str) -> list[Payload]:
        if who != caller:
            raise MattermostError(
                403,
                "api.context.permissions.app_error",
                "You do not have the appropriate permissions.",
            )
        with self._lock:
            return [dict(t) for i, t in self.teams.items() if who in self.team_members[i]]

    def _channels_of(self, who: str, team_id: str, caller: str) -> list[Payload]:
        if who != caller:
            raise MattermostError(
                403,
                "api.context.permissions.app_error",
                "You do not have the appropriate permissions.",
            )
        with self._lock:
            if team_id not in self.teams or who not in self.team_members[team_id]:
                raise MattermostError(
                    403,
                    "api.context.permissions.app_error",
                    "You do not have the appropriate permissions.",
                )
            return [
                dict(c)
                for i, c in self.channels.items()
                if who in self.members[i] and c["team_id"] in (team_id, "")
            ]

    def _readable_channel(self, channel_id: str, user_id: str) -> Payload:
        with self._lock:
            channel = self.channels.get(channel_id)
            if channel is None:
                raise MattermostError(
                    404,
                    "app.channel.get.existing.app_error",
                    "Unable to find the existing channel.",
                )
            if user_id not in self.members[channel_id] and channel["type"] != "O":
                raise MattermostError(
                    403,
                    "api.context.permissions.app_error",
                    "You do not have the appropriate permissions.",
                )
            return dict(channel)

    def _get_post(self, post_id: str, user_id: str) -> Payload:
        with self._lock:
            post = self.posts.get(post_id)
            if post is None or post["delete_at"]:
                raise MattermostError(404, "app.post.get.app_error", "Unable to get the post.")
            self._readable_channel(str(post["channel_id"]), user_id)
            return dict(post)

    def _channel_posts(self, channel_id: str, user_id: str, query: Any) -> Payload:
        self._readable_channel(channel_id, user_id)
        with self._lock:
            mine = [self.posts[p] for p in self._order if self.posts[p]["channel_id"] == channel_id]
            since = query.get("since")
            if since is not None:
                # Posts updated after `since` (deleted ones too), at most 1000, newest first.
                changed = [p for p in mine if p["update_at"] > int(since)][:1000]
                listed = _newest_first(changed)
                return self._post_list(listed, has_next=False)
            try:
                page = max(0, int(query.get("page", 0)))
                per_page = min(200, max(0, int(query.get("per_page", 60))))
            except ValueError:
                raise MattermostError(
                    400,
                    "api.context.invalid_url_param.app_error",
                    "Invalid or missing page in request URL.",
                ) from None
            alive = [p for p in mine if not p["delete_at"]]
            after, before = query.get("after"), query.get("before")
            if after or before:
                anchor = self.posts.get(str(after or before))
                if anchor is None or anchor["channel_id"] != channel_id:
                    return self._post_list([], has_next=False)
                at = anchor["create_at"]
                if after:
                    # ASC by create_at, offset/limit, then listed newest first.
                    chosen = _oldest_first([p for p in alive if p["create_at"] > at])
                    window = chosen[page * per_page : (page + 1) * per_page]
                    return self._post_list(
                        list(reversed(window)), has_next=len(chosen) > (page + 1) * per_page
                    )
                chosen = _newest_first([p for p in alive if p["create_at"] < at])
            else:
                chosen = _newest_first(alive)
            window = chosen[page * per_page : (page + 1) * per_page]
            return self._post_list(window, has_next=len(chosen) > (page + 1) * per_page)

    def _post_list(self, listed: list[Payload], *, has_next: bool) -> Payload:
        posts = {p["id"]: dict(p) for p in listed}
        for post in listed:
            root = self.posts.get(str(post["root_id"])) if post["root_id"] else None
            if root is not None:
                posts.setdefault(root["id"], dict(root))
        return {
            "order": [p["id"] for p in listed],
            "posts": posts,
            "next_post_id": "",
            "prev_post_id": "",
            "has_next": has_next,
        }

    # -- REST: writing -------------------------------------------------------------------

    def _check_post(self, user_id: str, body: Payload) -> tuple[Payload, str]:
        if not isinstance(body, dict):
            raise MattermostError(
                400,
                "api.context.invalid_body_param.app_error",
                "Invalid or missing post in request body.",
            )
        channel_id = str(body.get("channel_id") or "")
        channel = self.channels.get(channel_id)
        if channel is None or user_id not in self.members[channel_id]:
            raise MattermostError(
                403,
                "api.context.permissions.app_error",
                "You do not have the appropriate permissions.",
            )
        message = str(body.get("message") or "")
        if len(message) > self.max_post_chars:
            raise MattermostError(400, "model.post.is_valid.msg.app_error", "Invalid Message.")
        root_id = str(body.get("root_id") or "")
        if root_id:
            root = self.posts.get(root_id)
            if (
                root is None
                or root["channel_id"] != channel_id
                or root["root_id"]
                or root["delete_at"]
            ):
                raise MattermostError(
                    400, "api.post.create_post.root_id.app_error", "Invalid RootId parameter."
                )
        return channel, str(body.get("pending_post_id") or "")

    def _claim_pending(self, pending: str) -> Payload | None:
        """`deduplicateCreatePost`: the post made for `pending` (or None: claimed now)."""
        if not pending:
            return None
        now = time.monotonic()
        seen = self._pending.get(pending)
        if seen is None or seen[1] <= now:
            self._pending[pending] = ("", now + self.pending_ttl)
            return None
        if seen[0] == "":
            raise MattermostError(
                500,
                "api.post.deduplicate_create_post.pending",
                "Post rejected: a post with the same pending_post_id is still being made.",
            )
        return dict(self.posts[seen[0]])

    def _create_post(self, user_id: str, body: Payload) -> Payload:
        with self._lock:
            channel, pending = self._check_post(user_id, body)
            found = self._claim_pending(pending)
            if found is not None:
                return found
            return self._save_post(user_id, channel, body, pending)

    async def _create_post_slowly(self, user_id: str, body: Payload) -> Payload:
        with self._lock:
            channel, pending = self._check_post(user_id, body)
            found = self._claim_pending(pending)
            if found is not None:
                return found
        await asyncio.sleep(self.post_delay)
        with self._lock:
            return self._save_post(user_id, channel, body, pending)

    def _save_post(self, user_id: str, channel: Payload, body: Payload, pending: str) -> Payload:
        file_ids = [str(f) for f in body.get("file_ids") or []][:MAX_FILES_PER_POST]
        infos = []
        for file_id in file_ids:
            entry = self.files.get(file_id)
            if entry is None or entry[0]["user_id"] != user_id or entry[0]["post_id"]:
                continue
            infos.append(entry[0])
        now = max(self.now_ms(), self._last_ms) if self._clock_ms is None else self.now_ms()
        self._last_ms = now
        props = dict(body.get("props") or {})
        if self.users[user_id]["is_bot"]:
            props["from_bot"] = "true"
        post: Payload = {
            "id": new_id(),
            "create_at": now,
            "update_at": now,
            "edit_at": 0,
            "delete_at": 0,
            "is_pinned": False,
            "user_id": user_id,
            "channel_id": channel["id"],
            "root_id": str(body.get("root_id") or ""),
            "original_id": "",
            "message": str(body.get("message") or ""),
            "type": "",
            "props": props,
            "hashtags": "",
            "file_ids": [i["id"] for i in infos],
            "pending_post_id": pending,
            "reply_count": 0,
            "metadata": {"files": [dict(i) for i in infos]} if infos else {},
        }
        for info in infos:
            info["post_id"] = post["id"]
        self.posts[post["id"]] = post
        self._order.append(post["id"])
        stored = self.channels[channel["id"]]
        stored["last_post_at"] = max(stored["last_post_at"], now)
        if not post["root_id"]:
            stored["last_root_post_at"] = max(stored["last_root_post_at"], now)
        stored["total_msg_count"] += 1
        if pending:
            self._pending[pending] = (post["id"], time.monotonic() + self.pending_ttl)
        self._broadcast_post("posted", post)
        self._notify()
        return dict(post)

    def _patch_post(self, user_id: str, post_id: str, body: Payload) -> Payload:
        with self._lock:
            post = self.posts.get(post_id)
            if post is None or post["delete_at"]:
                raise MattermostError(404, "app.post.get.app_error", "Unable to get the post.")
            if post["user_id"] != user_id:
                raise MattermostError(
                    403,
                    "api.post.update_post.permissions_details.app_error",
                    "You do not have the appropriate permissions.",
                )
            if "message" in body:
                message = str(body.get("message") or "")
                if len(message) > self.max_post_chars:
                    raise MattermostError(
                        400, "model.post.is_valid.msg.app_error", "Invalid Message."
                    )
                post["message"] = message
            now = max(self.now_ms(), post["create_at"] + 1)
            post["edit_at"] = post["update_at"] = now
            self._broadcast_post("post_edited", post)
            self._notify()
            return dict(post)

    def _typing(self, who: str, caller: str, body: Payload) -> None:
        if who != caller:
            raise MattermostError(
                403,
                "api.context.permissions.app_error",
                "You do not have the appropriate permissions.",
            )
        channel_id = str((body or {}).get("channel_id") or "")
        with self._lock:
            if channel_id not in self.channels:
                raise MattermostError(
                    400,
                    "api.context.invalid_body_param.app_error",
                    "Invalid or missing channel_id in request body.",
                )
            data = {"parent_id": str(body.get("parent_id") or ""), "user_id": who}
            self._broadcast(channel_id, "typing", data, omit=who)

    async def _upload(self, request: web.Request, user_id: str) -> web.Response:
        reader = await request.multipart()
        channel_id = request.query.get("channel_id", "")
        infos = []
        while True:
            part = await reader.next()
            if part is None:
                break
            if part.name == "channel_id":
                channel_id = (await part.text()).strip()  # type: ignore[union-attr]
            elif part.name == "files":
                data = await part.read()  # type: ignore[union-attr]
                if len(data) > self.max_file_size:
                    raise MattermostError(
                        413,
                        "api.file.upload_file.too_large_detailed.app_error",
                        "Unable to upload file. File is too large.",
                    )
                name = part.filename or "file"  # type: ignore[union-attr]
                mime = part.headers.get("Content-Type", "application/octet-stream")
                infos.append(self._store_file(user_id, channel_id, name, data, mime))
        if not infos:
            raise MattermostError(
                400, "api.file.upload_file.storage.app_error", "No file uploaded."
            )
        return web.json_response({"file_infos": infos, "client_ids": []}, status=201)

    def _store_file(
        self, user_id: str, channel_id: str, name: str, data: bytes, mime: str
    ) -> Payload:
        with self._lock:
            if channel_id not in self.channels or user_id not in self.members[channel_id]:
                raise MattermostError(
                    403,
                    "api.context.permissions.app_error",
                    "You do not have the appropriate permissions.",
                )
            info = {
                "id": new_id(),
                "user_id": user_id,
                "channel_id": channel_id,
                "post_id": "",
                "create_at": self.now_ms(),
                "name": name,
                "extension": name.rsplit(".", 1)[-1] if "." in name else "",
                "size": len(data),
                "mime_type": mime,
            }
            self.files[info["id"]] = (info, data)
            return dict(info)

    def _file(self, file_id: str, user_id: str) -> tuple[Payload, bytes]:
        with self._lock:
            entry = self.files.get(file_id)
            if entry is None:
                raise MattermostError(
                    404, "app.file_info.get.app_error", "Unable to get the file info."
                )
            info, data = entry
            if info["user_id"] != user_id and user_id not in self.members.get(
                info["channel_id"], set()
            ):
                raise MattermostError(
                    403,
                    "api.context.permissions.app_error",
                    "You do not have the appropriate permissions.",
                )
            return dict(info), data

    # -- the WebSocket -------------------------------------------------------------------

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        conn = _Conn(ws, new_id(), request.transport)
        with self._lock:
            self._conns.append(conn)
        writer = asyncio.ensure_future(self._write(conn))
        try:
            user = self._authenticated(request.headers.get("Authorization", ""))
            if user is not None:
                self._hello(conn, user)
            async for frame in ws:
                if frame.type.name != "TEXT":
                    continue
                try:
                    action = json.loads(frame.data)
                except ValueError:
                    continue
                if not isinstance(action, dict):
                    continue
                seq = action.get("seq")
                if action.get("action") == "authentication_challenge":
                    if conn.user_id:
                        continue  # authenticated already: the server answers nothing
                    token = str((action.get("data") or {}).get("token") or "")
                    with self._lock:
                        user = self.tokens.get(token)
                    if user is None:
                        if isinstance(conn.transport, asyncio.Transport):
                            conn.transport.abort()  # `conn.WebSocket.Close()`: no close frame
                        break
                    conn.queue.put_nowait({"status": "OK", "seq_reply": seq})
                    self._hello(conn, user)
                elif not conn.user_id:
                    conn.queue.put_nowait(
                        {
                            "status": "FAIL",
                            "seq_reply": seq,
                            "error": {
                                "id": "api.web_socket_router.not_authenticated.app_error",
                                "message": "Not authenticated.",
                            },
                        }
                    )
                else:
                    conn.queue.put_nowait({"status": "OK", "seq_reply": seq})
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            self._notify()
        return ws

    def _hello(self, conn: _Conn, user_id: str) -> None:
        with self._lock:
            conn.user_id = user_id
            self._send_event(
                conn,
                "hello",
                {"server_version": SERVER_VERSION, "connection_id": conn.connection_id},
                {"omit_users": None, "user_id": user_id, "channel_id": "", "team_id": ""},
            )
        self._notify()

    async def _write(self, conn: _Conn) -> None:
        while True:
            payload = await conn.queue.get()
            if conn.ws.closed:
                return
            try:
                await conn.ws.send_str(json.dumps(payload))
            except (ConnectionError, RuntimeError):
                return

    def _send_event(self, conn: _Conn, event: str, data: Payload, broadcast: Payload) -> None:
        payload = {"event": event, "data": data, "broadcast": broadcast, "seq": conn.seq}
        conn.seq += 1
        self.events_sent.append((conn.user_id, event, payload))
        loop = self._loop
        if loop is None:
            return
        # From any thread, in the order made: the connection's writer sends them in turn.
        loop.call_soon_threadsafe(conn.queue.put_nowait, payload)

    def _broadcast(self, channel_id: str, event: str, data: Payload, *, omit: str = "") -> None:
        members = self.members.get(channel_id, set())
        broadcast = {
            "omit_users": {omit: True} if omit else None,
            "user_id": "",
            "channel_id": channel_id,
            "team_id": "",
        }
        for conn in list(self._conns):
            if conn.user_id and conn.user_id in members and conn.user_id != omit:
                self._send_event(conn, event, dict(data), broadcast)

    def _broadcast_post(self, kind: str, post: Payload) -> None:
        channel = self.channels[str(post["channel_id"])]
        data: Payload = {"post": json.dumps(post, separators=(",", ":"))}
        if kind == "posted":
            author = self.users[str(post["user_id"])]
            mentioned, _ = self.mentioned_users(post)
            data.update(
                {
                    "channel_display_name": channel["display_name"],
                    "channel_name": channel["name"],
                    "channel_type": channel["type"],
                    "sender_name": f"@{author['username']}",
                    "team_id": channel["team_id"],
                    "set_online": True,
                }
            )
            if mentioned:
                data["mentions"] = json.dumps(sorted(mentioned))
        self._broadcast(str(post["channel_id"]), kind, data)


def _oldest_first(posts: list[Payload]) -> list[Payload]:
    """By `create_at`, posts of one millisecond in the order they were made (as
    PostgreSQL's b-tree index keeps equal keys: by their row's place, since version 12)."""
    return sorted(posts, key=lambda p: p["create_at"])  # stable: `posts` is in made order


def _newest_first(posts: list[Payload]) -> list[Payload]:
    """`_oldest_first` reversed exactly (a backward scan of that index): ties too."""
    return list(reversed(_oldest_first(posts)))


def _route_of(method: str, path: str) -> str:
    """`VERB /route` with ids as `{id}` (``GET /channels/{id}/posts``)."""
    parts = [p for p in path.strip("/").split("/") if p]
    named = []
    for index, part in enumerate(parts):
        fixed = index % 2 == 0 or part in {
            "patch",
            "typing",
            "posts",
            "teams",
            "channels",
            "thread",
        }
        if part in {"me", "ping", "client"} or fixed:
            named.append(part)
        else:
            named.append("{id}")
    route = "/" + "/".join(named)
    return f"{method} {route.replace('/me', '/{id}')}"


def _me(user_id: str, caller: str) -> str:
    return caller if user_id == "me" else user_id


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise MattermostError(
            400, "api.context.invalid_body_param.app_error", "Invalid or missing body."
        ) from None


def _too_many(retry_after: float, limit: int) -> web.Response:
    headers = {
        "X-Ratelimit-Limit": str(limit),
        "X-Ratelimit-Remaining": "0",
        "X-Ratelimit-Reset": str(max(1, round(retry_after))),
        "Retry-After": str(max(1, round(retry_after))),
    }
    return web.Response(status=429, text="limit exceeded\n", headers=headers)


#: What `FakeMattermost.user_message` returns is what `POST /posts` answers; the callable
#: a test may pass where one is wanted.
PostMaker = Callable[[str, str, str], Payload]
