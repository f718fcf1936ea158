"""MCP servers' tools through the registry, against a real MCP server (the official SDK)
run as a subprocess over stdio and over streamable HTTP, including its failures: a
crash in the middle of a call, a server that never starts, one that starts only on a
later try, a call slower than the timeout, and an HTTP server that goes away."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.agent.mcp import MCPConnection, MCPServers, MCPUnavailable, ServerState, tool_name
from gateway.agent.tools import ToolContext, ToolRegistry
from gateway.config import MCPServerSettings, MCPSettings
from gateway.llm import ToolCall
from tests.fakes._serving import free_port
from tests.gateway_process import ROOT

pytestmark = pytest.mark.anyio

CONTEXT = ToolContext(session_key="cli:direct")
DEMO = ["-m", "tests.mcp_servers.demo"]
#: Generous: eight engineers' tests share two cores, and the SDK takes a while to import.
WAIT = 90.0


def stdio(**extra: Any) -> MCPServerSettings:
    return MCPServerSettings.model_validate(
        {"command": sys.executable, "args": DEMO, "env": {"PYTHONPATH": str(ROOT)}, **extra}
    )


async def call(registry: ToolRegistry, tool: str, /, **arguments: Any) -> str:
    return await registry.execute(
        ToolCall(id="c", function_name=tool, arguments=arguments), CONTEXT
    )


async def until(condition: Callable[[], bool], what: str) -> None:
    with anyio.fail_after(WAIT):
        while True:
            if condition():
                return
            await anyio.sleep(0.05)


class Running:
    """Servers supervised in a task group for the test's duration, with their states."""

    def __init__(self, registry: ToolRegistry, servers: MCPServers) -> None:
        self.registry = registry
        self.servers = servers
        self.states: list[tuple[str, ServerState]] = []
        servers.observe(lambda name, state: self.states.append((name, state)))

    def up(self, name: str = "demo") -> bool:
        return self.servers.connections[name].state.up


@pytest.fixture
def run_servers(tmp_path: Path) -> Callable[..., Any]:
    """`async with run_servers(demo=settings, ...) as running:` supervises them."""

    @contextlib.asynccontextmanager
    async def start(
        environ: dict[str, str] | None = None, **servers: MCPServerSettings
    ) -> AsyncIterator[Running]:
        registry = ToolRegistry()
        mcp = MCPServers(
            MCPSettings(servers=servers), registry, log_dir=tmp_path / "mcp", environ=environ
        )
        running = Running(registry, mcp)
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(WAIT):
                await tg.start(mcp.run)
            yield running
            tg.cancel_scope.cancel()

    return start


def test_tool_names_are_prefixed_and_made_safe() -> None:
    assert tool_name("files", "read_file") == "files__read_file"
    assert tool_name("files", "read.file/v2 now") == "files__read_file_v2_now"
    assert len(tool_name("files", "x" * 100)) == 64


async def test_stdio_server_tools_are_offered_and_answer(run_servers: Any) -> None:
    settings = stdio(
        tools=["add", "fail", "echo_env"],
        env={"PYTHONPATH": str(ROOT), "DEMO_GREETING": "hello"},
        pass_env=["PASSED_ON"],
    )
    environ = {"PASSED_ON": "from the gateway", "OPENAI_API_KEY": "sk-must-stay-here"}
    async with run_servers(environ=environ, demo=settings) as running:
        registry = running.registry
        assert running.up()
        assert registry.names() == ["demo__add", "demo__echo_env", "demo__fail"]
        spec = {s.name: s for s in registry.specs()}["demo__add"]
        assert spec.description == "Add two whole numbers."
        assert spec.parameters["required"] == ["a", "b"]
        assert await call(registry, "demo__add", a=2, b=3) == "5"
        failed = await call(registry, "demo__fail")
        assert failed == "error: Error executing tool fail: the demo tool failed on purpose"
        wrong = await call(registry, "demo__add", a="two", b=3)
        assert wrong.startswith("error: Error executing tool add: 1 validation error")
        assert await call(registry, "demo__echo_env", name="DEMO_GREETING") == "hello"
        assert await call(registry, "demo__echo_env", name="PASSED_ON") == "from the gateway"
        # Nothing else of the gateway's environment reaches the server.
        assert await call(registry, "demo__echo_env", name="OPENAI_API_KEY") == "(unset)"
        # A tool the operator did not allow is not there, even by name.
        crash = await call(registry, "demo__crash")
        assert crash.startswith("error: unknown tool 'demo__crash'")


async def test_a_crash_mid_call_answers_at_once_and_the_server_comes_back(
    run_servers: Any, tmp_path: Path
) -> None:
    async with run_servers(demo=stdio()) as running:
        registry = running.registry
        answer = await call(registry, "demo__crash")
        assert answer.startswith("error: MCP server demo went away during a call of crash")
        # Off at once: the next call in the same turn is answered without waiting.
        after = await call(registry, "demo__add", a=1, b=1)
        assert after.startswith("error: tool demo__add is unavailable now: MCP server demo:")
        assert "demo__add" not in registry.names()
        await until(running.up, "the restart")
        assert await call(registry, "demo__add", a=1, b=1) == "2"
        downs = [s.detail for _, s in running.states if not s.up]
        assert any("went away during a call of crash" in d for d in downs)
        # The server's stderr went to its log file, and its last line into the reason.
        assert "demo: crashing on purpose" in (tmp_path / "mcp" / "demo.stderr.log").read_text()
        assert any("its stderr ends: demo: crashing on purpose" in d for d in downs)


async def test_a_server_that_cannot_start_is_off_with_the_reason(run_servers: Any) -> None:
    missing = MCPServerSettings(command="/nonexistent/mcp-server")
    async with run_servers(demo=missing) as running:
        registry = running.registry
        assert not running.up()
        assert registry.names() == []
        answer = await call(registry, "demo__anything")
        assert answer.startswith(
            "error: tool demo__anything is unavailable now: MCP server demo: did not start: "
            "command not found: /nonexistent/mcp-server; restarting in 1s"
        )
        group = next(g for g in registry.groups() if g.name == "demo")
        assert not group.on and "command not found" in group.reason


async def test_a_failing_start_is_retried_with_backoff(run_servers: Any, tmp_path: Path) -> None:
    counter = tmp_path / "starts"
    settings = stdio(
        env={"PYTHONPATH": str(ROOT), "DEMO_FAIL_STARTS": "2", "DEMO_COUNTER": str(counter)}
    )
    async with run_servers(demo=settings) as running:
        await until(running.up, "the third start")
        assert await call(running.registry, "demo__add", a=20, b=22) == "42"
        downs = [s.detail for _, s in running.states if not s.up]
        assert counter.read_text() == "3"
        # Two failed starts, each saying why (the server's last stderr line), the
        # waits doubling: 1 s, then 2 s.
        assert "refusing to start (1 of 2)" in downs[0] and "restarting in 1s" in downs[0]
        assert "refusing to start (2 of 2)" in downs[1] and "restarting in 2s" in downs[1]


async def test_a_slow_call_is_cut_off_and_the_server_stays_up(run_servers: Any) -> None:
    async with run_servers(demo=stdio(timeout=1.5)) as running:
        registry = running.registry
        assert await call(registry, "demo__slow", seconds=60) == (
            "error: tool demo__slow timed out after 1.5s"
        )
        assert running.up()
        assert await call(registry, "demo__add", a=1, b=2) == "3"
        assert await call(registry, "demo__slow", seconds=0.1) == "slept 0.1s"


async def test_the_server_process_ends_with_the_gateway(run_servers: Any, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    settings = stdio(env={"PYTHONPATH": str(ROOT), "DEMO_PID_FILE": str(pid_file)})
    async with run_servers(demo=settings) as running:
        assert running.up()
        pid = int(pid_file.read_text())
    await until(lambda: not _alive(pid), "the server process to end")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes (its parent reaps it).
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


@pytest.fixture
def http_server() -> Iterator[Callable[[], tuple[str, subprocess.Popen[bytes]]]]:
    """Starts the demo server over streamable HTTP (again on the same port when called
    again); every process is killed at the end."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[str, subprocess.Popen[bytes]]:
        proc = subprocess.Popen(
            [sys.executable, *DEMO, "http", str(port)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        return f"http://127.0.0.1:{port}/mcp", proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


async def _listening(url: str) -> None:
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    async def connects() -> bool:
        try:
            stream = await anyio.connect_tcp("127.0.0.1", port)
        except OSError:
            return False
        await stream.aclose()
        return True

    with anyio.fail_after(WAIT):
        while True:
            if await connects():
                return
            await anyio.sleep(0.1)


async def test_streamable_http_server_and_its_loss(run_servers: Any, http_server: Any) -> None:
    url, proc = http_server()
    await _listening(url)
    settings = MCPServerSettings(url=url, timeout=20)
    async with run_servers(web=settings) as running:
        registry = running.registry
        assert running.up("web")
        assert "web__add" in registry.names()
        assert await call(registry, "web__add", a=4, b=5) == "9"
        # The server dies in the middle of a call: answered at once, not at the timeout.
        answer = await call(registry, "web__crash")
        assert answer.startswith("error: MCP server web went away during a call of crash")
        proc.wait(10)
        after = await call(registry, "web__add", a=1, b=1)
        assert after.startswith("error: tool web__add is unavailable now: MCP server web:")
        # Back on the same address: the supervisor finds it again.
        http_server()
        await until(lambda: running.up("web"), "the reconnect")
        assert await call(registry, "web__add", a=1, b=1) == "2"


async def test_an_http_server_that_is_not_there(run_servers: Any) -> None:
    settings = MCPServerSettings(url=f"http://127.0.0.1:{free_port()}/mcp")
    async with run_servers(web=settings) as running:
        assert not running.up("web")
        detail = running.servers.connections["web"].state.detail
        assert detail.startswith("did not start: ") and "restarting in" in detail


async def test_probe_lists_the_tools_or_says_why_not(tmp_path: Path) -> None:
    registry = ToolRegistry()
    good = MCPConnection("demo", stdio(tools=["add"]), registry, log_dir=tmp_path)
    assert await good.probe() == ["demo__add"]
    bad = MCPConnection(
        "broken",
        MCPServerSettings(command=sys.executable, args=["-c", "import sys; sys.exit('no config')"]),
        registry,
        log_dir=tmp_path,
    )
    with pytest.raises(MCPUnavailable, match="its stderr ends: no config"):
        await bad.probe()


def test_settings_refuse_what_cannot_work() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exactly one of command"):
        MCPServerSettings()
    with pytest.raises(ValidationError, match="exactly one of command"):
        MCPServerSettings(command="x", url="http://127.0.0.1/mcp")
    with pytest.raises(ValidationError, match="http:// or https://"):
        MCPServerSettings(url="ftp://x")
    with pytest.raises(ValidationError, match="server name 'a__b'"):
        MCPSettings(servers={"a__b": MCPServerSettings(command="x")})
