"""`[cache]`: the shared response cache."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Section


class CacheSettingsSection(Section):
    enabled: bool = Field(True, description="Answer repeated questions from the cache.")
    url: str | None = Field(
        None,
        description="Backend: unset for a SQLite file in the workspace, or redis://host:port/db "
        "to share the cache between replicas.",
        examples=["redis://127.0.0.1:6379/0"],
    )
    namespace: str = Field("gateway:cache:", description="Redis key prefix.")
    ttl_seconds: float = Field(3600.0, gt=0, description="How long an answer stays valid.")
    max_entries: int = Field(10_000, ge=1, description="Entries kept; least recently used go.")
    max_temperature: float = Field(
        0.3, ge=0, description="Replies sampled hotter than this are not cached."
    )
    near_duplicates: bool = Field(
        True,
        description="Also match paraphrases of standalone questions (needs the extra of "
        "near_duplicate_model; without it the cache says so and matches exact questions).",
    )
    near_duplicate_model: Literal["wordllama", "minilm"] = Field(
        "minilm",
        description="The embedding model that finds paraphrases: wordllama (the "
        "cache-neardup extra) or all-MiniLM-L6-v2 (the embedding extra; more precise, "
        "1.4 ms of CPU a lookup: bench/results/embeddings.md).",
    )
    near_duplicate_threshold: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Cosine similarity a paraphrase must reach until the labels of "
        "answers compared certify another under near_duplicate_max_error; unset: the "
        "model's own (wordllama 0.70, minilm 0.985).",
        examples=[0.985],
    )
    near_duplicate_max_error: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="Share of served paraphrase hits allowed to be wrong: each entry's "
        "threshold is kept under it by comparing answers (gateway/cache/verified.py).",
    )
    disabled_channels: list[str] = Field(
        default_factory=list, description='Channels that never use the cache, e.g. ["api"].'
    )
