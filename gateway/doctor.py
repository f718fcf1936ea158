"""`gateway doctor`: checks an installation and says what to fix, one line per finding."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio

from gateway.config import ConfigError, Settings

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class Finding:
    status: Status
    what: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[self.status]
        return f"{mark}  {self.what}" + (f"\n      fix: {self.fix}" if self.fix else "")


def check_workspace(workspace: Path, *, max_listed: int = 5) -> list[Finding]:
    """Writable, and private: folders 0700 and files 0600 (conversations are personal)."""
    if not workspace.exists():
        return [
            Finding(
                "warn",
                f"workspace {workspace} does not exist yet",
                "it is created (0700) on first start",
            )
        ]
    findings: list[Finding] = []
    try:
        with tempfile.NamedTemporaryFile(dir=workspace, prefix=".doctor-"):
            pass
        findings.append(Finding("ok", f"workspace {workspace} is writable"))
    except OSError as exc:
        findings.append(
            Finding(
                "fail",
                f"workspace {workspace} is not writable ({exc.strerror})",
                "chown/chmod it for the gateway's user, or pick another with --workspace",
            )
        )
    loose: list[str] = []
    for root, dirs, files in os.walk(workspace):
        for name in dirs:
            path = Path(root, name)
            if stat.S_IMODE(path.lstat().st_mode) & 0o077:
                loose.append(f"{path} (folder)")
        for name in files:
            path = Path(root, name)
            if stat.S_IMODE(path.lstat().st_mode) & 0o077:
                loose.append(str(path))
    if stat.S_IMODE(workspace.stat().st_mode) & 0o077:
        loose.insert(0, f"{workspace} (folder)")
    if loose:
        shown = ", ".join(loose[:max_listed]) + (" ..." if len(loose) > max_listed else "")
        findings.append(
            Finding(
                "fail",
                f"{len(loose)} workspace paths are readable by other users: {shown}",
                f"chmod -R go-rwx {workspace}",
            )
        )
    else:
        findings.append(Finding("ok", "workspace permissions are private (0700/0600)"))
    return findings


async def check_llm(settings: Settings) -> list[Finding]:
    from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

    from gateway.llm.openai_provider import check_credentials
    from gateway.llm.types import LLMConfigError

    llm = settings.llm
    try:
        key = llm.resolved_api_key()
        check_credentials(llm.base_url, key)
    except (ConfigError, LLMConfigError) as exc:
        return [Finding("fail", "LLM credentials", str(exc))]
    where = llm.base_url or "https://api.openai.com/v1"
    client = AsyncOpenAI(
        base_url=where, api_key=key or "not-needed", timeout=min(llm.timeout, 10.0), max_retries=0
    )
    try:
        models = [m.id async for m in client.models.list()]
    except APIStatusError as exc:
        if exc.status_code in (401, 403):
            return [
                Finding(
                    "fail",
                    f"LLM endpoint {where} rejected the API key",
                    "check OPENAI_API_KEY (or llm.api_key_file)",
                )
            ]
        if exc.status_code == 404:
            return [Finding("warn", f"LLM endpoint {where} answers but has no /models listing")]
        return [
            Finding(
                "fail",
                f"LLM endpoint {where} answered HTTP {exc.status_code}",
                "check llm.base_url / OPENAI_BASE_URL",
            )
        ]
    except (APIConnectionError, APITimeoutError):
        return [
            Finding(
                "fail",
                f"LLM endpoint {where} is not reachable",
                "start the server or fix OPENAI_BASE_URL / llm.base_url",
            )
        ]
    finally:
        await client.close()
    wanted = [llm.model, *llm.fallback_models]
    missing = [m for m in wanted if models and m not in models]
    if missing:
        return [
            Finding(
                "warn",
                f"LLM endpoint {where} answers; it does not list {', '.join(missing)}",
                f"pick a model from: {', '.join(sorted(models)[:10])}",
            )
        ]
    return [Finding("ok", f"LLM endpoint {where} answers; model {llm.model} is available")]


def check_http(settings: Settings) -> list[Finding]:
    from gateway.http import HttpConfigError
    from gateway.http.auth import check_bind_policy, secret_value

    try:
        check_bind_policy(settings.http.host, secret_value(settings.http.token))
    except HttpConfigError as exc:
        return [Finding("fail", "HTTP server binding", str(exc))]
    if settings.http.token is None:
        return [
            Finding(
                "warn",
                "HTTP chat API has no token, so /api/chat is off",
                "set GATEWAY_HTTP__TOKEN to enable it",
            )
        ]
    return [Finding("ok", f"HTTP server on {settings.http.host}:{settings.http.port}")]


async def check_cache(settings: Settings) -> list[Finding]:
    """The response cache's backend: a SQLite file that can be opened, or a Redis that
    answers PING within a second. Creates nothing."""
    from gateway.cache import CacheUnavailable
    from gateway.daemon import build_cache

    try:
        cache = build_cache(settings)
    except ConfigError as exc:
        return [Finding("fail", str(exc), "fix cache.url (GATEWAY_CACHE__URL)")]
    if cache is None:
        return [Finding("ok", "response cache is off")]
    try:
        await cache.check()
    except CacheUnavailable as exc:
        return [Finding("fail", exc.problem, exc.fix)]
    finally:
        await cache.aclose()
    backend = cache.backend
    return [Finding("ok", f"response cache ({backend.name}) at {backend.where} is usable")]


ChannelCheck = Callable[[Settings], Awaitable[list[Finding]]]


async def check_channels(settings: Settings) -> list[Finding]:
    findings: list[Finding] = []
    tg = settings.channels.telegram
    if tg.enabled:
        token = tg.resolved_token()
        if not token:
            findings.append(
                Finding(
                    "fail",
                    "telegram is enabled without a bot token",
                    "set GATEWAY_CHANNELS__TELEGRAM__TOKEN (from @BotFather)",
                )
            )
        else:
            findings.append(await _remote_check("telegram", _telegram_identity(settings, token)))
        if tg.mode == "webhook" and not (tg.webhook_url and tg.webhook_secret):
            findings.append(
                Finding(
                    "fail",
                    "telegram webhook mode needs webhook_url and a secret",
                    "set channels.telegram.webhook_url and "
                    "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET",
                )
            )
    slack = settings.channels.slack
    if slack.enabled:
        bot = slack.bot_token.get_secret_value() if slack.bot_token else ""
        if not bot:
            findings.append(
                Finding(
                    "fail",
                    "slack is enabled without a bot token",
                    "set GATEWAY_CHANNELS__SLACK__BOT_TOKEN (xoxb-...)",
                )
            )
        else:
            app = slack.app_token.get_secret_value() if slack.app_token else None
            findings.append(await _remote_check("slack", _slack_identity(settings, bot, app)))
        if slack.mode == "socket" and not slack.app_token:
            findings.append(
                Finding(
                    "fail",
                    "slack Socket Mode needs an app-level token",
                    "set GATEWAY_CHANNELS__SLACK__APP_TOKEN (xapp-...)",
                )
            )
        if slack.mode == "http" and not slack.signing_secret:
            findings.append(
                Finding(
                    "fail",
                    "slack HTTP mode needs the signing secret",
                    "set GATEWAY_CHANNELS__SLACK__SIGNING_SECRET",
                )
            )
    for job, target in settings.undeliverable_heartbeats():
        channel = target.partition(":")[0]
        findings.append(
            Finding(
                "fail",
                f"heartbeat job {job!r} delivers to {target}, but {channel} is not enabled",
                f"enable channels.{channel} or change heartbeat.jobs.{job}.deliver_to",
            )
        )
    if not findings:
        findings.append(Finding("ok", "no chat platform enabled (terminal and HTTP API only)"))
    return findings


async def _telegram_identity(settings: Settings, token: str) -> str:
    from channels.telegram import check_credentials

    return str(await check_credentials(settings.channels.telegram, token))


async def _slack_identity(settings: Settings, token: str, app_token: str | None) -> str:
    from channels.slack import check_credentials

    socket = settings.channels.slack.mode == "socket"
    return await check_credentials(
        settings.channels.slack, token, app_token=app_token if socket else None
    )


async def _remote_check(name: str, probe: Awaitable[str]) -> Finding:
    try:
        with anyio.fail_after(15):
            who = await probe
    except Exception as exc:
        return Finding(
            "fail",
            f"{name} credentials were not accepted: {exc}",
            f"check the {name} token in the environment",
        )
    return Finding("ok", f"{name} credentials work: {who}")


async def run_checks(settings: Settings) -> list[Finding]:
    findings = [Finding("ok", "configuration is valid")]
    findings += check_workspace(settings.workspace_path)
    findings += await check_llm(settings)
    findings += check_http(settings)
    findings += await check_cache(settings)
    findings += await check_channels(settings)
    return findings
