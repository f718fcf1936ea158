"""`gateway doctor`: checks an installation and says what to fix, one line per finding.

The findings quote what servers and platforms answered; they go through the settings'
redactor (`gateway.redaction`) before they are shown, as a log line would."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from gateway.config import ConfigError, Settings, env_warnings
from gateway.storage.workspace import WorkspaceError, holder, prepare_workspace

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class Finding:
    status: Status
    what: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[self.status]
        return f"{mark}  {self.what}" + (f"\n      fix: {self.fix}" if self.fix else "")


def check_workspace(
    settings: Settings, *, config_path: Path | None = None, max_listed: int = 5
) -> list[Finding]:
    """Made and writable as `gateway run` makes it (the same `prepare_workspace`), and
    private: folders 0700, files 0600 (conversations are personal). The config file
    may live in the workspace readable by others: it holds no secrets by design."""
    workspace = settings.workspace_path
    try:
        prepare_workspace(settings)
    except WorkspaceError as exc:
        return [Finding("fail", f"workspace: {exc}")]
    findings = [Finding("ok", f"workspace {workspace} is writable")]
    running = holder(workspace)
    if running is not None:
        findings.append(
            Finding("ok", f"a gateway is running on this workspace ({running.describe()})")
        )
    config = config_path.resolve() if config_path is not None else None
    loose: list[str] = []
    for root, dirs, files in os.walk(workspace):
        for name in dirs:
            path = Path(root, name)
            if stat.S_IMODE(path.lstat().st_mode) & 0o077:
                loose.append(f"{path} (folder)")
        for name in files:
            path = Path(root, name)
            if path.resolve() == config:
                continue
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


# Shapes of credentials that have no business in a file others may read: OpenAI and
# Slack tokens, a Telegram bot token, a password in a URL.
_SECRET_SHAPES = re.compile(
    r"\bsk-[A-Za-z0-9_-]{16,}|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bxapp-[A-Za-z0-9-]{10,}"
    r"|\b\d{6,}:[A-Za-z0-9_-]{30,}|://[^/\s:@]+:[^/\s@]+@"
    r"|\b[MNO][A-Za-z0-9_-]{22,27}\.[A-Za-z0-9_-]{6,7}\.[A-Za-z0-9_-]{27,}"
)


def check_config_file(config_path: Path | None) -> list[Finding]:
    """A config readable by others is fine (it holds no secrets by design; secret keys
    are refused when it is loaded); a value shaped like a credential in it is a warning."""
    if config_path is None:
        return []
    try:
        data = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []  # loading it has already said what is wrong
    suspects = [key for key, value in _strings(data) if _SECRET_SHAPES.search(value)]
    if not suspects:
        return []
    others = bool(stat.S_IMODE(config_path.stat().st_mode) & 0o077)
    return [
        Finding(
            "warn",
            f"{config_path} holds what looks like a credential in {', '.join(suspects)}"
            + (" and other users can read it" if others else ""),
            "move it to the environment (or a *_file the gateway's user alone can read)",
        )
    ]


def _strings(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _strings(value, dotted + ".")
        elif isinstance(value, str):
            yield dotted, value
        elif isinstance(value, list):
            yield from ((dotted, item) for item in value if isinstance(item, str))


@dataclass(frozen=True, slots=True)
class _Endpoint:
    """One model provider as the doctor checks it, with what its findings say."""

    name: str
    url: str
    key: str | None
    timeout: float
    #: The models it will be asked for, the first the one a turn asks first.
    wanted: list[str]
    #: Put before each finding ("" for `[llm]`'s own server alone, as before failover).
    prefix: str
    #: The setting of its base URL, and what holds its key, for the fixes.
    url_setting: str
    key_setting: str


def _endpoints(settings: Settings) -> list[_Endpoint]:
    """Every provider a model name may go to (`[llm] chain`, aliases)."""
    from gateway.daemon import route_table

    llm = settings.llm
    used = llm.used_providers()
    table = route_table(settings)
    names = [llm.model, *table.aliases]
    endpoints = []
    for name, provider in used.items():
        routed = [r.model for n in names for r in table.routes(n) if r.provider == name]
        wanted = list(dict.fromkeys([*routed, *provider.fallback_models, *provider.models]))
        default = name == "default"
        env = f"GATEWAY_LLM__PROVIDERS__{name.upper()}__API_KEY"
        endpoints.append(
            _Endpoint(
                name=name,
                url=provider.base_url or "https://api.openai.com/v1",
                key=provider.resolved_api_key(),
                timeout=provider.timeout or llm.timeout,
                wanted=wanted or [llm.model],
                prefix="" if len(used) == 1 and default else f"provider {name}: ",
                url_setting="llm.base_url (or OPENAI_BASE_URL)"
                if default
                else f"llm.providers.{name}.base_url",
                key_setting="OPENAI_API_KEY (or llm.api_key_file)"
                if default
                else f"{env} (or llm.providers.{name}.api_key_file)",
            )
        )
    return endpoints


async def check_llm(settings: Settings) -> list[Finding]:
    """Each model provider: the endpoint answers with the key, lists the models it will
    be asked for, and the context window the first of them will be used with, and
    where that size came from (`gateway.agent.windows`)."""
    from gateway.llm.credentials import check_provider_credentials
    from gateway.llm.types import LLMConfigError

    try:
        endpoints = _endpoints(settings)
        for endpoint in endpoints:
            check_provider_credentials(endpoint.name, endpoint.url, endpoint.key)
    except (ConfigError, LLMConfigError) as exc:
        return [Finding("fail", "LLM credentials", str(exc))]
    findings = [
        Finding(
            "warn",
            f"llm.providers.{name} is configured but never asked",
            f'name it in [llm] chain (e.g. chain = ["default", "{name}"]) or in an alias',
        )
        for name in settings.llm.unused_providers()
    ]
    for endpoint in endpoints:
        findings += await _check_endpoint(settings, endpoint)
    return findings


async def _check_endpoint(settings: Settings, endpoint: _Endpoint) -> list[Finding]:
    from openai import APIConnectionError, APIStatusError, APITimeoutError, AsyncOpenAI

    from gateway.llm.openai_provider import display_url

    url, prefix = endpoint.url, endpoint.prefix
    where = display_url(url)  # a password in the URL stays out of the report
    client = AsyncOpenAI(
        base_url=url,
        api_key=endpoint.key or "not-needed",
        timeout=min(endpoint.timeout, 10.0),
        max_retries=0,
    )
    try:
        try:
            models = [m.id async for m in client.models.list()]
        except APIStatusError as exc:
            return [_prefixed(prefix, await _llm_refusal(client, exc, url, where, endpoint))]
        except (APIConnectionError, APITimeoutError):
            return [
                Finding(
                    "fail",
                    f"{prefix}LLM endpoint {where} is not reachable",
                    f"start the server or fix {endpoint.url_setting}",
                )
            ]
        model = endpoint.wanted[0]
        missing = [m for m in endpoint.wanted if models and m not in models]
        if missing:
            found = Finding(
                "warn",
                f"{prefix}LLM endpoint {where} answers; it does not list {', '.join(missing)}",
                f"pick a model from: {', '.join(sorted(models)[:10])}",
            )
        else:
            found = Finding(
                "ok", f"{prefix}LLM endpoint {where} answers; model {model} is available"
            )
        window = await _window_finding(client, url, settings, model)
        return [found, _prefixed(prefix, window)]
    finally:
        await client.close()


def _prefixed(prefix: str, finding: Finding) -> Finding:
    return Finding(finding.status, prefix + finding.what, finding.fix) if prefix else finding


async def _llm_refusal(client: Any, exc: Any, url: str, where: str, endpoint: _Endpoint) -> Finding:
    """What an error status from the endpoint's /models means. A 404 that names no
    model, from a base URL without /v1 whose /v1 answers, is the missing /v1."""
    from openai import APIError

    from gateway.llm.window import ends_in_version, names_a_model, wrong_path_detail

    if exc.status_code in (401, 403):
        return Finding(
            "fail", f"LLM endpoint {where} rejected the API key", f"check {endpoint.key_setting}"
        )
    if exc.status_code == 404:
        if not names_a_model(exc.body, exc.message) and not ends_in_version(url):
            with_v1 = f"{where.rstrip('/')}/v1"
            try:
                await client.get(f"{url.rstrip('/')}/v1/models", cast_to=bytes)
            except APIError:
                pass
            else:
                return Finding(
                    "fail",
                    f"LLM endpoint: {wrong_path_detail(where, '/models')}; {with_v1} answers",
                    f"set {endpoint.url_setting} to {with_v1}",
                )
        return Finding("warn", f"LLM endpoint {where} answers but has no /models listing")
    return Finding(
        "fail",
        f"LLM endpoint {where} answered HTTP {exc.status_code}",
        f"check {endpoint.url_setting}",
    )


async def _window_finding(client: Any, url: str, settings: Settings, model: str) -> Finding:
    """The context window `model` is used with on this endpoint and where it came
    from; a warning when `[llm] context_window` is larger than what the server holds."""
    from gateway.agent.windows import choose_window
    from gateway.llm.credentials import api_key_required
    from gateway.llm.types import WindowUnknown
    from gateway.llm.window import WINDOW_SETTINGS, probe_server_window

    llm = settings.llm
    said = None
    if not api_key_required(url):  # the hosted APIs state it nowhere
        try:
            said = await probe_server_window(client, url, model)
        except WindowUnknown:
            pass
    chosen = choose_window(llm.context_window, said)
    if said is not None and llm.context_window is not None and llm.context_window > said.tokens:
        return Finding(
            "warn",
            f"[llm] context_window is {llm.context_window:,} but {said.source} says "
            f"{said.tokens:,}: {model} is used with {said.tokens:,} tokens",
            f"set [llm] context_window = {said.tokens} (or leave it unset), or "
            f"{WINDOW_SETTINGS[said.server]}",
        )
    return Finding("ok", f"context window for {model}: {chosen.describe()}")


async def check_http(settings: Settings) -> list[Finding]:
    """The bind policy, and the port itself: listened on and let go, as `run` will."""
    from gateway.http import HttpBindError, HttpConfigError, check_listen
    from gateway.http.auth import check_bind_policy, secret_value
    from gateway.http.openai_routes import api_clients

    http = settings.http
    clients = api_clients(secret_value(http.token), http.api_tokens)
    try:
        # As the server decides: any token (the chat API's, a named client's) will do.
        check_bind_policy(http.host, clients[0].token if clients else None)
    except HttpConfigError as exc:
        return [Finding("fail", "HTTP server binding", str(exc))]
    running = holder(settings.workspace_path)
    if running is not None and running.url is not None and running.url.endswith(f":{http.port}"):
        # Taken by the gateway this checks: that is where `run` listens.
        findings = [Finding("ok", f"HTTP server: the running gateway listens on {running.url}")]
    else:
        try:
            await check_listen(http.host, http.port)
        except HttpBindError as exc:
            return [Finding("fail", str(exc))]
        findings = [Finding("ok", f"HTTP server can listen on {http.host}:{http.port}")]
    if http.token is None:
        findings.append(
            Finding(
                "warn",
                "HTTP chat API has no token, so /api/chat is off",
                "set GATEWAY_HTTP__TOKEN to enable it",
            )
        )
    return findings


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
    if settings.channels.email.enabled:
        findings += await check_email(settings)
    matrix = settings.channels.matrix
    if matrix.enabled:
        findings.extend(await _matrix_findings(settings))
    if settings.channels.whatsapp.enabled:
        findings.extend(await _whatsapp_findings(settings))
    if settings.channels.discord.enabled:
        findings += await check_discord(settings)
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


async def check_email(settings: Settings) -> list[Finding]:
    """The mailbox: IMAP login and its folders, SMTP login, and who may write."""
    from channels.email import EmailSetupError, check_mailbox

    email = settings.channels.email
    findings = []
    try:
        with anyio.fail_after(40):
            found = await check_mailbox(email)
        findings.append(Finding("ok", f"email works: {found}"))
    except ConfigError as exc:
        findings.append(Finding("fail", f"email is enabled but incomplete: {exc}"))
    except (EmailSetupError, TimeoutError) as exc:
        findings.append(
            Finding(
                "fail",
                f"email: {exc}".replace("email: email: ", "email: "),
                "fix the [channels.email] settings or the password; docs/email.md",
            )
        )
    if email.dm_policy == "allowlist" and not email.allow_from:
        findings.append(
            Finding(
                "warn",
                "email answers nobody: dm_policy is allowlist and allow_from is empty",
                'list addresses or domains in channels.email.allow_from (e.g. ["example.com"])',
            )
        )
    if email.dm_policy != "allowlist" and not email.require_auth:
        findings.append(
            Finding(
                "warn",
                f"email answers unknown senders (dm_policy = {email.dm_policy!r}) without "
                "checking who sent the mail: a forged sender gets the reply",
                'set channels.email.require_auth = ["dmarc"] and authserv_id',
            )
        )
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


async def _matrix_findings(settings: Settings) -> list[Finding]:
    """The Matrix account: settings present, the homeserver reachable, the token logged in
    as `user_id`."""
    matrix = settings.channels.matrix
    missing = [
        (what, fix)
        for what, fix, present in (
            (
                "homeserver",
                "set channels.matrix.homeserver (e.g. https://matrix.example.org)",
                matrix.homeserver,
            ),
            ("user_id", "set channels.matrix.user_id (e.g. @gateway:example.org)", matrix.user_id),
            (
                "access token",
                "set GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN (docs/matrix.md)",
                matrix.resolved_token(),
            ),
        )
        if not present
    ]
    if missing:
        return [
            Finding("fail", f"matrix is enabled without its {what}", fix) for what, fix in missing
        ]
    from channels.matrix import check_credentials

    token = matrix.resolved_token() or ""
    return [await _remote_check("matrix", check_credentials(matrix, token))]


async def _whatsapp_findings(settings: Settings) -> list[Finding]:
    """WhatsApp: the numbers, the webhook's verify token and app secret set, and the
    Graph API token valid for every number."""
    wa = settings.channels.whatsapp
    prefix = "GATEWAY_CHANNELS__WHATSAPP__"
    missing = [
        Finding("fail", f"whatsapp is enabled without {what}", fix)
        for what, fix, present in (
            (
                "phone_number_ids",
                'set channels.whatsapp.phone_number_ids = ["<id>"] (WhatsApp Manager > API Setup)',
                wa.phone_number_ids,
            ),
            (
                "the webhook's verify token",
                f"set {prefix}VERIFY_TOKEN to the token typed in the App Dashboard",
                wa.verify_token and wa.verify_token.get_secret_value(),
            ),
            (
                "the app secret",
                f"set {prefix}APP_SECRET (App Dashboard > App settings > Basic); every "
                "delivery is checked against it",
                wa.app_secret and wa.app_secret.get_secret_value(),
            ),
            (
                "an access token",
                f"set {prefix}ACCESS_TOKEN to a system user's token (docs/whatsapp.md)",
                wa.resolved_token(),
            ),
        )
        if not present
    ]
    if missing:
        return missing
    from channels.whatsapp import check_credentials

    return [await _remote_check("whatsapp", check_credentials(wa, wa.resolved_token() or ""))]


async def check_discord(settings: Settings) -> list[Finding]:
    """The bot token (logged in through the HTTP API), the Message Content intent
    enabled for the app when the bot asks for it, and the Gateway answering."""
    section = settings.channels.discord
    token = section.resolved_token()
    if not token:
        return [
            Finding(
                "fail",
                "discord is enabled without a bot token",
                "set GATEWAY_CHANNELS__DISCORD__TOKEN (Developer Portal > Bot > Reset Token)",
            )
        ]
    from channels.discord import check_credentials

    try:
        with anyio.fail_after(30):
            found = await check_credentials(section, token)
    except Exception as exc:
        return [Finding("fail", f"discord credentials were not accepted: {exc}")]
    findings = [Finding("ok", f"discord credentials work: {found.identity}")]
    if section.message_content and not found.message_content_enabled:
        findings.append(
            Finding(
                "fail",
                "discord: the Message Content intent is not enabled for the app; the "
                "Gateway would refuse the bot (close code 4014)",
                "Developer Portal > your app > Bot > Privileged Gateway Intents > Message "
                "Content Intent, or set channels.discord.message_content = false (the bot "
                "then reads only DMs and messages that mention it)",
            )
        )
    elif section.message_content:
        findings.append(Finding("ok", "discord: the Message Content intent is enabled"))
    if found.gateway_problem:
        findings.append(
            Finding(
                "fail",
                f"discord: {found.gateway_problem}",
                "check the network, or channels.discord.gateway_url",
            )
        )
    else:
        findings.append(Finding("ok", "discord: the Gateway answers"))
    return findings


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


async def check_tools(settings: Settings) -> list[Finding]:
    """Which tools reach outside (web_fetch, MCP servers), and each MCP server started
    once the way `run` starts it, its tools listed, then stopped."""
    from gateway.agent.mcp import MCPUnavailable
    from gateway.agent.toolset import build_mcp, build_tools

    try:
        registry = build_tools(settings)
        mcp = build_mcp(settings, registry)
    except ConfigError as exc:
        return [Finding("fail", str(exc))]
    findings = []
    for group in registry.groups():
        if group.name == "web_fetch":
            allowed = settings.tools.web_fetch.allow_networks
            where = "off" if not group.on else "on: the model may fetch public web pages"
            if group.on and allowed:
                where += f" and {', '.join(allowed)} (tools.web_fetch.allow_networks)"
            findings.append(Finding("ok", f"tool web_fetch is {where}"))
    if mcp is None:
        findings.append(Finding("ok", "no MCP servers configured"))
        return findings
    for name, connection in mcp.connections.items():
        if not connection.settings.enabled:
            findings.append(Finding("ok", f"MCP server {name} is off (enabled = false)"))
            continue
        for variable in connection.missing_env():
            findings.append(
                Finding(
                    "warn",
                    f"MCP server {name}: pass_env names {variable}, which is not set",
                    f"set {variable} in the gateway's environment",
                )
            )
        try:
            tools = await connection.probe()
        except MCPUnavailable as exc:
            findings.append(
                Finding(
                    "fail",
                    f"MCP server {name} ({connection.where}) did not work: {exc}",
                    f"fix mcp.servers.{name}; its stderr is in {connection.stderr_path}",
                )
            )
            continue
        listed = ", ".join(tools) if tools else f"none (check mcp.servers.{name}.tools)"
        findings.append(Finding("ok", f"MCP server {name} answers; tools: {listed}"))
    return findings


async def check_storage(settings: Settings) -> list[Finding]:
    """The storage of the configured mode can be opened (asked without changing it: no
    migration is applied by the doctor)."""
    from gateway.storage.postgres import StorageError, StorageUnavailable
    from gateway.storage.seam import open_storage

    storage = open_storage(settings)
    try:
        return [Finding("ok", await anyio.to_thread.run_sync(storage.check))]
    except StorageUnavailable as exc:
        return [Finding("fail", f"storage: {exc}", "start PostgreSQL or fix storage.url")]
    except StorageError as exc:
        return [Finding("fail", f"storage: {exc}")]


def check_secrets(settings: Settings) -> list[Finding]:
    """Secrets too short to be redacted from text (`gateway.redaction`)."""
    from gateway.config.section import secret_items
    from gateway.redaction import MIN_SECRET_CHARS

    return [
        Finding(
            "warn",
            f"{name} is shorter than {MIN_SECRET_CHARS} characters: it cannot be told from "
            "ordinary words, so logs and pages show it wherever it is quoted",
            "use a longer secret",
        )
        for name, value in secret_items({"": settings})
        if len(value) < MIN_SECRET_CHARS
    ]


async def run_checks(settings: Settings, *, config_path: Path | None = None) -> list[Finding]:
    """Everything `gateway run` will need, checked the way `run` uses it: the workspace
    is made, the HTTP port is listened on, the LLM and platforms are asked. Redacted."""
    findings = [Finding("ok", "configuration is valid")]
    findings += [Finding("warn", warning) for warning in env_warnings(os.environ)]
    findings += check_secrets(settings)
    findings += check_config_file(config_path)
    findings += check_workspace(settings, config_path=config_path)
    findings += await check_storage(settings)
    findings += await check_llm(settings)
    findings += await check_http(settings)
    findings += await check_cache(settings)
    findings += await check_channels(settings)
    findings += await check_tools(settings)
    redact = settings.redactor.redact
    return [Finding(f.status, redact(f.what), redact(f.fix)) for f in findings]
