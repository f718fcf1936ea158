"""The tool registry: tools the model may call, executed with a timeout and bounded output."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import anyio
from loguru import logger

from gateway.llm.types import ToolCall, ToolSpec
from gateway.media.outbound import send_file_handler
from gateway.messages import InboundMessage, OutboundFile


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may know about the turn that called it."""

    session_key: str
    sender_id: str = ""
    #: The message the turn answers: where a reply to this conversation goes.
    inbound: InboundMessage | None = None
    #: Adds a file to the turn's reply (None: this turn's reply cannot carry files).
    attach: Callable[[OutboundFile], None] | None = None
    #: The session entry of the user's message this turn answers ('' when unknown):
    #: where a fact the turn remembers came from.
    user_entry_id: str = ""


ToolHandler = Callable[[dict[str, Any], ToolContext], Awaitable[str]]


@dataclass(frozen=True, slots=True)
class Tool:
    spec: ToolSpec
    handler: ToolHandler
    timeout: float = 30.0


#: The group of tools registered without one (the built-in and memory tools).
BUILTIN_GROUP = "builtin"


@dataclass(frozen=True, slots=True)
class ToolGroupStatus:
    """A group of tools as `/status` shows it: on or off, why, and its tools."""

    name: str
    on: bool
    reason: str
    tools: tuple[str, ...]

    def describe(self) -> str:
        """One line, e.g. `files: on (files__read, files__list)` or `web_fetch: off (...)`."""
        listed = f" ({', '.join(self.tools)})" if self.tools and self.on else ""
        why = f" ({self.reason})" if self.reason and not self.on else ""
        return f"{self.name}: {'on' if self.on else 'off'}{listed}{why}"


@dataclass(slots=True)
class _Group:
    on: bool = True
    reason: str = ""
    prefix: str = ""


class ToolRegistry:
    """Named tools in named groups. `execute` never raises: every call gets a result
    text, so the transcript never holds a tool call without its tool result.

    A group's tools come and go together (an MCP server's, say) and the group can be
    off, with a reason: its tools are then not offered to the model, and a call to one
    (the model may still name it) is answered with that reason at once, never run.
    """

    MAX_RESULT_CHARS = 16_000

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}
        self._group_of: dict[str, str] = {}
        self._groups: dict[str, _Group] = {BUILTIN_GROUP: _Group()}

    def register(self, tool: Tool, *, group: str = BUILTIN_GROUP) -> None:
        if tool.spec.name in self._tools:
            raise ValueError(f"tool {tool.spec.name!r} is already registered")
        self._groups.setdefault(group, _Group())
        self._tools[tool.spec.name] = tool
        self._group_of[tool.spec.name] = group

    def add_group(self, name: str, *, on: bool = True, reason: str = "", prefix: str = "") -> None:
        """Declare a group, perhaps before it has tools. While it is off, a call to an
        unknown tool named like the group, or whose name starts with `prefix` (when not
        empty), is answered with this group's reason."""
        if name in self._groups:
            raise ValueError(f"tool group {name!r} is already registered")
        self._groups[name] = _Group(on=on, reason=reason, prefix=prefix)

    def replace_group_tools(self, name: str, tools: Iterable[Tool]) -> None:
        """The group's tools become `tools` (an MCP server's listing after a reconnect).
        A name another group holds is refused (ValueError) and nothing changes."""
        new = list(tools)
        for tool in new:
            owner = self._group_of.get(tool.spec.name)
            if owner is not None and owner != name:
                raise ValueError(f"tool {tool.spec.name!r} is already registered by {owner!r}")
        for old in [n for n, g in self._group_of.items() if g == name]:
            del self._tools[old]
            del self._group_of[old]
        self._groups.setdefault(name, _Group())
        for tool in new:
            self._tools[tool.spec.name] = tool
            self._group_of[tool.spec.name] = name

    def set_group_state(self, name: str, on: bool, reason: str = "") -> None:
        """Turn a group on or off; `reason` says why it is off (it reaches the model)."""
        group = self._groups.setdefault(name, _Group())
        group.on = on
        group.reason = reason

    def groups(self) -> list[ToolGroupStatus]:
        """Every group, the built-in one first, then by name."""
        order = sorted(self._groups, key=lambda n: (n != BUILTIN_GROUP, n))
        return [
            ToolGroupStatus(
                name=name,
                on=self._groups[name].on,
                reason=self._groups[name].reason,
                tools=tuple(sorted(t for t, g in self._group_of.items() if g == name)),
            )
            for name in order
        ]

    def _is_on(self, tool_name: str) -> bool:
        return self._groups[self._group_of[tool_name]].on

    def names(self) -> list[str]:
        """The tools offered now (those of groups that are on)."""
        return sorted(name for name in self._tools if self._is_on(name))

    def specs(self) -> list[ToolSpec]:
        return [self._tools[name].spec for name in self.names()]

    def __len__(self) -> int:
        return len(self.names())

    def _unavailable(self, tool_name: str) -> str | None:
        """The answer to a call of a tool that is off (or unknown but in an off group's
        namespace), or None when it may run."""
        group_name = self._group_of.get(tool_name)
        if group_name is None:
            group_name = next(
                (
                    name
                    for name, g in self._groups.items()
                    if not g.on
                    and (name == tool_name or (g.prefix and tool_name.startswith(g.prefix)))
                ),
                None,
            )
            if group_name is None:
                return None
        group = self._groups[group_name]
        if group.on:
            return None
        why = f": {group.reason}" if group.reason else ""
        return f"error: tool {tool_name} is unavailable now{why}"

    async def execute(
        self, call: ToolCall, context: ToolContext, *, max_chars: int | None = None
    ) -> str:
        """The call's result text, cut in the middle (head and tail kept) past
        `max_chars` (default `MAX_RESULT_CHARS`; the agent loop passes its stored-output
        limit when big results are stored whole, `gateway.agent.tool_outputs`)."""
        limit = self.MAX_RESULT_CHARS if max_chars is None else max_chars
        off = self._unavailable(call.function_name)
        if off is not None:
            logger.info("tool {} refused: its group is off", call.function_name)
            return off
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
        if len(result) > limit:
            half = limit // 2
            cut = len(result) - 2 * half
            result = f"{result[:half]}\n[... {cut} characters cut ...]\n{result[-half:]}"
        return result


async def _current_time(args: dict[str, Any], context: ToolContext) -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


async def _send_file(args: dict[str, Any], context: ToolContext) -> str:
    if context.attach is None:
        return "error: this conversation's replies cannot carry files"
    return send_file_handler(context.attach, args)


BUILTIN_TOOLS: dict[str, Tool] = {
    "send_file": Tool(
        ToolSpec(
            name="send_file",
            description="Send the user a text file (code, CSV, notes...) with your reply.",
            parameters={
                "type": "object",
                "properties": {
                    "name": {"type": "string", "description": "File name, e.g. report.csv"},
                    "content": {"type": "string", "description": "The file's text."},
                    "caption": {"type": "string", "description": "A short caption."},
                },
                "required": ["name", "content"],
                "additionalProperties": False,
            },
        ),
        _send_file,
    ),
    "current_time": Tool(
        ToolSpec(
            name="current_time",
            description="The current date and time (UTC, ISO 8601).",
            parameters={"type": "object", "properties": {}, "additionalProperties": False},
        ),
        _current_time,
    ),
}


def build_registry(
    names: list[str], outside: Mapping[str, Callable[[], Tool]] | None = None
) -> ToolRegistry:
    """A registry with the named built-in tools; unknown names are a config error.

    `outside` are the tools that reach outside the gateway (the web, say): each is
    built only when `names` lists it, in a group of its own, and otherwise shown off
    (with how to turn it on) but never offered."""
    outside = outside or {}
    registry = ToolRegistry()
    for name in names:
        if name in outside:
            registry.register(outside[name](), group=name)
            continue
        if name not in BUILTIN_TOOLS:
            known = ", ".join(sorted([*BUILTIN_TOOLS, *outside]))
            raise ValueError(f"agent.tools: unknown tool {name!r}; known tools: {known}")
        registry.register(BUILTIN_TOOLS[name])
    for name in sorted(set(outside) - set(names)):
        registry.add_group(name, on=False, reason="off; list it in agent.tools to turn it on")
    return registry
