"""Small agent parts: command parsing, the tool registry, text cleaning, log redaction."""

from __future__ import annotations

import anyio
import pytest

from gateway.agent import Tool, ToolContext, ToolRegistry, build_registry, clean_user_text
from gateway.agent.commands import COMMANDS, Command, parse_command, unknown_command_text
from gateway.llm import ToolCall, ToolSpec
from gateway.redaction import Redactor


def test_parse_command() -> None:
    assert parse_command("/model gpt-x").argument == "gpt-x"  # type: ignore[union-attr]
    assert parse_command("/new@my_bot").name == "new"  # type: ignore[union-attr]
    assert parse_command("  /STATUS ").name == "status"  # type: ignore[union-attr]
    assert parse_command("/etc/hosts is a file") is None
    assert parse_command("hello /new") is None
    assert parse_command("/") is None
    assert parse_command("/ what is this?") is None


def test_an_unknown_command_is_still_a_command() -> None:
    unknown = parse_command("/frobnicate@my_bot the knobs")
    assert unknown == Command(name="frobnicate", argument="the knobs")
    assert not unknown.known and parse_command("/help").known  # type: ignore[union-attr]
    text = unknown_command_text("frobnicate")
    assert text.startswith("unknown command /frobnicate;")
    assert all(f"/{name}" in text for name in COMMANDS)


def test_clean_user_text_removes_controls_and_bad_unicode() -> None:
    assert clean_user_text("a\x00b\x07c\td\ne") == "abc\td\ne"
    assert clean_user_text("x\udcff y") == "x\ufffd y"


def spec(name: str) -> ToolSpec:
    return ToolSpec(name=name, description="", parameters={"type": "object"})


@pytest.mark.anyio
async def test_registry_never_raises() -> None:
    async def boom(args: dict[str, object], ctx: ToolContext) -> str:
        raise RuntimeError("kaput")

    async def slow(args: dict[str, object], ctx: ToolContext) -> str:
        await anyio.sleep(5)
        return "late"

    async def big(args: dict[str, object], ctx: ToolContext) -> str:
        return "z" * 100_000

    reg = ToolRegistry()
    reg.register(Tool(spec("boom"), boom))
    reg.register(Tool(spec("slow"), slow, timeout=0.05))
    reg.register(Tool(spec("big"), big))
    ctx = ToolContext(session_key="cli:t")
    assert "kaput" in await reg.execute(ToolCall("1", "boom", {}), ctx)
    assert "timed out" in await reg.execute(ToolCall("2", "slow", {}), ctx)
    assert "unknown tool" in await reg.execute(ToolCall("3", "nope", {}), ctx)
    out = await reg.execute(ToolCall("4", "big", {}), ctx)
    assert len(out) < 20_000 and "characters cut" in out
    with pytest.raises(ValueError):
        reg.register(Tool(spec("boom"), boom))


def test_build_registry_rejects_unknown_tools() -> None:
    assert build_registry(["current_time"]).names() == ["current_time"]
    with pytest.raises(ValueError, match="unknown tool"):
        build_registry(["rm_rf"])


def test_redactor() -> None:
    r = Redactor(["hunter2-secret"])
    assert r.redact("key hunter2-secret used") == "key *** used"
    assert "abcdef123456" not in r.redact("Authorization: Bearer abcdef123456")
    assert "sk-***" in r.redact("got sk-abcdefghijkl")
    assert r.redact("ask-questions about the task-description") == (
        "ask-questions about the task-description"
    )
