"""The one redactor (gateway/redaction.py) and how the settings find what it redacts:
every secret setting by its type, never a list someone must remember to extend.
tests/test_secrets_e2e.py checks every surface of a running gateway with it."""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import quote, quote_plus

import markupsafe
import pytest
from pydantic import BaseModel, SecretStr

from gateway.config import SECRET_KEYS, Settings, load_sections, load_settings
from gateway.config.section import SECRET_NAME, secret_items
from gateway.redaction import MASK, MIN_SECRET_CHARS, Redactor, redact_url

SECRET = 'pl@nted:pass&word"<1>'


# --------------------------------------------------------------------------- the redactor


@pytest.mark.parametrize(
    "shown",
    [
        SECRET,
        quote(SECRET, safe=""),  # in a URL or a query string
        quote_plus(SECRET),  # in a form
        html.escape(SECRET),  # the standard library's entities
        str(markupsafe.escape(SECRET)),  # Jinja2's
        json.dumps(SECRET)[1:-1],  # a JSON string, a Prometheus label value
    ],
)
def test_a_configured_secret_is_replaced_in_every_encoding(shown: str) -> None:
    redact = Redactor([SECRET]).redact
    assert redact(f"said: {shown}.") == f"said: {MASK}."


def test_a_secret_is_replaced_inside_words_in_headers_and_in_urls() -> None:
    redact = Redactor(["planted-token-0001", "p@ss/w:rd"]).redact
    assert redact("Authorization: Bearer planted-token-0001") == f"Authorization: Bearer {MASK}"
    assert redact("GET /botplanted-token-0001/getMe") == f"GET /bot{MASK}/getMe"
    # A URL's password is written percent-encoded, and read back decoded.
    assert redact("redis://:p%40ss%2Fw%3Ard@db:6379") == f"redis://:{MASK}@db:6379"
    assert redact("password p@ss/w:rd refused") == f"password {MASK} refused"


def test_a_url_password_is_written_encoded_and_found_decoded_too() -> None:
    # url_password() returns the password as the URL spells it.
    redact = Redactor(["p%40ss%2Fword"]).redact
    assert redact("auth failed for p@ss/word") == f"auth failed for {MASK}"


def test_the_longest_secret_goes_first() -> None:
    redact = Redactor(["token-abcdef", "token-abcdef-and-more"]).redact
    assert redact("token-abcdef-and-more, token-abcdef") == f"{MASK}, {MASK}"


def test_short_secrets_are_caught_only_where_a_shape_puts_them() -> None:
    short = "x" * (MIN_SECRET_CHARS - 1)
    redactor = Redactor([short, "abc"])
    # Not every "abc" or "xxxxx" of every text: they cannot be told from words.
    assert redactor.redact(f"abc {short} abcdef") == f"abc {short} abcdef"
    # Where a URL's password stands, any password goes, configured or not.
    assert redactor.redact("postgresql://gw:abc@db/gw") == f"postgresql://gw:{MASK}@db/gw"


def test_token_shapes_are_replaced_without_being_configured() -> None:
    redact = Redactor().redact
    token = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw1"
    assert redact(f"GET https://api.telegram.org/bot{token}/getMe") == (
        f"GET https://api.telegram.org/bot123456789:{MASK}/getMe"
    )
    assert redact("Bearer abcdef123456 and api_key=zyxwvu98765") == (
        f"Bearer {MASK} and api_key={MASK}"
    )
    assert redact("got sk-abcdefghijkl, xoxb-1234567890-abc") == f"got sk-{MASK}, xoxb-{MASK}"
    assert redact("https://user:pw@host:8080/x") == f"https://user:{MASK}@host:8080/x"
    # Ordinary text is left alone.
    for text in (
        "ask-questions about the task-description",
        "at 10:30 session 1234567:abc",
        "https://example.org:8443/path@v2 and mail bob@example.org",
        "the bearer token was wrong",
    ):
        assert redact(text) == text


def test_text_for_chat_users_keeps_token_shapes_but_loses_configured_secrets() -> None:
    redactor = Redactor(["planted-token-0001"])
    text = "send Authorization: Bearer YOUR-TOKEN-HERE, not planted-token-0001"
    assert redactor.redact_configured(text) == (
        f"send Authorization: Bearer YOUR-TOKEN-HERE, not {MASK}"
    )


def test_redact_url_replaces_the_password_only() -> None:
    assert redact_url("postgresql://u:pw@h:5/d") == f"postgresql://u:{MASK}@h:5/d"
    assert redact_url("redis://:p%40ss@h/0") == f"redis://:{MASK}@h/0"
    assert redact_url("postgresql://u@h/d") == "postgresql://u@h/d"


# --------------------------------------------------------------------------- finding secrets


def _core(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _model_of(annotation: Any) -> type[BaseModel] | None:
    kind = _core(annotation)
    if get_origin(kind) is dict:
        kind = get_args(kind)[1]
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def fields_of(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every leaf setting of `model`'s tree as (path, annotation); a table of models
    (`[llm.providers.NAME]`) contributes one entry named NAME."""
    for name, field in model.model_fields.items():
        inner = _model_of(field.annotation)
        if inner is None:
            yield (*prefix, name), _core(field.annotation)
            continue
        table = get_origin(_core(field.annotation)) is dict
        yield from fields_of(inner, (*prefix, name, "name") if table else (*prefix, name))


#: Settings whose names look secret and that are not: why each is not.
NOT_SECRETS = {
    "heartbeat.jobs.name.ok_token": "the word a heartbeat reply is dropped for",
    "channels.email.authserv_id": "the receiving mail server's name",
    "channels.teams.token_url": "where the bot's token is asked for (an address, no secret)",
}


def _holds_no_text(kind: Any) -> bool:
    if kind in (int, float, bool, Path):
        return True
    return get_origin(kind) is list and all(get_origin(a) is Literal for a in get_args(kind))


def test_every_setting_that_looks_secret_is_a_secret_str() -> None:
    """The redactor finds secrets by their type (`SecretStr`): a new token, key or
    password setting declared as a plain `str` would be shown. Every leaf whose name
    looks secret is one, holds no text (a count, a file's path), or says why not."""
    fields = dict(fields_of(Settings))
    wrong = []
    for path, kind in fields.items():
        dotted = ".".join(path)
        if not SECRET_NAME.search(path[-1]) or kind is SecretStr or dotted in NOT_SECRETS:
            continue
        if path[-1].endswith("_file") and fields.get((*path[:-1], path[-1][:-5])) is SecretStr:
            continue  # the file a secret is read from
        if not _holds_no_text(kind):
            wrong.append(dotted)
    assert wrong == [], "declare them SecretStr (gateway.config.section.secret), or NOT_SECRETS"
    assert all(tuple(name.split(".")) in fields for name in NOT_SECRETS)


def test_the_loader_knows_every_secret_setting() -> None:
    """The loader refuses a secret written into gateway.toml and reads a secret's `*_file`
    by its key: the core's by name (`SECRET_KEYS`, no model built), a chat platform's by
    its model (`is_secret`). Both are held to the models' `SecretStr` settings."""
    from gateway.config.loader import is_secret

    secret = {path for path, kind in fields_of(Settings) if kind is SecretStr}
    core = {path[-1] for path in secret if path[0] != "channels"}
    assert core <= set(SECRET_KEYS)
    assert set(SECRET_KEYS) <= {path[-1] for path in secret}
    assert all(is_secret(path) for path in secret)
    plain = [path for path, kind in fields_of(Settings) if kind is not SecretStr]
    assert [path for path in plain if is_secret(path) and path[-1] not in SECRET_KEYS] == []


def _planted(tmp_path: Path) -> dict[str, str]:
    """A unique value for every `SecretStr` setting, by its variable."""
    env = {"GATEWAY_WORKSPACE": str(tmp_path)}
    for path, kind in fields_of(Settings):
        if kind is SecretStr:
            env["GATEWAY_" + "__".join(path).upper()] = "planted-" + "-".join(path)
    return env


def test_every_secret_setting_is_redacted_by_the_settings_redactor(tmp_path: Path) -> None:
    env = _planted(tmp_path) | {
        "GATEWAY_CACHE__URL": "redis://:redis-pw%2F1@127.0.0.1:6379/0",
        "GATEWAY_STORAGE__URL": "postgresql://gw:pg-password-1@db/gw",
        "GATEWAY_TELEMETRY__OTLP_ENDPOINT": "https://otel:otlp-password-1@collector:4318",
        "GATEWAY_MCP__SERVERS__GH__COMMAND": "github-mcp",
        "GATEWAY_MCP__SERVERS__GH__ENV": '{ GITHUB_TOKEN = "mcp-env-token-1", MODE = "readonly" }',
    }
    settings = load_settings(None, environ=env)
    planted = [value for name, value in env.items() if value.startswith("planted-")]
    assert len(planted) >= len(SECRET_KEYS)  # every key, some in several sections
    expected = {*planted, "redis-pw%2F1", "pg-password-1", "otlp-password-1", "mcp-env-token-1"}
    assert set(settings.secrets()) == expected
    text = " ".join(sorted(expected)) + " redis-pw/1 readonly"
    assert settings.redactor.redact(text) == " ".join([MASK] * (len(expected) + 1)) + " readonly"
    named = dict(secret_items({"": settings}))
    assert named["channels.telegram.token"] == "planted-channels-telegram-token"
    assert named["cache.url (its password)"] == "redis-pw%2F1"
    assert named["mcp.servers.gh.env.GITHUB_TOKEN"] == "mcp-env-token-1"


def test_what_an_mcp_server_is_passed_is_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GH_PAT", "ghp-passed-on-0001")
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path),
        "GATEWAY_MCP__SERVERS__GH__COMMAND": "github-mcp",
        "GATEWAY_MCP__SERVERS__GH__PASS_ENV": '["GH_PAT", "NOT_SET_ANYWHERE"]',
    }
    settings = load_settings(None, environ=env)
    assert dict(secret_items({"": settings})) == {
        "mcp.servers.gh: pass_env GH_PAT": "ghp-passed-on-0001"
    }


def test_the_redactor_is_built_once_and_a_copy_builds_its_own(tmp_path: Path) -> None:
    env = {"GATEWAY_WORKSPACE": str(tmp_path), "GATEWAY_HTTP__TOKEN": "first-token-0001"}
    settings = load_settings(None, environ=env)
    assert settings.redactor is settings.redactor
    http = settings.http.model_copy(update={"token": SecretStr("second-token-0002")})
    copied = settings.model_copy(update={"http": http})
    assert copied.redactor is not settings.redactor
    assert copied.redactor.redact("second-token-0002") == MASK


def test_a_command_that_loads_some_sections_redacts_the_others_secrets(tmp_path: Path) -> None:
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path),
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": "unread-telegram-token",
        "GATEWAY_CACHE__URL": "redis://:unread-redis-pw@h:6379/0",
    }
    partial = load_sections(None, ["sessions"], environ=env)
    assert partial.redactor is partial.redactor
    assert partial.redactor.redact("unread-telegram-token unread-redis-pw") == f"{MASK} {MASK}"


def test_settings_models_are_found_through_every_table() -> None:
    # The walk above reaches the models inside tables; a model it missed would leave
    # its secrets unchecked.
    paths = {".".join(path) for path, _ in fields_of(Settings)}
    assert {"llm.providers.name.api_key", "http.api_tokens.name.token"} <= paths
    assert "mcp.servers.name.env" in paths and "heartbeat.jobs.name.prompt" in paths


def test_the_doctor_names_secrets_too_short_to_redact(tmp_path: Path) -> None:
    from gateway.doctor import check_secrets

    env = {
        "GATEWAY_WORKSPACE": str(tmp_path),
        "GATEWAY_HTTP__TOKEN": "abc",
        "GATEWAY_CHANNELS__DISCORD__TOKEN": "long-enough-token",
    }
    [finding] = check_secrets(load_settings(None, environ=env))
    assert finding.status == "warn" and finding.what.startswith("http.token is shorter than 6")
    assert "abc" not in finding.line()
