"""`[usage]`: prices per model and token budgets."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from gateway.config.section import Section


class ModelPriceSettings(Section):
    prompt: float = Field(0.0, ge=0, description="US dollars per million prompt tokens.")
    completion: float = Field(0.0, ge=0, description="US dollars per million completion tokens.")
    per_minute: float = Field(
        0.0,
        ge=0,
        description="US dollars per minute of audio, for transcription models the server "
        "bills by duration (whisper-1).",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelPriceSettings:
        given = self.model_fields_set
        if not given or ("prompt" in given) != ("completion" in given):
            raise ValueError(
                "give prompt and completion (US dollars per million tokens), per_minute "
                "(US dollars per minute of audio), or all three"
            )
        return self


def _budget(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(
            "a budget of 0 tokens would stop every conversation; leave it unset for no "
            "budget, or give the tokens allowed per day"
        )
    return value


class UsageSettings(Section):
    prices: dict[str, ModelPriceSettings] = Field(
        default_factory=dict,
        description="Price per model in US dollars per million tokens (and per minute of "
        "audio for transcription models), one line each; a model without a price counts "
        "at $0.",
    )
    conversation_tokens_per_day: int | None = Field(
        None,
        description="Tokens one conversation may use per UTC day; at the limit the bot says "
        "so and stops calling the model until 00:00 UTC. Unset: no limit.",
        examples=[200_000],
    )
    tokens_per_day: int | None = Field(
        None,
        description="Tokens all conversations together may use per UTC day. Unset: no limit.",
        examples=[5_000_000],
    )

    _check_budgets = field_validator("conversation_tokens_per_day", "tokens_per_day")(_budget)
