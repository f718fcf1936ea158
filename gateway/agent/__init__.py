"""The agent: context building, the tool loop and chat commands."""

from gateway.agent.loop import AgentConfig, AgentLoop, clean_user_text
from gateway.agent.tools import Tool, ToolContext, ToolRegistry, build_registry

__all__ = [
    "AgentConfig",
    "AgentLoop",
    "Tool",
    "ToolContext",
    "ToolRegistry",
    "build_registry",
    "clean_user_text",
]
