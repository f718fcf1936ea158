"""MCP servers' tools for the model: one supervised client per `[mcp.servers.NAME]`.

Each server's tools are a group of the tool registry, named `NAME__tool`. A supervisor
task per server starts it (a command over stdio, or a streamable HTTP url, through the
official `mcp` SDK), lists its tools, offers the allowed ones, checks every
`CHECK_INTERVAL` seconds that it still answers, and when it is gone (it crashed, exited,
stopped answering, or never started) turns the group off with the reason and starts it
again with exponential backoff.

Promise: a call to a server's tool never hangs a turn on a dead server. While the
server is down its tools are not offered, and a call to one is answered at once with
why; a server that dies during a call answers that call with an error at once (and is
restarted); a call that takes longer than the server's `timeout` is cut off there.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import anyio
import anyio.abc
from loguru import logger

from gateway import __version__
from gateway.agent.tools import Tool, ToolContext, ToolRegistry
from gateway.config import MCPServerSettings, MCPSettings
from gateway.fsutil import ensure_private_dir
from gateway.llm.types import ToolSpec

SEPARATOR = "__"
MAX_DESCRIPTION_CHARS = 1024
_MAX_PAGES = 20
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class MCPUnavailable(Exception):
    """A server that did not start or stopped answering; the message says why."""


@dataclass(frozen=True, slots=True)
class ServerState:
    """What `/readyz` and `gateway doctor` show of one server."""

    up: bool
    detail: str


StateCallback = Callable[[str, ServerState], None]


def tool_name(server: str, tool: str) -> str:
    """The registry name of `server`'s tool `tool`: `server__tool`, with characters the
    model API refuses in a function name replaced by `_`, at most 64 characters."""
    return f"{server}{SEPARATOR}{_UNSAFE.sub('_', tool)}"[:64]


def describe_error(exc: BaseException) -> str:
    """One line for an exception out of the SDK (task groups wrap the real one)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, FileNotFoundError):
        return f"command not found: {exc.filename or exc}"
    if isinstance(exc, PermissionError):
        return f"command cannot be run: {exc.filename or exc}"
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text


def result_text(result: Any) -> str:
    """A `CallToolResult` as the text the model reads; `error: ...` when the server
    says the call failed. Content other than text is named, not inlined."""
    parts: list[str] = []
    for item in result.content or ():
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {getattr(item, 'mime_type', '')} not shown]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        elif kind == "resource":
            resource = item.resource
            text = getattr(resource, "text", None)
            parts.append(text if isinstance(text, str) else f"[resource {resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False, default=str))
    text = "\n".join(parts) if parts else "(no output)"
    return f"error: {text}" if result.is_error else text


class MCPConnection:
    """One configured server: its supervisor (`run`), its tools' handler and a one-off
    `probe` for `gateway doctor`."""

    #: Seconds between two checks that the server still answers.
    CHECK_INTERVAL = 10.0
    BACKOFF_MAX = 60.0
    #: A connection that lived this long starts the backoff over when it ends.
    STABLE_AFTER = 60.0

    def __init__(
        self,
        name: str,
        settings: MCPServerSettings,
        registry: ToolRegistry,
        *,
        log_dir: Path,
        environ: Mapping[str, str] | None = None,
        on_state: StateCallback | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.registry = registry
        self.stderr_path = log_dir / f"{name}.stderr.log"
        self._environ = os.environ if environ is None else environ
        self.on_state = on_state
        self.state = ServerState(False, "starting")
        self.first_attempt = anyio.Event()
        self._client: Any = None
        self._lost: anyio.Event | None = None
        self._lost_reason = ""

    # ------------------------------------------------------------------ wiring

    @property
    def where(self) -> str:
        s = self.settings
        return s.url if s.url else " ".join([s.command or "", *s.args])

    def missing_env(self) -> list[str]:
        """Names in `pass_env` that the gateway's environment does not have."""
        return [n for n in self.settings.pass_env if n not in self._environ]

    def _new_client(self, errlog: TextIO | None) -> Any:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp_types import Implementation

        s = self.settings
        server: Any
        if s.url:
            server = s.url
        else:
            assert s.command is not None
            # Only what is named goes to the server: the SDK adds PATH, HOME and the
            # like, never the rest of our environment (our API keys stay here).
            env = {n: self._environ[n] for n in s.pass_env if n in self._environ}
            env.update(s.env)
            params = StdioServerParameters(command=s.command, args=list(s.args), env=env or None)
            server = stdio_client(params, errlog=errlog) if errlog else stdio_client(params)
        return Client(
            server,
            client_info=Implementation(name="chat-gateway", version=__version__),
            cache=None,  # a listing must be the server's own, checked each time
        )

    def _open_errlog(self) -> TextIO | None:
        """The server's stderr goes to `<workspace>/mcp/NAME.stderr.log` (a terminal
        chat is not the place for it)."""
        if self.settings.url:
            return None
        ensure_private_dir(self.stderr_path.parent)
        fd = os.open(self.stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        return open(fd, "a", encoding="utf-8", errors="replace")

    def _last_stderr_line(self) -> str:
        """The last line the server wrote to stderr, for the reason it stopped."""
        try:
            with self.stderr_path.open("rb") as fh:
                fh.seek(max(0, fh.seek(0, os.SEEK_END) - 4096))
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1].strip()[:200] if lines else ""

    def _with_stderr(self, reason: str) -> str:
        line = self._last_stderr_line() if not self.settings.url else ""
        return f"{reason} (its stderr ends: {line})" if line else reason

    async def _list_tools(self, client: Any) -> list[Any]:
        found: list[Any] = []
        cursor: str | None = None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor, cache_mode="refresh")
            found.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return found

    def offered_tools(self, listing: list[Any]) -> list[Tool]:
        """The registry tools for a server's listing: the allowed ones, renamed."""
        allowed = self.settings.tools
        tools: dict[str, Tool] = {}
        for item in listing:
            if allowed is not None and item.name not in allowed:
                continue
            name = tool_name(self.name, item.name)
            if name in tools:
                logger.warning(
                    "mcp {}: tool {!r} clashes with another as {}", self.name, item.name, name
                )
                continue
            description = item.description or item.title or item.name
            schema = dict(item.input_schema or {"type": "object", "properties": {}})
            tools[name] = Tool(
                ToolSpec(name, description[:MAX_DESCRIPTION_CHARS], schema),
                partial(self._call, item.name),
                timeout=self.settings.timeout,
            )
        if allowed is not None:
            listed = {item.name for item in listing}
            missing = [n for n in allowed if n not in listed]
            if missing:
                logger.warning(
                    "mcp {}: mcp.servers.{}.tools names {} that the server does not offer",
                    self.name,
                    self.name,
                    ", ".join(missing),
                )
        return list(tools.values())

    def _set_state(self, up: bool, detail: str) -> None:
        self.state = ServerState(up, detail)
        self.registry.set_group_state(
            self.name, up, "" if up else f"MCP server {self.name}: {detail}"
        )
        if self.on_state is not None:
            self.on_state(self.name, self.state)

    # ------------------------------------------------------------------ calls

    async def _call(self, tool: str, args: dict[str, Any], context: ToolContext) -> str:
        client, lost = self._client, self._lost
        if client is None or lost is None or lost.is_set():
            return f"error: MCP server {self.name} is not connected; it is being restarted"
        try:
            result = await client.call_tool(tool, args)
        except Exception as exc:
            from mcp.shared.exceptions import MCPError
            from mcp_types import CONNECTION_CLOSED

            if isinstance(exc, MCPError) and exc.code != CONNECTION_CLOSED:
                return f"error: MCP server {self.name} refused the call: {exc}"
            reason = f"went away during a call of {tool} ({describe_error(exc)})"
            self._mark_lost(lost, reason)
            return (
                f"error: MCP server {self.name} {reason}; it is being restarted, so do "
                "without this tool for now"
            )
        return result_text(result)

    def _mark_lost(self, lost: anyio.Event, reason: str) -> None:
        """Off at once (later calls in this turn are answered without waiting), and the
        supervisor is woken to restart the server."""
        if lost.is_set():
            return
        self._lost_reason = reason
        lost.set()
        self._set_state(False, f"{reason}; restarting")

    # ------------------------------------------------------------------ supervision

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Keep the server running until cancelled; reports started after the first
        attempt, whether it came up or not (`first_attempt` is set then too)."""
        task_status.started()
        if not self.settings.enabled:
            self._set_state(False, "off (enabled = false in gateway.toml)")
            self.first_attempt.set()
            return
        backoff = 1.0
        while True:
            began = anyio.current_time()
            reason = await self._serve_once()
            if anyio.current_time() - began >= self.STABLE_AFTER:
                backoff = 1.0
            logger.warning("mcp {}: {}; restarting in {:g}s", self.name, reason, backoff)
            self._set_state(False, f"{reason}; restarting in {backoff:g}s")
            self.first_attempt.set()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, self.BACKOFF_MAX)

    async def _serve_once(self) -> str:
        """One life of the server: start it, offer its tools, watch it. Returns why it
        ended (never raises but for cancellation)."""
        timeout = self.settings.startup_timeout
        up = False
        reason = ""
        errlog: TextIO | None = None
        try:
            errlog = await anyio.to_thread.run_sync(self._open_errlog)
            # The deadline covers starting and listing; it is lifted once the tools are
            # offered. One scope around the whole connection keeps anyio's nesting.
            with anyio.CancelScope(deadline=anyio.current_time() + timeout) as scope:
                async with self._new_client(errlog) as client:
                    tools = self.offered_tools(await self._list_tools(client))
                    scope.deadline = math.inf
                    lost = anyio.Event()
                    self._client, self._lost = client, lost
                    self.registry.replace_group_tools(self.name, tools)
                    up = True
                    logger.info(
                        "mcp {}: up with {} tools ({})",
                        self.name,
                        len(tools),
                        ", ".join(t.spec.name for t in tools) or "none allowed",
                    )
                    self._set_state(True, f"{len(tools)} tools")
                    self.first_attempt.set()
                    reason = await self._watch(client, lost)
                    lost.set()
            if scope.cancelled_caught:
                reason = f"did not start within {timeout:g}s"
        except Exception as exc:
            if not reason:  # else the server was found gone first, and closing it failed
                reason = ("lost" if up else "did not start") + f": {describe_error(exc)}"
        finally:
            self._client = None
            if self._lost is not None:
                self._lost.set()
            if errlog is not None:
                errlog.close()
        self._lost_reason = ""
        return await anyio.to_thread.run_sync(self._with_stderr, reason or "stopped")

    async def _watch(self, client: Any, lost: anyio.Event) -> str:
        """Until the server is gone: woken by a call that lost it, or finding on a
        periodic listing that it no longer answers (which also picks up new tools)."""
        while True:
            with anyio.move_on_after(self.CHECK_INTERVAL):
                await lost.wait()
            if lost.is_set():
                return self._lost_reason or "lost"
            try:
                with anyio.fail_after(self.settings.timeout):
                    listing = await self._list_tools(client)
            except TimeoutError:
                return f"stopped answering (no tool listing within {self.settings.timeout:g}s)"
            except Exception as exc:
                return f"lost: {describe_error(exc)}"
            self.registry.replace_group_tools(self.name, self.offered_tools(listing))

    async def probe(self) -> list[str]:
        """Start the server once, list the tools it would offer, stop it (for `gateway
        doctor`). Raises MCPUnavailable saying why it did not work."""
        timeout = self.settings.startup_timeout
        errlog = None
        try:
            errlog = await anyio.to_thread.run_sync(self._open_errlog)
            with anyio.fail_after(timeout):
                async with self._new_client(errlog) as client:
                    listing = await self._list_tools(client)
        except TimeoutError:
            problem = f"did not start within {timeout:g}s"
        except Exception as exc:
            problem = describe_error(exc)
        else:
            problem = ""
        finally:
            if errlog is not None:
                errlog.close()
        if problem:
            raise MCPUnavailable(await anyio.to_thread.run_sync(self._with_stderr, problem))
        return [t.spec.name for t in self.offered_tools(listing)]


class MCPServers:
    """Every configured server, each with its tool group in `registry`."""

    def __init__(
        self,
        settings: MCPSettings,
        registry: ToolRegistry,
        *,
        log_dir: Path,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.connections: dict[str, MCPConnection] = {}
        for name, server in settings.servers.items():
            registry.add_group(
                name, on=False, reason=f"MCP server {name}: starting", prefix=name + SEPARATOR
            )
            self.connections[name] = MCPConnection(
                name, server, registry, log_dir=log_dir, environ=environ
            )

    def observe(self, callback: StateCallback) -> None:
        """Call `callback(name, state)` on every change of a server's state."""
        for connection in self.connections.values():
            connection.on_state = callback

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Supervise every server until cancelled; reports started once each has come
        up or failed once, so the first turn sees the tools of those that work."""
        async with anyio.create_task_group() as tg:
            for connection in self.connections.values():
                for name in connection.missing_env():
                    logger.warning(
                        "mcp {}: pass_env names {}, which is not set here", connection.name, name
                    )
                await tg.start(connection.run)
            for connection in self.connections.values():
                await connection.first_attempt.wait()
            task_status.started()
