"""The one loader of the configuration: gateway.toml, GATEWAY_* environment overrides and
command-line flags, validated into frozen settings with errors a person can act on.

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

One pipeline, two products. `load_settings` checks every section (`Settings`): the
daemon, `gateway doctor` and nearly every command load it. `load_sections` checks the
top level (where an unknown section is refused) and the sections one command names
(`PartialSettings`), and builds no model of the others: pydantic builds a model's
validator when its class is made, and all of them took most of a one-shot `gateway
sessions list`. The price is deliberate: such a command does not see a mistake in a
section it does not read (that section's keys, types and variables), which the daemon and
`gateway doctor` still report. A malformed file, a secret written into it and a malformed
GATEWAY_* name are refused by every command.

This module imports no pydantic (nor any section's model) until it validates.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import tomllib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from gateway.redaction import redact_url, url_password

if TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

    from gateway.config.agent import AgentSettings
    from gateway.config.cache import CacheSettingsSection
    from gateway.config.channels import ChannelsSettings
    from gateway.config.dispatch import DispatchSettings
    from gateway.config.heartbeat import HeartbeatSettings
    from gateway.config.http import HTTPSettings
    from gateway.config.llm import LLMSettings
    from gateway.config.log import LogSettings
    from gateway.config.mcp import MCPSettings
    from gateway.config.media import MediaSettings
    from gateway.config.memory import MemorySettings
    from gateway.config.schedules import ScheduleSettings
    from gateway.config.section import Section
    from gateway.config.sessions import SessionSettings
    from gateway.config.settings import Settings
    from gateway.config.storage import StorageSettings
    from gateway.config.subagents import SubagentSettings
    from gateway.config.telemetry import TelemetrySettings
    from gateway.config.tools import ToolsSettings
    from gateway.config.toplevel import TopLevelSettings
    from gateway.config.usage import UsageSettings
    from gateway.redaction import Redactor

ENV_PREFIX = "GATEWAY_"
DEFAULT_CONFIG_NAME = "gateway.toml"
# Exit code for a configuration error (sysexits EX_CONFIG): systemd must not restart on it.
EXIT_CONFIG = 78

# Keys whose values are secrets: refused in gateway.toml, read from their `_file`. The
# models' `SecretStr` settings, listed here because the loader builds no model to ask
# (tests/test_redaction.py holds the two together).
SECRET_KEYS = frozenset(
    {
        "api_key",
        "transcription_api_key",
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

#: The sections of the configuration, in the order of `Settings`' fields: each key's
#: model is the class of this name in `gateway/config/<key>.py`.
SECTIONS: dict[str, str] = {
    "llm": "LLMSettings",
    "agent": "AgentSettings",
    "media": "MediaSettings",
    "sessions": "SessionSettings",
    "memory": "MemorySettings",
    "cache": "CacheSettingsSection",
    "dispatch": "DispatchSettings",
    "usage": "UsageSettings",
    "heartbeat": "HeartbeatSettings",
    "subagents": "SubagentSettings",
    "schedules": "ScheduleSettings",
    "log": "LogSettings",
    "telemetry": "TelemetrySettings",
    "http": "HTTPSettings",
    "storage": "StorageSettings",
    "channels": "ChannelsSettings",
    "tools": "ToolsSettings",
    "mcp": "MCPSettings",
}


class ConfigError(Exception):
    """A configuration problem the operator must fix; the message is one line each."""


def section_model(name: str) -> type[Section]:
    """The model of section `name` (a key of `SECTIONS`), its module imported."""
    model: type[Section] = getattr(
        importlib.import_module(f"gateway.config.{name}"), SECTIONS[name]
    )
    return model


class PartialSettings:
    """The configuration as far as one command reads it (`load_sections`): the top level
    and the sections it named, each checked as `load_settings` checks it. Asking for a
    section it did not name is a bug in that command: AttributeError, naming it."""

    # `Settings`' attributes, for the type checker; at run time each is looked up in the
    # top level or among the sections loaded (`__getattr__`).
    workspace: Path
    workspace_io: Literal["loop", "threads"]
    event_loop: Literal["auto", "uvloop", "asyncio"]
    use_uvloop: bool
    io_on_loop: bool
    workspace_path: Path
    sessions_dir: Path
    llm: LLMSettings
    agent: AgentSettings
    media: MediaSettings
    sessions: SessionSettings
    memory: MemorySettings
    cache: CacheSettingsSection
    dispatch: DispatchSettings
    usage: UsageSettings
    heartbeat: HeartbeatSettings
    subagents: SubagentSettings
    schedules: ScheduleSettings
    log: LogSettings
    telemetry: TelemetrySettings
    http: HTTPSettings
    storage: StorageSettings
    channels: ChannelsSettings
    tools: ToolsSettings
    mcp: MCPSettings

    def __init__(
        self,
        top: TopLevelSettings,
        sections: Mapping[str, Section],
        unread_secrets: Collection[str] = (),
    ) -> None:
        self._top = top
        self._sections = dict(sections)
        self._unread_secrets = list(unread_secrets)
        self._redactor: Redactor | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in SECTIONS:
            try:
                return self._sections[name]
            except KeyError:
                raise AttributeError(
                    f"[{name}] of the configuration was not loaded: add {name!r} to the "
                    "sections this command loads"
                ) from None
        return getattr(self._top, name)

    @property
    def loaded(self) -> list[str]:
        """The sections loaded, in `SECTIONS`' order."""
        return list(self._sections)

    def secrets(self) -> list[str]:
        """Every secret value of what was loaded (those read from files too), and those
        the environment gives the other sections: unread, they are still redacted."""
        from gateway.config.section import secret_items

        return [value for _, value in secret_items(self._sections)] + self._unread_secrets

    @property
    def redactor(self) -> Redactor:
        """The one redactor of these settings' secrets (`Settings.redactor`)."""
        if self._redactor is None:
            from gateway.redaction import Redactor

            self._redactor = Redactor(self.secrets())
        return self._redactor


# --------------------------------------------------------------------------- reading


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
    or None if it names none. Only the model of the section it is in is loaded."""
    from pydantic import BaseModel

    if not path:
        return None
    if path[0] in SECTIONS and len(path) == 1:
        from gateway.config.settings import Settings

        return Settings.model_fields[path[0]]
    model: Any
    if path[0] in SECTIONS:
        model, path = section_model(path[0]), path[1:]
    else:
        from gateway.config.toplevel import TopLevelSettings

        model = TopLevelSettings
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
    from pydantic import SecretStr

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


def is_secret(path: Sequence[str]) -> bool:
    """Is the key at `path` a secret? A name of `SECRET_KEYS` is; so is any `SecretStr`
    key of a chat platform's section, whatever its name (a channel package declares its
    own: its model is asked, which loads the channels' models)."""
    if path and path[-1] in SECRET_KEYS:
        return True
    if len(path) < 3 or path[0] != "channels":
        return False
    from pydantic import SecretStr

    field = _field_at(list(path))
    return field is not None and _core_type(field.annotation) is SecretStr


def _has_password(url: str) -> bool:
    return bool(url_password(url))


def _reject_secrets_in_file(
    data: Mapping[str, Any], path: Path, prefix: str = "", *, models: bool = True
) -> None:
    """ConfigError for a secret written into the file. Without `models`, only the names of
    `SECRET_KEYS` are known (a command that reads no channel section builds no model)."""
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            _reject_secrets_in_file(value, path, dotted + ".", models=models)
        elif dotted == "storage.url" and isinstance(value, str) and _has_password(value):
            raise ConfigError(
                f"storage.url: a password does not belong in {path.name}; set "
                "GATEWAY_STORAGE__URL in the environment, or PGPASSWORD / ~/.pgpass"
            )
        elif key in SECRET_KEYS or (models and is_secret(dotted.split("."))):
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
        if secret == key or value in (None, ""):
            continue
        name, dotted = f"{prefix}{key}", f"{prefix}{secret}"
        if not is_secret(dotted.split(".")):
            continue
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


#: Variables that are ours without being GATEWAY_<SECTION>__<KEY>.
_SHORTCUTS = {
    "GATEWAY_WORKSPACE": ["workspace"],
    "GATEWAY_WORKSPACE_IO": ["workspace_io"],
    "GATEWAY_EVENT_LOOP": ["event_loop"],
    "GATEWAY_MODEL": ["llm", "model"],
}


def _gather(
    path: Path | None,
    env: Mapping[str, str],
    overrides: Mapping[str, Any] | None,
    sections: Collection[str] | None,
) -> tuple[dict[str, Any], list[str]]:
    """The configuration's data from the file at `path`, the environment and the
    command line's `overrides`, secret files read in: the top level and `sections`
    (every section when None). Also the secrets the environment gives the sections left
    out: unread, they are still redacted from the log."""

    def wanted(key: str) -> bool:
        return sections is None or key not in SECTIONS or key in sections

    data: dict[str, Any] = {}
    unread_secrets: list[str] = []
    if path is not None:
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc}); fix the file") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
        _reject_secrets_in_file(data, path, models=False)
        data = {key: value for key, value in data.items() if wanted(key)}
        if "channels" in data:
            # A channel package's secrets are known by its model (read only here, by a
            # command that reads the channels).
            _reject_secrets_in_file({"channels": data["channels"]}, path)

    # Conventional variables of the OpenAI ecosystem.
    if env.get("OPENAI_API_KEY"):
        if wanted("llm"):
            _set_path(data, ["llm", "api_key"], env["OPENAI_API_KEY"])
        else:
            unread_secrets.append(env["OPENAI_API_KEY"])
    if env.get("OPENAI_BASE_URL") and wanted("llm"):
        _set_path(data, ["llm", "base_url"], env["OPENAI_BASE_URL"])

    for name, value in sorted(env.items()):
        if name in _SHORTCUTS:
            if wanted(_SHORTCUTS[name][0]):
                _set_path(data, _SHORTCUTS[name], value)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
            if not all(parts):
                raise ConfigError(f"{name}: malformed; use GATEWAY_<SECTION>__<KEY>")
            if not wanted(parts[0]):
                if parts[-1] in SECRET_KEYS:
                    unread_secrets.append(value)
                elif "://" in value and (password := url_password(value)):
                    unread_secrets.append(password)
                continue
            # Secrets and the names of their files are text, whatever they look like.
            named = [*parts[:-1], parts[-1].removesuffix("_file")]
            raw = is_secret(parts) or is_secret(named)
            _set_path(data, parts, value if raw else _parse_env_value(parts, value))

    for dotted, value in (overrides or {}).items():
        if value is not None and wanted(dotted.partition(".")[0]):
            _set_path(data, dotted.split("."), value)

    _read_secret_files(data)
    return data, unread_secrets


# --------------------------------------------------------------------------- errors


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
    from pydantic import BaseModel

    from gateway.config.settings import Settings

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
    import difflib

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


def env_warnings(environ: Mapping[str, str], sections: Collection[str] | None = None) -> list[str]:
    """One line per GATEWAY_* variable that looks like a key but is none (a single
    underscore where the scheme needs two, say), naming the closest key. Variables
    nothing like ours (GATEWAY_INTERFACE of CGI, say) are left alone: the prefix is
    not ours alone. With `sections` (`load_sections`' own), the variables of the other
    sections are not looked at, as their values are not."""
    ours: set[str] | None = None  # every key's variable: all the models, built when needed
    warnings = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name == "GATEWAY_CONFIG" or name in _SHORTCUTS:
            continue
        if "__" in name:
            parts = [p.lower() for p in name[len(ENV_PREFIX) :].split("__")]
            if sections is not None and parts[0] in SECTIONS and parts[0] not in sections:
                continue
            if _field_at(parts):
                continue  # a key, or a key of a heartbeat job (GATEWAY_HEARTBEAT__JOBS__X__EVERY)
        if ours is None:
            ours = {_env_name(tuple(k.split("."))) for k in all_keys()}
            ours |= {"GATEWAY_CONFIG", *_SHORTCUTS}
        if name in ours:
            continue
        near = _closest(name, sorted(ours))
        if near is not None:
            warnings.append(f"{name} is not a setting and is ignored; did you mean {near}?")
    return warnings


# --------------------------------------------------------------------------- loading


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


def _validated(model: type[BaseModel], data: Any) -> Any:
    """`data` validated by `model`: strict, in JSON mode (booleans and numbers must be
    written as such, while strings still become paths and secrets, which JSON has no
    types for). Raises ValidationError."""
    return model.model_validate_json(json.dumps(data, default=str), strict=True)


def _config_error(errors: list[Mapping[str, Any]], path: Path | None) -> ConfigError:
    named = str(path) if path is not None else DEFAULT_CONFIG_NAME
    return ConfigError("\n".join(_describe(err, named) for err in errors))


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read and validate the whole configuration. Raises ConfigError with one line per
    problem.

    `overrides` are dotted keys from command-line flags (e.g. {"llm.model": "x"}).
    """
    from pydantic import ValidationError

    from gateway.config.settings import Settings

    env = os.environ if environ is None else environ
    path = find_config_path(config_path, env)
    data, _ = _gather(path, env, overrides, None)
    try:
        settings: Settings = _validated(Settings, data)
    except ValidationError as exc:
        raise _config_error(list(exc.errors()), path) from None
    return settings


def load_sections(
    config_path: str | os.PathLike[str] | None,
    sections: Collection[str],
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PartialSettings:
    """Read the configuration as `load_settings` does, and validate its top level and
    `sections` only (keys of `SECTIONS`); the models of the others are not even built.
    Raises ConfigError, one line per problem, as `load_settings` would for these."""
    from pydantic import ValidationError

    from gateway.config.toplevel import TopLevelSettings

    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"no such section: {', '.join(sorted(unknown))}")
    env = os.environ if environ is None else environ
    path = find_config_path(config_path, env)
    data, unread_secrets = _gather(path, env, overrides, sections)
    # Reported in the order `load_settings` reports them: the top level's keys, the
    # sections in `Settings`' order, then the keys that are none.
    first: list[Mapping[str, Any]] = []
    last: list[Mapping[str, Any]] = []
    try:
        top = _validated(TopLevelSettings, {k: v for k, v in data.items() if k not in SECTIONS})
    except ValidationError as exc:
        top = None
        for err in exc.errors():
            known = err["loc"] and err["loc"][0] in TopLevelSettings.model_fields
            (first if known else last).append(err)
    loaded: dict[str, Section] = {}
    for name in SECTIONS:
        if name not in sections:
            continue
        try:
            loaded[name] = _validated(section_model(name), data.get(name, {}))
        except ValidationError as exc:
            first.extend({**err, "loc": (name, *err["loc"])} for err in exc.errors())
    if first or last:
        raise _config_error(first + last, path)
    assert top is not None
    return PartialSettings(top, loaded, unread_secrets)
