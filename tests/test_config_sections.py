"""`load_sections`: the configuration of the sections one command reads, checked as
`load_settings` checks them, and nothing of the others (gateway/config/loader.py says
why, and what a command loading sections does not see)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import (
    SECTIONS,
    ConfigError,
    PartialSettings,
    Settings,
    env_warnings,
    load_sections,
    load_settings,
)
from gateway.config.loader import section_model

SOME = ("sessions", "memory", "storage", "log")


def test_the_sections_are_settings_fields_in_order() -> None:
    fields = list(Settings.model_fields)
    assert fields == ["workspace", "workspace_io", "event_loop", *SECTIONS]
    for name in SECTIONS:
        assert Settings.model_fields[name].annotation is section_model(name)


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_section_checked_alone_has_the_defaults_of_the_whole(name: str) -> None:
    alone = load_sections(None, [name], environ={})
    assert getattr(alone, name) == getattr(Settings(), name)


def test_loaded_sections_have_the_values_the_whole_has(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("tok-from-a-file\n")
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        'workspace_io = "threads"\n[sessions]\nfsync = "never"\nmax_cache_mb = 3\n'
        '[memory]\nenabled = false\n[log]\nformat = "json"\n'
        f'[http]\nport = 1234\ntoken_file = "{token}"\n'
    )
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "GATEWAY_SESSIONS__MAX_CACHE_SIZE": "7",
        "GATEWAY_STORAGE__POOL_SIZE": "3",
        "GATEWAY_STORAGE__MIGRATE": "never",
        "GATEWAY_LOG__LEVEL": "debug",
    }
    overrides = {"workspace": None, "llm.model": "m", "log.level": "WARNING"}
    whole = load_settings(cfg, environ=env, overrides=overrides)
    part = load_sections(cfg, SOME, environ=env, overrides=overrides)
    assert part.loaded == ["sessions", "memory", "log", "storage"]  # in SECTIONS' order
    for name in SOME:
        assert getattr(part, name) == getattr(whole, name)
    for name in ("workspace", "workspace_io", "workspace_path", "sessions_dir", "io_on_loop"):
        assert getattr(part, name) == getattr(whole, name)
    assert part.log.level == "WARNING" and part.sessions.max_cache_size == 7


@pytest.mark.parametrize(
    ("toml", "env"),
    [
        ("[sessions]\nfsnc = 'never'\n", {}),  # did you mean sessions.fsync?
        ("[htpp]\nport = 1\n", {}),  # a misspelt section: did you mean http?
        ("[storage]\npool_size = '3'\n", {}),
        ("", {"GATEWAY_SESSIONS__FSYNC": "sometimes", "GATEWAY_LOG__LEVEL": "LOUD"}),
        ("", {"GATEWAY_WORKSPACE_IO": "fast"}),
        ("workspace_io = 'disk'\nbogus = 1\n[memory]\nenabled = 'yes'\n", {}),
        ("sessions = 5\n", {}),
        ("[storage]\nurl = 'mysql://db/x'\n", {}),
        ("[storage]\nurl = 'postgresql://u:pw@db/x'\n", {}),  # a password in the file
        ("[channels.telegram]\ntoken = 'oops'\n", {}),  # a secret in the file, anywhere
        ("[sessions\n", {}),
        ("", {"GATEWAY_SESSIONS____FSYNC": "never"}),
    ],
)
def test_a_mistake_in_what_is_loaded_reads_as_load_settings_says_it(
    tmp_path: Path, toml: str, env: dict[str, str]
) -> None:
    cfg = tmp_path / "mine.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as whole:
        load_settings(cfg, environ=env)
    with pytest.raises(ConfigError) as part:
        load_sections(cfg, SOME, environ=env)
    assert str(part.value) == str(whole.value)


@pytest.mark.parametrize(
    ("toml", "env"),
    [
        ("[channels.telegram]\nenabled = 'yes'\n", {}),
        ("[llm]\nmodle = 'x'\n", {}),
        ("", {"GATEWAY_HTTP__PORT": "high"}),
        ("", {"GATEWAY_LLM__API_KEY_FILE": "/nonexistent/key"}),
    ],
)
def test_a_mistake_in_a_section_left_out_is_not_seen(
    tmp_path: Path, toml: str, env: dict[str, str]
) -> None:
    """The deliberate price of loading some sections: `gateway run` and `gateway doctor`
    (load_settings) refuse such a configuration; `gateway sessions list` reads on."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError):
        load_settings(cfg, environ=env)
    assert load_sections(cfg, SOME, environ=env).sessions.fsync == "batch"


def test_a_section_not_loaded_cannot_be_read_by_mistake() -> None:
    part = load_sections(None, SOME, environ={})
    assert isinstance(part, PartialSettings)
    with pytest.raises(AttributeError, match=r"\[channels\] of the configuration was not loaded"):
        _ = part.channels
    with pytest.raises(AttributeError):
        _ = part.no_such_thing
    with pytest.raises(ValueError, match="no such section: sesions"):
        load_sections(None, ["sesions"], environ={})


def test_secrets_of_the_sections_left_out_are_still_redacted(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("from-a-file-never-read\n")
    env = {
        "OPENAI_API_KEY": "sk-unread-0123456789",
        "GATEWAY_CHANNELS__TELEGRAM__TOKEN": "plain-unread-token",
        "GATEWAY_HTTP__TOKEN_FILE": str(key),
        "GATEWAY_STORAGE__URL": "postgresql://gw:pg-password@127.0.0.1/gw",
    }
    secrets = load_sections(None, SOME, environ=env).secrets()
    assert set(secrets) == {"sk-unread-0123456789", "plain-unread-token", "pg-password"}
    # Every secret the whole configuration knows but for the file nothing read.
    assert set(load_settings(None, environ=env).secrets()) - set(secrets) == {
        "from-a-file-never-read"
    }


def test_variables_of_the_sections_left_out_are_not_looked_at() -> None:
    env = {
        "GATEWAY_SESSIONS__FSNYC": "never",  # a loaded section's: looked at
        "GATEWAY_LOG_LEVEL": "DEBUG",  # one underscore: whose it is cannot be told
        "GATEWAY_HTTP__PROT": "1",  # [http] is not loaded
        "GATEWAY_STORAGE__URL": "postgresql://db/gw",  # a key: nothing to say
    }
    assert env_warnings(env, SOME) == [
        "GATEWAY_LOG_LEVEL is not a setting and is ignored; did you mean GATEWAY_LOG__LEVEL?",
        "GATEWAY_SESSIONS__FSNYC is not a setting and is ignored; did you mean "
        "GATEWAY_SESSIONS__FSYNC?",
    ]
    assert len(env_warnings(env)) == 3  # the whole configuration's: [http]'s too
