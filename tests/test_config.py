"""Configuration: defaults, file, environment, flags, and the errors a person sees."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

from gateway.config import (
    ConfigError,
    Settings,
    env_warnings,
    load_settings,
    starter_toml,
    write_starter_config,
)

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_gateway_toml_is_the_documented_default() -> None:
    shipped = (ROOT / "gateway.toml").read_text(encoding="utf-8")
    assert shipped == starter_toml("chat-gateway"), (
        'regenerate gateway.toml from gateway.config.starter_toml("chat-gateway")'
    )
    assert Settings.model_validate(tomllib.loads(shipped)) == Settings()


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text('[llm]\nmodel = "from-file"\ntimeout = 5\n[http]\nport = 1234\n')
    s = load_settings(cfg, environ={})
    assert (s.llm.model, s.llm.timeout, s.http.port) == ("from-file", 5.0, 1234)

    env = {"GATEWAY_LLM__MODEL": "from-env", "GATEWAY_HTTP__PORT": "9000"}
    s = load_settings(cfg, environ=env)
    assert (s.llm.model, s.http.port) == ("from-env", 9000)

    s = load_settings(cfg, environ=env, overrides={"llm.model": "from-flag"})
    assert s.llm.model == "from-flag"


def test_shortcuts_and_openai_conventions(tmp_path: Path) -> None:
    env = {
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "GATEWAY_MODEL": "m1",
        "OPENAI_API_KEY": "sk-test-secret-123456",
        "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        "GATEWAY_LLM__FALLBACK_MODELS": '["a", "b"]',
    }
    s = load_settings(None, environ=env)
    assert s.workspace_path == tmp_path / "ws"
    assert s.llm.model == "m1"
    assert s.llm.base_url == "http://127.0.0.1:9/v1"
    assert s.llm.fallback_models == ["a", "b"]
    assert s.llm.resolved_api_key() == "sk-test-secret-123456"
    assert "sk-test-secret-123456" not in repr(s)
    assert "sk-test-secret-123456" in s.secrets()


SECRET_FILES = [
    ("llm", "api_key"),
    ("http", "token"),
    ("channels.telegram", "token"),
    ("channels.telegram", "webhook_secret"),
    ("channels.slack", "bot_token"),
    ("channels.slack", "app_token"),
    ("channels.slack", "signing_secret"),
    ("channels.discord", "token"),
]


def secret_of(settings: Settings, section: str, name: str) -> str | None:
    node: object = settings
    for part in section.split("."):
        node = getattr(node, part)
    value = getattr(node, name)
    return None if value is None else str(value.get_secret_value())


def env_name(section: str, key: str) -> str:
    return "GATEWAY_" + "__".join([*section.upper().split("."), key.upper()])


@pytest.mark.parametrize(("section", "name"), SECRET_FILES)
def test_every_secret_can_come_from_a_file(tmp_path: Path, section: str, name: str) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-from-file\n")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'[{section}]\n{name}_file = "{secret}"\n')
    s = load_settings(cfg, environ={})
    assert secret_of(s, section, name) == "s3cr3t-from-file"  # read at load, newline gone
    assert "s3cr3t-from-file" in s.secrets()  # so it is redacted from logs
    assert "s3cr3t-from-file" not in repr(s)

    by_env = load_settings(None, environ={env_name(section, name + "_file"): str(secret)})
    assert secret_of(by_env, section, name) == "s3cr3t-from-file"

    missing = {env_name(section, name + "_file"): str(tmp_path / "nope")}
    with pytest.raises(ConfigError) as info:
        load_settings(None, environ=missing)
    assert str(info.value) == (
        f"{section}.{name}_file: cannot read {tmp_path / 'nope'} (No such file or directory); "
        "fix the path or let the gateway's user read the file"
    )

    both = {env_name(section, name): "s3cr3t-from-env"}
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ=both)
    message = str(info.value)
    assert message.startswith(f"{section}.{name} and {section}.{name}_file are both set")
    assert env_name(section, name) in message and "s3cr3t" not in message


def test_secret_file_edge_cases(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-from-file\r\n")
    s = load_settings(None, environ={"GATEWAY_LLM__API_KEY_FILE": str(key)})
    assert s.llm.resolved_api_key() == "sk-from-file"
    key.write_text("\n")
    with pytest.raises(ConfigError, match=r"llm\.api_key_file: .* is empty"):
        load_settings(None, environ={"GATEWAY_LLM__API_KEY_FILE": str(key)})
    with pytest.raises(ConfigError, match=r"cannot read .* \(Is a directory\)"):
        load_settings(None, environ={"GATEWAY_LLM__API_KEY_FILE": str(tmp_path)})
    key.write_text("sk-1")
    with pytest.raises(ConfigError, match="unset OPENAI_API_KEY or GATEWAY_LLM__API_KEY"):
        load_settings(
            None, environ={"GATEWAY_LLM__API_KEY_FILE": str(key), "OPENAI_API_KEY": "sk-2"}
        )


def test_every_commented_secret_file_key_is_valid_toml_when_uncommented() -> None:
    keys = set()
    for line in starter_toml().splitlines():
        if re.fullmatch(r"# \w+_file = .*", line):
            keys |= set(tomllib.loads(line[2:]))
    assert keys >= {f"{name}_file" for _, name in SECRET_FILES}


@pytest.mark.parametrize(
    ("toml", "env", "expected"),
    [
        ("[llm]\nmodle = 'x'\n", {}, "llm.modle: unknown key"),
        ("[nonsense]\na = 1\n", {}, "nonsense: unknown key"),
        ("[llm]\ntimeout = 'soon'\n", {}, "llm.timeout: "),
        ("", {"GATEWAY_HTTP__PORT": "99999"}, "http.port: "),
        ("", {"GATEWAY_SESSIONS__FSYNC": "sometimes"}, "sessions.fsync: "),
        ("workspace_io = 'disk'\n", {}, "workspace_io: Input should be 'loop' or 'threads'"),
        ("", {"GATEWAY_WORKSPACE_IO": "fast"}, "workspace_io: "),
        ("event_loop = 'trio'\n", {}, "event_loop: Input should be 'auto', 'uvloop' or"),
        ("", {"GATEWAY_EVENT_LOOP": "fast"}, "event_loop: "),
        ("[llm]\napi_key = 'sk-oops'\n", {}, "llm.api_key: secrets do not belong"),
        ("[llm\n", {}, "not valid TOML"),
        # A client's sessions are api:<name>:...: no two alike but for case.
        ("[http.api_tokens.Default]\n", {}, "'Default' cannot name a client"),
        ("[http.api_tokens.ide]\n[http.api_tokens.IDE]\n", {}, "'IDE' cannot name a client"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, toml: str, env: dict[str, str], expected: str) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ=env)
    message = str(info.value)
    assert expected in message
    assert "sk-oops" not in message  # a refused secret is not echoed back
    assert "Traceback" not in message


def test_an_event_loop_that_is_not_installed_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text("event_loop = 'uvloop'\n")
    assert load_settings(cfg, environ={}).use_uvloop  # a dependency: installed here
    assert not load_settings(cfg, environ={"GATEWAY_EVENT_LOOP": "asyncio"}).use_uvloop
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"event_loop: .*'uvloop' is not installed"):
        load_settings(cfg, environ={})
    # auto falls back to asyncio's own loop where uvloop is missing (Windows, PyPy).
    assert not load_settings(
        tmp_path / "gateway.toml", environ={"GATEWAY_EVENT_LOOP": "auto"}
    ).use_uvloop


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gateway init"):
        load_settings(tmp_path / "nope.toml", environ={})


def test_init_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    write_starter_config(path)
    assert load_settings(path, environ={}) == Settings()
    path.write_text("# mine\n")
    with pytest.raises(FileExistsError):
        write_starter_config(path)
    assert path.read_text() == "# mine\n"


def test_init_makes_missing_parent_folders(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "g.toml"
    write_starter_config(path)
    assert load_settings(path, environ={}) == Settings()


COMMENTED_KEY = re.compile(r"^# ([a-z_]+(\.[a-z_]+)*) = ")


def test_every_commented_key_of_the_template_is_valid_when_uncommented(tmp_path: Path) -> None:
    lines = starter_toml().splitlines()
    commented = [i for i, line in enumerate(lines) if COMMENTED_KEY.match(line)]
    assert len(commented) >= 10  # base_url, api_key_file, max_tokens, cache url, ...
    for i in commented:
        edited = [*lines[:i], lines[i].removeprefix("# "), *lines[i + 1 :]]
        path = tmp_path / f"line{i}.toml"
        path.write_text("\n".join(edited) + "\n")
        try:
            settings = load_settings(path, environ={})
        except ConfigError as exc:
            if "_file = " in lines[i] and "cannot read" in str(exc):
                continue  # a valid key naming an example secret file this machine lacks
            raise AssertionError(f"uncommenting {lines[i]!r} gives: {exc}") from None
        assert settings != Settings(), f"{lines[i]!r} changes nothing when uncommented"


# ------------------------------------------------------------------ strict types


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[cache]\nenabled = "yes"\n', "cache.enabled: expected true or false, got 'yes'"),
        ("[cache]\nenabled = 1\n", "cache.enabled: expected true or false, got 1"),
        ('[http]\nport = "9000"\n', "http.port: expected a whole number, got '9000'"),
        ("[http]\nport = 9000.0\n", "http.port: expected a whole number, got 9000.0"),
        ('[llm]\ntimeout = "5"\n', "llm.timeout: expected a number, got '5'"),
        ("[llm]\nstream = 0\n", "llm.stream: expected true or false, got 0"),
    ],
)
def test_file_booleans_and_numbers_are_strict(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "g.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, environ={})
    assert str(caught.value).startswith(message)
    assert "GATEWAY_" in str(caught.value)  # and where else it can be fixed
    if "'" in message:
        assert "without quotes" in str(caught.value)


def test_a_whole_number_is_a_fine_float(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text("[llm]\ntimeout = 5\n")
    assert load_settings(path, environ={}).llm.timeout == 5.0


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        *[(word, True) for word in ("true", "1", "Yes", "ON")],
        *[(word, False) for word in ("false", "0", "no", "off")],
    ],
)
def test_environment_booleans_read_the_usual_words(raw: str, value: bool) -> None:
    env = {"GATEWAY_CACHE__ENABLED": raw, "GATEWAY_LLM__STREAM": raw}
    settings = load_settings(None, environ=env)
    assert (settings.cache.enabled, settings.llm.stream) == (value, value)


def test_environment_values_are_read_by_the_type_of_their_key() -> None:
    settings = load_settings(
        None,
        environ={
            "GATEWAY_HTTP__PORT": "9000",
            "GATEWAY_LLM__TIMEOUT": "2.5",
            "GATEWAY_LLM__MODEL": "123",  # a model may be named by digits
            "GATEWAY_AGENT__SYSTEM_PROMPT": '["not", "a", "list"]',
            "GATEWAY_LLM__FALLBACK_MODELS": '["a", "b"]',
            "GATEWAY_HEARTBEAT__JOBS__DISKS__EVERY": "1h",
            "GATEWAY_HEARTBEAT__JOBS__DISKS__PROMPT": "42",
        },
    )
    assert (settings.http.port, settings.llm.timeout) == (9000, 2.5)
    assert settings.llm.model == "123"
    assert settings.agent.system_prompt == '["not", "a", "list"]'
    assert settings.llm.fallback_models == ["a", "b"]
    assert settings.heartbeat.jobs["disks"].prompt == "42"
    with pytest.raises(ConfigError, match=r"cache\.enabled: expected true or false, got 'maybe'"):
        load_settings(None, environ={"GATEWAY_CACHE__ENABLED": "maybe"})
    with pytest.raises(ConfigError, match=r"http\.port: expected a whole number"):
        load_settings(None, environ={"GATEWAY_HTTP__PORT": "eighty"})


def test_a_variable_that_looks_like_ours_is_named_with_the_closest_key() -> None:
    warnings = env_warnings({"GATEWAY_HTTP_PORT": "9000", "GATEWAY_LLM_MODLE": "x"})
    assert warnings == [
        "GATEWAY_HTTP_PORT is not a setting and is ignored; did you mean GATEWAY_HTTP__PORT?",
        "GATEWAY_LLM_MODLE is not a setting and is ignored; did you mean GATEWAY_LLM__MODEL?",
    ]
    fine = {
        "GATEWAY_HTTP__PORT": "1",
        "GATEWAY_WORKSPACE": "/x",
        "GATEWAY_MODEL": "m",
        "GATEWAY_CONFIG": "/g.toml",
        "GATEWAY_HEARTBEAT__JOBS__DISKS__EVERY": "1h",
        "GATEWAY_INTERFACE": "CGI/1.1",  # another program's, nothing like ours
        "HTTP_PORT": "1",
    }
    assert env_warnings(fine) == []


def test_an_unknown_key_names_the_closest_one() -> None:
    with pytest.raises(ConfigError, match=r"http.prot: unknown key; did you mean http.port\?"):
        load_settings(None, environ={"GATEWAY_HTTP__PROT": "1"})


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[htpp]\nport = 1\n", "htpp: unknown key; did you mean http?"),
        ("[sesions]\nfsync = 'never'\n", "sesions: unknown key; did you mean sessions?"),
        ("[foo]\nx = 1\n", "foo: unknown key; check its spelling against `gateway init`"),
    ],
)
def test_a_misspelt_section_names_the_closest_one(tmp_path: Path, toml: str, expected: str) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ={})
    assert str(info.value) == expected


def test_an_error_names_the_config_file_that_was_given(tmp_path: Path) -> None:
    """`--config other.toml`: the fix is in that file, not in a gateway.toml."""
    cfg = tmp_path / "other.toml"
    cfg.write_text("[http]\nport = 'abc'\n")
    with pytest.raises(ConfigError) as info:
        load_settings(cfg, environ={})
    assert f"fix it in {cfg} or GATEWAY_HTTP__PORT" in str(info.value)
    assert "gateway.toml" not in str(info.value)


# ------------------------------------------------------------------ failover providers


def test_providers_take_their_keys_from_the_environment_or_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "backup-key"
    key_file.write_text("sk-backup-from-file-0001\n")
    cfg = tmp_path / "g.toml"
    cfg.write_text(
        '[llm]\nchain = ["primary", "backup"]\n'
        '[llm.providers.primary]\nbase_url = "https://api.openai.com/v1"\n'
        'models = ["gpt-4o-mini"]\n'
        f'[llm.providers.backup]\nbase_url = "https://openrouter.ai/api/v1"\n'
        f'api_key_file = "{key_file}"\ntimeout = 20\n'
    )
    settings = load_settings(
        cfg,
        environ={
            "GATEWAY_LLM__PROVIDERS__PRIMARY__API_KEY": "sk-primary-from-env-0001",
            "GATEWAY_LLM__TIMEOUT": "45",
        },
    )
    used = settings.llm.used_providers()
    assert list(used) == ["primary", "backup"]
    assert used["primary"].resolved_api_key() == "sk-primary-from-env-0001"
    assert used["backup"].resolved_api_key() == "sk-backup-from-file-0001"
    assert (used["primary"].timeout, used["backup"].timeout) == (45.0, 20.0)
    assert {"sk-primary-from-env-0001", "sk-backup-from-file-0001"} <= set(settings.secrets())
    assert env_warnings({"GATEWAY_LLM__PROVIDERS__BACKUP__API_KEY": "x"}) == []


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[llm]\nchain = ["default", "nope"]\n',
            "llm.chain: no provider 'nope'; add [llm.providers.nope]",
        ),
        ('[llm]\nchain = ["default", "default"]\n', "llm.chain: a provider is named twice"),
        (
            '[llm.providers.default]\nbase_url = "http://127.0.0.1:1/v1"\n',
            'llm.providers.default: "default" is the server [llm] itself describes',
        ),
        (
            '[llm.providers."a b"]\nbase_url = "http://x/v1"\n',
            "llm.providers: 'a b' cannot name a provider",
        ),
        (
            '[llm.aliases]\nfast = ["nope:gpt-4o-mini"]\n',
            "llm.aliases.fast: no provider 'nope' in 'nope:gpt-4o-mini'",
        ),
        (
            '[llm]\nchain = ["default", "b"]\n[llm.aliases]\nfast = ["b:gpt-5"]\n'
            '[llm.providers.b]\nmodels = ["gpt-4o-mini"]\n',
            "llm.aliases.fast: b does not list 'gpt-5' in its models",
        ),
        (
            '[llm.providers.b]\napi_key = "sk-oops"\n',
            "llm.providers.b.api_key: secrets do not belong",
        ),
        ("[llm.failover]\ncooldown_seconds = 0\n", "llm.failover.cooldown_seconds: "),
    ],
)
def test_a_failover_mistake_is_one_line_naming_the_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    cfg = tmp_path / "g.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_settings(cfg, environ={"OPENAI_API_KEY": "sk-never-shown-0001"})
    assert str(caught.value).startswith(message), str(caught.value)
    assert "sk-never-shown-0001" not in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1
