"""The tools a gateway offers, from its settings: built-in, outside-world and MCP ones."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from gateway.agent.mcp import MCPServers
from gateway.agent.tools import Tool, ToolRegistry, build_registry
from gateway.config import ConfigError, Settings


def outside_tools(settings: Settings) -> dict[str, Callable[[], Tool]]:
    """Tools that reach outside the gateway, by name: off unless agent.tools lists them."""

    def web_fetch() -> Tool:
        from gateway.agent.web_fetch import FetchPolicy, web_fetch_tool

        if importlib.util.find_spec("trafilatura") is None:
            raise ConfigError(
                "agent.tools: web_fetch needs the web extra; install it with "
                "pip install 'chat-gateway[web]'"
            )
        section = settings.tools.web_fetch
        return web_fetch_tool(
            FetchPolicy.build(
                timeout=section.timeout,
                max_bytes=section.max_bytes,
                max_chars=section.max_chars,
                max_redirects=section.max_redirects,
                allow_networks=section.allow_networks,
            )
        )

    return {"web_fetch": web_fetch}


def build_tools(settings: Settings) -> ToolRegistry:
    """The registry of agent.tools (ConfigError for an unknown name or a missing extra)."""
    try:
        return build_registry(settings.agent.tools, outside_tools(settings))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_mcp(settings: Settings, registry: ToolRegistry) -> MCPServers | None:
    """The configured MCP servers, each a tool group of `registry`; None without any."""
    if not settings.mcp.servers:
        return None
    if importlib.util.find_spec("mcp") is None:
        raise ConfigError(
            "mcp.servers: MCP servers need the mcp extra; install it with "
            "pip install 'chat-gateway[mcp]'"
        )
    return MCPServers(settings.mcp, registry, log_dir=settings.workspace_path / "mcp")
