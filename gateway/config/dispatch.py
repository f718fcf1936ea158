"""`[dispatch]`: turns at once, queues per conversation, queue modes."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.section import Section
from gateway.dispatch.queue_modes import QueueMode


class DispatchSettings(Section):
    max_concurrent_turns: int = Field(
        8, ge=1, le=10_000, description="Turns running at once across all sessions."
    )
    max_queue_per_lane: int = Field(
        50,
        ge=1,
        description="Messages of the chat APIs, the terminal and scheduled runs waiting per "
        "session before their senders are told to wait. A platform's message is never "
        "refused: it is journaled and waits its turn.",
    )
    max_queued_total: int = Field(
        10_000,
        ge=1,
        description="Messages held in memory in all sessions together, at most; past it "
        "a platform's message waits in the journal (file mode) or is left with the "
        "platform, which sends it again (shared mode).",
    )
    mode: QueueMode = Field(
        "followup",
        description="Messages sent while a conversation's turn runs: followup = a turn "
        "each, after it; collect = merged into the next turn; steer = joins the running "
        "turn at its next step (after its tool calls); interrupt = stops the running turn "
        "(as /stop) and starts the next with it. /queue MODE sets one conversation's.",
    )
    channel_modes: dict[str, QueueMode] = Field(
        default_factory=dict,
        description="A channel's own mode, in place of mode, one line each.",
    )
    drain_grace_seconds: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight turns may take to finish."
    )
    deliver_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="How long sending one reply may take, flood-control waits included.",
    )
    redeliver_window_seconds: float = Field(
        3600.0,
        gt=0,
        description="How long a reply its platform could not take (down, unreachable) is "
        "sent again, its conversation's later replies waiting behind it.",
    )
    dedupe_ttl_seconds: float = Field(
        7 * 86400.0, gt=0, description="How long platform message ids are remembered."
    )

    @field_validator("channel_modes")
    @classmethod
    def _known_channels(cls, value: dict[str, str]) -> dict[str, str]:
        from gateway.config.channels import ChannelsSettings

        # The channels of [channels], and the gateway's own (jobs, the chat API).
        known = sorted({*ChannelsSettings.model_fields, "system", "api"})
        for name in value:
            if name not in known:
                raise ValueError(f"there is no channel {name!r}; use one of {', '.join(known)}")
        return value
