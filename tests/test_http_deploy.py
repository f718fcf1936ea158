"""Structural checks of deploy/ (Docker cannot run here): the Dockerfile's user, volume,
probe and command, the systemd unit's restart policy and hardening, the compose file,
and the env template. The HEALTHCHECK command itself runs against a live server."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import SecretStr

from gateway.config import EXIT_CONFIG, HTTPSettings, load_settings
from gateway.http import HealthState, HttpServer
from gateway.http.metrics import Metrics

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
    # `docker compose up` without a profile still starts the single node alone.
    assert [name for name, svc in compose["services"].items() if "profiles" not in svc] == [
        "gateway"
    ]


# --------------------------------------------------------------------------- compose replicas

REPLICAS = ("gateway-1", "gateway-2", "gateway-3")


def compose_file() -> dict[str, Any]:
    import yaml  # the dev extra has it

    data = yaml.safe_load((DEPLOY / "compose.yaml").read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def depends_closure(services: dict[str, Any], name: str) -> set[str]:
    """Every service `docker compose up NAME` starts."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(services[current].get("depends_on", {}))
    return seen


def test_the_replicas_profile_has_its_services_and_the_proxy_pulls_them_all_in() -> None:
    services = compose_file()["services"]
    profiled = {name for name, svc in services.items() if "replicas" in svc.get("profiles", [])}
    assert profiled == {"postgres", "redis", "migrate", "proxy", *REPLICAS}
    # `up proxy` (what the README says) starts every replica service, not the single node.
    assert depends_closure(services, "proxy") == profiled
    for name in profiled:
        for dependency in services[name].get("depends_on", {}):
            assert dependency in profiled, f"{name} depends on {dependency} outside the profile"
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["proxy"]["image"].startswith("nginx:")
    assert all(port.startswith("127.0.0.1:") for port in services["proxy"]["ports"])


def test_replicas_share_storage_and_cache_and_start_after_the_one_migration(
    tmp_path: Path,
) -> None:
    from gateway.config import DispatchSettings

    services = compose_file()["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["db", "migrate"] and migrate["restart"] == "no"
    assert migrate["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    urls = set()
    volumes = set()
    for name in REPLICAS:
        replica = services[name]
        assert replica["command"] == ["run"]
        assert replica["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "postgres": {"condition": "service_healthy"},
            "redis": {"condition": "service_healthy"},
        }
        env = dict(replica["environment"]) | {"GATEWAY_WORKSPACE": str(tmp_path)}
        env["GATEWAY_HTTP__TOKEN"] = "t" * 32  # from gateway.env in a real deployment
        settings = load_settings(None, environ=env)
        assert settings.storage.url and settings.storage.url.startswith("postgresql://")
        assert settings.storage.migrate == "never"  # only the migrate service migrates
        assert settings.cache.url and settings.cache.url.startswith("redis://redis:")
        urls.add((settings.storage.url, settings.cache.url))
        probe = " ".join(replica["healthcheck"]["test"])
        assert f"127.0.0.1:{settings.http.port}/readyz" in probe
        grace = float(replica["stop_grace_period"].removesuffix("s"))
        assert grace > DispatchSettings().drain_grace_seconds
        assert replica["read_only"] is True and replica["cap_drop"] == ["ALL"]
        assert "postgres-password" in replica["secrets"]
        (volume,) = replica["volumes"]
        volumes.add(volume.split(":")[0])
    assert len(urls) == 1, "every replica must point at the same PostgreSQL and Redis"
    assert len(volumes) == 3, "each replica keeps its own workspace volume"
    for name in ("postgres", "redis", "proxy"):
        assert services[name]["healthcheck"]["test"], name


def test_the_proxy_spreads_the_three_entry_points_over_every_replica() -> None:
    services = compose_file()["services"]
    conf = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    mounted = [v for v in services["proxy"]["volumes"] if v.startswith("./nginx.conf:")]
    assert mounted and mounted[0].endswith(":ro")
    upstream = conf.split("upstream gateways {", 1)[1].split("}", 1)[0]
    servers = [
        line.split()[1] for line in upstream.splitlines() if line.strip().startswith("server ")
    ]
    assert servers == [f"{name}:8080" for name in REPLICAS]
    for path in ("/api/chat", "/telegram/webhook", "/slack/events"):
        block = conf.split(f"location = {path} {{", 1)[1].split("}", 1)[0]
        assert "proxy_pass http://gateways;" in block, path
    # Only the webhooks, which the journal dedupes, are retried after reaching a replica.
    chat = conf.split("location = /api/chat {", 1)[1].split("}", 1)[0]
    assert "non_idempotent" not in chat
    assert "return 404;" in conf.split("location / {", 1)[1].split("}", 1)[0]


def test_the_replicas_count_wrong_tokens_per_client_behind_the_proxy(tmp_path: Path) -> None:
    """nginx appends the client's address and the replicas trust it for that; nginx
    closes an idle connection to a replica before the replica would."""
    import ipaddress

    conf = (DEPLOY / "nginx.conf").read_text(encoding="utf-8")
    assert "proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;" in conf
    upstream = conf.split("upstream gateways {", 1)[1].split("}", 1)[0]
    (pool_idle,) = [
        line.split()[1].rstrip(";")
        for line in upstream.splitlines()
        if line.strip().startswith("keepalive_timeout ")
    ]
    services = compose_file()["services"]
    for name in REPLICAS:
        env = dict(services[name]["environment"]) | {"GATEWAY_WORKSPACE": str(tmp_path)}
        env["GATEWAY_HTTP__TOKEN"] = "t" * 32
        http = load_settings(None, environ=env).http
        assert float(pool_idle.removesuffix("s")) < http.keepalive_timeout_seconds
        trusted = [ipaddress.ip_network(item) for item in http.trusted_proxies]
        # Docker's default address pools, where nginx's address comes from.
        for address in ("172.17.0.5", "172.30.1.2", "192.168.16.3", "10.5.0.2"):
            assert any(ipaddress.ip_address(address) in net for net in trusted), address
        assert not any(ipaddress.ip_address("203.0.113.9") in net for net in trusted)


def test_no_secret_is_written_into_the_compose_file() -> None:
    compose = compose_file()
    services = compose["services"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/secrets/")
    assert "POSTGRES_PASSWORD" not in services["postgres"]["environment"]
    for name in REPLICAS:
        url = services[name]["environment"]["GATEWAY_STORAGE__URL"]
        assert "@" in url and ":" not in url.split("://", 1)[1].split("@", 1)[0]
    assert compose["secrets"]["postgres-password"]["file"] == "./postgres-password"


@pytest.mark.skipif(
    subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
    if shutil.which("docker")
    else True,
    reason="docker compose is not installed",
)
def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    for name, text in (("gateway.env", "GATEWAY_HTTP__TOKEN=x\n"), ("postgres-password", "pw\n")):
        if not (DEPLOY / name).exists():
            (DEPLOY / name).write_text(text)
            tmp_path.joinpath(name).touch()  # remember to remove it
    try:
        for profile in ([], ["--profile", "replicas"]):
            result = subprocess.run(
                ["docker", "compose", "-f", str(DEPLOY / "compose.yaml"), *profile, "config", "-q"],
                capture_output=True,
                text=True,
            )
            assert result.returncode == 0, result.stderr
    finally:
        for name in ("gateway.env", "postgres-password"):
            if tmp_path.joinpath(name).exists():
                (DEPLOY / name).unlink()


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
