"""Builds the gateway's parts from settings and runs them in one anyio task group."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import anyio
from loguru import logger

from gateway.agent import AgentConfig, AgentLoop, build_registry
from gateway.cache import CacheSettings, SemanticCache, backend_from_url
from gateway.config import ConfigError, Settings
from gateway.llm.openai_provider import OpenAIProvider, check_credentials
from gateway.llm.types import LLMProvider
from gateway.sessions import SessionManager


def ensure_private_dir(path: os.PathLike[str] | str) -> None:
    """Create a folder readable only by its owner (0700); conversations are private."""
    os.makedirs(path, mode=0o700, exist_ok=True)


def build_provider(settings: Settings) -> LLMProvider:
    """The OpenAI-compatible provider; raises LLMConfigError saying what to set."""
    llm = settings.llm
    api_key = llm.resolved_api_key()
    check_credentials(llm.base_url, api_key)
    return OpenAIProvider(
        base_url=llm.base_url,
        api_key=api_key,
        model=llm.model,
        fallback_models=llm.fallback_models,
        timeout=llm.timeout,
        max_retries=llm.max_retries,
        default_temperature=llm.temperature,
        default_max_tokens=llm.max_tokens,
    )


def build_session_manager(settings: Settings) -> SessionManager:
    try:
        ensure_private_dir(settings.workspace_path)
    except OSError as exc:
        raise ConfigError(
            f"workspace: cannot create {settings.workspace_path} ({exc.strerror}); "
            "choose another with --workspace or GATEWAY_WORKSPACE"
        ) from None
    return SessionManager(
        settings.sessions_dir,
        max_cache_size=settings.sessions.max_cache_size,
        fsync=settings.sessions.fsync,
    )


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
    )


def build_cache(settings: Settings) -> SemanticCache | None:
    """The response cache, or None when disabled. SQLite in the workspace by default."""
    section = settings.cache
    if not section.enabled:
        return None
    url = section.url or str(settings.workspace_path / "cache.sqlite")
    try:
        backend = backend_from_url(url, namespace=section.namespace)
        return SemanticCache(
            backend,
            CacheSettings(
                enabled=True,
                ttl_seconds=section.ttl_seconds,
                max_entries=section.max_entries,
                max_temperature=section.max_temperature,
                near_duplicates=section.near_duplicates,
                near_duplicate_threshold=section.near_duplicate_threshold,
            ),
        )
    except (ValueError, ImportError, OSError) as exc:
        raise ConfigError(f"cache: {exc}") from None


@dataclass
class Gateway:
    """The assembled parts: one session manager, one provider, one agent."""

    settings: Settings
    sessions: SessionManager
    provider: LLMProvider
    agent: AgentLoop
    cache: SemanticCache | None = None

    @classmethod
    def build(cls, settings: Settings) -> Gateway:
        try:
            tools = build_registry(settings.agent.tools)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        provider = build_provider(settings)
        sessions = build_session_manager(settings)
        cache = build_cache(settings)
        agent = AgentLoop(
            sessions=sessions,
            provider=provider,
            config=agent_config(settings),
            tools=tools,
            cache=cache,
        )
        return cls(
            settings=settings, sessions=sessions, provider=provider, agent=agent, cache=cache
        )

    async def aclose(self) -> None:
        await self.provider.aclose()
        if self.cache is not None:
            await self.cache.aclose()
        await anyio.to_thread.run_sync(self.sessions.close)


async def run_daemon(gateway: Gateway) -> int:
    """Run every enabled channel until it ends or the process is told to stop."""
    from channels.cli import CLIChannel

    cli = gateway.settings.channels.cli
    if not (cli.enabled and sys.stdin.isatty()):
        logger.error(
            "nothing to run: the terminal chat needs stdin to be a terminal "
            "(other channels arrive with the daemon's HTTP server)"
        )
        return 1
    try:
        async with anyio.create_task_group() as tg:
            channel = CLIChannel(gateway.agent, session_key=cli.session)
            tg.start_soon(channel.run_interactive)
    finally:
        await gateway.aclose()
    return 0
