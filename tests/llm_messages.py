"""Builders for the LLM messages tests need, and the tool-pairing check they share."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.llm import LLMMessage, TokenUsage, ToolCall


def user(text: str) -> LLMMessage:
    return LLMMessage(role="user", content=text)


def assistant(text: str, usage: TokenUsage | None = None) -> LLMMessage:
    return LLMMessage(role="assistant", content=text, usage=usage)


def call(*ids: str) -> LLMMessage:
    """An assistant message calling tool `f` once per id."""
    return LLMMessage(
        role="assistant", tool_calls=[ToolCall(id=i, function_name="f", arguments={}) for i in ids]
    )


def result(call_id: str, text: str = "ok") -> LLMMessage:
    return LLMMessage(role="tool", content=text, tool_call_id=call_id, name="f")


def assert_well_paired(messages: Sequence[LLMMessage]) -> None:
    """Every tool result follows its call; every call is answered before anything else."""
    pending: set[str] = set()
    for m in messages:
        if m.role == "tool":
            assert m.tool_call_id in pending, "tool result without its call"
            pending.discard(m.tool_call_id)
        else:
            assert not pending, "tool call left unanswered"
            if m.role == "assistant":
                pending = {c.id for c in m.tool_calls}
    assert not pending
