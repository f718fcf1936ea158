"""The operator's web page under `/admin` on the daemon's HTTP port.

Pages: the overview (channel health, each model provider's circuit breaker and a live
view of turns, refreshed by htmx without a reload), sessions (search, sort, counts), one
session (its tree and the transcript of its current branch), the memory of a scope,
pairing requests (approve, revoke) and the response cache (statistics, invalidate).
Everything is read through the stores the daemon runs on (`SessionManager`,
`MemoryBackend`, `PairingBackend`, `SemanticCache`), so in the shared mode every replica
shows the same; the breakers are this replica's own.

Invariants (tested in tests/test_admin_http.py and tests/test_admin_browser.py):
- Every page needs a login (the cookie of the login form, or the bearer header);
  without an HTTP token configured the page is off (see `gateway.http.admin.auth`).
- Wrong tokens (the login form's, a bearer header's) count against the client address
  they came from, with the chat API's (`HttpServer.auth_throttle`): past the bound that
  address gets 429 with Retry-After, and the operator's own address still logs in.
- Every POST needs the login's CSRF token and, when the browser names an `Origin`,
  this very origin; otherwise 403 and nothing changes.
- Everything a user or the model wrote is escaped by Jinja2's autoescape and shown with
  `show_text` (bidi overrides visible, long texts cut); the Content-Security-Policy lets
  only this page's own script and style files run, so even a missed escape runs nothing.
- No page shows a secret. Tokens, keys and URLs with passwords are never rendered; every
  page, whole, loses the configured secrets on its way out (the settings' redactor,
  `gateway.redaction`), HTML-escaped or not; and what came from outside (`show`: a model
  server's error, a channel's health, a transcript) loses token shapes too.
- The operator reaches every session, of every channel and every API client, on
  purpose: a page's session key is resolved as `OPERATOR`'s
  (`gateway.http.namespace.resolve_session`), which takes any key that can be stored.
  Set `http.admin_token` to keep the operator apart from the chat API's token holder.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import jinja2
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler
from loguru import logger
from markupsafe import Markup

from gateway.http.admin.auth import (
    COOKIE_NAME,
    CSRF_FIELD,
    CSRF_HEADER,
    SESSION_SECONDS,
    AdminKeys,
    AdminLogin,
)
from gateway.http.admin.views import (
    MAX_SHOWN_CHARS,
    SESSION_SORTS,
    TurnWindow,
    session_rows,
    show_text,
    transcript,
    tree_rows,
)
from gateway.http.auth import TOKEN_ENV
from gateway.http.health import HealthState
from gateway.http.namespace import OPERATOR, SessionRefused, resolve_session
from gateway.http.pages import StaticFiles, page_headers, same_origin, secure_enough
from gateway.http.throttle import AuthThrottle
from gateway.messages import OutboundMessage
from gateway.redaction import Redactor
from gateway.sessions.errors import SessionKeyError

if TYPE_CHECKING:
    from gateway.access.protocol import PairingBackend
    from gateway.cache import SemanticCache
    from gateway.dispatch.dispatcher import DispatcherStats
    from gateway.http.server import HttpServer
    from gateway.llm.breaker import BreakerStatus
    from gateway.memory.protocol import MemoryBackend
    from gateway.sessions import SessionManager

PREFIX = "/admin"
#: Rows of a session's tree and messages of its transcript shown at most (the newest).
MAX_TREE_ROWS = 500
MAX_TRANSCRIPT = 200
#: The message a sender gets on their channel when the operator approves their code.
APPROVED_TEXT = "Your pairing request was approved: you can write to the assistant now."
_OFF = f"The admin page is off until an HTTP token is set: set {TOKEN_ENV}."
# Only this page's own files may run or style it; no frames, no foreign forms.
_SECURITY_HEADERS = page_headers()


@dataclass
class AdminSources:
    """What the page reads and acts on: the daemon's own stores and counters."""

    health: HealthState
    sessions: SessionManager
    pairing: PairingBackend
    pairing_channels: tuple[str, ...] = ()
    memory: MemoryBackend | None = None
    cache: SemanticCache | None = None
    #: Sends a message to a channel (the daemon's `deliver`), for approval notices.
    deliver: Callable[[OutboundMessage], Awaitable[None]] | None = None
    turns: TurnWindow = field(default_factory=TurnWindow)
    dispatcher_stats: Callable[[], DispatcherStats] | None = None
    llm_errors: Mapping[str, int] = field(default_factory=dict)
    #: Each model provider's circuit breaker (the failover's `statuses`), this replica's.
    providers: Callable[[], Sequence[BreakerStatus]] | None = None
    #: Where the state lives, for the header ("workspace files", a redacted URL).
    storage: str = "workspace files"
    #: Replies a channel keeps as undeliverable (WhatsApp outside its 24-hour window),
    #: newest first; the overview lists them under a marker. Channels add theirs with
    #: `add_undeliverable`.
    undeliverable: Callable[[], Awaitable[Sequence[Any]]] | None = None

    def add_undeliverable(self, source: Callable[[], Awaitable[Sequence[Any]]]) -> None:
        """List `source`'s replies too, after those of the channels that came before: one
        channel's never hide another's."""
        before = self.undeliverable
        if before is None:
            self.undeliverable = source
            return

        async def both() -> Sequence[Any]:
            return [*await before(), *await source()]

        self.undeliverable = both


def _templates(redactor: Redactor) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("gateway.http.admin", "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )

    def show(text: str | None, limit: int = MAX_SHOWN_CHARS) -> Markup:
        # Before it is cut: half a secret at the cut is still a secret.
        return show_text(redactor.redact(text or ""), limit)

    env.filters["show"] = show
    env.filters["when"] = _when
    env.filters["ago"] = _ago
    return env


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _ago(ts: float) -> str:
    seconds = max(0, int(time.time() - ts))
    if seconds < 60:
        return f"{seconds}s ago"
    if seconds < 3600:
        return f"{seconds // 60}m ago"
    if seconds < 86400:
        return f"{seconds // 3600}h ago"
    return f"{seconds // 86400}d ago"


class AdminPage:
    """The `/admin` routes; `mount(server)` adds them to the daemon's HTTP server."""

    def __init__(
        self, token: str | None, sources: AdminSources, redactor: Redactor | None = None
    ) -> None:
        """`redactor` is the settings' (None: token shapes only)."""
        self.keys = AdminKeys(token) if token else None
        self.sources = sources
        self.redactor = redactor or Redactor()
        #: The server's count of wrong tokens per client, set by `mount`.
        self.throttle: AuthThrottle | None = None
        self.templates = _templates(self.redactor)
        self._static = StaticFiles("gateway.http.admin")

    def mount(self, server: HttpServer) -> None:
        """Add the routes. They answer while starting and draining too: an operator
        looks at a gateway most when it is not ready."""
        self.throttle = server.auth_throttle
        get, post = "GET", "POST"
        routes: list[tuple[str, str, Handler]] = [
            (get, PREFIX, self._guard(self.overview)),
            (get, f"{PREFIX}/live", self._guard(self.live)),
            (get, f"{PREFIX}/sessions", self._guard(self.sessions)),
            (get, f"{PREFIX}/session", self._guard(self.session)),
            (get, f"{PREFIX}/memory", self._guard(self.memory)),
            (get, f"{PREFIX}/pairing", self._guard(self.pairing)),
            (post, f"{PREFIX}/pairing/approve", self._guard(self.approve, changes=True)),
            (post, f"{PREFIX}/pairing/revoke", self._guard(self.revoke, changes=True)),
            (get, f"{PREFIX}/cache", self._guard(self.cache)),
            (post, f"{PREFIX}/cache/invalidate", self._guard(self.invalidate, changes=True)),
            (post, f"{PREFIX}/logout", self._guard(self.logout, changes=True)),
            (get, f"{PREFIX}/login", self.login_form),
            (post, f"{PREFIX}/login", self.login),
            (get, f"{PREFIX}/static/{{name}}", self.static),
        ]
        for method, path, handler in routes:
            server.mount(method, path, handler, require_ready=False)

    # ------------------------------------------------------------------ plumbing

    async def _render(
        self,
        template: str,
        request: web.Request,
        login: AdminLogin | None,
        /,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
        **context: Any,
    ) -> web.Response:
        render = functools.partial(
            self.templates.get_template(template).render,
            csrf=login.csrf if login is not None else "",
            csrf_field=CSRF_FIELD,
            logged_in=login is not None,
            path=request.path,
            storage=self.sources.storage,
            **context,
        )
        # In a worker thread: a long session's page must not hold up the turns. The whole
        # page loses the configured secrets, whatever a template shows and however it
        # escaped it; token shapes are `show`'s (not the page's: a CSRF token is random).
        page = await anyio.to_thread.run_sync(lambda: self.redactor.redact_configured(render()))
        return web.Response(
            text=page,
            status=status,
            content_type="text/html",
            charset="utf-8",
            headers=_SECURITY_HEADERS | dict(headers or {}),
        )

    async def _refuse(
        self,
        request: web.Request,
        status: int,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> web.Response:
        return await self._render(
            "message.html", request, None, status=status, headers=headers, message=message
        )

    def _locked_out(self, request: web.Request) -> int | None:
        """Seconds this client must wait before a token of theirs is checked again."""
        assert self.throttle is not None, "mount() the page first"
        return self.throttle.retry_after(request.remote)

    def _login_of(self, request: web.Request) -> AdminLogin | None:
        assert self.keys is not None and self.throttle is not None
        authorization = request.headers.get(hdrs.AUTHORIZATION)
        if authorization:  # a wrong bearer header is not rescued by a cookie
            login = self.keys.check_authorization(authorization)
            if login is None:
                self.throttle.failed(request.remote)
                logger.warning("admin: wrong bearer token from {}", request.remote or "-")
            return login
        # A stale cookie is no guess (a forged one cannot be made): it is not counted.
        return self.keys.check_cookie(request.cookies.get(COOKIE_NAME))

    def _guard(
        self, handler: Callable[..., Awaitable[web.StreamResponse]], *, changes: bool = False
    ) -> Handler:
        """Log in, CSRF and origin checks in front of a page (see the module doc)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if self.keys is None:
                return await self._refuse(
                    request,
                    503,
                    _OFF,
                )
            if hdrs.AUTHORIZATION in request.headers and (wait := self._locked_out(request)):
                return await self._refuse(
                    request,
                    429,
                    f"Too many wrong tokens from your address: wait {wait} s, then try again.",
                    {hdrs.RETRY_AFTER: str(wait)},
                )
            login = self._login_of(request)
            if login is None:
                if request.headers.get("HX-Request") == "true":
                    # The live view's poll after the login expired: the whole page goes
                    # to the login form (a redirect would put the form inside the panel).
                    return web.Response(status=401, headers={"HX-Redirect": f"{PREFIX}/login"})
                if request.method == "GET" and hdrs.AUTHORIZATION not in request.headers:
                    raise web.HTTPSeeOther(f"{PREFIX}/login")
                return await self._refuse(
                    request, 401, "Log in first: the token is missing or wrong."
                )
            if changes:
                form = await request.post()
                given = request.headers.get(CSRF_HEADER) or form.get(CSRF_FIELD)
                if not AdminKeys.csrf_ok(login, given if isinstance(given, str) else None):
                    logger.warning(
                        "admin: {} {} refused: no valid CSRF token", request.method, request.path
                    )
                    return await self._refuse(
                        request,
                        403,
                        "Refused: the form's security token is missing or stale. "
                        "Reload the page and try again.",
                    )
                if not same_origin(request):
                    logger.warning(
                        "admin: {} {} refused: foreign origin", request.method, request.path
                    )
                    return await self._refuse(
                        request, 403, "Refused: the request came from another site."
                    )
            return await handler(request, login)

        return guarded

    # ------------------------------------------------------------------ login

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        if self.keys is None:
            return await self._refuse(request, 503, _OFF)
        return await self._render("login.html", request, None, error="")

    async def login(self, request: web.Request) -> web.StreamResponse:
        if self.keys is None:
            return await self._refuse(request, 503, _OFF)
        assert self.throttle is not None
        wait = self._locked_out(request)
        if wait is not None:
            return await self._render(
                "login.html",
                request,
                None,
                status=429,
                headers={hdrs.RETRY_AFTER: str(wait)},
                error=f"Too many wrong tokens from your address: wait {wait} s, then try again.",
            )
        form = await request.post()
        token = form.get("token")
        if not isinstance(token, str) or not self.keys.token_matches(token.strip()):
            self.throttle.failed(request.remote)
            logger.warning("admin: failed login from {}", request.remote or "-")
            return await self._render("login.html", request, None, status=401, error="Wrong token.")
        if not secure_enough(request):
            return await self._render(
                "login.html",
                request,
                None,
                status=400,
                error="The login cookie is only sent over HTTPS off this machine: open the "
                "page through TLS (deploy/nginx.conf) or an SSH tunnel to 127.0.0.1.",
            )
        response = web.HTTPSeeOther(PREFIX)
        response.set_cookie(
            COOKIE_NAME,
            self.keys.new_cookie(),
            max_age=SESSION_SECONDS,
            path=PREFIX,
            secure=True,
            httponly=True,
            samesite="Strict",
        )
        logger.info("admin: operator logged in from {}", request.remote or "-")
        raise response

    async def logout(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        response = web.HTTPSeeOther(f"{PREFIX}/login")
        response.del_cookie(COOKIE_NAME, path=PREFIX)
        raise response

    async def static(self, request: web.Request) -> web.StreamResponse:
        return await self._static.handler(request)

    # ------------------------------------------------------------------ overview

    async def _live_context(self) -> dict[str, Any]:
        src = self.sources
        readiness = src.health.readiness()
        stats = src.dispatcher_stats() if src.dispatcher_stats is not None else None
        undeliverable: Sequence[Any] = []
        if src.undeliverable is not None:
            try:
                undeliverable = await src.undeliverable()
            except Exception as exc:  # a page that shows the rest beats an error page
                logger.warning("admin: undeliverable replies not read: {!r}", exc)
        return {
            "undeliverable": undeliverable,
            "readiness": readiness,
            "live": src.turns.snapshot(),
            "queued": stats.queued_total if stats is not None else 0,
            "in_flight": stats.in_flight if stats is not None else 0,
            "llm_errors": dict(src.llm_errors),
            "providers": list(src.providers()) if src.providers is not None else [],
        }

    async def overview(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        return await self._render("overview.html", request, login, **await self._live_context())

    async def live(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        return await self._render("live.html", request, login, **await self._live_context())

    # ------------------------------------------------------------------ sessions

    async def sessions(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        query = request.query.get("q", "")[:200]
        sort = request.query.get("sort", "recent")
        infos = await anyio.to_thread.run_sync(self.sources.sessions.list_sessions)
        rows, counts = session_rows(infos, query, sort, time.time())
        return await self._render(
            "sessions.html",
            request,
            login,
            rows=rows[:500],
            counts=counts,
            query=query,
            sort=sort if sort in SESSION_SORTS else "recent",
            sorts=SESSION_SORTS,
        )

    async def session(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        key = request.query.get("key", "")
        try:
            key = resolve_session(OPERATOR, key) if key else ""
            found = await anyio.to_thread.run_sync(self.sources.sessions.get, key) if key else None
        except (SessionRefused, SessionKeyError):
            found = None
        if found is None:
            return await self._render(
                "message.html",
                request,
                login,
                status=404,
                message=f"No session {key!r}. The sessions page lists the keys.",
            )
        session = found

        def read() -> dict[str, Any]:
            branch = session.get_branch()
            branch_ids = {e.id for e in branch}
            leaf = session.leaf_id
            rows = tree_rows(session.get_tree(), leaf, branch_ids)
            messages = transcript(branch)
            return {
                # The newest part of a long session; the CLI shows all of it.
                "rows": rows[-MAX_TREE_ROWS:],
                "rows_hidden": max(0, len(rows) - MAX_TREE_ROWS),
                "entries": len(rows),
                "messages": messages[-MAX_TRANSCRIPT:],
                "messages_hidden": max(0, len(messages) - MAX_TRANSCRIPT),
                "leaf": leaf,
                "name": session.name,
                "created_at": session.created_at,
                "updated_at": session.updated_at,
                "labels": session.labels,
            }

        data = await anyio.to_thread.run_sync(read)
        memory = self.sources.memory
        has_memory = memory is not None and await anyio.to_thread.run_sync(memory.exists, key)
        return await self._render(
            "session.html", request, login, key=key, has_memory=has_memory, **data
        )

    # ------------------------------------------------------------------ memory

    async def memory(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        key = request.query.get("key", "")
        query = request.query.get("q", "")[:200]
        backend = self.sources.memory
        context: dict[str, Any] = {"key": key, "query": query, "enabled": backend is not None}
        if backend is None or not key:
            return await self._render("memory.html", request, login, found=False, **context)
        try:
            key = resolve_session(OPERATOR, key)
        except SessionRefused:
            return await self._render("memory.html", request, login, found=False, **context)

        def read() -> dict[str, Any] | None:
            assert backend is not None
            if not backend.exists(key):
                return None
            scope = backend.for_session(key)
            knowledge: dict[str, list[Any]] = {}
            for entry in scope.knowledge:
                knowledge.setdefault(entry.category, []).append(entry)
            return {
                "scope": scope.scope,
                "facts": scope.read_memory(),
                "fact_list": scope.list_facts(),
                "history": scope.search_history(query, max_results=50),
                # Every past message of the scope's sessions, searched only when asked.
                "messages": scope.search_messages(query, 20) if query.strip() else [],
                "knowledge": dict(sorted(knowledge.items())),
            }

        try:
            data = await anyio.to_thread.run_sync(read)
        except SessionKeyError:
            data = None
        if data is None:
            return await self._render("memory.html", request, login, found=False, **context)
        return await self._render("memory.html", request, login, found=True, **context, **data)

    # ------------------------------------------------------------------ pairing

    async def pairing(
        self, request: web.Request, login: AdminLogin, *, notice: str = "", error: str = ""
    ) -> web.StreamResponse:
        store = self.sources.pairing
        listing = await anyio.to_thread.run_sync(store.list)
        return await self._render(
            "pairing.html",
            request,
            login,
            status=400 if error else 200,
            listing=listing,
            channels=self.sources.pairing_channels,
            load_error=store.load_error or "",
            notice=notice,
            error=error,
        )

    async def approve(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        form = await request.post()
        channel, code = str(form.get("channel", "")), str(form.get("code", "")).strip()
        if channel not in self.sources.pairing_channels or not code:
            return await self.pairing(request, login, error="Choose a channel and enter a code.")
        store = self.sources.pairing
        from gateway.access.protocol import normalize_code

        wanted = normalize_code(code)

        def approve() -> tuple[str | None, str]:
            pending = {r.code: r for r in store.list(channel).pending}
            sender = store.approve(channel, code)
            request_ = pending.get(wanted)
            return sender, request_.chat_id if request_ is not None else ""

        sender, chat_id = await anyio.to_thread.run_sync(approve)
        if sender is None:
            return await self.pairing(
                request, login, error=f"No live request on {channel} has code {wanted!r}."
            )
        logger.info("admin: approved sender {} on {}", sender, channel)
        await self._notify_approved(channel, chat_id or sender)
        return await self.pairing(
            request, login, notice=f"Approved {sender} on {channel}; telling them there."
        )

    async def _notify_approved(self, channel: str, chat_id: str) -> None:
        """Tell the sender they may write now (best effort: approved either way)."""
        deliver = self.sources.deliver
        if deliver is None:
            return
        message = OutboundMessage(
            channel=channel, chat_id=chat_id, text=APPROVED_TEXT, session_key=f"{channel}:{chat_id}"
        )
        try:
            await deliver(message)
        except Exception as exc:
            logger.warning("admin: could not tell {} on {}: {}", chat_id, channel, exc)

    async def revoke(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        form = await request.post()
        channel, sender = str(form.get("channel", "")), str(form.get("sender", ""))
        if channel not in self.sources.pairing_channels or not sender:
            return await self.pairing(request, login, error="Choose a channel and a sender.")
        done = await anyio.to_thread.run_sync(self.sources.pairing.revoke, channel, sender)
        if not done:
            return await self.pairing(
                request, login, error=f"{sender} is not approved on {channel}."
            )
        logger.info("admin: revoked sender {} on {}", sender, channel)
        return await self.pairing(request, login, notice=f"Revoked {sender} on {channel}.")

    # ------------------------------------------------------------------ cache

    async def cache(
        self, request: web.Request, login: AdminLogin, *, notice: str = "", error: str = ""
    ) -> web.StreamResponse:
        from gateway.cache import CacheUnavailable

        cache = self.sources.cache
        stats = None
        if cache is not None:
            try:
                stats = await cache.stats()
            except CacheUnavailable as exc:
                error = error or f"The cache does not answer: {exc}"
        return await self._render(
            "cache.html",
            request,
            login,
            status=400 if error and notice == "" and request.method == "POST" else 200,
            enabled=cache is not None,
            stats=stats,
            notice=notice,
            error=error,
        )

    async def invalidate(self, request: web.Request, login: AdminLogin) -> web.StreamResponse:
        from gateway.cache import CacheUnavailable

        cache = self.sources.cache
        if cache is None:
            return await self.cache(request, login, error="The cache is off.")
        form = await request.post()
        what, value = str(form.get("what", "")), str(form.get("value", "")).strip()
        try:
            if what == "key" and value:
                removed = await cache.invalidate(value)
            elif what == "session" and value:
                try:
                    key = resolve_session(OPERATOR, value)
                except SessionRefused as exc:
                    return await self.cache(request, login, error=f"Nothing removed: {exc}")
                removed = await cache.invalidate(session_key=key)
            elif what == "model" and value:
                removed = await cache.invalidate(model=value)
            elif what == "shared":
                removed = await cache.invalidate(shared=True)
            elif what == "all":
                removed = await cache.clear()
            else:
                return await self.cache(request, login, error="Say what to invalidate.")
        except CacheUnavailable as exc:
            return await self.cache(request, login, error=f"Nothing removed: {exc}")
        noun = "entry" if removed == 1 else "entries"
        return await self.cache(request, login, notice=f"Removed {removed} cache {noun}.")
