"""`[heartbeat]`: scheduled jobs the operator configures."""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.config.section import Section


class HeartbeatJobSettings(Section):
    every: str | None = Field(None, description="Interval, e.g. '30m' (or use cron).")
    cron: str | None = Field(None, description="Cron schedule, e.g. '0 9 * * 1-5'.")
    timezone: str = Field("UTC", description="Time zone of cron and active_hours.")
    active_hours: str | None = Field(None, description="Only run within, e.g. '08:00-22:00'.")
    prompt: str | None = Field(None, description="What to ask (or use prompt_file).")
    prompt_file: str | None = Field(
        None, description="File with the prompt, relative to the workspace (HEARTBEAT.md)."
    )
    deliver_to: str | None = Field(
        None,
        description="Where replies go: CHANNEL:CHAT, the chat as its session key names it; "
        "unset = log.",
    )
    ok_token: str = Field("HEARTBEAT_OK", description="A reply of only this is not delivered.")

    @model_validator(mode="after")
    def _check(self) -> HeartbeatJobSettings:
        from gateway.schedules.schedule import Schedule

        Schedule.build(
            every=self.every,
            cron=self.cron,
            timezone=self.timezone,
            active_hours=self.active_hours,
        )
        if (self.prompt is None) == (self.prompt_file is None):
            raise ValueError("give exactly one of prompt and prompt_file")
        if self.deliver_to is not None:
            channel, sep, chat = self.deliver_to.partition(":")
            if not (channel and sep and chat):
                raise ValueError(
                    "deliver_to: use CHANNEL:CHAT, the chat as its session key names it"
                )
        return self


class HeartbeatSettings(Section):
    jobs: dict[str, HeartbeatJobSettings] = Field(
        default_factory=dict,
        description="Scheduled jobs: a [heartbeat.jobs.NAME] table or a jobs.NAME = { ... } "
        "line each.",
    )
