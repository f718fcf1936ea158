"""`[subagents]`: the spawn tool."""

from __future__ import annotations

from pydantic import Field

from gateway.config.section import Section


class SubagentSettings(Section):
    enabled: bool = Field(
        False, description="Offer the model the spawn tool (a task run in its own session)."
    )
    max_depth: int = Field(
        1, ge=1, le=5, description="How deep subagents nest (1: subagents spawn none)."
    )
    max_concurrent: int = Field(
        4, ge=1, le=64, description="Subagents running at once in the whole gateway."
    )
    token_budget: int = Field(
        20_000, ge=100, description="Tokens one subagent's model calls may use in all."
    )
    timeout_seconds: float = Field(300.0, gt=0, description="Longest one subagent may run.")
