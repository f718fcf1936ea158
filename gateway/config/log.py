"""`[log]`: level and format of the log."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.config.section import Section


class LogSettings(Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level logged."
    )
    format: Literal["text", "json"] = Field("text", description="text or json lines.")

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value
