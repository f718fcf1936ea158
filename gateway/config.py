"""Configuration: gateway.toml, GATEWAY_* environment overrides and command-line flags,
validated into one frozen settings object with errors a person can act on.

Precedence, lowest first: built-in defaults, gateway.toml, the conventional
OPENAI_API_KEY / OPENAI_BASE_URL, GATEWAY_<SECTION>__<KEY> variables, command-line flags.
Secrets (API keys, tokens) come only from the environment or from files named in the
config; a secret written into gateway.toml is refused, and secrets are never printed.

Types are strict: in gateway.toml a boolean is `true`/`false` and a number is unquoted
(`enabled = "yes"` or `port = "9000"` is refused, not guessed at). Environment values
are always strings, so they are read by the type of their key: a boolean key takes
true/false, 1/0, yes/no or on/off (any case), a number key a TOML number, a string key
the value as it is, a list key a TOML array. A GATEWAY_* variable that is no key but
looks like one (`GATEWAY_HTTP_PORT`, one underscore) is reported by `env_warnings`.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from gateway.dispatch.queue_modes import QueueMode
from gateway.messages import session_key_from_name

ENV_PREFIX = "GATEWAY_"
DEFAULT_CONFIG_NAME = "gateway.toml"
# Exit code for a configuration error (sysexits EX_CONFIG): systemd must not restart on it.
EXIT_CONFIG = 78

# Keys whose values are secrets: refused in gateway.toml, redacted everywhere.
SECRET_KEYS = frozenset(
    {
        "api_key",
        "token",
        "bot_token",
        "app_token",
        "signing_secret",
        "webhook_secret",
        "admin_token",
        "password",
        "smtp_password",
        "access_token",
        "app_secret",
        "verify_token",
    }
)


class ConfigError(Exception):
    """A configuration problem the operator must fix; the message is one line each."""


def _secret(what: str, env: str) -> Any:
    """A secret setting: never in gateway.toml, from `env` or the file of its `_file`."""
    return Field(None, description=f"Secret: {what}, from {env}, or from the file below.")


def _secret_file(env: str, example: str) -> Any:
    """The `<secret>_file` setting next to a secret: a file holding it."""
    return Field(
        None,
        description=f"File holding the secret above, read at start-up (a trailing newline "
        f"is dropped); also {env}_FILE.",
        examples=[f"/run/secrets/{example}"],
    )


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


#: What a provider's name may be (it appears in `model@provider` and `provider:model`).
_PROVIDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
#: The provider `[llm]` itself describes (base_url, api_key, ...).
DEFAULT_PROVIDER = "default"


class LLMProviderSettings(_Section):
    """One OpenAI-compatible server the failover may ask (`[llm.providers.NAME]`)."""

    base_url: str | None = Field(
        None,
        description="Its OpenAI-compatible endpoint. Unset means api.openai.com.",
        examples=["https://openrouter.ai/api/v1"],
    )
    api_key: SecretStr | None = _secret("its API key", "GATEWAY_LLM__PROVIDERS__NAME__API_KEY")
    api_key_file: Path | None = _secret_file(
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


class FailoverSettings(_Section):
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


class LLMSettings(_Section):
    model: str = Field("gpt-4o-mini", description="Model name sent to the server.")
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1 for Ollama "
        "(also OPENAI_BASE_URL). Unset means api.openai.com.",
        examples=["http://127.0.0.1:11434/v1"],
    )
    api_key: SecretStr | None = _secret("the API key", "OPENAI_API_KEY or GATEWAY_LLM__API_KEY")
    api_key_file: Path | None = _secret_file("GATEWAY_LLM__API_KEY", "openai-api-key")
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
            if not _PROVIDER_NAME.fullmatch(name):
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


class AgentSettings(_Section):
    system_prompt: str = Field(
        "You are a helpful assistant reachable from chat apps and a terminal. "
        "Answer clearly and concisely.",
        description="System prompt for every conversation.",
    )
    memory_window: int = Field(
        10, ge=1, le=1000, description="Recent messages sent to the model with each turn."
    )
    max_tool_iterations: int = Field(
        8, ge=1, le=100, description="Tool-call rounds per turn before a final answer."
    )
    reply_reserve_tokens: int = Field(
        1024, ge=0, description="Tokens of the context window kept free for the reply."
    )
    max_message_chars: int = Field(
        100_000, ge=1, description="Longest user message accepted, in characters."
    )
    tools: list[str] = Field(
        default_factory=lambda: ["current_time"],
        description="Built-in tools offered: current_time, and web_fetch (reaches the "
        "internet: off unless listed here; see [tools.web_fetch]). MCP servers' tools are "
        "offered by [mcp.servers.NAME].",
    )
    owners: list[str] = Field(
        default_factory=list,
        description="Sender ids (channel:user) allowed to run privileged chat commands.",
    )
    offline_after_seconds: float = Field(
        3600.0,
        ge=0,
        description="A message older than this when its turn comes (sent while the "
        "gateway was down, or replayed after a crash) gets a short 'I was offline' notice "
        "instead of an answer; 0 answers every message however old.",
    )
    tool_output_inline_chars: int = Field(
        6_000,
        ge=0,
        description="A tool result longer than this (characters) is stored whole beside "
        "the session and the model sees a preview with a handle, reading the rest with "
        "read_tool_output and search_tool_output; 0 turns this off (long results are cut "
        "in the middle at 16,000 characters).",
    )
    tool_output_preview_chars: int = Field(
        2_000,
        ge=100,
        description="Characters of a stored tool result shown in its preview (two thirds "
        "from its start, one third from its end).",
    )
    tool_output_read_chars: int = Field(
        8_000,
        ge=500,
        description="Most characters one read_tool_output call returns (lower it with a "
        "small context window: a read must fit in the context).",
    )
    tool_output_max_chars: int = Field(
        5_000_000,
        ge=10_000,
        description="Longest tool result stored; the middle of a longer one is cut.",
    )

    @model_validator(mode="after")
    def _tool_output_sizes(self) -> AgentSettings:
        inline = self.tool_output_inline_chars
        if inline and self.tool_output_preview_chars >= inline:
            raise ValueError(
                f"tool_output_preview_chars ({self.tool_output_preview_chars}) must be below "
                f"tool_output_inline_chars ({inline}): a preview shorter than the result"
            )
        return self


class MediaSettings(_Section):
    """`[media]`: images, voice notes and documents people send, and files in replies."""

    enabled: bool = Field(True, description="Read images, voice messages and documents.")
    max_download_mb: float = Field(
        20.0, gt=0, le=2000, description="Largest file fetched (Telegram bots get 20 MB at most)."
    )
    image_max_side: int = Field(
        2048, ge=64, le=16384, description="Longer images are scaled down to this many pixels."
    )
    image_max_kb: int = Field(
        2048, ge=16, description="Larger images are re-encoded (JPEG) to fit under this size."
    )
    image_max_megapixels: float = Field(
        50.0, gt=0, description="Larger images are refused (decompression bombs)."
    )
    vision_models: list[str] = Field(
        default_factory=lambda: [
            "gpt-4o*",
            "gpt-4.1*",
            "gpt-5*",
            "o3*",
            "o4*",
            "*vision*",
            "*-vl*",
            "llava*",
            "gemma3*",
            "claude*",
            "gemini*",
        ],
        description="Models that see images (glob patterns); others get a short note instead.",
    )
    document_max_chars: int = Field(
        20_000,
        ge=100,
        description="Text taken from one document (PDF, DOCX, text); reading stops there.",
    )
    document_max_unpacked_mb: float = Field(
        50.0,
        gt=0,
        le=2000,
        description="A DOCX whose parts, or a PDF whose one stream, expand to more than "
        "this is refused (zip and stream bombs); sizes are counted, not taken on trust.",
    )
    document_max_ratio: float = Field(
        500.0,
        ge=2,
        description="A DOCX part over 1 MB that expands to more than this many times its "
        "packed size is refused: a zip bomb's trait (deflate's most is about 1,000; Word's "
        "styles part is 32, a document of one line repeated 30,000 times 307).",
    )
    document_max_pages: int = Field(
        500, ge=1, description="PDF pages read at most; the model is told where reading stopped."
    )
    document_max_seconds: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Reading one PDF or DOCX stops here (the text so far is used); a "
        "reader stuck past it by 5 s is killed and the document refused.",
    )
    document_max_memory_mb: int = Field(
        512,
        ge=128,
        description="Memory (address space) of the child process that reads one PDF or "
        "DOCX; reading a document that needs more is refused.",
    )
    document_readers: int = Field(
        2, ge=1, le=64, description="PDF and DOCX files read at once (one child process each)."
    )
    transcription_model: str = Field(
        "whisper-1", description="Model of the /audio/transcriptions endpoint for voice messages."
    )
    transcription_base_url: str | None = Field(
        None,
        description="OpenAI-compatible server for transcriptions; unset = llm.base_url.",
        examples=["http://127.0.0.1:8000/v1"],
    )
    transcription_api_key: SecretStr | None = _secret(
        "the transcription server's key (unset: llm's key when the server is llm's, else none)",
        "GATEWAY_MEDIA__TRANSCRIPTION_API_KEY",
    )
    transcription_api_key_file: Path | None = _secret_file(
        "GATEWAY_MEDIA__TRANSCRIPTION_API_KEY", "transcription-api-key"
    )
    transcription_timeout: float = Field(
        120.0, gt=0, description="Seconds one transcription may take."
    )
    code_block_file_chars: int = Field(
        4000,
        ge=0,
        description="A reply's code block longer than this goes out as a file (0: never).",
    )

    @model_validator(mode="after")
    def _check(self) -> MediaSettings:
        # The reader holds the whole file, and a Python with pypdf and lxml takes ~60 MB.
        if self.document_max_memory_mb < self.max_download_mb * 2 + 100:
            raise ValueError(
                f"document_max_memory_mb = {self.document_max_memory_mb} is too little to read "
                f"a {self.max_download_mb:g} MB file (max_download_mb): give at least "
                f"{self.max_download_mb * 2 + 100:.0f}"
            )
        return self


class SessionSettings(_Section):
    fsync: Literal["always", "batch", "never"] = Field(
        "batch",
        description="always: fsync each append; batch: group commit, a turn is still "
        "acknowledged only once on disk; never: leave it to the OS.",
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


class CacheSettingsSection(_Section):
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
        False,
        description="Also match paraphrases of standalone questions (needs the "
        "cache-neardup extra).",
    )
    near_duplicate_threshold: float = Field(
        0.7, gt=0, le=1, description="Cosine similarity a paraphrase must reach."
    )
    disabled_channels: list[str] = Field(
        default_factory=list, description='Channels that never use the cache, e.g. ["slack"].'
    )


class MemorySettings(_Section):
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


class ModelPriceSettings(_Section):
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


class UsageSettings(_Section):
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


class DispatchSettings(_Section):
    max_concurrent_turns: int = Field(
        8, ge=1, le=10_000, description="Turns running at once across all sessions."
    )
    max_queue_per_lane: int = Field(
        50, ge=1, description="Messages waiting per session before senders are told to wait."
    )
    max_queued_total: int = Field(
        10_000, ge=1, description="Messages waiting in all sessions together, at most."
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
    dedupe_ttl_seconds: float = Field(
        7 * 86400.0, gt=0, description="How long platform message ids are remembered."
    )

    @field_validator("channel_modes")
    @classmethod
    def _known_channels(cls, value: dict[str, str]) -> dict[str, str]:
        # The channels of [channels], and the gateway's own (jobs, the chat API).
        known = sorted({*ChannelsSettings.model_fields, "system", "api"})
        for name in value:
            if name not in known:
                raise ValueError(f"there is no channel {name!r}; use one of {', '.join(known)}")
        return value


class HeartbeatJobSettings(_Section):
    every: str | None = Field(None, description="Interval, e.g. '30m' (or use cron).")
    cron: str | None = Field(None, description="Cron schedule, e.g. '0 9 * * 1-5'.")
    timezone: str = Field("UTC", description="Time zone of cron and active_hours.")
    active_hours: str | None = Field(None, description="Only run within, e.g. '08:00-22:00'.")
    prompt: str | None = Field(None, description="What to ask (or use prompt_file).")
    prompt_file: str | None = Field(
        None, description="File with the prompt, relative to the workspace (HEARTBEAT.md)."
    )
    deliver_to: str | None = Field(
        None, description="Where replies go: telegram:<chat> or slack:<channel>; unset = log."
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
                raise ValueError("deliver_to: use channel:chat, e.g. 'telegram:123456'")
        return self


class HeartbeatSettings(_Section):
    jobs: dict[str, HeartbeatJobSettings] = Field(
        default_factory=dict,
        description="Scheduled jobs: a [heartbeat.jobs.NAME] table or a jobs.NAME = { ... } "
        "line each.",
    )


class SubagentSettings(_Section):
    enabled: bool = Field(
        False, description="Offer the model the spawn tool (a task run in its own session)."
    )
    max_depth: int = Field(
        1, ge=1, le=5, description="How deep subagents nest (1: subagents spawn none)."
    )
    max_concurrent: int = Field(
        4, ge=1, le=64, description="Subagents running at once in the whole gateway."
    )
    token_budget: int = Field(
        20_000, ge=100, description="Tokens one subagent's model calls may use in all."
    )
    timeout_seconds: float = Field(300.0, gt=0, description="Longest one subagent may run.")


class ScheduleSettings(_Section):
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


class LogSettings(_Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level logged."
    )
    format: Literal["text", "json"] = Field("text", description="text or json lines.")

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class TelemetrySettings(_Section):
    otlp_endpoint: str | None = Field(
        None,
        description="Where traces go over OTLP/HTTP (protobuf), e.g. http://127.0.0.1:4318 "
        "(/v1/traces is added) or a full .../v1/traces URL. Unset: the standard "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT, else no "
        "tracing (and no cost). Needs the telemetry extra.",
        examples=["http://127.0.0.1:4318"],
    )
    service_name: str = Field(
        "chat-gateway", description="The service.name traces carry (OTEL_SERVICE_NAME wins)."
    )
    capture_content: bool = Field(
        False,
        description="Put message and reply text into spans. Off: spans hold sizes, ids "
        "and timings only, never what people wrote.",
    )


class ApiTokenSettings(_Section):
    """One named client of the OpenAI-compatible API (`[http.api_tokens.NAME]`)."""

    token: SecretStr | None = _secret(
        "this client's bearer token", "GATEWAY_HTTP__API_TOKENS__NAME__TOKEN"
    )
    token_file: Path | None = _secret_file("GATEWAY_HTTP__API_TOKENS__NAME__TOKEN", "ide-token")
    sessions: list[str] = Field(
        default_factory=list,
        description="Session names this client may use start with one of these (e.g. "
        '["ide-"]); its sessions are api:NAME:<session>. Empty: any name.',
    )


class HTTPSettings(_Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP server.")
    token: SecretStr | None = _secret("bearer token of the chat API", "GATEWAY_HTTP__TOKEN")
    token_file: Path | None = _secret_file("GATEWAY_HTTP__TOKEN", "gateway-http-token")
    admin_token: SecretStr | None = _secret(
        "token of the /admin page (unset: the chat API's token; set: chat API clients "
        "cannot open /admin)",
        "GATEWAY_HTTP__ADMIN_TOKEN",
    )
    admin_token_file: Path | None = _secret_file("GATEWAY_HTTP__ADMIN_TOKEN", "gateway-admin-token")
    api_tokens: dict[str, ApiTokenSettings] = Field(
        default_factory=dict,
        description="Named clients of /v1/chat/completions, one [http.api_tokens.NAME] "
        "table each (token_file or GATEWAY_HTTP__API_TOKENS__NAME__TOKEN, sessions); the "
        'token above is the client named "default".',
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=600,
        description="A connection that has not sent a whole request header this long after "
        "it opened (or after the first byte of a later request) is closed.",
    )
    body_timeout_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="A request body not all there this long after its header gets 408 and "
        "the connection is closed.",
    )
    keepalive_timeout_seconds: float = Field(
        75.0,
        gt=0,
        le=3600,
        description="An idle kept-alive connection is closed after this long; keep it above "
        "the idle timeout of a proxy's connection pool in front (nginx: 60 s).",
    )
    max_connections: int = Field(
        512,
        ge=1,
        le=1_000_000,
        description="Connections open at once; at the bound a new one replaces the longest "
        "idle one, or gets 503 when none is idle.",
    )
    auth_max_failures: int = Field(
        10,
        ge=1,
        le=10_000,
        description="Wrong tokens (chat API, admin page) one client address may send in "
        "the window below; then 429 with Retry-After until the oldest leaves it.",
    )
    auth_failure_window_seconds: float = Field(
        60.0, gt=0, le=86400, description="The window of auth_max_failures, in seconds."
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses or CIDR networks of proxies in front of the gateway, e.g. "
        '["127.0.0.1", "10.0.0.0/8"]: only requests from them have their X-Forwarded-For '
        "read, for the client address that wrong tokens are counted under.",
    )

    @field_validator("api_tokens")
    @classmethod
    def _token_names(cls, value: dict[str, ApiTokenSettings]) -> dict[str, ApiTokenSettings]:
        for name in value:
            if name == "default" or not _PROVIDER_NAME.fullmatch(name):
                raise ValueError(
                    f"api_tokens: {name!r} cannot name a client; use up to 32 letters, "
                    'digits, - and _ (and not "default": that is http.token\'s client)'
                )
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _proxy_networks(cls, value: list[str]) -> list[str]:
        if value:  # the import pulls in aiohttp: not for every command's settings
            from gateway.http.throttle import parse_networks

            parse_networks(value)
        return value


class StorageSettings(_Section):
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
            from gateway.storage.postgres import StorageError, check_url

            try:
                check_url(value)
            except StorageError as exc:
                raise ValueError(str(exc)) from None
        return value or None


class CLIChannelSettings(_Section):
    enabled: bool = Field(True, description="Chat in the terminal when stdin is a TTY.")
    session: str = Field(
        "cli:direct",
        description="Session of the terminal chat: a name (work = cli:work) or a full key.",
    )

    @field_validator("session")
    @classmethod
    def _session_key(cls, value: str) -> str:
        return session_key_from_name(value)


class AccessSection(_Section):
    """Who may talk to the bot on a chat platform."""

    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "pairing",
        description="Direct messages: open = anyone, allowlist = allow_from only, pairing = "
        "strangers get a code for `gateway pairing approve`.",
    )
    allow_from: list[str] = Field(
        default_factory=list, description='Sender or chat ids always allowed; "*" = anyone.'
    )
    group_policy: Literal["open", "allowlist", "disabled"] = Field(
        "allowlist", description="Groups and channels: open, allowlist or disabled."
    )
    require_mention: bool = Field(
        True, description="In groups, answer only when mentioned or replied to."
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")
    streaming: bool = Field(
        False, description="Show the reply while it is written (needs llm.stream = true)."
    )


class TelegramSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Telegram bot.")
    token: SecretStr | None = _secret("the BotFather token", "GATEWAY_CHANNELS__TELEGRAM__TOKEN")
    token_file: Path | None = _secret_file("GATEWAY_CHANNELS__TELEGRAM__TOKEN", "telegram-token")
    mode: Literal["polling", "webhook"] = Field(
        "polling", description="polling (no public URL needed) or webhook."
    )
    base_url: str | None = Field(
        None,
        description="Bot API server for self-hosted servers, e.g. http://127.0.0.1:8081/bot "
        "(the token is appended).",
        examples=["http://127.0.0.1:8081/bot"],
    )
    base_file_url: str | None = Field(
        None,
        description="File download URL prefix, likewise.",
        examples=["http://127.0.0.1:8081/file/bot"],
    )
    webhook_url: str | None = Field(
        None,
        description="Public HTTPS URL that reaches this gateway's /telegram/webhook "
        "(webhook mode).",
        examples=["https://bot.example.com/telegram/webhook"],
    )
    webhook_secret: SecretStr | None = _secret(
        "webhook secret token ([A-Za-z0-9_-])", "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET"
    )
    webhook_secret_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET", "telegram-webhook-secret"
    )
    poll_timeout: int = Field(30, ge=0, le=50, description="Long-poll seconds per request.")

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)


class SlackSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Slack app.")
    bot_token: SecretStr | None = _secret("xoxb- token", "GATEWAY_CHANNELS__SLACK__BOT_TOKEN")
    bot_token_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__SLACK__BOT_TOKEN", "slack-bot-token"
    )
    app_token: SecretStr | None = _secret(
        "xapp- token for Socket Mode", "GATEWAY_CHANNELS__SLACK__APP_TOKEN"
    )
    app_token_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__SLACK__APP_TOKEN", "slack-app-token"
    )
    signing_secret: SecretStr | None = _secret(
        "signing secret for HTTP mode", "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET"
    )
    signing_secret_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET", "slack-signing-secret"
    )
    mode: Literal["socket", "http"] = Field(
        "socket", description="socket (no public URL needed) or http (/slack/events)."
    )
    base_url: str | None = Field(
        None,
        description="Web API URL, e.g. https://slack-gov.com/api/ for GovSlack.",
        examples=["https://slack-gov.com/api/"],
    )
    reply_mode: Literal["thread", "channel"] = Field(
        "thread",
        description="Where to answer: thread = always in a thread, channel = in the channel.",
    )


class EmailSettings(_Section):
    """One mailbox: mail in over IMAP, replies out over SMTP (docs/email.md). Mail has no
    groups: who may write is `dm_policy` and `allow_from` alone."""

    enabled: bool = Field(False, description="Answer the mail of one mailbox.")
    address: str | None = Field(
        None,
        description="The mailbox's address: replies come from it, mail from it is never answered.",
        examples=["assistant@example.com"],
    )
    from_name: str = Field("", description="Display name on replies, e.g. Assistant.")
    imap_host: str | None = Field(None, description="IMAP server.", examples=["imap.example.com"])
    imap_port: int | None = Field(
        None, ge=1, le=65535, description="Default: 993 with tls, 143 with starttls."
    )
    imap_security: Literal["tls", "starttls"] = Field(
        "tls", description="tls (IMAPS) or starttls; never without TLS."
    )
    username: str | None = Field(None, description="IMAP (and SMTP) login; default: address.")
    password: SecretStr | None = _secret(
        "the mailbox password", "GATEWAY_CHANNELS__EMAIL__PASSWORD"
    )
    password_file: Path | None = _secret_file("GATEWAY_CHANNELS__EMAIL__PASSWORD", "email-password")
    folder: str = Field("INBOX", description="The folder watched for new mail.")
    processed_folder: str | None = Field(
        None,
        description="Move mail here once it is in the journal, instead of flagging it \\Seen.",
        examples=["Processed"],
    )
    idle: bool = Field(True, description="Wait for mail with IMAP IDLE where the server has it.")
    poll_interval_seconds: float = Field(
        60.0, gt=0, le=3600, description="Without IDLE: seconds between two looks at the folder."
    )
    catch_up_days: int = Field(
        7,
        ge=0,
        description="At the first start (and after the server renumbered the folder): unseen "
        "mail of the last N days is answered; 0 = all unseen mail.",
    )
    smtp_host: str | None = Field(None, description="SMTP server.", examples=["smtp.example.com"])
    smtp_port: int | None = Field(
        None, ge=1, le=65535, description="Default: 587 with starttls, 465 with tls."
    )
    smtp_security: Literal["starttls", "tls"] = Field(
        "starttls", description="starttls (submission) or tls (SMTPS); never without TLS."
    )
    smtp_username: str | None = Field(None, description="SMTP login; default: username.")
    smtp_password: SecretStr | None = _secret(
        "the SMTP password when it differs", "GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD"
    )
    smtp_password_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__EMAIL__SMTP_PASSWORD", "email-smtp-password"
    )
    tls_ca_file: Path | None = Field(
        None,
        description="CA certificates for servers with a private CA (PEM).",
        examples=["/etc/ssl/private-ca.pem"],
    )
    threads: bool = Field(
        True,
        description="A conversation per email thread (email:ADDRESS:thread:ROOT); false: one "
        "per correspondent (email:ADDRESS).",
    )
    own_addresses: list[str] = Field(
        default_factory=list,
        description="Other addresses of the gateway (aliases): mail from them is never answered.",
    )
    require_auth: list[Literal["spf", "dkim", "dmarc"]] = Field(
        default_factory=list,
        description="Answer only mail whose Authentication-Results (from authserv_id) show "
        'these passed for the sender\'s domain, e.g. ["dmarc"].',
    )
    authserv_id: str | None = Field(
        None,
        description="Your receiving server's id in Authentication-Results (with require_auth).",
        examples=["mx.example.com"],
    )
    refusal_replies: bool = Field(
        False,
        description="Answer mail the allowlist refuses with a one-line refusal (off: such "
        "mail, mostly spam with a forged sender, is ignored).",
    )
    max_message_mb: float = Field(
        25.0, gt=0, description="Larger mail is answered without its body being read."
    )
    dm_policy: Literal["open", "allowlist", "pairing"] = Field(
        "allowlist",
        description="Who is answered: allowlist (allow_from only), pairing (strangers get a "
        "code by reply, for `gateway pairing approve email CODE`) or open (anyone; spam too).",
    )
    allow_from: list[str] = Field(
        default_factory=list,
        description="Addresses (alice@example.com) and domains (example.com) always "
        'answered; "*" = anyone.',
    )
    pairing_ttl_seconds: float = Field(3600.0, gt=0, description="How long a code is valid.")

    @model_validator(mode="after")
    def _complete(self) -> EmailSettings:
        if self.require_auth and not self.authserv_id:
            raise ValueError(
                "require_auth needs authserv_id: the id your receiving server writes in "
                "Authentication-Results (others can be forged by the sender)"
            )
        return self

    def resolved_password(self) -> str | None:
        """The IMAP password (from the environment or `password_file`), if any."""
        return reveal(self.password)

    def resolved_smtp_password(self) -> str | None:
        """The SMTP password: its own, else the IMAP one."""
        return reveal(self.smtp_password) or self.resolved_password()


class MatrixSettings(AccessSection):
    """A Matrix account the gateway answers as (channels/matrix, docs/matrix.md)."""

    enabled: bool = Field(False, description="Serve a Matrix account.")
    homeserver: str | None = Field(
        None,
        description="The homeserver's client-server API URL.",
        examples=["https://matrix.example.org"],
    )
    user_id: str | None = Field(
        None, description="The bot account's full Matrix id.", examples=["@gateway:example.org"]
    )
    access_token: SecretStr | None = _secret(
        "the account's access token", "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN"
    )
    access_token_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN", "matrix-access-token"
    )
    sync_timeout: int = Field(30, ge=0, le=120, description="Long-poll seconds per /sync.")
    encryption: bool = Field(
        True,
        description="Take part in end-to-end encrypted rooms (docs/matrix.md, section 7); "
        "false declines them with a reason.",
    )
    room_key_wait: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds an encrypted message waits for its room key before its sender "
        "is told it could not be read (later messages of its room wait behind it).",
    )

    @field_validator("user_id")
    @classmethod
    def _matrix_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"@[^:\s]+:\S+", value):
            raise ValueError("a Matrix user id looks like @gateway:example.org")
        return value

    def resolved_token(self) -> str | None:
        """The access token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)


class WhatsAppSettings(AccessSection):
    """A WhatsApp Business number through the Cloud API (channels/whatsapp, docs/whatsapp.md)."""

    enabled: bool = Field(False, description="Serve WhatsApp Business numbers (Cloud API).")
    phone_number_ids: list[str] = Field(
        default_factory=list,
        description="The business numbers' phone number ids (WhatsApp Manager > API Setup); "
        "messages to other numbers are acknowledged and ignored.",
    )
    access_token: SecretStr | None = _secret(
        "a system user's token with whatsapp_business_messaging",
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN",
    )
    access_token_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN", "whatsapp-access-token"
    )
    app_secret: SecretStr | None = _secret(
        "the Meta app's secret, which signs every webhook (X-Hub-Signature-256)",
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET",
    )
    app_secret_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET", "whatsapp-app-secret"
    )
    verify_token: SecretStr | None = _secret(
        "the webhook's verify token, as typed in the App Dashboard",
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN",
    )
    verify_token_file: Path | None = _secret_file(
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN", "whatsapp-verify-token"
    )
    api_url: str = Field(
        "https://graph.facebook.com", description="The Graph API's root (no version)."
    )
    api_version: str = Field("v26.0", description="The Graph API version the requests name.")
    template: str | None = Field(
        None,
        description="An approved template sent instead of a reply that falls outside the "
        "24-hour customer-service window; unset: such a reply is kept as undeliverable.",
        examples=["pending_reply"],
    )
    template_language: str = Field("en", description="The template's language code.")
    template_parameter: bool = Field(
        True,
        description="Pass the start of the reply as the template body's {{1}} parameter.",
    )
    quote_replies: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Quote the person's message in the reply: auto = only when they wrote "
        "again meanwhile.",
    )
    read_receipts: bool = Field(
        True, description="Mark messages read and show the typing indicator while answering."
    )

    @field_validator("phone_number_ids")
    @classmethod
    def _digits(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.isdigit():
                raise ValueError(f"{item!r}: a phone number id is digits only (not the number)")
        return value

    def resolved_token(self) -> str | None:
        """The Graph API token (from the environment or `access_token_file`), if any."""
        return reveal(self.access_token)


class DiscordSettings(AccessSection):
    enabled: bool = Field(False, description="Serve a Discord bot.")
    token: SecretStr | None = _secret(
        "the bot token (Developer Portal > Bot > Reset Token)", "GATEWAY_CHANNELS__DISCORD__TOKEN"
    )
    token_file: Path | None = _secret_file("GATEWAY_CHANNELS__DISCORD__TOKEN", "discord-token")
    api_url: str | None = Field(
        None,
        description="HTTP API base URL, for an egress proxy or tests (default "
        "https://discord.com/api/v10).",
        examples=["https://discord-proxy.internal/api/v10"],
    )
    gateway_url: str | None = Field(
        None,
        description="Gateway WebSocket URL; when set, resumes go there too (default "
        "wss://gateway.discord.gg/).",
        examples=["wss://discord-proxy.internal/gateway/"],
    )
    message_content: bool = Field(
        True,
        description="Ask for the privileged Message Content intent (enable it on the "
        "Developer Portal's Bot page); without it the bot reads only DMs and messages "
        "that mention it.",
    )
    backfill_max_age_seconds: float = Field(
        86400.0,
        gt=0,
        description="After a (re)connect, read back what was written while away up to "
        "this old; older messages are not answered.",
    )
    backfill_max_messages: int = Field(
        500, ge=1, le=10_000, description="At most this many messages read back per conversation."
    )
    backfill_max_conversations: int = Field(
        1000,
        ge=1,
        description="At most this many conversations read back (the most recently active; "
        "each costs one request, DMs always, server channels only when they have news).",
    )

    def resolved_token(self) -> str | None:
        """The bot token (from the environment or `token_file`), if any."""
        return reveal(self.token)


# ----------------------------------------------------------------- tools and MCP servers

_MCP_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_))*")


class WebFetchSettings(_Section):
    """The `web_fetch` tool; it is offered only when agent.tools lists it."""

    timeout: float = Field(15.0, gt=0, le=300, description="Seconds one fetch may take in all.")
    max_bytes: int = Field(
        2_000_000, ge=1024, description="Bytes of a page read at most; the rest is cut."
    )
    max_chars: int = Field(
        200_000,
        ge=100,
        description="Characters of a page's text kept; past [agent] "
        "tool_output_inline_chars the model sees a preview and reads the rest on demand.",
    )
    max_redirects: int = Field(5, ge=0, le=20, description="Redirects followed, each checked.")
    allow_networks: list[str] = Field(
        default_factory=list,
        description="Private, loopback or link-local addresses (CIDR) it may still reach, "
        'e.g. ["10.1.2.0/24"]; everything but public addresses is refused otherwise.',
    )

    @field_validator("allow_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        import ipaddress

        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an address or a CIDR network") from None
        return value


class ToolsSettings(_Section):
    web_fetch: WebFetchSettings = Field(default_factory=WebFetchSettings)


class MCPServerSettings(_Section):
    """One MCP server: a command run over stdio, or a streamable HTTP url."""

    enabled: bool = Field(True, description="Start this server with the gateway.")
    command: str | None = Field(None, description="Program to run (stdio transport).")
    args: list[str] = Field(default_factory=list, description="Its arguments.")
    url: str | None = Field(None, description="Streamable HTTP endpoint instead of a command.")
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment of the command (no secrets here)."
    )
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the gateway's environment passed on to the command "
        "(secrets go this way); nothing else of it is, but PATH, HOME and the like.",
    )
    tools: list[str] | None = Field(
        None, description="Tools of the server offered to the model; unset = all."
    )
    timeout: float = Field(30.0, gt=0, le=3600, description="Seconds one tool call may take.")
    startup_timeout: float = Field(
        30.0, gt=0, le=600, description="Seconds the server may take to start and list tools."
    )

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) and url (streamable HTTP)")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("url: use an http:// or https:// address")
        if self.url is not None and (self.env or self.pass_env):
            raise ValueError("env and pass_env are for a command, not for a url")
        return self


class MCPSettings(_Section):
    servers: dict[str, MCPServerSettings] = Field(
        default_factory=dict,
        description="MCP servers whose tools the model may call, as NAME__tool: a "
        "[mcp.servers.NAME] table each. They reach outside the gateway: none by default.",
    )

    @field_validator("servers")
    @classmethod
    def _names(cls, value: dict[str, MCPServerSettings]) -> dict[str, MCPServerSettings]:
        for name in value:
            if len(name) > 32 or not _MCP_NAME.fullmatch(name):
                raise ValueError(
                    f"server name {name!r}: use up to 32 letters, digits, - and single _ "
                    "(tools are named NAME__tool)"
                )
        return value


def reveal(secret: SecretStr | None) -> str | None:
    """A secret's value; None when it is unset or empty."""
    return (secret.get_secret_value() or None) if secret is not None else None


class ChannelsSettings(_Section):
    cli: CLIChannelSettings = Field(default_factory=CLIChannelSettings)
    telegram: TelegramSettings = Field(default_factory=TelegramSettings)
    slack: SlackSettings = Field(default_factory=SlackSettings)
    email: EmailSettings = Field(default_factory=EmailSettings)
    matrix: MatrixSettings = Field(default_factory=MatrixSettings)
    whatsapp: WhatsAppSettings = Field(default_factory=WhatsAppSettings)
    discord: DiscordSettings = Field(default_factory=DiscordSettings)


class Settings(_Section):
    """Everything the gateway reads from configuration, validated and frozen."""

    # The default is a string, validated into a Path like one read from gateway.toml
    # (strict validation of defaults takes no Path object).
    workspace: Path = Field(  # type: ignore[assignment]
        "~/.gateway", description="Folder for sessions, memory and cache."
    )
    workspace_io: Literal["loop", "threads"] = Field(
        "loop",
        description="loop: a turn's small file and SQLite work runs on the event loop "
        "when it cannot wait (local disks); threads: all of it in worker threads "
        "(network file systems, where even a small write can stall).",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The event loop of `gateway run`. auto: uvloop where it is installed "
        "(a dependency on Linux and macOS; less CPU per turn), else asyncio's own; "
        "uvloop: refuse to start without it; asyncio: always asyncio's own.",
    )
    llm: LLMSettings = Field(default_factory=LLMSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    media: MediaSettings = Field(default_factory=MediaSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    memory: MemorySettings = Field(default_factory=MemorySettings)
    cache: CacheSettingsSection = Field(default_factory=CacheSettingsSection)
    dispatch: DispatchSettings = Field(default_factory=DispatchSettings)
    usage: UsageSettings = Field(default_factory=UsageSettings)
    heartbeat: HeartbeatSettings = Field(default_factory=HeartbeatSettings)
    subagents: SubagentSettings = Field(default_factory=SubagentSettings)
    schedules: ScheduleSettings = Field(default_factory=ScheduleSettings)
    log: LogSettings = Field(default_factory=LogSettings)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    channels: ChannelsSettings = Field(default_factory=ChannelsSettings)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    mcp: MCPSettings = Field(default_factory=MCPSettings)

    @field_validator("event_loop")
    @classmethod
    def _uvloop_installed(cls, value: str) -> str:
        if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("'uvloop' is not installed here (pip install uvloop), or set 'auto'")
        return value

    @property
    def use_uvloop(self) -> bool:
        """Whether `gateway run` runs on uvloop (`event_loop`)."""
        if self.event_loop == "asyncio":
            return False
        return importlib.util.find_spec("uvloop") is not None

    @property
    def io_on_loop(self) -> bool:
        """`workspace_io == "loop"`: what the stores take as `io_on_loop`."""
        return self.workspace_io == "loop"

    @property
    def workspace_path(self) -> Path:
        return self.workspace.expanduser()

    @property
    def sessions_dir(self) -> Path:
        return self.workspace_path / "sessions"

    def undeliverable_heartbeats(self) -> list[tuple[str, str]]:
        """(job, deliver_to) of heartbeat jobs whose target channel is not enabled: their
        replies would only reach the log."""
        enabled = {
            name
            for name, on in (
                ("cli", self.channels.cli.enabled),
                ("telegram", self.channels.telegram.enabled),
                ("slack", self.channels.slack.enabled),
                ("email", self.channels.email.enabled),
                ("matrix", self.channels.matrix.enabled),
                ("whatsapp", self.channels.whatsapp.enabled),
                ("discord", self.channels.discord.enabled),
            )
            if on
        }
        return [
            (name, job.deliver_to)
            for name, job in self.heartbeat.jobs.items()
            if job.deliver_to and job.deliver_to.partition(":")[0] not in enabled
        ]

    def secrets(self) -> list[str]:
        """Every secret value configured (those read from files too), for log redaction."""
        found: list[str] = []

        def collect(section: BaseModel) -> None:
            for name in type(section).model_fields:
                value = getattr(section, name)
                if isinstance(value, BaseModel):
                    collect(value)
                elif isinstance(value, dict):  # [llm.providers.NAME] and the like
                    for item in value.values():
                        if isinstance(item, BaseModel):
                            collect(item)
                elif isinstance(value, SecretStr) and value.get_secret_value():
                    found.append(value.get_secret_value())

        collect(self)
        if self.storage.url:
            from gateway.storage.postgres import url_password

            password = url_password(self.storage.url)
            if password:
                found.append(password)
        return found


# --------------------------------------------------------------------------- loading


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {part} is a value, not a section")
        node = child
    node[path[-1]] = value


_ENV_TRUE = frozenset({"true", "1", "yes", "on"})
_ENV_FALSE = frozenset({"false", "0", "no", "off"})


def _core_type(annotation: Any) -> Any:
    """`X` of `X | None`; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _field_at(path: list[str]) -> FieldInfo | None:
    """The field a dotted config path names (through [heartbeat.jobs.NAME] tables too),
    or None if it names none."""
    model: Any = Settings
    field: FieldInfo | None = None
    parts = iter(path)
    for part in parts:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _core_type(field.annotation)
        if get_origin(model) is dict:
            if next(parts, None) is None:
                return field
            model = get_args(model)[1]
    return field


def _parse_env_value(path: list[str], raw: str) -> Any:
    """An environment value (always a string) read by the type of its key: booleans
    from true/false, 1/0, yes/no, on/off; strings as they are; numbers, lists and
    tables as TOML. A value that fits no reading stays a string, for validation to
    refuse with a message."""
    field = _field_at(path)
    kind = _core_type(field.annotation) if field is not None else None
    if kind is bool:
        word = raw.strip().lower()
        return True if word in _ENV_TRUE else False if word in _ENV_FALSE else raw
    if kind in (str, Path, SecretStr) or get_origin(kind) is Literal:
        return raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _has_password(url: str) -> bool:
    from gateway.storage.postgres import url_password

    return bool(url_password(url))


def _reject_secrets_in_file(data: Mapping[str, Any], path: Path, prefix: str = "") -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _reject_secrets_in_file(value, path, dotted + ".")
        elif dotted == "storage.url" and isinstance(value, str) and _has_password(value):
            raise ConfigError(
                f"storage.url: a password does not belong in {path.name}; set "
                "GATEWAY_STORAGE__URL in the environment, or PGPASSWORD / ~/.pgpass"
            )
        elif key in SECRET_KEYS:
            env = ENV_PREFIX + dotted.upper().replace(".", "__")
            raise ConfigError(
                f"{dotted}: secrets do not belong in {path.name}; remove it and set {env} "
                f"in the environment, or name a file holding it in {key}_file"
            )


def _secret_sources(dotted: str) -> str:
    """Where a secret's value can come from besides its file, for error messages."""
    env = ENV_PREFIX + dotted.upper().replace(".", "__")
    return f"OPENAI_API_KEY or {env}" if dotted == "llm.api_key" else env


def _read_secret_files(data: dict[str, Any], prefix: str = "") -> None:
    """Put the content of every secret's `<name>_file` into `<name>`, in place.

    Read once, at load: a missing or unreadable file stops start-up with one line, and
    a rotated secret is picked up by a restart. A trailing newline (as `echo` and most
    editors leave) is dropped. A secret given both as a value and as a file is refused:
    which one would win is a guess the operator should not have to make.
    """
    for key, value in list(data.items()):
        if isinstance(value, dict):
            _read_secret_files(value, f"{prefix}{key}.")
            continue
        secret = key.removesuffix("_file")
        if secret == key or secret not in SECRET_KEYS or value in (None, ""):
            continue
        name, dotted = f"{prefix}{key}", f"{prefix}{secret}"
        if data.get(secret) not in (None, ""):
            raise ConfigError(
                f"{dotted} and {name} are both set; keep one: unset "
                f"{_secret_sources(dotted)}, or remove {name}"
            )
        path = Path(str(value)).expanduser()
        try:
            text = path.read_text(encoding="utf-8").rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"{name}: cannot read {path} ({exc.strerror}); fix the path or let the "
                "gateway's user read the file"
            ) from None
        except UnicodeDecodeError:
            raise ConfigError(
                f"{name}: {path} is not UTF-8 text; write the secret as text"
            ) from None
        if not text.strip():
            raise ConfigError(f"{name}: {path} is empty; write the secret into it")
        data[secret] = text


def _env_name(loc: tuple[Any, ...]) -> str:
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc)


_EXPECTED = {
    "bool_type": "expected true or false",
    "int_type": "expected a whole number",
    "float_type": "expected a number",
}


def _describe(error: Mapping[str, Any], config_file: str = "gateway.toml") -> str:
    """One line for a validation error; `config_file` names the file the user gave."""
    loc = tuple(error.get("loc", ()))
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        near = _closest(dotted, all_keys())
        hint = f"did you mean {near}?" if near else "check its spelling against `gateway init`"
        return f"{dotted}: unknown key; {hint}"
    if kind == "missing":
        return f"{dotted}: required; set it in {config_file} or as {_env_name(loc)}"
    given = error.get("input")
    if isinstance(given, str) and "://" in given:  # a URL may carry a password
        from gateway.storage.postgres import redact_url

        given = redact_url(given)
    if kind in _EXPECTED:
        unquote = " (write it without quotes)" if isinstance(given, str) else ""
        return (
            f"{dotted}: {_EXPECTED[kind]}, got {given!r}{unquote}; "
            f"fix it in {config_file} or {_env_name(loc)}"
        )
    message = str(error.get("msg", "invalid value"))
    if isinstance(given, dict):
        # A section's check: its whole table is no help to read (and may hold a secret);
        # a message that starts with the key it is about names that key.
        message = message.removeprefix("Value error, ")
        key, colon, rest = message.partition(": ")
        if colon and re.fullmatch(r"[\w.-]+", key):
            dotted, message = f"{dotted}.{key}", rest
        return f"{dotted}: {message}; fix it in {config_file}"
    return f"{dotted}: {message} (got {given!r}); fix it in {config_file} or {_env_name(loc)}"


def all_keys() -> list[str]:
    """Every dotted key of the configuration; a heartbeat job's keys with the job's
    name as `NAME` (heartbeat.jobs.NAME.every)."""
    keys: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            kind = _core_type(field.annotation)
            value = get_args(kind)[1] if get_origin(kind) is dict else None
            if isinstance(value, type) and issubclass(value, BaseModel):
                walk(value, f"{prefix}{name}.NAME.")
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                walk(kind, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)

    walk(Settings, "")
    return keys


def _closest(name: str, candidates: list[str]) -> str | None:
    """The candidate `name` most likely misspells: the same but for underscores (and
    case), else a close spelling; None if nothing is close."""
    squeezed = name.replace("_", "").lower()
    # A misspelt section (`htpp`) is near a section's name, not a key's full path.
    sections = {c.rsplit(".", 1)[0] for c in candidates if "." in c}
    candidates = [*candidates, *sorted(sections)]
    for candidate in candidates:
        if candidate.replace("_", "").lower() == squeezed:
            return candidate
    # One slip in a short word is a larger share of it: `htpp` is 0.75 like `http`.
    cutoff = 0.85 if len(name) > 6 else 0.74
    near = difflib.get_close_matches(name, candidates, n=1, cutoff=cutoff)
    return near[0] if near else None


#: Variables that are ours without being GATEWAY_<SECTION>__<KEY>.
_SHORTCUTS = {
    "GATEWAY_WORKSPACE": ["workspace"],
    "GATEWAY_WORKSPACE_IO": ["workspace_io"],
    "GATEWAY_EVENT_LOOP": ["event_loop"],
    "GATEWAY_MODEL": ["llm", "model"],
}


def env_warnings(environ: Mapping[str, str]) -> list[str]:
    """One line per GATEWAY_* variable that looks like a key but is none (a single
    underscore where the scheme needs two, say), naming the closest key. Variables
    nothing like ours (GATEWAY_INTERFACE of CGI, say) are left alone: the prefix is
    not ours alone."""
    ours = {"GATEWAY_CONFIG", *_SHORTCUTS, *(_env_name(tuple(k.split("."))) for k in all_keys())}
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in ours:
            continue
        if "__" in name and _field_at([p.lower() for p in name[len(ENV_PREFIX) :].split("__")]):
            continue  # a key of a heartbeat job, e.g. GATEWAY_HEARTBEAT__JOBS__DISKS__EVERY
        near = _closest(name, sorted(ours))
        if near is not None:
            warnings.append(f"{name} is not a setting and is ignored; did you mean {near}?")
    return warnings


def find_config_path(
    explicit: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> Path | None:
    """The config file to read: --config, then GATEWAY_CONFIG, then ./gateway.toml."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file; run `gateway init` to create one")
        return path
    if environ.get("GATEWAY_CONFIG"):
        path = Path(environ["GATEWAY_CONFIG"]).expanduser()
        if not path.is_file():
            raise ConfigError(f"GATEWAY_CONFIG={path}: no such file")
        return path
    default = Path.cwd() / DEFAULT_CONFIG_NAME
    return default if default.is_file() else None


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read and validate the configuration. Raises ConfigError with one line per problem.

    `overrides` are dotted keys from command-line flags (e.g. {"llm.model": "x"}).
    """
    env = os.environ if environ is None else environ
    path = find_config_path(config_path, env)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc}); fix the file") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        _reject_secrets_in_file(data, path)

    # Conventional variables of the OpenAI ecosystem.
    if env.get("OPENAI_API_KEY"):
        _set_path(data, ["llm", "api_key"], env["OPENAI_API_KEY"])
    if env.get("OPENAI_BASE_URL"):
        _set_path(data, ["llm", "base_url"], env["OPENAI_BASE_URL"])

    for name, value in sorted(env.items()):
        if name in _SHORTCUTS:
            _set_path(data, _SHORTCUTS[name], value)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
            if not all(parts):
                raise ConfigError(f"{name}: malformed; use GATEWAY_<SECTION>__<KEY>")
            # Secrets and the names of their files are text, whatever they look like.
            raw = parts[-1] in SECRET_KEYS or parts[-1].removesuffix("_file") in SECRET_KEYS
            _set_path(data, parts, value if raw else _parse_env_value(parts, value))

    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(data, dotted.split("."), value)

    _read_secret_files(data)
    try:
        # Strict, in JSON mode: booleans and numbers must be written as such, while
        # strings still become paths and secrets (JSON has no such types).
        return Settings.model_validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        named = str(path) if path is not None else "gateway.toml"
        lines = [_describe(err, named) for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


# --------------------------------------------------------------------------- starter file


def _commented_section(model: type[BaseModel], instance: BaseModel, header: str) -> list[str]:
    lines: list[str] = []
    nested: list[tuple[str, type[BaseModel], BaseModel]] = []
    body: list[str] = []
    for name, field in model.model_fields.items():
        value = getattr(instance, name)
        if isinstance(value, BaseModel):
            nested.append((name, type(value), value))
            continue
        if field.description:
            body.append(f"# {field.description}")
        if name in SECRET_KEYS:
            continue
        if isinstance(value, dict) and not value:
            body.extend(_EXAMPLES.get(f"{header}.{name}" if header else name, []))
            continue
        if value is None:
            # Commented out, with an example that is valid when uncommented; a field
            # without an example keeps only its description.
            if field.examples:
                body.append("# " + tomli_w.dumps({name: field.examples[0]}).rstrip("\n"))
        else:
            plain = str(value) if isinstance(value, Path) else value
            body.append(tomli_w.dumps({name: plain}).rstrip("\n"))
    if body:
        if header:
            lines.append(f"[{header}]")
        lines.extend(body)
        lines.append("")
    for name, sub_model, sub in nested:
        lines.extend(_commented_section(sub_model, sub, f"{header}.{name}" if header else name))
    return lines


# One line each, so that uncommenting a line gives a valid config.
_EXAMPLES: dict[str, list[str]] = {
    "mcp.servers": [
        '# servers.files = { command = "npx", args = ["-y", '
        '"@modelcontextprotocol/server-filesystem", "/srv/shared"], tools = ["read_file"] }',
        '# servers.search = { url = "http://127.0.0.1:9000/mcp", timeout = 20.0 }',
    ],
    "heartbeat.jobs": [
        '# jobs.morning = { cron = "0 8 * * 1-5", timezone = "Europe/Berlin", '
        'prompt = "Anything on my calendar today?" }',
    ],
    "llm.providers": [
        '# providers.backup = { base_url = "https://openrouter.ai/api/v1", '
        'api_key_file = "/run/secrets/openrouter-key", connect_timeout = 5.0 }',
    ],
    "llm.aliases": [
        '# aliases.smart = ["default:gpt-4o", "default:gpt-4o-mini"]',
    ],
    "http.api_tokens": [
        '# api_tokens.ide = { token_file = "/run/secrets/ide-token", sessions = ["ide-"] }',
    ],
    "dispatch.channel_modes": [
        '# channel_modes.telegram = "steer"',
        '# channel_modes.slack = "collect"',
    ],
    "usage.prices": [
        '# prices."gpt-4o-mini" = { prompt = 0.15, completion = 0.6 }',
        '# prices."whisper-1" = { per_minute = 0.006 }',
    ],
}


def starter_toml() -> str:
    """The documented default configuration, as a commented gateway.toml."""
    head = [
        "# gateway.toml: configuration of the chat gateway.",
        "# Every key can be overridden from the environment as GATEWAY_<SECTION>__<KEY>,",
        "# e.g. GATEWAY_LLM__MODEL=gpt-4o or GATEWAY_HTTP__PORT=9000.",
        "# Secrets never go here: set them in the environment (OPENAI_API_KEY or",
        "# GATEWAY_LLM__API_KEY, GATEWAY_HTTP__TOKEN, ...) or name a file holding each one",
        '# (api_key_file, token_file, ...: e.g. token_file = "/run/secrets/telegram-token").',
        "",
    ]
    return "\n".join(head + _commented_section(Settings, Settings(), "")).rstrip() + "\n"


def write_starter_config(path: Path) -> None:
    """Write the starter config, making missing parent folders; never overwrites an
    existing file (FileExistsError). Other OSErrors are the caller's to report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("x", encoding="utf-8") as fh:
        fh.write(starter_toml())
