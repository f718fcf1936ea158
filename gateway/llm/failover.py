"""Failover across model providers: each model name has an ordered chain of (provider,
model) routes, and a request goes to the first provider whose circuit breaker lets it.

Which failures move a request on, and which count against the provider (`judge`). A
429 asking to wait less than `long_retry_after` is waited out by the client first; a
longer one is not, and keeps the provider skipped for as long as it asked:

| failure | next provider? | counts against the provider? |
|---|---|---|
| connection refused or reset, time-out, HTTP 5xx, 408, 409 | yes | yes |
| 429 after the client's own retries | yes | yes; a long Retry-After opens it at once |
| 401, 403, 402 or out of credit, a base URL without /v1 | yes | yes |
| 404 for the model (this provider does not have it) | yes | no (the provider answered) |
| the request is longer than the model's window | no: the agent fits it again | no |
| any other 400 | no: it would fail everywhere | no |

The promises:
- a request moves to the next provider only before any of its answer was passed on: a
  streamed answer that has begun is never restarted elsewhere (it fails as cut off);
- a provider whose breaker is open is not asked, unless every provider that could
  answer is open: then the one whose cool-down ends first is asked, so a person is never
  refused without one provider being asked (a single provider works as it did before);
- the answer says which provider gave it (`LLMResponse.provider`), for the usage ledger.

Breakers live in this process: each replica keeps its own (see docs/failover.md).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loguru import logger

from gateway.llm.breaker import BreakerStatus, CircuitBreaker
from gateway.llm.types import (
    ContextOverflow,
    LLMConfigError,
    LLMError,
    LLMMessage,
    LLMProvider,
    LLMResponse,
    ServerWindow,
    ServerWindowProbe,
    StreamDelta,
    ToolSpec,
)
from gateway.telemetry import telemetry

#: The name of the provider `[llm]` itself describes (base_url, api_key).
DEFAULT_PROVIDER = "default"

#: Failure kinds that say "this provider, not this request".
PROVIDER_KINDS = frozenset(
    {"unavailable", "timeout", "rate_limited", "auth", "denied", "quota", "wrong_path"}
)


class Verdict(enum.Enum):
    #: The provider failed: count it, ask the next one.
    PROVIDER = "provider"
    #: The provider answered that it does not have the model: ask the next one.
    MODEL_MISSING = "model_missing"
    #: The request itself is refused; another provider would refuse it too.
    REQUEST = "request"


def judge(error: LLMError) -> Verdict:
    """What a provider's error says (the table in the module docstring). An error that
    does not say its kind (another provider implementation) counts as the provider's."""
    if isinstance(error, ContextOverflow):
        return Verdict.REQUEST
    kinds = set(error.kinds) or {"unavailable"}
    if kinds & PROVIDER_KINDS:
        return Verdict.PROVIDER
    if "not_found" in kinds:
        return Verdict.MODEL_MISSING
    return Verdict.REQUEST


@dataclass(frozen=True, slots=True)
class Route:
    """One way to answer a model name: `provider` asked for `model` (its own name)."""

    provider: str
    model: str


class RouteTable:
    """Which routes answer a model name, in order (a pure policy).

    A name in `aliases` has its own routes (``fast = ["primary:gpt-4o-mini",
    "backup:openai/gpt-4o-mini"]``); any other name goes to every provider of `chain`
    that serves it (a provider's `models`, empty for any), under the same name."""

    def __init__(
        self,
        chain: Sequence[str],
        *,
        aliases: Mapping[str, Sequence[Route]] | None = None,
        serves: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.chain = tuple(chain)
        self.aliases = {name: tuple(routes) for name, routes in (aliases or {}).items()}
        self.serves = {name: frozenset(models) for name, models in (serves or {}).items()}
        used = [*self.chain, *(r.provider for rs in self.aliases.values() for r in rs)]
        #: The providers any model name may go to, in the order first named.
        self.providers = tuple(dict.fromkeys(used))

    def routes(self, name: str) -> tuple[Route, ...]:
        if name in self.aliases:
            return self.aliases[name]
        return tuple(
            Route(provider, name)
            for provider in self.chain
            if not self.serves.get(provider) or name in self.serves[provider]
        )

    def window_key(self, route: Route) -> str:
        """The name a route's context window is known by: the model alone with one
        provider (as before failover existed), ``model@provider`` with several."""
        return route.model if len(self.providers) <= 1 else f"{route.model}@{route.provider}"


class FailoverProvider:
    """An `LLMProvider` over several providers (`RouteTable`), each behind its own
    `CircuitBreaker` (see the module docstring for the rules it keeps)."""

    def __init__(
        self,
        providers: Mapping[str, LLMProvider],
        routes: RouteTable,
        *,
        model: str,
        breakers: Mapping[str, CircuitBreaker],
        long_retry_after: float = 10.0,
    ) -> None:
        """`model` is the default model name; `long_retry_after` the Retry-After from
        which a 429 opens its provider's breaker at once."""
        self.providers = dict(providers)
        self.table = routes
        self.model = model
        self.breakers = dict(breakers)
        self.long_retry_after = long_retry_after

    # -- what people and operators see ---------------------------------------------------

    def statuses(self) -> list[BreakerStatus]:
        """Each provider's breaker, in the order of `RouteTable.providers`."""
        return [self.breakers[name].status() for name in self.table.providers]

    def serves(self, model: str) -> bool:
        """Whether any provider would be asked for `model`."""
        return bool(self.table.routes(model))

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(self.table.aliases)

    # -- context windows -----------------------------------------------------------------

    def window_key(self, model: str, provider: str | None = None) -> str:
        """The name `model`'s context window is known by on `provider`, or (None) on the
        provider a request for it goes to first now (`gateway.agent.windows`)."""
        routes = self.table.routes(model)
        if not routes:
            return model
        chosen = next((r for r in routes if r.provider == provider), None)
        if chosen is None:
            open_ = (r for r in routes if self.breakers[r.provider].would_allow())
            chosen = next(open_, routes[0])
        return self.table.window_key(chosen)

    async def server_window(self, key: str) -> ServerWindow | None:
        """What the server of the route known as `key` (`window_key`) says its window
        is: ``model@provider`` with several providers, the model alone with one."""
        model, at, provider = key.rpartition("@")
        if at and provider in self.providers:
            return await self._probe(Route(provider, model))
        routes = self.table.routes(key)
        return await self._probe(routes[0] if routes else Route(self.table.providers[0], key))

    async def _probe(self, route: Route) -> ServerWindow | None:
        provider = self.providers[route.provider]
        if not isinstance(provider, ServerWindowProbe):
            return None
        return await provider.server_window(route.model)

    # -- calls ---------------------------------------------------------------------------

    def _plan(self, model: str | None) -> tuple[str, tuple[Route, ...]]:
        name = model or self.model
        routes = self.table.routes(name)
        if not routes:
            raise LLMConfigError(
                f"no provider serves model {name!r}: name it in [llm.aliases] or in the "
                "models of a provider in [llm] chain",
                user_message=f"No configured model provider offers {name!r}.",
            )
        return name, routes

    def _last_resort(self, routes: Sequence[Route]) -> Route:
        """Every route's breaker is open: the one whose cool-down ends first."""
        route = min(routes, key=lambda r: self.breakers[r.provider].reopens_in())
        breaker = self.breakers[route.provider]
        breaker.force()
        logger.info("every provider for this model is failing; asking {} anyway", route.provider)
        return route

    def _failed(self, route: Route, error: LLMError) -> Verdict:
        """Settle the breaker after `error`; what it means for the request."""
        breaker = self.breakers[route.provider]
        verdict = judge(error)
        if verdict is Verdict.PROVIDER:
            wait = error.retry_after
            long_wait = wait if wait is not None and wait >= self.long_retry_after else None
            breaker.failure(_short(str(error)), open_for=long_wait)
        else:
            breaker.success()  # it answered: it is up
        return verdict

    async def chat(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> LLMResponse:
        _, routes = self._plan(model)
        errors: list[tuple[Route, LLMError]] = []
        tracing = telemetry()
        for attempt, route in enumerate(_Routes(self, routes), start=1):
            try:
                # One span per provider asked (traced turns show each failover step).
                with tracing.span(
                    "gateway.llm.attempt",
                    {
                        "gen_ai.provider.name": route.provider,
                        "gen_ai.request.model": route.model,
                        "gateway.llm.attempt": attempt,
                    },
                ):
                    response = await self.providers[route.provider].chat(
                        messages,
                        model=route.model,
                        tools=tools,
                        temperature=temperature,
                        max_tokens=max_tokens,
                        tool_choice=tool_choice,
                    )
            except LLMError as exc:
                if self._failed(route, exc) is Verdict.REQUEST:
                    raise _from(route, exc) from None
                errors.append((route, exc))
                continue
            except BaseException:
                self.breakers[route.provider].release()
                raise
            self.breakers[route.provider].success()
            return dataclasses.replace(response, provider=route.provider)
        raise _combined(errors)

    async def stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamDelta]:
        _, routes = self._plan(model)
        errors: list[tuple[Route, LLMError]] = []
        for route in _Routes(self, routes):
            said = False
            try:
                async for delta in self.providers[route.provider].stream(
                    messages,
                    model=route.model,
                    tools=tools,
                    temperature=temperature,
                    max_tokens=max_tokens,
                ):
                    if delta.response is not None:
                        answered = dataclasses.replace(delta.response, provider=route.provider)
                        delta = dataclasses.replace(delta, response=answered)
                    said = said or bool(delta.text)
                    yield delta
            except LLMError as exc:
                verdict = self._failed(route, exc)
                if said or verdict is Verdict.REQUEST:
                    # What the person saw is never continued by another provider.
                    raise _from(route, exc) from None
                errors.append((route, exc))
                continue
            except BaseException:
                self.breakers[route.provider].release()
                raise
            self.breakers[route.provider].success()
            return
        raise _combined(errors)

    async def aclose(self) -> None:
        for provider in self.providers.values():
            await provider.aclose()


class _Routes:
    """The routes a request goes through, decided one at a time: each provider's breaker
    is asked just before it would be (a probe's slot is taken only when it is used), and
    the last resort only when every breaker said no."""

    def __init__(self, failover: FailoverProvider, routes: Sequence[Route]) -> None:
        self._failover = failover
        self._routes = routes

    def __iter__(self) -> Iterator[Route]:
        asked = False
        for route in self._routes:
            if self._failover.breakers[route.provider].allow():
                asked = True
                yield route
        if not asked:
            yield self._failover._last_resort(self._routes)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _from(route: Route, error: LLMError) -> LLMError:
    """`error` as raised to the caller, naming the provider it came from."""
    if isinstance(error, ContextOverflow):
        error.provider = route.provider
    return error


def _combined(errors: Sequence[tuple[Route, LLMError]]) -> LLMError:
    """The error once no provider is left: the only one as it was, or one that names
    each provider's failure (the person's message is theirs when all agree)."""
    if len(errors) == 1:
        return errors[0][1]
    detail = "every provider failed: " + "; ".join(
        f"{route.provider} ({route.model}): {error}" for route, error in errors
    )
    said = {error.user_message for _, error in errors}
    user_message = said.pop() if len(said) == 1 else None
    config = all(isinstance(error, LLMConfigError) for _, error in errors)
    kinds = tuple(dict.fromkeys(kind for _, error in errors for kind in error.kinds))
    waits = [error.retry_after for _, error in errors if error.retry_after is not None]
    return (LLMConfigError if config else LLMError)(
        detail,
        user_message=user_message,
        kinds=kinds,
        retry_after=min(waits) if waits else None,
    )
