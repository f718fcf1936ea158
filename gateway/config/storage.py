"""`[storage]`: PostgreSQL for replicas sharing state (unset: workspace files)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.config.section import Section


class StorageSettings(Section):
    url: str | None = Field(
        None,
        description="PostgreSQL for several replicas sharing state, e.g. "
        "postgresql://gateway@db:5432/gateway (a password only from GATEWAY_STORAGE__URL, "
        "PGPASSWORD or ~/.pgpass). Unset: everything stays in workspace files.",
        examples=["postgresql://gateway@127.0.0.1:5432/gateway"],
    )
    pool_size: int = Field(8, ge=1, le=200, description="Connections per pool per replica.")
    migrate: Literal["auto", "never"] = Field(
        "auto",
        description="auto: apply pending schema migrations at start (under a lock); never: "
        "refuse to start until `gateway db migrate` (or a migration Job) has run.",
    )
    lease_ttl_seconds: float = Field(
        10.0,
        ge=1.0,
        le=600.0,
        description="How long a replica's lease of a conversation lasts unrenewed: a "
        "replica paused or cut off this long loses it, another takes the conversation "
        "over, and the paused one's writes are refused (renewed every third of it).",
    )

    @field_validator("url")
    @classmethod
    def _postgres_only(cls, value: str | None) -> str | None:
        if value:
            from gateway.plumbing.postgres import StorageError, check_url

            try:
                check_url(value)
            except StorageError as exc:
                raise ValueError(str(exc)) from None
        return value or None
