"""The daemon's one HTTP server (aiohttp.web): probes, metrics, the chat API, and mount
points for channel adapters (a platform's webhook, at `/<channel>/...` by convention).

Routes:
  GET  /healthz   200 "ok" while the process is alive (liveness; stays 200 while draining)
  GET  /readyz    200 when ready, else 503 with {"status", "reasons", "components"}
  GET  /metrics   Prometheus text format 0.0.4
  POST /api/chat  {"session", "text"} -> {"session", "reply", "error"}; bearer token
  POST /v1/chat/completions, GET /v1/models  the OpenAI-compatible API
                  (`gateway.http.openai_routes`); bearer tokens of named clients
  anything mounted with `mount()` before `run()`

Invariants (tested in tests/test_http_server.py):
- Without a token the server listens on loopback only (`HttpConfigError` otherwise), and
  /api/chat answers 503 instead of being open.
- Every error the server itself produces is JSON `{"error": "..."}` with a message that
  says what to do; an unexpected exception becomes a 500 and a log line, never a
  traceback in the response.
- Access log lines carry method, path (without the query string), status, duration and
  peer, never a header value: the Authorization header and tokens never reach a log.
- While the gateway is not ready (starting or draining), /api/chat and mounted routes
  answer 503 with Retry-After, so platforms redeliver later instead of losing messages.
- `run()` releases the port however it ends, cancellation included.
- Slow, idle and surplus connections are closed (`gateway.http.limits`); wrong tokens are
  counted per client address and answered 429 past the bound (`gateway.http.throttle`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import anyio
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from anyio.abc import TaskStatus
from loguru import logger
from pydantic import SecretStr

from gateway.http.auth import (
    TOKEN_ENV,
    BearerCheck,
    check_bearer,
    check_bind_policy,
    secret_value,
    www_authenticate,
)
from gateway.http.chat_api import ApiError, parse_chat_request, reply_body
from gateway.http.health import HealthState, Phase
from gateway.http.limits import BodyTimeout, ConnectionLimits, GuardedRunner, body_deadline
from gateway.http.metrics import Metrics
from gateway.http.namespace import CHAT_CALLER
from gateway.http.openai_api import error_body
from gateway.http.openai_routes import (
    COMPLETIONS_PATH,
    MODELS_PATH,
    ApiTokenLike,
    Door,
    OpenAIRoutes,
    api_clients,
)
from gateway.http.throttle import AuthThrottle, client_address, parse_networks
from gateway.messages import InboundMessage, OutboundMessage

ChatHandler = Callable[[InboundMessage], Awaitable[OutboundMessage | None]]

DEFAULT_MAX_BODY_BYTES = 64 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
RETRY_AFTER_SECONDS = "5"

_BUILTIN_PATHS = frozenset(
    {"/healthz", "/readyz", "/metrics", "/api/chat", COMPLETIONS_PATH, MODELS_PATH}
)
_MOUNTABLE_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
# Method names are client-chosen: anything else is counted as "other" to bound the labels.
_KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Probes and scrapes arrive every few seconds: log them at DEBUG to keep the log useful.
_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
_MAX_LOGGED_PATH = 200


class HttpSettingsLike(Protocol):
    """What the server reads from `gateway.config.HTTPSettings`."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def token(self) -> SecretStr | str | None: ...
    @property
    def header_timeout_seconds(self) -> float: ...
    @property
    def body_timeout_seconds(self) -> float: ...
    @property
    def keepalive_timeout_seconds(self) -> float: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def auth_max_failures(self) -> int: ...
    @property
    def auth_failure_window_seconds(self) -> float: ...
    @property
    def trusted_proxies(self) -> Sequence[str]: ...
    @property
    def api_tokens(self) -> Mapping[str, ApiTokenLike]: ...


class HttpBindError(Exception):
    """The server could not listen (port taken, address not on this machine)."""


async def _listen(runner: web.AppRunner, host: str, port: int) -> None:
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        raise HttpBindError(
            f"http: cannot listen on {host}:{port} ({exc.strerror or exc}); "
            "is another gateway running? choose http.host / http.port "
            "(GATEWAY_HTTP__HOST, GATEWAY_HTTP__PORT)"
        ) from None


async def check_listen(host: str, port: int) -> None:
    """Listen on host:port the way `HttpServer.run` does, then let go: HttpBindError
    exactly when `run` would meet one now (what `gateway doctor` checks)."""
    runner = web.AppRunner(web.Application(), handle_signals=False)
    await runner.setup()
    try:
        await _listen(runner, host, port)
    finally:
        await runner.cleanup()


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The one shape of every error the server answers: `{"error": message}`."""
    return web.json_response({"error": message}, status=status, headers=headers)


def edge_error(
    request: web.Request, status: int, message: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error the server answers before (or instead of) a route: in OpenAI's shape under
    `/v1/` (its clients parse nothing else), `json_error`'s elsewhere."""
    if not request.path.startswith("/v1/"):
        return json_error(status, message, headers)
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response(error_body(message, kind), status=status, headers=headers)


def _too_many_failures(retry_after: int) -> str:
    """What a client locked out by `AuthThrottle` is told."""
    return (
        f"too many wrong tokens from your address; try again in {retry_after} s with the right one"
    )


def _loggable_path(request: web.Request) -> str:
    path = request.raw_path.split("?", 1)[0]  # a query string may carry secrets
    path = "".join(char if char.isprintable() else f"\\x{ord(char):02x}" for char in path)
    return path if len(path) <= _MAX_LOGGED_PATH else path[:_MAX_LOGGED_PATH] + "…"


def _route_label(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _formatted_exception(exc: BaseException) -> str:
    # Formatted into the message (no local variables, unlike loguru's diagnose mode) so
    # the log redactor sees all of it.
    return "".join(traceback.format_exception(exc)).rstrip()


class HttpServer:
    """The gateway's HTTP server; see the module doc for its routes and promises."""

    def __init__(
        self,
        settings: HttpSettingsLike,
        *,
        health: HealthState,
        metrics: Metrics,
        chat: ChatHandler | None = None,
        door: Door | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    ) -> None:
        self.host = settings.host
        self.port = settings.port
        self._token = secret_value(settings.token)
        clients = api_clients(self._token, settings.api_tokens)
        check_bind_policy(self.host, self._token or (clients[0].token if clients else None))
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        self.health = health
        self.metrics = metrics
        self._chat = chat
        self.max_body_bytes = max_body_bytes
        self._shutdown_timeout = shutdown_timeout
        self.limits = ConnectionLimits.from_settings(settings)
        self._trusted_proxies = parse_networks(settings.trusted_proxies)
        #: Wrong tokens per client address, for the chat API and the admin page alike.
        self.auth_throttle = AuthThrottle(
            settings.auth_max_failures, settings.auth_failure_window_seconds
        )
        self._started = False
        self.bound_port: int | None = None
        self._mounted: set[tuple[str, str]] = set()
        self.app = web.Application(
            client_max_size=max_body_bytes, middlewares=[self._edge_middleware()]
        )
        router = self.app.router
        router.add_get("/healthz", self._healthz)
        router.add_get("/readyz", self._readyz)
        router.add_get("/metrics", self._metrics)
        router.add_post("/api/chat", self._chat_api)
        self.openai = OpenAIRoutes(self, clients, door)

    # ------------------------------------------------------------------ mounting

    def mount(
        self, method: str, path: str, handler: Handler, *, require_ready: bool = True
    ) -> None:
        """Route `method path` to `handler`, which gets the raw aiohttp request (body
        unread, so a signature over the exact bytes can be checked). Mount before `run()`.

        With `require_ready` (the default) the route answers 503 + Retry-After while the
        gateway is starting or draining, so the platform redelivers later; the body-size
        limit and the access log apply to every mounted route.
        """
        if self._started:
            raise RuntimeError(f"mount {method} {path}: mount routes before run() starts")
        method = method.upper()
        if method not in _MOUNTABLE_METHODS:
            raise ValueError(f"mount: method {method!r} is not one of {sorted(_MOUNTABLE_METHODS)}")
        if not path.startswith("/") or path in _BUILTIN_PATHS:
            raise ValueError(f"mount: path {path!r} must start with / and not be a built-in route")
        if (method, path) in self._mounted:
            raise ValueError(f"mount: {method} {path} is already mounted")
        self.app.router.add_route(method, path, self._gated(handler) if require_ready else handler)
        self._mounted.add((method, path))

    def _gated(self, handler: Handler) -> Handler:
        async def gated(request: web.Request) -> web.StreamResponse:
            if not self.health.accepting:
                return self._not_accepting(request)
            return await handler(request)

        return gated

    def _not_accepting(self, request: web.Request) -> web.Response:
        phase = self.health.phase
        why = "is starting" if phase is Phase.STARTING else "is shutting down"
        return edge_error(
            request,
            503,
            f"the gateway {why}; retry in a few seconds",
            headers={hdrs.RETRY_AFTER: RETRY_AFTER_SECONDS},
        )

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; reports the bound port through `task_status.started`
        (so `http.port = 0` picks a free one) and always releases it on the way out."""
        if self._started:
            raise RuntimeError("HttpServer.run() can only be called once")
        self._started = True
        runner = GuardedRunner(
            self.app,
            self.limits,
            on_drop=self._connection_dropped,
            handle_signals=False,
            access_log=None,  # the edge middleware writes the access log through loguru
            shutdown_timeout=self._shutdown_timeout,
        )
        await runner.setup()
        try:
            await _listen(runner, self.host, self.port)
            self.bound_port = int(runner.addresses[0][1])
            logger.info(
                "http: listening on {}:{} (chat API {})",
                self.host,
                self.bound_port,
                "on" if self._token else f"off until {TOKEN_ENV} is set",
            )
            task_status.started(self.bound_port)
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            if self.bound_port is not None:
                logger.info("http: stopped listening on {}:{}", self.host, self.bound_port)

    def _connection_dropped(self, reason: str) -> None:
        self.metrics.http_connections_dropped.labels(reason).inc()

    # ------------------------------------------------------------------ edge

    def _edge_middleware(self) -> Middleware:
        """The client's address, the body's deadline, access log, request metrics, and
        JSON for every error (see the module doc)."""

        @web.middleware
        async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
            start = time.perf_counter()
            status = 500
            client = client_address(
                request.remote,
                request.headers.getall(hdrs.X_FORWARDED_FOR, []),
                self._trusted_proxies,
            )
            if client is not None and client != request.remote:  # behind a trusted proxy
                request = request.clone(remote=client)
            try:
                with body_deadline(request, self.limits.body_timeout):
                    response = await handler(request)
                status = response.status
                return response
            except BodyTimeout as exc:
                status = 408
                self._connection_dropped("body_timeout")
                response = edge_error(request, 408, f"{exc}; send it faster, or a smaller one")
                response.force_close()
                return response
            except web.HTTPException as exc:
                status = exc.status
                if status < 400:
                    raise
                return self._error_from_http_exception(request, exc)
            except Exception as exc:
                logger.error(
                    "http: {} {} failed:\n{}",
                    request.method,
                    _loggable_path(request),
                    _formatted_exception(exc),
                )
                return edge_error(request, 500, "internal error; the gateway log has the details")
            finally:
                self._record(request, status, time.perf_counter() - start)

        return edge

    def _error_from_http_exception(
        self, request: web.Request, exc: web.HTTPException
    ) -> web.Response:
        headers: dict[str, str] = {}
        if isinstance(exc, web.HTTPMethodNotAllowed):
            allowed = ", ".join(sorted(exc.allowed_methods))
            headers[hdrs.ALLOW] = allowed
            message = f"method {request.method} is not allowed here; use {allowed}"
        elif isinstance(exc, web.HTTPNotFound):
            message = (
                "no such endpoint; see /healthz, /readyz, /metrics, /api/chat, "
                "/v1/chat/completions, /v1/models"
            )
        elif isinstance(exc, web.HTTPRequestEntityTooLarge):
            message = f"request body is over the {self.max_body_bytes}-byte limit"
        else:
            message = exc.reason
        return edge_error(request, exc.status, message, headers=headers)

    def _record(self, request: web.Request, status: int, seconds: float) -> None:
        method = request.method if request.method in _KNOWN_METHODS else "other"
        route = _route_label(request)
        self.metrics.http_requests.labels(method, route, str(status)).inc()
        self.metrics.http_request_seconds.labels(route).observe(seconds)
        path = _loggable_path(request)
        logger.log(
            "DEBUG" if request.path in _QUIET_PATHS and status < 500 else "INFO",
            "http {} {} {} {:.1f}ms {}",
            method,
            path,
            status,
            seconds * 1000,
            request.remote or "-",
        )

    # ------------------------------------------------------------------ routes

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        readiness = self.health.readiness()
        return web.json_response(readiness.as_json(), status=200 if readiness.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = await self.metrics.collect(request.headers.get(hdrs.ACCEPT, ""))
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})

    def bearer_refusal(
        self, request: web.Request, checked: BearerCheck
    ) -> tuple[str, dict[str, str]] | None:
        """None for a good token; else the 401's message and headers (every API route
        says the same). A wrong token counts against the client's address."""
        if checked is BearerCheck.OK:
            return None
        if checked is BearerCheck.INVALID:
            self.auth_throttle.failed(request.remote)
        message = (
            "missing bearer token; send Authorization: Bearer <token>"
            if checked is BearerCheck.MISSING
            else "invalid bearer token"
        )
        return message, {hdrs.WWW_AUTHENTICATE: www_authenticate(checked)}

    async def _chat_api(self, request: web.Request) -> web.Response:
        if self._token is None:
            return json_error(503, f"the chat API is off until a token is set: set {TOKEN_ENV}")
        retry_after = self.auth_throttle.retry_after(request.remote)
        if retry_after is not None:
            return json_error(
                429, _too_many_failures(retry_after), headers={hdrs.RETRY_AFTER: str(retry_after)}
            )
        checked = check_bearer(request.headers.get(hdrs.AUTHORIZATION), self._token)
        refused = self.bearer_refusal(request, checked)
        if refused is not None:
            return json_error(401, refused[0], headers=refused[1])
        if not self.health.accepting:
            return self._not_accepting(request)
        if self._chat is None:
            return json_error(503, "no agent is attached to the chat API in this process")
        if request.content_type != "application/json" or (
            request.charset is not None and request.charset.lower() not in ("utf-8", "utf8")
        ):
            return json_error(415, "send the body as Content-Type: application/json (UTF-8)")
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return json_error(413, f"request body is over the {self.max_body_bytes}-byte limit")
        body = await request.read()  # client_max_size bounds a body without Content-Length
        try:
            # Only the `[http] token` opens /api/chat: the `default` client.
            chat_request = parse_chat_request(body, CHAT_CALLER)
        except ApiError as exc:
            return json_error(exc.status, exc.message)
        with logger.contextualize(session=chat_request.session_key):
            try:
                reply = await self._chat(chat_request.inbound())
            except ApiError as exc:
                retry = {"Retry-After": "1"} if exc.status == 503 else None
                return json_error(exc.status, exc.message, headers=retry)
        return web.json_response(reply_body(chat_request.session_key, reply))
