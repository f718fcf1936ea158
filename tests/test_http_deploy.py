"""Structural checks of deploy/ (Docker cannot run here): the Dockerfile's user, volume,
probe and command, the systemd unit's restart policy and hardening, the compose file,
and the env template. The HEALTHCHECK command itself runs against a live server."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import anyio
import pytest
from pydantic import SecretStr

from gateway.config import EXIT_CONFIG, HTTPSettings, load_settings
from gateway.http import HealthState, HttpServer
from gateway.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return instructions


def args_of(keyword: str) -> list[str]:
    return [args for kw, args in dockerfile_instructions() if kw == keyword]


def env_of_dockerfile() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in args_of("ENV"):
        for pair in shlex.split(args):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def healthcheck_command() -> list[str]:
    (args,) = args_of("HEALTHCHECK")
    _, _, exec_form = args.partition("CMD ")
    command = json.loads(exec_form)
    assert isinstance(command, list) and all(isinstance(part, str) for part in command)
    return command


# --------------------------------------------------------------------------- Dockerfile


def test_dockerfile_base_user_volume_port_and_command() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    users = args_of("USER")
    assert users, "the image must switch to a non-root user"
    final_user = users[-1].split(":")[0]
    assert final_user not in {"root", "0"}
    assert [kw for kw, _ in instructions].index("USER") > max(
        i for i, (kw, args) in enumerate(instructions) if kw == "RUN"
    ), "USER comes after every RUN that needs root"
    env = env_of_dockerfile()
    assert env["GATEWAY_WORKSPACE"] == "/data"
    assert env["GATEWAY_HTTP__HOST"] == "0.0.0.0"
    assert env["GATEWAY_HTTP__PORT"] == "8080"
    assert "/data" in json.loads(args_of("VOLUME")[0])
    assert args_of("EXPOSE") == ["8080"]
    assert json.loads(args_of("CMD")[-1]) == ["gateway", "run"]
    assert any("pip install" in args for args in args_of("RUN"))


def test_dockerfile_copies_only_paths_that_exist() -> None:
    for args in args_of("COPY"):
        *sources, _destination = args.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_healthcheck_uses_python_not_curl() -> None:
    command = healthcheck_command()
    assert command[:2] == ["python", "-c"]
    assert "urllib" in command[2] and "/healthz" in command[2]
    assert "curl" not in " ".join(command)
    compile(command[2], "<HEALTHCHECK>", "exec")


@pytest.mark.anyio
async def test_healthcheck_passes_against_a_live_server_and_fails_without_one() -> None:
    code = healthcheck_command()[2]
    settings = HTTPSettings(host="127.0.0.1", port=0, token=SecretStr("t" * 32))
    server = HttpServer(settings, health=HealthState(), metrics=Metrics(), chat=None)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        env = {**os.environ, "GATEWAY_HTTP__PORT": str(port)}
        result = await anyio.run_process([sys.executable, "-c", code], env=env, check=False)
        assert result.returncode == 0, result.stderr.decode()
        tg.cancel_scope.cancel()
    result = await anyio.run_process([sys.executable, "-c", code], env=env, check=False)
    assert result.returncode != 0


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert "**" in lines
    assert {"!pyproject.toml", "!README.md", "!gateway/**", "!channels/**"} <= set(lines)


# --------------------------------------------------------------------------- systemd


def unit_file() -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value (systemd keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in (DEPLOY / "gateway.service").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_restarts_on_failure_but_not_on_config_errors() -> None:
    service = unit_file()["Service"]
    assert service["Restart"] == ["on-failure"]
    assert str(EXIT_CONFIG) in service["RestartPreventExitStatus"][0].split()
    assert service["ExecStart"][0].endswith("gateway run")
    assert service["User"][0] not in {"root", "0"}
    assert service["EnvironmentFile"], "secrets come from an EnvironmentFile"


def test_unit_is_hardened_and_can_write_only_its_workspace() -> None:
    sections = unit_file()
    service = sections["Service"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
    }.items():
        assert service[key] == [value], key
    env = dict(item.split("=", 1) for item in service["Environment"])
    workspace = env["GATEWAY_WORKSPACE"]
    assert workspace in service["ReadWritePaths"][0].split()
    assert service["WorkingDirectory"] == [workspace]
    assert sections["Install"]["WantedBy"] == ["multi-user.target"]


# --------------------------------------------------------------------------- compose and env


def test_compose_parses_and_wires_the_gateway() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    gateway = compose["services"]["gateway"]
    build = gateway["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert any(volume.endswith(":/data") for volume in gateway["volumes"])
    volume_name = next(v for v in gateway["volumes"] if v.endswith(":/data")).split(":")[0]
    assert volume_name in compose["volumes"]
    assert gateway["environment"]["GATEWAY_WORKSPACE"] == "/data"
    assert all(port.startswith("127.0.0.1:") for port in gateway["ports"])
    assert gateway["env_file"] == ["gateway.env"]
    assert set(compose["services"]) == {"gateway"}  # redis/postgres stay commented for now


def test_env_template_is_valid_configuration(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    for raw in (DEPLOY / "gateway.env.example").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert "GATEWAY_HTTP__TOKEN" in env
    env["GATEWAY_WORKSPACE"] = str(tmp_path)
    settings = load_settings(None, environ=env)
    assert settings.http.token is not None
