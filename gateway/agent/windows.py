"""The context window each model is used with: the operator's bound, fitted to what the
model's server says (asked once per model, or read from its overflow error).

With several providers (`gateway.llm.failover`) each provider's window is its own: a
model's window is known per provider (``model@provider``), and a request is fitted to
the window of the provider it goes to first."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
from loguru import logger

from gateway.llm.types import (
    DEFAULT_CONTEXT_WINDOW,
    LLMProvider,
    ServerKind,
    ServerWindow,
    ServerWindowProbe,
    WindowRoutes,
)

#: Where a window read from an overflow error came from, as /status shows it.
OVERFLOW_SOURCE = "the server's overflow error"


@dataclass(frozen=True, slots=True)
class WindowInUse:
    """The window requests to a model are fitted to, where that size came from, and what
    the server said (None: nothing yet)."""

    tokens: int
    source: str
    server: ServerWindow | None = None

    def describe(self) -> str:
        return f"{self.tokens:,} tokens (from {self.source})"


def choose_window(configured: int | None, server: ServerWindow | None) -> WindowInUse:
    """The window to use, given `[llm] context_window` (None: not set) and what the
    server says.

    The server's size wins when nothing is configured, larger than the default or not
    (it is what the server holds); a configured size is an upper bound the operator set,
    so the smaller of the two is used. With neither, the default."""
    if server is None:
        if configured is None:
            return WindowInUse(DEFAULT_CONTEXT_WINDOW, "the default; the server does not say")
        return WindowInUse(configured, "[llm] context_window")
    if configured is None or server.tokens <= configured:
        return WindowInUse(server.tokens, server.source, server)
    return WindowInUse(
        configured, f"[llm] context_window; the server holds {server.tokens:,}", server
    )


def window_probe(provider: LLMProvider) -> Callable[[str], Awaitable[ServerWindow | None]] | None:
    """The provider's way to ask its server for a model's window, if it has one."""
    return provider.server_window if isinstance(provider, ServerWindowProbe) else None


Router = Callable[[str, str | None], str]


def window_routes(provider: LLMProvider) -> Router | None:
    """The provider's names for a model's window per provider, if it has several."""
    return provider.window_key if isinstance(provider, WindowRoutes) else None


class ContextWindows:
    """Which window each model is used with (`choose_window`), per model.

    The promises: asking the server never fails a turn or start-up and never waits
    longer than `timeout` (a server that does not answer is asked again after
    `retry_after` seconds, and the configured or default size is used meanwhile); each
    model's server is asked once, unless what it said was an assumption (Ollama's
    default), which is asked again after the model has answered; what an overflow error
    says replaces what was asked; a configured size larger than the server's is logged
    once per model.

    With `routes` (several providers), "a model" is a model on one provider: each method
    takes the model name and, where it is known, the provider (None: the one a request
    goes to first now)."""

    def __init__(
        self,
        *,
        configured: int | None,
        probe: Callable[[str], Awaitable[ServerWindow | None]] | None,
        routes: Router | None = None,
        timeout: float = 5.0,
        retry_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.configured = configured
        self._probe = probe
        self._routes = routes
        self.timeout = timeout
        self.retry_after = retry_after
        self._clock = clock
        self._said: dict[str, ServerWindow | None] = {}  # model -> what its server said
        self._ask_again: set[str] = set()  # models whose assumed window is asked again
        self._retry_at: dict[str, float] = {}  # model -> when an unanswered ask is due
        self._locks: dict[str, anyio.Lock] = {}
        self._warned: set[str] = set()

    def key(self, model: str, provider: str | None = None) -> str:
        """The name `model`'s window on `provider` is known by (the model's own name
        with a single provider)."""
        return model if self._routes is None else self._routes(model, provider)

    def known(self, model: str, provider: str | None = None) -> WindowInUse:
        """The window for `model` from what is known now (no I/O)."""
        return self._known(self.key(model, provider))

    def _known(self, model: str) -> WindowInUse:
        chosen = choose_window(self.configured, self._said.get(model))
        server = chosen.server
        smaller = server is not None and server.tokens < (self.configured or 0)
        if smaller and server is not None and model not in self._warned:
            self._warned.add(model)
            logger.warning(
                "[llm] context_window is {:,} but {} says {:,} for {}: using {:,}",
                self.configured,
                server.source,
                server.tokens,
                model,
                server.tokens,
            )
        return chosen

    async def ensure(self, model: str, provider: str | None = None) -> WindowInUse:
        """The window for `model`, asking its server first if it was not asked yet (at
        most `timeout` seconds; never raises)."""
        model = self.key(model, provider)
        if self._probe is None or not self._due(model):
            return self._known(model)
        lock = self._locks.setdefault(model, anyio.Lock())
        async with lock:
            if self._due(model):  # another turn may have asked while this one waited
                await self._ask(model, self._probe)
        return self._known(model)

    def learn(
        self, model: str, tokens: int, server: ServerKind | None, provider: str | None = None
    ) -> WindowInUse:
        """Remember the window an overflow error named for `model` (on `provider`)."""
        model = self.key(model, provider)
        said = self._said.get(model)
        kind = server or (said.server if said is not None else None)
        self._said[model] = ServerWindow(tokens, OVERFLOW_SOURCE, kind)
        self._ask_again.discard(model)
        logger.info("{}'s context window is {:,} tokens (from {})", model, tokens, OVERFLOW_SOURCE)
        return self._known(model)

    def answered(self, model: str, provider: str | None = None) -> None:
        """`model` answered (on `provider`): an assumed window (the model was not loaded
        yet) is asked again at the next `ensure`."""
        model = self.key(model, provider)
        said = self._said.get(model)
        if said is not None and not said.settled:
            self._ask_again.add(model)

    def _due(self, model: str) -> bool:
        if model in self._said:
            return model in self._ask_again
        return self._clock() >= self._retry_at.get(model, 0.0)

    async def _ask(
        self, model: str, probe: Callable[[str], Awaitable[ServerWindow | None]]
    ) -> None:
        said: ServerWindow | None = None
        try:
            with anyio.fail_after(self.timeout):
                said = await probe(model)
        except Exception as exc:  # the server's trouble must not cost the turn
            self._retry_at[model] = self._clock() + self.retry_after
            logger.warning(
                "{}'s context window could not be asked of its server ({}); using {}",
                model,
                str(exc) or type(exc).__name__,
                self._known(model).describe(),
            )
            return
        self._ask_again.discard(model)
        previous = self._said.get(model)
        learned = previous is not None and previous.source == OVERFLOW_SOURCE
        if learned and said is not None and not said.settled:
            return  # an assumption does not replace what the server's error said
        self._said[model] = said if said is not None else previous
        logger.info("{}'s context window: {}", model, self._known(model).describe())
