"""The starter gateway.toml (`gateway init`): every key with its default and its
description, commented where it has no value."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import tomli_w
from pydantic import BaseModel

from gateway.config.loader import SECRET_KEYS
from gateway.config.settings import Settings
from gateway.registry import installed


def _commented_section(
    model: type[BaseModel], instance: BaseModel, header: str, skip: Collection[str] = ()
) -> list[str]:
    lines: list[str] = []
    nested: list[tuple[str, type[BaseModel], BaseModel]] = []
    body: list[str] = []
    for name, field in model.model_fields.items():
        value = getattr(instance, name)
        if f"{header}.{name}" in skip:
            continue
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
        lines.extend(
            _commented_section(sub_model, sub, f"{header}.{name}" if header else name, skip)
        )
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
        '# channel_modes.cli = "steer"',
        '# channel_modes.api = "collect"',
    ],
    "usage.prices": [
        '# prices."gpt-4o-mini" = { prompt = 0.15, completion = 0.6 }',
        '# prices."whisper-1" = { per_minute = 0.006 }',
    ],
}


def starter_toml(distribution: str | None = None) -> str:
    """The documented default configuration, as a commented gateway.toml: with a section
    for every installed chat platform, or only for those `distribution` provides (the
    project's own gateway.toml holds the built-in ones, whatever else is installed)."""
    head = [
        "# gateway.toml: configuration of the chat gateway.",
        "# Every key can be overridden from the environment as GATEWAY_<SECTION>__<KEY>,",
        "# e.g. GATEWAY_LLM__MODEL=gpt-4o or GATEWAY_HTTP__PORT=9000.",
        "# Secrets never go here: set them in the environment (OPENAI_API_KEY or",
        "# GATEWAY_LLM__API_KEY, GATEWAY_HTTP__TOKEN, ...) or name a file holding each one",
        '# (api_key_file, token_file, ...: e.g. token_file = "/run/secrets/bot-token").',
        "",
    ]
    skip = [
        f"channels.{spec.name}"
        for spec in installed().specs.values()
        if distribution is not None and spec.distribution != distribution
    ]
    body = _commented_section(Settings, Settings(), "", skip)
    return "\n".join(head + body).rstrip() + "\n"


def write_starter_config(path: Path) -> None:
    """Write the starter config, making missing parent folders; never overwrites an
    existing file (FileExistsError). Other OSErrors are the caller's to report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("x", encoding="utf-8") as fh:
        fh.write(starter_toml())
