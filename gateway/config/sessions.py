"""`[sessions]`: durability of session files and the session cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Section


class SessionSettings(Section):
    fsync: Literal["always", "batch", "never"] = Field(
        "batch",
        description="always: fsync each append; batch: group commit through a commit "
        "log (one fsync a round), a turn is still acknowledged only once on disk; never: "
        "leave it to the OS.",
    )
    max_cache_size: int = Field(
        2000,
        ge=1,
        description="Sessions kept in memory (the recently active ones), at most "
        "max_cache_mb of session files between them.",
    )
    max_cache_mb: int = Field(
        256, ge=1, description="Budget of the session cache, in MiB of session files."
    )
