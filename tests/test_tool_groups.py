"""The tool registry's groups: tools that come and go together, off with a reason."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.agent.tools import BUILTIN_GROUP, Tool, ToolContext, ToolRegistry
from gateway.llm import ToolCall
from gateway.llm.types import ToolSpec

pytestmark = pytest.mark.anyio

CONTEXT = ToolContext(session_key="cli:direct")


def make_tool(name: str, answer: str = "ran") -> Tool:
    async def handler(args: dict[str, Any], context: ToolContext) -> str:
        calls.append(name)
        return answer

    return Tool(ToolSpec(name=name, description=name, parameters={"type": "object"}), handler)


calls: list[str] = []


def call(name: str) -> ToolCall:
    return ToolCall(id="call_1", function_name=name, arguments={})


async def test_an_off_group_is_not_offered_and_its_tools_answer_with_the_reason() -> None:
    calls.clear()
    registry = ToolRegistry()
    registry.register(make_tool("current_time"))
    registry.replace_group_tools("files", [make_tool("files__read")])
    assert registry.names() == ["current_time", "files__read"]

    registry.set_group_state("files", False, "server exited with code 3; restarting in 2s")
    assert registry.names() == ["current_time"]
    assert [s.name for s in registry.specs()] == ["current_time"]
    answer = await registry.execute(call("files__read"), CONTEXT)
    assert answer == (
        "error: tool files__read is unavailable now: server exited with code 3; restarting in 2s"
    )
    assert calls == []  # never run

    registry.set_group_state("files", True)
    assert await registry.execute(call("files__read"), CONTEXT) == "ran"
    assert calls == ["files__read"]


async def test_a_prefix_answers_for_tools_the_group_never_listed() -> None:
    registry = ToolRegistry()
    registry.add_group("files", on=False, reason="did not start: no such command", prefix="files__")
    answer = await registry.execute(call("files__write"), CONTEXT)
    assert "unavailable now: did not start: no such command" in answer
    registry.add_group("web_fetch", on=False, reason="off; list it in agent.tools")
    named = await registry.execute(call("web_fetch"), CONTEXT)
    assert named == "error: tool web_fetch is unavailable now: off; list it in agent.tools"
    other = await registry.execute(call("other__x"), CONTEXT)
    assert other.startswith("error: unknown tool 'other__x'")


def test_replacing_a_groups_tools_drops_the_old_ones_and_guards_other_groups() -> None:
    registry = ToolRegistry()
    registry.register(make_tool("current_time"))
    registry.replace_group_tools("files", [make_tool("files__a"), make_tool("files__b")])
    registry.replace_group_tools("files", [make_tool("files__b"), make_tool("files__c")])
    assert registry.names() == ["current_time", "files__b", "files__c"]
    with pytest.raises(ValueError, match="already registered by 'builtin'"):
        registry.replace_group_tools("files", [make_tool("current_time")])
    assert registry.names() == ["current_time", "files__b", "files__c"]  # nothing changed


def test_groups_describe_themselves_for_status() -> None:
    registry = ToolRegistry()
    registry.register(make_tool("current_time"))
    registry.add_group("web_fetch", on=False, reason="off in gateway.toml")
    registry.replace_group_tools("files", [make_tool("files__a")])
    lines = [group.describe() for group in registry.groups()]
    assert lines == [
        f"{BUILTIN_GROUP}: on (current_time)",
        "files: on (files__a)",
        "web_fetch: off (off in gateway.toml)",
    ]
    with pytest.raises(ValueError, match="already registered"):
        registry.add_group("files")
