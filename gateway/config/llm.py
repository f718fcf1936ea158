"""`[llm]`: the model server, the providers to fail over to, and model aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from gateway.config.section import SHORT_NAME, Section, reveal, secret, secret_file
from gateway.config.usage import ModelPriceSettings

#: The provider `[llm]` itself describes (base_url, api_key, ...).
DEFAULT_PROVIDER = "default"


class LLMProviderSettings(Section):
    """One OpenAI-compatible server the failover may ask (`[llm.providers.NAME]`)."""

    base_url: str | None = Field(
        None,
        description="Its OpenAI-compatible endpoint. Unset means api.openai.com.",
        examples=["https://openrouter.ai/api/v1"],
    )
    api_key: SecretStr | None = secret("its API key", "GATEWAY_LLM__PROVIDERS__NAME__API_KEY")
    api_key_file: Path | None = secret_file(
        "GATEWAY_LLM__PROVIDERS__NAME__API_KEY", "provider-api-key"
    )
    models: list[str] = Field(
        default_factory=list,
        description="The model names it serves; a name it does not list is not asked of "
        "it. Empty: any name.",
    )
    fallback_models: list[str] = Field(
        default_factory=list,
        description="Models of its own tried in order when the asked one fails.",
    )
    timeout: float | None = Field(None, gt=0, description="Seconds per request; unset: [llm]'s.")
    connect_timeout: float | None = Field(
        None, gt=0, description="Seconds to connect; unset: [llm]'s."
    )
    max_retries: int | None = Field(
        None, ge=0, le=10, description="Retries on 429/5xx/timeouts; unset: [llm]'s."
    )
    prices: dict[str, ModelPriceSettings] = Field(
        default_factory=dict,
        description="Its price per model name as it answers, like usage.prices, which "
        "covers the models it does not list.",
    )

    def resolved_api_key(self) -> str | None:
        return reveal(self.api_key)


class FailoverSettings(Section):
    failures_to_open: int = Field(
        3,
        ge=1,
        le=100,
        description="Provider failures in a row (connection errors, time-outs, 5xx, 429, "
        "refused keys, no credit) after which that provider is skipped.",
    )
    cooldown_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a failing provider is skipped before one request tries it "
        "again (a success puts it back in use).",
    )
    long_retry_after_seconds: float = Field(
        10.0,
        gt=0,
        le=120,
        description="With more than one provider, a 429 asking to wait at least this long "
        "is not waited out: the next provider is asked, and this one is skipped for as "
        "long as it asked. Shorter waits are waited out.",
    )


class LLMSettings(Section):
    model: str = Field("gpt-4o-mini", description="Model name sent to the server.")
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1 for Ollama "
        "(also OPENAI_BASE_URL). Unset means api.openai.com.",
        examples=["http://127.0.0.1:11434/v1"],
    )
    api_key: SecretStr | None = secret("the API key", "OPENAI_API_KEY or GATEWAY_LLM__API_KEY")
    api_key_file: Path | None = secret_file("GATEWAY_LLM__API_KEY", "openai-api-key")
    fallback_models: list[str] = Field(
        default_factory=list, description="Models tried in order when the main one fails."
    )
    timeout: float = Field(60.0, gt=0, description="Seconds per request before giving up.")
    connect_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds to connect to the server; unset: timeout. A short one skips "
        "a provider that does not answer at all sooner.",
        examples=[5.0],
    )
    max_retries: int = Field(2, ge=0, le=10, description="Retries on 429/5xx/timeouts.")
    temperature: float | None = Field(
        0.3,
        ge=0,
        le=2,
        description="Sampling temperature; answers sampled above cache.max_temperature are "
        "never cached.",
    )
    max_tokens: int | None = Field(
        None, gt=0, description="Upper bound on reply tokens.", examples=[1024]
    )
    context_window: int | None = Field(
        None,
        gt=256,
        description="The model's context window, in tokens: an upper bound. Unset: the "
        "size the model's server says (llama.cpp /props, Ollama /api/ps or /api/show, vLLM "
        "/v1/models, or its overflow error), else 32768.",
        examples=[32768],
    )
    stream: bool = Field(False, description="Stream replies token by token where possible.")
    tool_choice: Literal["auto", "none", "required"] | None = Field(
        None,
        description="tool_choice sent with a (not streamed) request that offers tools; unset "
        "leaves it to the server (OpenAI: auto). llama-cpp-python's chatml-function-calling "
        'offers the tools only with "auto".',
        examples=["auto"],
    )
    chain: list[str] = Field(
        default_factory=lambda: [DEFAULT_PROVIDER],
        description='Providers asked in order for a model name without an alias: "default" '
        "is the server above (base_url, api_key), any other a [llm.providers.NAME]. The "
        "next one is asked when one fails, before any of the answer was shown.",
    )
    providers: dict[str, LLMProviderSettings] = Field(
        default_factory=dict,
        description="More OpenAI-compatible servers to fail over to, one [llm.providers.NAME] "
        "table each (base_url, api_key_file or GATEWAY_LLM__PROVIDERS__NAME__API_KEY, "
        "models, timeout, connect_timeout, max_retries, prices).",
    )
    aliases: dict[str, list[str]] = Field(
        default_factory=dict,
        description='Model names with their own chain, "provider:model" each, in order; '
        "/model NAME picks one.",
    )
    failover: FailoverSettings = Field(default_factory=FailoverSettings)

    def resolved_api_key(self) -> str | None:
        """The API key (from the environment or `api_key_file`), if any."""
        return reveal(self.api_key)

    @model_validator(mode="after")
    def _check_providers(self) -> LLMSettings:
        for name in self.providers:
            if name == DEFAULT_PROVIDER:
                raise ValueError(
                    'providers.default: "default" is the server [llm] itself describes '
                    "(base_url, api_key); give this provider another name"
                )
            if not SHORT_NAME.fullmatch(name):
                raise ValueError(
                    f"providers: {name!r} cannot name a provider; use up to 32 letters, "
                    "digits, - and _"
                )
        known = {DEFAULT_PROVIDER, *self.providers}
        if len(set(self.chain)) != len(self.chain):
            raise ValueError("chain: a provider is named twice; name each once, in order")
        for name in self.chain:
            if name not in known:
                raise ValueError(f"chain: no provider {name!r}; add [llm.providers.{name}]")
        for alias, entries in self.aliases.items():
            if not alias.strip() or not entries:
                raise ValueError(f"aliases.{alias}: give it a name and at least one provider")
            for entry in entries:
                provider, _, model = entry.partition(":")
                if provider not in known:
                    raise ValueError(
                        f"aliases.{alias}: no provider {provider!r} in {entry!r}; write "
                        '"provider:model" with a provider of [llm.providers] or "default"'
                    )
                served = self.providers[provider].models if provider in self.providers else []
                if served and (model or alias) not in served:
                    raise ValueError(
                        f"aliases.{alias}: {provider} does not list {model or alias!r} in its "
                        "models; add it there or fix the name"
                    )
        return self

    def unused_providers(self) -> list[str]:
        """Providers no chain or alias names (`gateway doctor` warns of them)."""
        used = set(self.used_providers())
        return [name for name in self.providers if name not in used]

    def alias_routes(self) -> dict[str, list[tuple[str, str]]]:
        """Each alias's (provider, model) routes; "provider" alone asks it for the
        alias's own name."""
        return {
            alias: [(e.partition(":")[0], e.partition(":")[2] or alias) for e in entries]
            for alias, entries in self.aliases.items()
        }

    def used_providers(self) -> dict[str, LLMProviderSettings]:
        """Every provider a model name may go to, in the order first named (chain, then
        aliases), with what it leaves unset taken from [llm]; "default" is [llm]'s own."""
        names = [*self.chain, *(p for rs in self.alias_routes().values() for p, _ in rs)]
        used: dict[str, LLMProviderSettings] = {}
        for name in dict.fromkeys(names):
            if name == DEFAULT_PROVIDER:
                used[name] = LLMProviderSettings.model_construct(
                    base_url=self.base_url,
                    api_key=self.api_key,
                    api_key_file=None,
                    models=[],
                    fallback_models=self.fallback_models,
                    timeout=self.timeout,
                    connect_timeout=self.connect_timeout,
                    max_retries=self.max_retries,
                    prices={},
                )
                continue
            own = self.providers[name]
            used[name] = own.model_copy(
                update={
                    "timeout": own.timeout or self.timeout,
                    "connect_timeout": own.connect_timeout or self.connect_timeout,
                    "max_retries": self.max_retries if own.max_retries is None else own.max_retries,
                }
            )
        return used
