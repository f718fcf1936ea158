"""The tool registry: tools the model may call, executed with a timeout and bounded output."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
from loguru import logger

from gateway.llm.types import ToolCall, ToolSpec


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may know about the turn that called it."""

    session_key: str
    sender_id: str = ""


ToolHandler = Callable[[dict[str, Any], ToolContext], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    spec: ToolSpec
    handler: ToolHandler
    timeout: float = 30.0


class ToolRegistry:
    """Named tools. `execute` never raises: every call gets a result text, so the
    transcript never holds a tool call without its tool result."""

    MAX_RESULT_CHARS = 16_000

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def register(self, tool: Tool) -> None:
        if tool.spec.name in self._tools:
            raise ValueError(f"tool {tool.spec.name!r} is already registered")
        self._tools[tool.spec.name] = tool

    def names(self) -> list[str]:
        return sorted(self._tools)

    def specs(self) -> list[ToolSpec]:
        return [self._tools[name].spec for name in sorted(self._tools)]

    def __len__(self) -> int:
        return len(self._tools)

    async def execute(self, call: ToolCall, context: ToolContext) -> str:
        tool = self._tools.get(call.function_name)
        if tool is None:
            return (
                f"error: unknown tool {call.function_name!r}; available: {', '.join(self.names())}"
            )
        try:
            with anyio.fail_after(tool.timeout):
                result = await tool.handler(dict(call.arguments), context)
        except TimeoutError:
            logger.warning("tool {} timed out after {}s", call.function_name, tool.timeout)
            return f"error: tool {call.function_name} timed out after {tool.timeout:g}s"
        except Exception as exc:  # a tool bug must not break the turn
            logger.exception("tool {} failed", call.function_name)
            return f"error: tool {call.function_name} failed: {type(exc).__name__}: {exc}"
        if not isinstance(result, str):
            result = json.dumps(result, ensure_ascii=False, default=str)
        if len(result) > self.MAX_RESULT_CHARS:
            half = self.MAX_RESULT_CHARS // 2
            cut = len(result) - self.MAX_RESULT_CHARS
            result = f"{result[:half]}\n[... {cut} characters cut ...]\n{result[-half:]}"
        return result


async def _current_time(args: dict[str, Any], context: ToolContext) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


BUILTIN_TOOLS: dict[str, Tool] = {
    "current_time": Tool(
        ToolSpec(
            name="current_time",
            description="The current date and time (UTC, ISO 8601).",
            parameters={"type": "object", "properties": {}, "additionalProperties": False},
        ),
        _current_time,
    ),
}


def build_registry(names: list[str]) -> ToolRegistry:
    """A registry with the named built-in tools; unknown names are a config error."""
    registry = ToolRegistry()
    for name in names:
        if name not in BUILTIN_TOOLS:
            known = ", ".join(sorted(BUILTIN_TOOLS))
            raise ValueError(f"agent.tools: unknown tool {name!r}; known tools: {known}")
        registry.register(BUILTIN_TOOLS[name])
    return registry
