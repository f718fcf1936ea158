"""`[agent]`: the system prompt, the context's window, tools per turn, tool outputs."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.config.section import Section


class AgentSettings(Section):
    system_prompt: str = Field(
        "You are a helpful assistant reachable from chat apps and a terminal. "
        "Answer clearly and concisely.",
        description="System prompt for every conversation.",
    )
    memory_window: int = Field(
        10, ge=1, le=1000, description="Recent messages sent to the model with each turn."
    )
    max_tool_iterations: int = Field(
        8, ge=1, le=100, description="Tool-call rounds per turn before a final answer."
    )
    reply_reserve_tokens: int = Field(
        1024, ge=0, description="Tokens of the context window kept free for the reply."
    )
    max_message_chars: int = Field(
        100_000, ge=1, description="Longest user message accepted, in characters."
    )
    tools: list[str] = Field(
        default_factory=lambda: ["current_time"],
        description="Built-in tools offered: current_time, and web_fetch (reaches the "
        "internet: off unless listed here; see [tools.web_fetch]). MCP servers' tools are "
        "offered by [mcp.servers.NAME].",
    )
    owners: list[str] = Field(
        default_factory=list,
        description="Sender ids (channel:user) allowed to run privileged chat commands.",
    )
    offline_after_seconds: float = Field(
        3600.0,
        ge=0,
        description="A message older than this when its turn comes (sent while the "
        "gateway was down, or replayed after a crash) gets a short 'I was offline' notice "
        "instead of an answer; 0 answers every message however old.",
    )
    tool_output_inline_chars: int = Field(
        6_000,
        ge=0,
        description="A tool result longer than this (characters) is stored whole beside "
        "the session and the model sees a preview with a handle, reading the rest with "
        "read_tool_output and search_tool_output; 0 turns this off (long results are cut "
        "in the middle at 16,000 characters).",
    )
    tool_output_preview_chars: int = Field(
        2_000,
        ge=100,
        description="Characters of a stored tool result shown in its preview (two thirds "
        "from its start, one third from its end).",
    )
    tool_output_read_chars: int = Field(
        8_000,
        ge=500,
        description="Most characters one read_tool_output call returns (lower it with a "
        "small context window: a read must fit in the context).",
    )
    tool_output_max_chars: int = Field(
        5_000_000,
        ge=10_000,
        description="Longest tool result stored; the middle of a longer one is cut.",
    )

    @model_validator(mode="after")
    def _tool_output_sizes(self) -> AgentSettings:
        inline = self.tool_output_inline_chars
        if inline and self.tool_output_preview_chars >= inline:
            raise ValueError(
                f"tool_output_preview_chars ({self.tool_output_preview_chars}) must be below "
                f"tool_output_inline_chars ({inline}): a preview shorter than the result"
            )
        return self
