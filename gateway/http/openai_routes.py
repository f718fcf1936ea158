"""The OpenAI-compatible routes: `POST /v1/chat/completions` and `GET /v1/models`.

The shapes are `gateway.http.openai_api`'s; the turn is the `Door`'s (the daemon's
`gateway.http.door.AgentDoor`), so these handlers only authenticate, parse, check the
client's view of the conversation and write the answer.

Invariants (tested in tests/test_openai_api.py):
- Every request names its client by its bearer token (`[http] token` is "default", each
  `[http.api_tokens.NAME]` another); every token is compared, in constant time, and a
  wrong one counts against the address like on /api/chat.
- A client reaches only its own sessions, and of those only the names its `sessions`
  prefixes allow (403 otherwise): `gateway.http.namespace.resolve_session` decides.
- A stream starts (status 200, the first event) only once the turn has produced text:
  a refusal found before (queue full, a conflict, a retry of a message still running)
  is still an HTTP error with its status. The turn never waits for a slow reader and
  goes on (and is stored) when the client goes away.
- A stream ends with finish_reason "stop" only when the text it sent is the answer. A
  turn that ends in the gateway's notice after text was sent (the model's stream broke
  off) ends its stream as OpenAI-compatible servers end a failed one: the text sent
  stays, then one error event whose message is the notice, then `data: [DONE]`; no
  finish_reason, no usage chunk. The `openai` client raises `APIError` on it.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import hdrs, web
from loguru import logger
from pydantic import SecretStr

from gateway.http.auth import BearerCheck, bearer_credentials, secret_value
from gateway.http.namespace import (
    DEFAULT_CLIENT,
    Caller,
    Route,
    SessionRefused,
    resolve_session,
    throwaway_session_key,
)
from gateway.http.openai_api import (
    IDEMPOTENCY_HEADER,
    SESSION_HEADER,
    SSE_DONE,
    ClientMessage,
    CompletionRequest,
    OpenAIError,
    chunk_body,
    completion_body,
    error_body,
    history_conflict,
    idempotency_id,
    models_body,
    parse_completion_request,
    sse_event,
    usage_body,
)

if TYPE_CHECKING:
    from gateway.http.health import HealthState
    from gateway.http.throttle import AuthThrottle

COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
#: A response header set on a reply that is the gateway's notice (an error the turn
#: met, a budget used up), not the model's answer.
NOTICE_HEADER = "X-Gateway-Notice"
#: The `code` of the error event that ends a stream whose answer broke off after some of
#: its text was sent.
CUT_OFF_CODE = "answer_cut_off"


@dataclass(frozen=True, slots=True)
class ApiClient:
    """One bearer token of the OpenAI-compatible API and what it may reach."""

    name: str
    token: str
    sessions: tuple[str, ...] = ()

    @property
    def caller(self) -> Caller:
        """Who this token is when it names a session on `/v1`."""
        return Caller(self.name, Route.OPENAI, self.sessions)


class ApiTokenLike(Protocol):
    @property
    def token(self) -> SecretStr | str | None: ...
    @property
    def sessions(self) -> Sequence[str]: ...


def api_clients(token: str | None, named: Mapping[str, ApiTokenLike]) -> list[ApiClient]:
    """The clients: `[http] token` as "default", then each named one that has a token."""
    clients = [ApiClient(DEFAULT_CLIENT, token)] if token else []
    for name, settings in named.items():
        value = secret_value(settings.token)
        if value:
            clients.append(ApiClient(name, value, tuple(settings.sessions)))
    return clients


def find_client(
    authorization: str | None, clients: Sequence[ApiClient]
) -> tuple[BearerCheck, ApiClient | None]:
    """The client whose token the `Authorization` header carries. Every token is
    compared (no early exit), so the time taken does not say which one was close."""
    given = bearer_credentials(authorization)
    if given is None:
        return BearerCheck.MISSING, None
    found = None
    for client in clients:
        if hmac.compare_digest(given, client.token.encode("utf-8")) and found is None:
            found = client
    return (BearerCheck.OK, found) if found is not None else (BearerCheck.INVALID, None)


@dataclass(frozen=True, slots=True)
class DoorTurn:
    """One turn the API asks of the agent."""

    session_key: str
    text: str
    model: str
    message_id: str | None = None
    #: A throwaway session: `earlier` is its history, and nothing of it is kept.
    stateless: bool = False
    earlier: tuple[ClientMessage, ...] = ()


@dataclass(frozen=True, slots=True)
class DoorReply:
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: The gateway's notice (a turn error, a used-up budget), not the model's answer.
    is_notice: bool = False


#: Called with each piece of the reply's text as the model writes it; never blocks.
DeltaSink = Callable[[str], None]


class Door(Protocol):
    """What the routes need of the agent (the daemon's `AgentDoor`)."""

    def models(self) -> list[str]:
        """The model names a request may give."""
        ...

    async def stored_user_texts(self, session_key: str) -> list[str]:
        """The session's user messages on its current branch, oldest first."""
        ...

    async def run(self, turn: DoorTurn, on_delta: DeltaSink | None) -> DoorReply:
        """Run (or, for a retried message id, find) the turn; OpenAIError for a refusal."""
        ...


def _error(exc: OpenAIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


class RouteHost(Protocol):
    """What the routes need of the HTTP server they are added to (`HttpServer`)."""

    app: web.Application
    auth_throttle: AuthThrottle
    health: HealthState
    max_body_bytes: int

    def bearer_refusal(
        self, request: web.Request, checked: BearerCheck
    ) -> tuple[str, dict[str, str]] | None: ...


class OpenAIRoutes:
    """The two routes, on `server`'s app (see the module doc)."""

    def __init__(self, server: RouteHost, clients: Sequence[ApiClient], door: Door | None):
        self.server = server
        self.clients = list(clients)
        self.door = door
        server.app.router.add_post(COMPLETIONS_PATH, self.completions)
        server.app.router.add_get(MODELS_PATH, self.models)

    # ------------------------------------------------------------------ access

    def _client(self, request: web.Request) -> ApiClient:
        """The authenticated client, or OpenAIError (401, 429, 503)."""
        if not self.clients:
            raise OpenAIError(
                503,
                "the OpenAI-compatible API is off until a token is set: set "
                "GATEWAY_HTTP__TOKEN or an [http.api_tokens.NAME] token",
                type="server_error",
                code="api_off",
            )
        throttle = self.server.auth_throttle
        retry_after = throttle.retry_after(request.remote)
        if retry_after is not None:
            raise OpenAIError(
                429,
                f"too many wrong tokens from your address; try again in {retry_after} s",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={hdrs.RETRY_AFTER: str(retry_after)},
            )
        checked, client = find_client(request.headers.get(hdrs.AUTHORIZATION), self.clients)
        refused = self.server.bearer_refusal(request, checked)
        if refused is not None:
            message, headers = refused
            raise OpenAIError(401, message, code="invalid_api_key", headers=headers)
        assert client is not None  # find_client finds one exactly when the check is OK
        if not self.server.health.accepting:
            raise OpenAIError(
                503,
                "the gateway is starting or shutting down; retry in a few seconds",
                type="server_error",
                code="unavailable",
                headers={hdrs.RETRY_AFTER: "5"},
            )
        return client

    def _door(self) -> Door:
        if self.door is None:
            raise OpenAIError(
                503, "no agent is attached to this process", type="server_error", code=None
            )
        return self.door

    # ------------------------------------------------------------------ routes

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._client(request)
            names = self._door().models()
        except OpenAIError as exc:
            return _error(exc)
        return web.json_response(models_body(names, int(time.time())))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            client = self._client(request)
            door = self._door()
            parsed = await self._parse(request)
            if parsed.model not in door.models():
                raise OpenAIError(
                    404,
                    f"the model {parsed.model!r} does not exist here; GET /v1/models lists "
                    "the ones this gateway serves",
                    param="model",
                    code="model_not_found",
                )
            turn = await self._turn(request, client, parsed, door)
        except OpenAIError as exc:
            return _error(exc)
        with logger.contextualize(session=turn.session_key):
            if parsed.stream:
                return await self._stream(request, door, turn, parsed)
            try:
                reply = await door.run(turn, None)
            except OpenAIError as exc:
                return _error(exc)
            body = completion_body(
                _completion_id(),
                int(time.time()),
                parsed.model,
                reply.text,
                usage_body(reply.prompt_tokens, reply.completion_tokens),
            )
            return web.json_response(body, headers=_notice_header(reply))

    async def _parse(self, request: web.Request) -> CompletionRequest:
        if request.content_type != "application/json":
            raise OpenAIError(415, "send the body as Content-Type: application/json")
        limit = self.server.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise OpenAIError(413, f"the request body is over the {limit}-byte limit")
        body = await request.read()
        return parse_completion_request(body, request.headers.get(SESSION_HEADER))

    async def _turn(
        self, request: web.Request, client: ApiClient, parsed: CompletionRequest, door: Door
    ) -> DoorTurn:
        message_id = idempotency_id(request.headers.get(IDEMPOTENCY_HEADER))
        name = parsed.session_name
        if name is None:
            # Stateless: a throwaway session holding the client's own messages; a retry
            # (same Idempotency-Key) finds the same one.
            key = throwaway_session_key(client.caller, message_id or uuid.uuid4().hex)
            return DoorTurn(
                key,
                parsed.text,
                parsed.model,
                message_id,
                stateless=True,
                earlier=parsed.earlier,
            )
        try:
            key = resolve_session(client.caller, name)
        except SessionRefused as exc:
            if exc.status == 403:
                raise OpenAIError(
                    403,
                    exc.message,
                    type="permission_error",
                    param="user",
                    code="session_not_allowed",
                ) from None
            raise OpenAIError(exc.status, exc.message, param="user") from None
        if parsed.earlier:
            conflict = history_conflict(parsed.earlier, await door.stored_user_texts(key))
            if conflict is not None:
                raise OpenAIError(409, conflict, code="conversation_conflict", param="messages")
        return DoorTurn(key, parsed.text, parsed.model, message_id)

    async def _stream(
        self, request: web.Request, door: Door, turn: DoorTurn, parsed: CompletionRequest
    ) -> web.StreamResponse:
        """Server-sent events; see the module doc for when the stream starts."""
        # The turn's deltas, then None once it ends: one queue read per delta, and no
        # task or wait per delta (a streamed reply has hundreds).
        deltas: asyncio.Queue[str | None] = asyncio.Queue()
        run = asyncio.ensure_future(door.run(turn, deltas.put_nowait))
        run.add_done_callback(lambda _: deltas.put_nowait(None))
        completion_id, created = _completion_id(), int(time.time())
        usage_on = parsed.include_usage
        response: web.StreamResponse | None = None
        sent: list[str] = []

        def chunk(delta: dict[str, Any] | None, **kw: Any) -> bytes:
            return sse_event(
                chunk_body(
                    completion_id, created, parsed.model, delta, include_usage=usage_on, **kw
                )
            )

        async def send(text: str, *, notice: bool = False) -> None:
            nonlocal response
            if response is None:
                headers: dict[str, str] = {
                    hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8",
                    hdrs.CACHE_CONTROL: "no-cache",
                }
                if notice:  # the whole reply is the gateway's notice
                    headers[NOTICE_HEADER] = "true"
                response = web.StreamResponse(headers=headers)
                await response.prepare(request)
                await response.write(chunk({"role": "assistant", "content": "", "refusal": None}))
            if text:
                await response.write(chunk({"content": text}))
                sent.append(text)

        try:
            while (text := await deltas.get()) is not None:
                await send(text)
            try:
                reply = run.result()
            except OpenAIError as exc:
                if response is None:
                    return _error(exc)
                return await _end_with_error(response, exc.body())
            streamed = "".join(sent)
            if streamed and reply.is_notice:
                # The text sent is not the answer (the model's stream broke off): a
                # "stop" would pass it for a whole one.
                assert response is not None
                logger.info(
                    "openai api: the streamed answer ended in a notice after {} characters; "
                    "the client gets an error event",
                    len(streamed),
                )
                failed = error_body(reply.text, "server_error", CUT_OFF_CODE)
                return await _end_with_error(response, failed)
            # What was not streamed (no streaming configured, a cached answer, a retried
            # message): the rest of the reply's text, or all of it.
            rest = reply.text[len(streamed) :] if reply.text.startswith(streamed) else ""
            await send(rest, notice=reply.is_notice)
            assert response is not None
            await response.write(chunk({}, finish_reason="stop"))
            if usage_on:
                usage = usage_body(reply.prompt_tokens, reply.completion_tokens)
                await response.write(chunk(None, usage=usage))
            await response.write(SSE_DONE)
            await response.write_eof()
            return response
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # The client went away: the turn goes on in its lane and is stored; a retry
            # with the same Idempotency-Key gets its reply.
            logger.info("openai api: the client left a streamed reply")
            if isinstance(exc, asyncio.CancelledError) or response is None:
                raise
            # aiohttp ends a response whose client is gone quietly; raised, a hang-up
            # would be logged as the gateway's own failure (a 500 and a traceback).
            return response


async def _end_with_error(
    response: web.StreamResponse, error: dict[str, Any]
) -> web.StreamResponse:
    """End a started stream as a failed one: an error event in OpenAI's shape (the
    `openai` client raises `APIError` with its message), then `data: [DONE]`."""
    await response.write(sse_event(error))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _notice_header(reply: DoorReply) -> dict[str, str] | None:
    return {NOTICE_HEADER: "true"} if reply.is_notice else None
