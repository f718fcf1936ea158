"""Configuration: gateway.toml, GATEWAY_* environment overrides and command-line flags,
validated into one frozen settings object with errors a person can act on.

Precedence, lowest first: built-in defaults, gateway.toml, the conventional
OPENAI_API_KEY / OPENAI_BASE_URL, GATEWAY_<SECTION>__<KEY> variables, command-line flags.
Secrets (API keys, tokens) come only from the environment or from files named in the
config; a secret written into gateway.toml is refused, and secrets are never printed.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

ENV_PREFIX = "GATEWAY_"
DEFAULT_CONFIG_NAME = "gateway.toml"
# Exit code for a configuration error (sysexits EX_CONFIG): systemd must not restart on it.
EXIT_CONFIG = 78

# Keys whose values are secrets: refused in gateway.toml, redacted everywhere.
SECRET_KEYS = frozenset({"api_key", "token", "bot_token", "app_token", "signing_secret"})


class ConfigError(Exception):
    """A configuration problem the operator must fix; the message is one line each."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class LLMSettings(_Section):
    model: str = Field("gpt-4o-mini", description="Model name sent to the server.")
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible endpoint, e.g. http://127.0.0.1:11434/v1 for Ollama "
        "(also OPENAI_BASE_URL). Unset means api.openai.com.",
    )
    api_key: SecretStr | None = Field(
        None, description="Secret: only from OPENAI_API_KEY or GATEWAY_LLM__API_KEY."
    )
    api_key_file: Path | None = Field(None, description="File holding the API key.")
    fallback_models: list[str] = Field(
        default_factory=list, description="Models tried in order when the main one fails."
    )
    timeout: float = Field(60.0, gt=0, description="Seconds per request before giving up.")
    max_retries: int = Field(2, ge=0, le=10, description="Retries on 429/5xx/timeouts.")
    temperature: float | None = Field(
        0.3,
        ge=0,
        le=2,
        description="Sampling temperature; answers sampled above cache.max_temperature are "
        "never cached.",
    )
    max_tokens: int | None = Field(None, gt=0, description="Upper bound on reply tokens.")
    context_window: int = Field(
        32_768, gt=256, description="The model's context window, in tokens."
    )
    stream: bool = Field(False, description="Stream replies token by token where possible.")

    def resolved_api_key(self) -> str | None:
        """The API key from the environment or from `api_key_file`, if any."""
        if self.api_key is not None and self.api_key.get_secret_value():
            return self.api_key.get_secret_value()
        if self.api_key_file is not None:
            try:
                return self.api_key_file.expanduser().read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(
                    f"llm.api_key_file: cannot read {self.api_key_file}: {exc.strerror}; "
                    "fix the path or set OPENAI_API_KEY instead"
                ) from None
        return None


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
        default_factory=lambda: ["current_time"], description="Built-in tools offered."
    )
    owners: list[str] = Field(
        default_factory=list,
        description="Sender ids (channel:user) allowed to run privileged chat commands.",
    )


class SessionSettings(_Section):
    fsync: Literal["always", "batch", "never"] = Field(
        "batch",
        description="always: fsync each append; batch: group commit, a turn is still "
        "acknowledged only once on disk; never: leave it to the OS.",
    )
    max_cache_size: int = Field(200, ge=1, description="Sessions kept in memory.")


class CacheSettingsSection(_Section):
    enabled: bool = Field(True, description="Answer repeated questions from the cache.")
    url: str | None = Field(
        None,
        description="Backend: unset for a SQLite file in the workspace, or redis://host:port/db "
        "to share the cache between replicas.",
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
        0.8, gt=0, le=1, description="Cosine similarity a paraphrase must reach."
    )
    disabled_channels: list[str] = Field(
        default_factory=list, description='Channels that never use the cache, e.g. ["slack"].'
    )


class LogSettings(_Section):
    level: Literal["TRACE", "DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level logged."
    )
    format: Literal["text", "json"] = Field("text", description="text or json lines.")

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value


class HTTPSettings(_Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8080, ge=0, le=65535, description="Port of the HTTP server.")
    token: SecretStr | None = Field(
        None, description="Secret: bearer token for the API, from GATEWAY_HTTP__TOKEN."
    )


class CLIChannelSettings(_Section):
    enabled: bool = Field(True, description="Chat in the terminal when stdin is a TTY.")
    session: str = Field("cli:direct", description="Session key of the terminal chat.")


class ChannelsSettings(_Section):
    cli: CLIChannelSettings = Field(default_factory=CLIChannelSettings)


class Settings(_Section):
    """Everything the gateway reads from configuration, validated and frozen."""

    workspace: Path = Field(
        Path("~/.gateway"), description="Folder for sessions, memory and cache."
    )
    llm: LLMSettings = Field(default_factory=LLMSettings)
    agent: AgentSettings = Field(default_factory=AgentSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    cache: CacheSettingsSection = Field(default_factory=CacheSettingsSection)
    log: LogSettings = Field(default_factory=LogSettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    channels: ChannelsSettings = Field(default_factory=ChannelsSettings)

    @property
    def workspace_path(self) -> Path:
        return self.workspace.expanduser()

    @property
    def sessions_dir(self) -> Path:
        return self.workspace_path / "sessions"

    def secrets(self) -> list[str]:
        """Every secret value configured, for log redaction."""
        found = []
        for secret in (self.llm.api_key, self.http.token):
            if secret is not None and secret.get_secret_value():
                found.append(secret.get_secret_value())
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


def _parse_env_value(raw: str) -> Any:
    """An environment value as TOML if it reads as one (numbers, booleans, arrays),
    else as a plain string: GATEWAY_HTTP__PORT=9000 is an int, GATEWAY_LLM__MODEL=gpt-4o
    a string, GATEWAY_LLM__FALLBACK_MODELS='["a", "b"]' a list."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _reject_secrets_in_file(data: Mapping[str, Any], path: Path, prefix: str = "") -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _reject_secrets_in_file(value, path, dotted + ".")
        elif key in SECRET_KEYS:
            env = ENV_PREFIX + dotted.upper().replace(".", "__")
            raise ConfigError(
                f"{dotted}: secrets do not belong in {path.name}; remove it and set {env} "
                f"in the environment (or use {key}_file where offered)"
            )


def _env_name(loc: tuple[Any, ...]) -> str:
    return ENV_PREFIX + "__".join(str(p).upper() for p in loc)


def _describe(error: Mapping[str, Any]) -> str:
    loc = tuple(error.get("loc", ()))
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        return f"{dotted}: unknown key; check its spelling against `gateway init` output"
    if kind == "missing":
        return f"{dotted}: required; set it in gateway.toml or as {_env_name(loc)}"
    return (
        f"{dotted}: {error.get('msg', 'invalid value')} (got {error.get('input')!r}); "
        f"fix it in gateway.toml or {_env_name(loc)}"
    )


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

    shortcuts = {"GATEWAY_WORKSPACE": ["workspace"], "GATEWAY_MODEL": ["llm", "model"]}
    for name, value in sorted(env.items()):
        if name in shortcuts:
            _set_path(data, shortcuts[name], value)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
            if not all(parts):
                raise ConfigError(f"{name}: malformed; use GATEWAY_<SECTION>__<KEY>")
            value_parsed: Any = value if parts[-1] in SECRET_KEYS else _parse_env_value(value)
            _set_path(data, parts, value_parsed)

    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(data, dotted.split("."), value)

    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(err) for err in exc.errors()]
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
        if value is None:
            body.append(f"# {name} = ")
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


def starter_toml() -> str:
    """The documented default configuration, as a commented gateway.toml."""
    head = [
        "# gateway.toml: configuration of the chat gateway.",
        "# Every key can be overridden from the environment as GATEWAY_<SECTION>__<KEY>,",
        "# e.g. GATEWAY_LLM__MODEL=gpt-4o or GATEWAY_HTTP__PORT=9000.",
        "# Secrets never go here: set OPENAI_API_KEY (or GATEWAY_LLM__API_KEY) and",
        "# GATEWAY_HTTP__TOKEN in the environment.",
        "",
    ]
    return "\n".join(head + _commented_section(Settings, Settings(), "")).rstrip() + "\n"


def write_starter_config(path: Path) -> None:
    """Write the starter config; never overwrites an existing file."""
    try:
        with path.open("x", encoding="utf-8") as fh:
            fh.write(starter_toml())
    except FileExistsError:
        raise ConfigError(f"{path} already exists; not overwriting it") from None
