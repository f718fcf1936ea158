"""`[memory]`: long-term memory and its consolidation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Section


class MemorySettings(Section):
    enabled: bool = Field(True, description="Long-term memory: MEMORY.md, HISTORY.md, knowledge.")
    scope: Literal["per_session", "workspace", "person"] = Field(
        "per_session",
        description="per_session: each conversation has its own memory (users never see each "
        "other's); workspace: one shared memory for a single-owner assistant; person: a "
        "person's direct chats share one memory on every channel once `gateway people link` "
        "joins their ids (groups keep their own).",
    )
    auto_consolidate: bool = Field(
        True, description="Summarize old turns into memory in the background."
    )
    consolidation_model: str | None = Field(
        None,
        description="A cheaper model for consolidation; unset = llm.model.",
        examples=["gpt-4o-mini"],
    )
    consolidation_timeout: float = Field(
        120.0, gt=0, description="Seconds one consolidation may take."
    )
    token_share: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Consolidate when the conversation fills this share of the context window.",
    )
    retry_base_seconds: float = Field(30.0, gt=0, description="First retry after a failure.")
    retry_max_seconds: float = Field(3600.0, gt=0, description="Longest wait between retries.")
    history_max_bytes: int = Field(
        512_000, ge=4096, description="HISTORY.md is archived past this size."
    )
    recall_wait_seconds: float = Field(
        1.0,
        ge=0,
        description="How long a turn's memory recall waits for a search index still being "
        "built (after a restart without a saved index, an import); then it answers from the "
        "newest facts, logged and counted in gateway_memory_search_incomplete_total.",
    )
    dense_recall: bool = Field(
        True,
        description="Fuse the local embedding model's similarity (the `embedding` extra) "
        "into the search of past messages, each message embedded in the background; "
        "without the extra, keyword search alone.",
    )
