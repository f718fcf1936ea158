"""Builds the gateway's parts from settings and runs them in one anyio task group."""

from __future__ import annotations

import contextlib
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from loguru import logger

from gateway import __version__, failpoints
from gateway.agent import AgentConfig, AgentLoop
from gateway.agent.consolidation import Consolidator
from gateway.agent.memory_tools import memory_tools
from gateway.agent.schedule_tools import Reminders, ScheduleLimits
from gateway.agent.subagents import META_SUBAGENT, SubagentLimits, Subagents
from gateway.agent.tool_outputs import OutputLimits, ToolOutputs
from gateway.agent.tools import ToolRegistry
from gateway.agent.toolset import build_mcp, build_tools
from gateway.agent.windows import ContextWindows, window_probe, window_routes
from gateway.cache import (
    CacheSettings,
    NearDuplicateUnavailable,
    SemanticCache,
    backend_from_url,
)
from gateway.channel import Channel, DeliveryFailed, Ticket, enrich_for_turn, redelivers
from gateway.config import ConfigError, Settings
from gateway.dispatch.queue_modes import QueueModes
from gateway.gcpolicy import GCPolicy
from gateway.journal.protocol import dedupe_key
from gateway.llm.breaker import CircuitBreaker
from gateway.llm.credentials import check_provider_credentials
from gateway.llm.failover import FailoverProvider, Route, RouteTable
from gateway.llm.openai_provider import OpenAIProvider, display_url
from gateway.llm.types import DEFAULT_CONTEXT_WINDOW, LLMProvider
from gateway.media import FileSource
from gateway.media.build import build_media
from gateway.memory.protocol import MemoryBackend
from gateway.messages import (
    META_API_STREAM,
    META_REPLY_WANTED,
    InboundMessage,
    OutboundMessage,
)
from gateway.registry import ChannelServices, installed
from gateway.schedules.protocol import META_SCHEDULE
from gateway.sessions import SessionManager
from gateway.storage.seam import Storage, open_storage
from gateway.storage.workspace import cannot_write, write_denied
from gateway.usage.meter import MeteredProvider, UsageMeter

if TYPE_CHECKING:
    import aiohttp

    from gateway.access.rules import ChannelAccessPolicy
    from gateway.agent.mcp import MCPServers, ServerState
    from gateway.dispatch.lanes import ReplicaRouter, SubmitStatus
    from gateway.http.admin import AdminPage
    from gateway.journal.protocol import DedupeStore
    from gateway.storage.workspace import WorkspaceLock
    from gateway.telemetry import Telemetry


def route_table(settings: Settings) -> RouteTable:
    """Which (provider, model) routes answer each model name (`[llm] chain`, aliases)."""
    llm = settings.llm
    aliases = {
        alias: [Route(provider, model) for provider, model in routes]
        for alias, routes in llm.alias_routes().items()
    }
    serves = {name: p.models for name, p in llm.used_providers().items()}
    return RouteTable(llm.chain, aliases=aliases, serves=serves)


def build_provider(settings: Settings) -> FailoverProvider:
    """Every configured OpenAI-compatible server, each behind its circuit breaker, in
    the failover of `[llm]` (one provider, "default", when nothing more is configured);
    raises LLMConfigError saying what to set."""
    llm = settings.llm
    table = route_table(settings)
    used = llm.used_providers()
    several = len(used) > 1
    providers: dict[str, LLMProvider] = {}
    breakers: dict[str, CircuitBreaker] = {}
    for name, section in used.items():
        api_key = section.resolved_api_key()
        check_provider_credentials(name, section.base_url, api_key)
        # What this provider calls the default model (its fallback after a /model one).
        mine = [r.model for r in table.routes(llm.model) if r.provider == name]
        provider = OpenAIProvider(
            base_url=section.base_url,
            api_key=api_key,
            model=mine[0] if mine else llm.model,
            fallback_models=section.fallback_models,
            timeout=section.timeout or llm.timeout,
            connect_timeout=section.connect_timeout,
            max_retries=llm.max_retries if section.max_retries is None else section.max_retries,
            # Alone, a provider's long Retry-After is waited out as it always was.
            long_retry_after=llm.failover.long_retry_after_seconds if several else None,
            default_temperature=llm.temperature,
            default_max_tokens=llm.max_tokens,
            default_tool_choice=llm.tool_choice,
            # With others to ask, the chain says what comes after a model, not this.
            falls_back_to_model=not several,
            redactor=settings.redactor,
        )
        providers[name] = provider
        breakers[name] = CircuitBreaker(
            name,
            where=display_url(provider.base_url),
            failures_to_open=llm.failover.failures_to_open,
            cooldown=llm.failover.cooldown_seconds,
        )
    return FailoverProvider(
        providers,
        table,
        model=llm.model,
        breakers=breakers,
        long_retry_after=llm.failover.long_retry_after_seconds,
    )


#: Empty session files a gateway keeps ready, so a new conversation's first message is
#: not held up by the file system creating a file (`gateway.sessions.spares`).
SPARE_FILES = 64


async def wait_for_storage(storage: Storage, *, max_backoff: float = 30.0) -> bool:
    """Before a gateway starts: open its storage (for PostgreSQL: connect, and migrate),
    retrying with backoff while the database does not answer, with one log line saying
    what it waits for. Meanwhile the HTTP port answers /healthz 200 and /readyz 503, so
    an orchestrator sees a live process that is not ready. False when a signal stopped
    the wait; True at once when there is nothing to wait for (files, or open already)."""
    if storage.connected():
        return True
    from aiohttp import web

    from gateway.http.limits import ConnectionLimits, GuardedRunner
    from gateway.plumbing.postgres import StorageUnavailable

    settings = storage.settings
    reason = ["starting"]

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        body = {"status": "starting", "waiting_for": storage.kind, "reason": reason[0]}
        return web.json_response(body, status=503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    # The same bounds on slow and idle connections as the gateway's own server.
    runner = GuardedRunner(app, ConnectionLimits.from_settings(settings.http), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http.host, settings.http.port)
    with contextlib.suppress(OSError):  # the port is taken: `run` says so clearly later
        await site.start()
    stopped = anyio.Event()

    async def on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stopped.set()
                return

    backoff = 1.0
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(on_signal)
            while True:
                try:
                    await anyio.to_thread.run_sync(storage.connect)
                    break
                except StorageUnavailable as exc:
                    if reason[0] == "starting":
                        logger.error(
                            "storage: waiting for {} at {} ({}); retrying with backoff "
                            "up to every {:g}s, /readyz answers 503 meanwhile",
                            storage.title,
                            storage.where(),
                            exc,
                            max_backoff,
                        )
                    reason[0] = str(exc)
                with anyio.move_on_after(backoff):
                    await stopped.wait()
                if stopped.is_set():
                    break
                backoff = min(backoff * 2, max_backoff)
            tg.cancel_scope.cancel()
    finally:
        await runner.cleanup()
    if stopped.is_set():
        return False
    if reason[0] != "starting":
        logger.info("storage: {} at {} answers; starting", storage.title, storage.where())
    return True


def build_usage_meter(storage: Storage) -> UsageMeter:
    """Token usage totals with their prices and budgets, in the storage's ledger (in the
    shared mode a budget holds across replicas)."""
    from gateway.usage.meter import Budgets, Price, PriceTable

    settings = storage.settings
    section = settings.usage
    ledger = storage.usage_ledger()
    prices = {
        name: Price(p.prompt, p.completion, p.per_minute) for name, p in section.prices.items()
    }
    by_provider = {
        provider: {name: Price(p.prompt, p.completion, p.per_minute) for name, p in own.items()}
        for provider, own in ((n, s.prices) for n, s in settings.llm.providers.items())
        if own
    }
    budgets = Budgets(section.conversation_tokens_per_day, section.tokens_per_day)
    return UsageMeter(ledger, PriceTable(prices, by_provider), budgets)


def agent_config(settings: Settings) -> AgentConfig:
    return AgentConfig(
        model=settings.llm.model,
        system_prompt=settings.agent.system_prompt,
        memory_window=settings.agent.memory_window,
        max_tool_iterations=settings.agent.max_tool_iterations,
        context_window=settings.llm.context_window,
        reply_reserve_tokens=settings.agent.reply_reserve_tokens,
        max_message_chars=settings.agent.max_message_chars,
        temperature=settings.llm.temperature,
        max_tokens=settings.llm.max_tokens,
        stream=settings.llm.stream,
        owners=frozenset(settings.agent.owners),
        cache_disabled_channels=frozenset(settings.cache.disabled_channels),
        auto_consolidate=settings.memory.auto_consolidate,
        memory_recall_wait=settings.memory.recall_wait_seconds,
        offline_after=settings.agent.offline_after_seconds,
        code_block_file_chars=settings.media.code_block_file_chars,
        queue_modes=QueueModes(settings.dispatch.mode, dict(settings.dispatch.channel_modes)),
    )


def build_tool_outputs(
    settings: Settings, sessions: SessionManager, tools: ToolRegistry
) -> ToolOutputs | None:
    """Big tool results stored whole beside the sessions (`[agent] tool_output_*`), or
    None when that is off or the model is offered no tool at all: a gateway set up for a
    model without tool calling is not offered the two tools that read them."""
    section = settings.agent
    if not section.tool_output_inline_chars:
        return None
    if not (
        tools.names()
        or settings.mcp.servers
        or settings.subagents.enabled
        or settings.schedules.enabled
    ):
        return None
    limits = OutputLimits(
        inline_chars=section.tool_output_inline_chars,
        preview_chars=section.tool_output_preview_chars,
        read_chars=section.tool_output_read_chars,
        max_chars=section.tool_output_max_chars,
    )
    return ToolOutputs(sessions.outputs, limits)


def build_cache(settings: Settings) -> SemanticCache | None:
    """The response cache, or None when disabled. SQLite in the workspace by default."""
    section = settings.cache
    if not section.enabled:
        return None
    url = section.url or str(settings.workspace_path / "cache.sqlite")
    try:
        backend = backend_from_url(url, namespace=section.namespace, io_on_loop=settings.io_on_loop)
        cache_settings = CacheSettings(
            enabled=True,
            ttl_seconds=section.ttl_seconds,
            max_entries=section.max_entries,
            max_temperature=section.max_temperature,
            near_duplicates=section.near_duplicates,
            near_duplicate_model=section.near_duplicate_model,
            near_duplicate_threshold=section.near_duplicate_threshold,
            near_duplicate_max_error=section.near_duplicate_max_error,
        )
        try:
            return SemanticCache(backend, cache_settings)
        except NearDuplicateUnavailable as exc:
            # The semantic layer is optional: without its model the cache still answers
            # exact repeats, and says why it does no more.
            logger.warning("cache: {}; matching exact questions only", exc)
            return SemanticCache(backend, replace(cache_settings, near_duplicates=False))
    except OSError as exc:
        if write_denied(exc):
            raise cannot_write(exc.filename or url, exc) from None
        raise ConfigError(f"cache: {exc}") from None
    except (ValueError, ImportError) as exc:
        raise ConfigError(f"cache: {exc}") from None


def build_memory(
    storage: Storage,
    sessions: SessionManager,
    provider: LLMProvider,
    windows: ContextWindows | None = None,
) -> tuple[MemoryBackend | None, Consolidator | None]:
    """The memory store and, with auto_consolidate, its background consolidator (its
    requests fitted to `windows`, the agent's context windows)."""
    settings = storage.settings
    section = settings.memory
    if not section.enabled:
        return None, None
    memory = storage.memory()
    consolidator = Consolidator(
        sessions,
        memory,
        provider,
        model=settings.llm.model,
        consolidation_model=section.consolidation_model,
        memory_window=settings.agent.memory_window,
        context_window=settings.llm.context_window or DEFAULT_CONTEXT_WINDOW,
        token_share=section.token_share,
        timeout=section.consolidation_timeout,
        retry_base=section.retry_base_seconds,
        retry_max=section.retry_max_seconds,
        guard=storage.consolidation_guard(),
        windows=windows,
    )
    return memory, consolidator


def build_subagents(settings: Settings, agent: AgentLoop) -> Subagents | None:
    """The spawn tool, registered with the agent's tools, when `[subagents]` is on."""
    section = settings.subagents
    if not section.enabled:
        return None
    subagents = Subagents(
        agent,
        SubagentLimits(
            max_depth=section.max_depth,
            max_concurrent=section.max_concurrent,
            token_budget=section.token_budget,
            timeout_seconds=section.timeout_seconds,
        ),
    )
    agent.tools.register(subagents.tool(), group="subagents")
    return subagents


def build_reminders(storage: Storage, agent: AgentLoop) -> Reminders | None:
    """The schedule tools, registered with the agent's tools, when `[schedules]` is on."""
    section = storage.settings.schedules
    if not section.enabled:
        return None
    reminders = Reminders(
        storage.jobs(),
        ScheduleLimits(
            timezone=section.timezone,
            max_per_conversation=section.max_per_conversation,
            max_late=timedelta(seconds=section.max_late_seconds),
            min_interval=timedelta(seconds=section.min_interval_seconds),
            max_runs_per_day=section.max_runs_per_day,
        ),
    )
    for tool in reminders.tools():
        agent.tools.register(tool, group="schedules")
    return reminders


@dataclass
class Gateway:
    """The assembled parts. The agent holds them; the properties name them."""

    settings: Settings
    agent: AgentLoop
    #: Where every store of the mode chosen at start comes from.
    storage: Storage
    subagents: Subagents | None = None
    reminders: Reminders | None = None
    #: The MCP servers whose tools the agent offers (None: none configured).
    mcp: MCPServers | None = None
    closed: bool = field(default=False, init=False)

    @property
    def sessions(self) -> SessionManager:
        return self.agent.sessions

    @property
    def provider(self) -> LLMProvider:
        return self.agent.provider

    @property
    def cache(self) -> SemanticCache | None:
        return self.agent.cache

    @property
    def memory(self) -> MemoryBackend | None:
        return self.agent.memory

    @property
    def consolidator(self) -> Consolidator | None:
        return self.agent.consolidator

    @classmethod
    def build(cls, settings: Settings) -> Gateway:
        storage = open_storage(settings)
        tools = build_tools(settings)
        mcp = build_mcp(settings, tools)
        sessions = storage.sessions(spare_files=SPARE_FILES)
        usage = build_usage_meter(storage)
        # Every model call (turns, heartbeats, consolidation) is counted at this one seam.
        provider: LLMProvider = MeteredProvider(build_provider(settings), usage)
        # Which context window each model is used with: one view for turns and upkeep.
        windows = ContextWindows(
            configured=settings.llm.context_window,
            probe=window_probe(provider),
            routes=window_routes(provider),
        )
        cache = build_cache(settings)
        memory, consolidator = build_memory(storage, sessions, provider, windows)
        if memory is not None:
            for tool in memory_tools(memory, cache):
                tools.register(tool)
        agent = AgentLoop(
            sessions=sessions,
            provider=provider,
            config=agent_config(settings),
            tools=tools,
            cache=cache,
            memory=memory,
            consolidator=consolidator,
            usage=usage,
            people=storage.people() if settings.memory.scope == "person" else None,
            media=build_media(settings, usage),
            windows=windows,
            outputs=build_tool_outputs(settings, sessions, tools),
        )
        return cls(
            settings=settings,
            agent=agent,
            storage=storage,
            subagents=build_subagents(settings, agent),
            reminders=build_reminders(storage, agent),
            mcp=mcp,
        )

    async def run_services(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Background work every mode needs (memory consolidation), until cancelled.
        The model's server is asked its context window meanwhile, so the first turn
        rarely waits for it (it never fails start-up)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.agent.windows.ensure, self.settings.llm.model)
            if self.cache is not None:
                # The near-duplicate model's one-time build and load, off any turn,
                # and the labels of explored candidates, compared off the turns too.
                tg.start_soon(self.cache.warm_up)
                await tg.start(self.cache.run)
            if self.consolidator is not None:
                await tg.start(self.consolidator.run)
            if self.subagents is not None:
                await tg.start(self.subagents.run)
            if self.mcp is not None:
                # Each server has come up or failed once before the first turn.
                await tg.start(self.mcp.run)
            task_status.started()

    async def aclose(self, *, grace: float = 10.0) -> None:
        """Finish background work (bounded by `grace`), then release everything.
        Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self.consolidator is not None:
            await self.consolidator.drain(grace)
            await self.consolidator.aclose()
        if self.memory is not None:
            await anyio.to_thread.run_sync(self.memory.close)
        await self.provider.aclose()
        if self.agent.media is not None:
            await self.agent.media.aclose()
        if self.cache is not None:
            await self.cache.aclose()
        await anyio.to_thread.run_sync(self.sessions.close)
        if self.agent.usage is not None:
            await anyio.to_thread.run_sync(self.agent.usage.ledger.close)


#: Channels whose senders are the operator (terminal, scheduled jobs) or are already
#: authenticated (the HTTP API's bearer token): no pairing, no allowlist.
TRUSTED_CHANNELS = frozenset({"cli", "system", "api"})


def access_policies(settings: Settings) -> dict[str, ChannelAccessPolicy]:
    """One access policy per installed chat platform, from its `[channels.NAME]` section
    as its spec reads it (`ChannelSpec.access`)."""
    specs = installed().specs
    return {
        name: specs[name].access(section) for name, section in settings.channels.platforms().items()
    }


def _joins_turns(agent: AgentLoop) -> Callable[[InboundMessage], bool]:
    """What may join another message's turn (collect, steer, interrupt): what the agent
    would run as a plain turn (`AgentLoop.may_join`), but no message the gateway made
    itself (a reminder firing, a subagent's result): each of those is a turn of its own."""

    def joins(message: InboundMessage) -> bool:
        made = message.metadata.get(META_SCHEDULE) or message.metadata.get(META_SUBAGENT)
        return not made and agent.may_join(message)

    return joins


def _is_stop(message: InboundMessage) -> bool:
    """/stop bypasses its session's lane: it must reach the turn it stops."""
    from gateway.agent.commands import is_stop_command

    return is_stop_command(message.text)


#: The chat API's answers (503 + Retry-After) to a message it has no reply for yet: one
#: still being answered (a client's retry), and one it did not take in.
STILL_RUNNING_TEXT = (
    "this message (same id) is still being answered; send it again to get its reply"
)
RETRY_LATER_TEXT = (
    "the message was not taken in yet (another replica is taking it in); send it again "
    "with the same id"
)


class Daemon:
    """`gateway run`: every part in one anyio task group on asyncio.

    The HTTP server (probes, metrics, chat API, webhooks), the dispatcher, background
    services and the enabled channels. A channel that crashes is restarted with backoff
    and reported unhealthy meanwhile; it never takes the process down. SIGTERM or
    SIGINT (or the end of the terminal chat) stops intake, lets in-flight turns finish
    within `dispatch.drain_grace_seconds`, flushes, and returns 0.
    """

    BACKOFF_MAX = 60.0
    CHANNEL_WAIT = 30.0
    #: Seconds between two checks that sessions can be written and the cache answers.
    STORAGE_CHECK_INTERVAL = 5.0
    #: Seconds between two checks that the model server answers, and each one's bound.
    MODEL_CHECK_INTERVAL = 30.0
    MODEL_CHECK_TIMEOUT = 3.0

    def __init__(
        self,
        gateway: Gateway,
        *,
        interactive: bool | None = None,
        lock: WorkspaceLock | None = None,
    ) -> None:
        from gateway.access.policy import AccessGate
        from gateway.dispatch.dispatcher import Dispatcher
        from gateway.http import HealthState, HttpServer
        from gateway.http.metrics import Metrics

        self.gateway = gateway
        self.lock = lock
        settings = gateway.settings
        self.health = HealthState(redactor=settings.redactor)
        self.metrics = Metrics(version=__version__, redactor=settings.redactor)
        if gateway.agent.usage is not None:
            gateway.agent.usage.on_record(self.metrics.observe_usage)
        self.gc_policy = GCPolicy()
        storage = gateway.storage
        usage = gateway.agent.usage
        self.dedupe: DedupeStore = storage.journal(
            ttl=settings.dispatch.dedupe_ttl_seconds,
            sessions=gateway.sessions,
            usage=usage.ledger if usage is not None else None,
        )
        self.pairing = storage.pairing()
        self.access = AccessGate(access_policies(settings), self.pairing, trusted=TRUSTED_CHANNELS)
        self.dispatcher = Dispatcher(
            self._handle,
            self.deliver,
            max_concurrent_turns=settings.dispatch.max_concurrent_turns,
            max_queue_per_lane=settings.dispatch.max_queue_per_lane,
            max_queued_total=settings.dispatch.max_queued_total,
            mode=settings.dispatch.mode,
            mode_for=gateway.agent.queue_mode,
            joinable=_joins_turns(gateway.agent),
            dedupe=self.dedupe,
            access=self.access,
            on_turn_done=self._turn_done,
            deliver_timeout=settings.dispatch.deliver_timeout_seconds,
            redeliver_window=settings.dispatch.redeliver_window_seconds,
            urgent=_is_stop,
            redelivers=self._redelivers,
        )
        self.router: ReplicaRouter | None = storage.router(self.dispatcher)
        if self.router is not None:
            self.dispatcher.router = self.router
            # /stop reaches the turn wherever it runs.
            self.router.on_stop = gateway.agent.stop
            gateway.agent.stop_elsewhere = self.router.stop_elsewhere
        from gateway.http.door import AgentDoor

        #: The tracer `run` installs (None: the one `[telemetry]` describes).
        self.telemetry: Telemetry | None = None
        #: Where the text deltas of a streamed OpenAI-API reply go, by stream id.
        self.api_streams: dict[str, Callable[[str], None]] = {}
        self.door = AgentDoor(gateway.agent, settings.llm, self.api_turn, self.api_streams)
        self.http = HttpServer(
            settings.http,
            health=self.health,
            metrics=self.metrics,
            chat=self._api_chat,
            door=self.door,
        )
        self.admin = self._admin_page()
        self.channels: dict[str, Channel] = {}
        self._stop = anyio.Event()
        if gateway.subagents is not None:
            gateway.subagents.submit = self.submit  # background results come back here
        self._watch_metrics()
        self._watch_mcp()
        cli = settings.channels.cli
        if interactive is None:
            interactive = cli.enabled and sys.stdin.isatty()
        self.interactive = interactive
        if interactive:
            from channels.cli import CLIChannel

            self.add_channel(CLIChannel(session_key=cli.session))
        if settings.heartbeat.jobs:
            self.add_channel(self._heartbeat_channel())
            for job, target in settings.undeliverable_heartbeats():
                logger.warning(
                    "heartbeat job {} delivers to {}, whose channel is not enabled: "
                    "its replies only reach this log",
                    job,
                    target,
                )
        if gateway.reminders is not None:
            from channels.schedules import ScheduleRunner

            self.add_channel(ScheduleRunner(gateway.reminders))
        self._add_platforms()

    # ----------------------------------------------------------------- assembly

    def add_channel(self, channel: Channel) -> None:
        if channel.name in self.channels:
            raise ValueError(f"channel {channel.name!r} is added twice")
        self.channels[channel.name] = channel
        self.health.component(channel.name)

    def _say_where(self, port: int) -> None:
        """The terminal chat's first line: where the HTTP port and the admin page are (a
        person at `gateway run` sees no INFO log)."""
        from channels.cli import CLIChannel

        cli = self.channels.get("cli")
        if not isinstance(cli, CLIChannel):
            return
        url = f"http://{self.gateway.settings.http.host}:{port}"
        admin = (
            f"{url}/admin"
            if self.admin.keys is not None
            else "off until GATEWAY_HTTP__TOKEN (or GATEWAY_HTTP__ADMIN_TOKEN) is set"
        )
        cli.serving = f"HTTP: {url} (health, metrics, chat API); admin page: {admin}"

    def _admin_page(self) -> AdminPage:
        """The operator's page under /admin, on the stores this daemon runs on."""
        from gateway.http.admin import AdminPage, AdminSources, TurnWindow
        from gateway.http.auth import secret_value

        settings = self.gateway.settings
        sources = AdminSources(
            health=self.health,
            sessions=self.gateway.sessions,
            pairing=self.pairing,
            pairing_channels=tuple(sorted(self.access.policies)),
            memory=self.gateway.memory,
            cache=self.gateway.cache,
            deliver=self.deliver,
            turns=TurnWindow(),
            dispatcher_stats=self.dispatcher.stats,
            llm_errors=self.gateway.agent.llm_errors,
            providers=getattr(self.gateway.provider, "statuses", None),
            storage=self.gateway.storage.describe(),
        )
        token = secret_value(settings.http.admin_token) or secret_value(settings.http.token)
        page = AdminPage(token, sources, settings.redactor)
        page.mount(self.http)
        return page

    def _add_platforms(self) -> None:
        """Build every enabled chat platform from its spec (`gateway.registry`). One that
        cannot be built (its library is missing, its package is broken, its settings are
        incomplete) is one logged line and a failed, not required, component of /readyz:
        the others run."""
        settings = self.gateway.settings
        registry = installed()
        for spec in registry.specs.values():
            failpoints.declare(spec.failpoints)
        failpoints.check_armed()
        unusable = settings.channels.unusable()
        for name, section in settings.channels.platforms().items():
            spec = registry.specs[name]
            if not spec.enabled(section):
                continue
            problem = unusable.get(name)
            if problem is None:
                try:
                    channel = spec.build(section, self._services(name))
                except ConfigError as exc:
                    problem = str(exc)
                except Exception as exc:
                    problem = (
                        f"channels.{name}: {spec.distribution} failed to build the channel "
                        f"({type(exc).__name__}: {exc}); see its documentation: {spec.docs}"
                    )
                else:
                    self.add_channel(channel)
                    continue
            self._unusable(name, problem)
        for name, broken in registry.broken.items():
            if name in unusable:
                self._unusable(name, unusable[name])
            else:
                logger.warning(
                    "{} (it has no section here: nothing else is affected)", broken.line()
                )

    def _unusable(self, name: str, problem: str) -> None:
        logger.error("{}", problem)
        component = self.health.component(name, required=False)
        component.healthy(False, problem, fix=problem.rpartition("; ")[2])

    def _services(self, name: str) -> ChannelServices:
        """What channel `name`'s spec may use to build it."""
        admin = self.admin

        class Admin:
            def undeliverable(self, source: Callable[[], Awaitable[list[Any]]]) -> None:
                admin.sources.add_undeliverable(source)

        return ChannelServices(
            http=self.http,
            storage=self.gateway.storage,
            metrics=self.metrics.for_channel(name),
            admin=Admin(),
            access_check=self.access.check,
            replicas=self.router is not None,
        )

    def _heartbeat_channel(self) -> Channel:
        from channels.heartbeat import HeartbeatChannel, HeartbeatJob
        from gateway.schedules.runs import STATE_FILE
        from gateway.schedules.schedule import Schedule

        workspace = self.gateway.settings.workspace_path
        jobs = {
            name: HeartbeatJob(
                name=name,
                schedule=Schedule.build(
                    every=job.every,
                    cron=job.cron,
                    timezone=job.timezone,
                    active_hours=job.active_hours,
                ),
                prompt=job.prompt,
                prompt_file=workspace / job.prompt_file if job.prompt_file else None,
                deliver_to=job.deliver_to,
                ok_token=job.ok_token,
            )
            for name, job in self.gateway.settings.heartbeat.jobs.items()
        }
        return HeartbeatChannel(
            jobs,
            state_path=workspace / STATE_FILE,
            route=self.deliver,
            state=self.gateway.storage.heartbeat_runs(),
        )

    def _watch_mcp(self) -> None:
        """Each MCP server is a component of /readyz: shown, not required (a dead tool
        server makes answers poorer, it does not stop them)."""
        mcp = self.gateway.mcp
        if mcp is None:
            return
        components = {
            name: self.health.component(f"mcp:{name}", required=False) for name in mcp.connections
        }

        def report(name: str, state: ServerState) -> None:
            fix = (
                "" if state.up else f"see `gateway doctor` and {mcp.connections[name].stderr_path}"
            )
            components[name].healthy(state.up, state.detail, fix=fix)

        mcp.observe(report)

    def _watch_metrics(self) -> None:
        metrics = self.metrics
        if self.gateway.cache is not None:
            metrics.watch_cache(self.gateway.cache)
            metrics.watch_near_duplicates(self.gateway.cache)
        metrics.queue_depth.set_function(lambda: self.dispatcher.stats().queued_total)
        metrics.inflight_turns.set_function(lambda: self.dispatcher.stats().in_flight)
        statuses = getattr(self.gateway.provider, "statuses", None)  # the failover's
        if statuses is not None:
            metrics.mirror_providers(statuses())

        async def refresh_counters() -> None:
            stats = self.dispatcher.stats()
            metrics.mirror_drops(
                "all",
                {
                    "lane_full": stats.dropped_full,
                    "draining": stats.rejected_draining,
                    "access_denied": stats.denied,
                },
            )
            metrics.duplicates.set_total(stats.duplicates, "all")
            for kind, count in self.gateway.agent.llm_errors.items():
                metrics.llm_errors.set_total(count, kind)
            metrics.memory_search_incomplete.set_total(self.gateway.agent.incomplete_recalls)
            if statuses is not None:
                metrics.mirror_providers(statuses())
            consolidator = self.gateway.consolidator
            if consolidator is not None:
                done = consolidator.stats
                metrics.consolidations.set_total(done.compactions, "ok")
                metrics.consolidations.set_total(done.failures, "failed")
                metrics.consolidations.set_total(done.skipped, "skipped")

        metrics.on_scrape("dispatcher", refresh_counters)

    async def _handle(self, message: InboundMessage) -> OutboundMessage:
        """One turn; with streaming on, text deltas go to channels that can show them.

        What a person is sent (the reply, its streamed deltas, a notice) has every
        configured secret replaced (`Redactor.redact_configured`): a model that read one
        in a tool's output must not hand it on. The reply is redacted before the
        dispatcher records it in the outbox."""
        agent = self.gateway.agent
        hide = self.gateway.settings.redactor.redact_configured
        channel = self.channels.get(message.channel)
        files = channel if isinstance(channel, FileSource) else None
        message = await enrich_for_turn(channel, message)
        shown = getattr(channel, "notice", None)
        on_notice = None
        if shown is not None:

            async def on_notice(text: str) -> None:
                await shown(message, hide(text))

        sink = self.api_streams.get(str(message.metadata.get(META_API_STREAM)))
        stream_delta = getattr(channel, "stream_delta", None)
        if sink is not None and agent.config.stream:
            # An OpenAI-API client reading the reply as it is written (never blocks).

            async def to_client(text: str) -> None:
                sink(hide(text))

            reply = await agent.handle(message, on_delta=to_client, files=files)
        elif stream_delta is None or not agent.config.stream:
            reply = await agent.handle(message, files=files, on_notice=on_notice)
        else:

            async def on_delta(text: str) -> None:
                await stream_delta(message, hide(text))

            reply = await agent.handle(message, on_delta=on_delta, files=files, on_notice=on_notice)
        text = hide(reply.text)
        return reply if text == reply.text else replace(reply, text=text)

    def _turn_done(self, reply: OutboundMessage, seconds: float) -> None:
        self.metrics.observe_turn(reply, seconds)
        self.admin.sources.turns.record(reply, seconds)

    # ----------------------------------------------------------------- routing

    async def submit(self, message: InboundMessage) -> Ticket:
        """What every channel calls. The dispatcher checks access in the message's lane:
        a stranger's message never reaches the LLM (it is ignored, or answered with a
        refusal or a pairing code), and one sender's messages keep their order."""
        return await self.dispatcher.submit(message)

    async def _api_chat(self, message: InboundMessage) -> OutboundMessage | None:
        _, reply = await self.api_turn(message)
        return reply

    async def api_turn(
        self, message: InboundMessage
    ) -> tuple[SubmitStatus, OutboundMessage | None]:
        """An HTTP API's message (/api/chat, /v1/chat/completions): its submit status and
        its reply. ApiError(503) when it was not taken in, or is a retry of one still
        being answered (the client must send it again)."""
        # Its sender waits on the request: a full queue may refuse it (429), which loses
        # nothing, where a platform's message is never refused.
        message = replace(message, metadata={**message.metadata, META_REPLY_WANTED: True})
        if self.router is not None:
            # Shared mode: journaled like a platform message, so whichever replica holds
            # the session runs it; the reply comes back here.
            message = replace(message, message_id=message.message_id or uuid.uuid4().hex)
        ticket = await self.dispatcher.submit(message)
        from gateway.dispatch.lanes import SubmitStatus
        from gateway.http.chat_api import ApiError

        if ticket.status is SubmitStatus.RETRY_LATER:
            # Not taken: another replica holds the claim and has not journaled it (or it
            # died doing so). Like a platform, the client must send it again; an answer
            # of "no reply" here would tell it the message was handled.
            raise ApiError(503, RETRY_LATER_TEXT)
        if self.router is not None and ticket.status is SubmitStatus.DUPLICATE:
            # A client's retry (same "id") of a message taken in already, perhaps by a
            # replica that died since: the reply of its one turn, when it comes.
            key = dedupe_key(message)
            if key is not None:
                with anyio.move_on_after(self.gateway.settings.llm.timeout * 3):
                    return ticket.status, await self.router.wait_reply(key)
            # Still running (or its replica died and another has not resumed it yet):
            # "no reply" would tell the client it was handled; it must ask again.
            raise ApiError(503, STILL_RUNNING_TEXT)
        reply = await ticket.reply()
        return ticket.status, reply

    async def deliver(self, message: OutboundMessage) -> None:
        """Route a reply to its channel. API replies are returned by the HTTP handler."""
        if message.channel == "api":
            return
        channel = self.channels.get(message.channel)
        if channel is None:
            logger.warning(
                "reply for {} dropped: channel {!r} is not enabled",
                message.session_key,
                message.channel,
            )
            return
        await self._channel_up(message.channel)
        try:
            await channel.send(message)
        except DeliveryFailed:
            raise  # the dispatcher sends it again
        except Exception:
            logger.exception("delivery to {} failed", message.channel)

    async def _channel_up(self, name: str) -> None:
        """Wait (at most `CHANNEL_WAIT` seconds) until channel `name` reports healthy: a
        reply made while its channel starts or reconnects is sent once it is back."""
        with anyio.move_on_after(self.CHANNEL_WAIT):
            while True:
                status = self.health.readiness().components.get(name)
                if status is None or status.healthy:
                    return
                await anyio.sleep(0.05)

    # ----------------------------------------------------------------- running

    def stop(self) -> None:
        """Ask for a graceful stop (what SIGTERM does)."""
        self._stop.set()

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> int:
        """Serve until stopped; returns the exit code. Reports the HTTP port to
        `task_status` once everything is up. Signals are watched until the very end,
        so a Ctrl-C during shutdown is handled like one before it, never raised."""
        from gateway.telemetry import from_settings, install

        settings = self.gateway.settings
        tracing = self.telemetry or from_settings(settings.telemetry, redactor=settings.redactor)
        previous = install(tracing)
        try:
            async with anyio.create_task_group() as signals:
                await signals.start(self._watch_signals)
                try:
                    await self._serve(task_status)
                finally:
                    signals.cancel_scope.cancel()
        finally:
            install(previous)
            if tracing.enabled:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(tracing.shutdown)
        logger.info("gateway stopped")
        return 0

    async def _serve(self, task_status: anyio.abc.TaskStatus[int]) -> None:
        self.health.set_starting()
        try:
            async with anyio.create_task_group() as tg:
                port = await tg.start(self.http.run)
                self._say_where(port)
                await tg.start(self.dispatcher.run)
                await tg.start(self.gateway.run_services)
                await tg.start(self._check_storage)
                tg.start_soon(self._check_model)
                beats = getattr(self.dedupe, "run_beats", None)
                if beats is not None:  # a replica tells the others it is alive
                    tg.start_soon(beats)
                if self.router is not None:
                    # Shared mode: sessions left by this or a dead replica are taken up
                    # by the sweep, through their leases, before any channel starts.
                    await tg.start(self.router.run)
                else:
                    # Before any channel starts: each replayed message stays ahead of
                    # the newer messages of its session; replies wait for their channel.
                    await self.dispatcher.replay()
                for channel in self.channels.values():
                    tg.start_soon(self._supervise, channel)
                await tg.start(self.gc_policy.run)  # start-up done: freeze what it made
                self.health.set_ready()
                url = f"http://{self.gateway.settings.http.host}:{port}"
                if self.lock is not None:  # `gateway doctor` and a refused second run say it
                    await anyio.to_thread.run_sync(self.lock.announce, url)
                logger.info(
                    "gateway ready: {} channels: {}", url, ", ".join(self.channels) or "none"
                )
                task_status.started(port)
                await self._stop.wait()
                await self._drain()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.dedupe.aclose()
                await self.gateway.aclose()

    async def _check_model(self) -> None:
        """Report on /readyz, every `MODEL_CHECK_INTERVAL` seconds, whether each model
        server answers at all (``GET <base URL>/models``): shown under `degraded`, not
        fatal, as the cache is (a replica leaving the load balancer does not bring the
        model back; the turns meanwhile answer that the model is unreachable, or go to
        the next provider). Any HTTP answer counts as answering; a refused connection, a
        time-out or a 5xx does not. One provider is the component "model", as before
        failover; several are "model:NAME" each."""
        import aiohttp

        from gateway.llm.openai_provider import display_url

        used = self.gateway.settings.llm.used_providers()
        timeout = aiohttp.ClientTimeout(total=self.MODEL_CHECK_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as http, anyio.create_task_group() as tg:
            for name, provider in used.items():
                base = (provider.base_url or "https://api.openai.com/v1").rstrip("/")
                key = provider.resolved_api_key()
                component = "model" if len(used) == 1 else f"model:{name}"
                fix = (
                    "start it, or fix OPENAI_BASE_URL; `gateway doctor` checks it"
                    if name == "default"
                    else f"start it, or fix llm.providers.{name}.base_url; `gateway doctor` "
                    "checks it"
                )
                tg.start_soon(
                    self._check_one_model, http, component, base, display_url(base), key, fix
                )

    async def _check_one_model(
        self,
        http: aiohttp.ClientSession,
        name: str,
        base: str,
        where: str,
        key: str | None,
        fix: str,
    ) -> None:
        import aiohttp

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        component = self.health.component(name, required=False)
        while True:
            problem = ""
            try:
                async with http.get(f"{base}/models", headers=headers) as response:
                    if response.status >= 500:
                        problem = f"answers HTTP {response.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"does not answer ({type(exc).__name__}: {exc})".replace(" ()", "")
            if problem:
                component.healthy(False, f"the model server at {where} {problem}", fix=fix)
            else:
                component.healthy(True, where)
            self.metrics.component_healthy.labels(name).set(0 if problem else 1)
            await anyio.sleep(self.MODEL_CHECK_INTERVAL)

    async def _check_storage(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Report on /readyz, every `STORAGE_CHECK_INTERVAL` seconds, whether a new file
        can be written in the sessions folder (in a worker thread) and whether the cache
        answers (`SemanticCache.check`): a gateway that cannot keep what people say, or
        whose shared cache is down, is not ready. The first round runs before start-up
        is reported done."""
        from gateway.cache import CacheUnavailable
        from gateway.plumbing.postgres import StorageError

        where = self.gateway.storage.where()
        sessions = self.health.component("sessions")
        cache = self.gateway.cache
        # A cache outage is shown, not fatal: answers bypass it (a whole fleet leaving
        # the load balancer because Redis is down would be worse than slower answers).
        cache_health = self.health.component("cache", required=False)

        async def check() -> None:
            try:
                await anyio.to_thread.run_sync(self.gateway.sessions.probe)
                sessions.healthy(True)
                self.metrics.component_healthy.labels("sessions").set(1)
            except OSError as exc:
                sessions.healthy(
                    False,
                    f"cannot write in {where} ({exc.strerror or exc})",
                    fix="make it writable for the gateway's user; check free space",
                )
                self.metrics.component_healthy.labels("sessions").set(0)
            except StorageError as exc:
                sessions.healthy(
                    False, str(exc), fix="start PostgreSQL or fix storage.url; retrying"
                )
                self.metrics.component_healthy.labels("sessions").set(0)
            try:
                if cache is not None:
                    await cache.check()
                cache_health.healthy(True, "" if cache is not None else "off")
                self.metrics.component_healthy.labels("cache").set(1)
            except CacheUnavailable as exc:
                cache_health.healthy(False, exc.problem, fix=exc.fix)
                self.metrics.component_healthy.labels("cache").set(0)

        await check()
        task_status.started()
        while True:
            await anyio.sleep(self.STORAGE_CHECK_INTERVAL)
            await check()

    def _redelivers(self, channel_name: str) -> bool:
        """Does this channel's platform hand over again what was not confirmed
        (`gateway.channel.redelivers`)? The dispatcher keeps what it would not."""
        channel = self.channels.get(channel_name)
        return channel is None or redelivers(channel)

    async def _drain(self) -> None:
        """Stop intake and let turns in flight finish (the dispatcher logs the drain)."""
        self.health.set_draining()
        for channel in self.channels.values():
            # What platforms still hold stays with them for the next start, rather than
            # being refused with "send it again".
            pause = getattr(channel, "pause_intake", None)
            if pause is not None:
                pause()
        await self.dispatcher.drain(self.gateway.settings.dispatch.drain_grace_seconds)
        if self.router is not None:
            # After the drain: what was fed here has finished (or was told to be sent
            # again); the other replicas take the rest of these sessions at once.
            await self.router.stop()

    async def _watch_signals(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """SIGTERM or SIGINT: drain, then stop. A second one ends the drain's grace:
        turns in flight stop, their senders are asked to send again (the journal replays
        them on the next start), and the exit is the same as after one. Later ones
        change nothing."""
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            count = 0
            async for signum in signals:
                count += 1
                name = signal.Signals(signum).name
                if count == 1:
                    logger.info("{} received: stopping", name)
                    self.stop()
                elif count == 2:
                    logger.warning(
                        "second {}: not waiting for turns in flight; their senders are "
                        "asked to send again",
                        name,
                    )
                    self.stop()
                    self.dispatcher.end_grace()

    async def _supervise(self, channel: Channel) -> None:
        """Run a channel; restart it with exponential backoff when it fails or stops.

        A channel whose end is the user leaving (`ends_gateway`, the terminal chat at
        Ctrl-D) stops the gateway instead; any other channel that returns has lost its
        platform (e.g. polling stopped) and is restarted like a failed one."""
        component = self.health.component(channel.name)
        up = self.metrics.channel_up.labels(channel.name)
        backoff = 1.0
        while not self._stop.is_set():
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(channel.run, self.submit)
                    component.healthy(True)
                    up.set(1)
                    backoff = 1.0
                up.set(0)
                if getattr(channel, "ends_gateway", False):
                    logger.info("channel {} finished: stopping the gateway", channel.name)
                    component.healthy(True, "finished")
                    self.stop()
                    return
                problem = "stopped by itself"
            except Exception as exc:
                up.set(0)
                # The task group wraps the channel's own error: report that one, whose
                # message says what to fix.
                while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                    exc = exc.exceptions[0]
                problem = f"{type(exc).__name__}: {exc}"
                logger.opt(exception=exc).error("channel {} failed", channel.name)
            component.healthy(False, problem)
            logger.warning("channel {} {}; restarting in {:g}s", channel.name, problem, backoff)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, self.BACKOFF_MAX)


async def run_daemon(gateway: Gateway, lock: WorkspaceLock | None = None) -> int:
    """Run the gateway until a signal (or the end of the terminal chat) stops it; `lock`:
    the workspace's, held by this process (it names the HTTP address once known)."""
    return await Daemon(gateway, lock=lock).run()
