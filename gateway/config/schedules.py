"""`[schedules]`: reminders and tasks people set from chat."""

from __future__ import annotations

from pydantic import Field, field_validator

from gateway.config.section import Section


class ScheduleSettings(Section):
    enabled: bool = Field(
        False,
        description="Offer the model the schedule, list_schedules and cancel_schedule tools "
        "(reminders and tasks set from chat; in workspace/schedules.json, or PostgreSQL "
        "with storage.url).",
    )
    timezone: str = Field("UTC", description="Time zone of times given without one.")
    max_per_conversation: int = Field(
        20, ge=1, le=1000, description="Jobs one conversation may hold at once."
    )
    max_late_seconds: float = Field(
        86400.0,
        gt=0,
        description="A job missed while the gateway was down fires once at start when at "
        "most this late; older ones are skipped (and logged).",
    )
    min_interval_seconds: float = Field(
        900.0,
        ge=60,
        le=86400,
        description="A repeating job set from chat whose cron runs closer together than "
        "this (anywhere: '*/5 * * * *', '0,1 * * * *', '* 3 * * *') is refused.",
    )
    max_runs_per_day: int = Field(
        48,
        ge=1,
        le=100_000,
        description="Runs a conversation's jobs may make in a day (in `timezone`) between "
        "them; later runs are skipped and the person told once. A repeating job that "
        "alone runs more often is refused when it is set. Heartbeat jobs are not counted.",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from gateway.schedules.schedule import zone

        zone(value)
        return value
