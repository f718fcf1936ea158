"""Tools that reach outside, end to end: `gateway chat -m`, `gateway run` and `gateway
doctor` as subprocesses, the fake OpenAI server calling an MCP server's tool (a real
MCP server over stdio) and `web_fetch` (a local site), with every call and result
persisted in the session, and the failures a user meets: a dead MCP server, a hostile
URL, a tool that is off."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.fakes.openai_server import FakeOpenAI, content_text
from tests.fakes.web_server import ARTICLE_SENTENCE, FakeWeb
from tests.gateway_process import ROOT, GatewayProcess, base_env, wait_until
from tests.test_cli_e2e import run_gateway

DEMO_SERVER = f"""
[mcp.servers.demo]
command = "{sys.executable}"
args = ["-m", "tests.mcp_servers.demo"]
env = {{ PYTHONPATH = "{ROOT}" }}
tools = ["add", "slow"]
timeout = 2.0
"""
BROKEN_SERVER = """
[mcp.servers.broken]
command = "/nonexistent/mcp-server"
"""


def tool_result_responder(body: dict[str, Any]) -> str:
    """Answers with what the last tool said (or echoes the user when no tool spoke)."""
    for message in reversed(body["messages"]):
        if message["role"] == "tool":
            return f"the tool said: {content_text(message['content'])}"
        if message["role"] == "user":
            return f"echo: {content_text(message['content'])}"
    return "nothing"


def session_lines(workspace: Path, key: str = "cli%3Adirect") -> list[dict[str, Any]]:
    files = sorted((workspace / "sessions").glob(f"{key}*.jsonl"))
    assert files, f"no session file for {key} in {workspace / 'sessions'}"
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def persisted_tool_turn(workspace: Path) -> tuple[list[Any], list[str]]:
    """The tool calls of the session's assistant entries and its tool results."""
    calls, results = [], []
    for entry in session_lines(workspace):
        message = entry.get("message") or {}
        calls += message.get("tool_calls") or []
        if message.get("role") == "tool":
            results.append(message.get("content"))
    return calls, results


def env_for(tmp_path: Path, fake: FakeOpenAI, config: str) -> dict[str, str]:
    (tmp_path / "gateway.toml").write_text(config)
    return base_env(tmp_path / "ws", fake)


def test_chat_calls_an_mcp_tool_and_persists_call_and_result(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.responder = tool_result_responder
    fake_openai_thread.add_tool_call("demo__add", {"a": 2, "b": 3})
    env = env_for(tmp_path, fake_openai_thread, DEMO_SERVER)
    out = run_gateway(["chat", "-m", "what is 2 + 3?"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the tool said: 5"
    offered = [t["function"]["name"] for t in fake_openai_thread.chat_requests[0].tools]
    assert {"demo__add", "demo__slow"} <= set(offered) and "demo__crash" not in offered
    calls, results = persisted_tool_turn(tmp_path / "ws")
    assert [(c["function_name"], c["arguments"]) for c in calls] == [
        ("demo__add", {"a": 2, "b": 3})
    ]
    assert results == ["5"]

    status = run_gateway(["chat", "-m", "/status"], env, tmp_path)
    assert "Tools demo: on (demo__add, demo__slow)" in status.stdout
    assert "Tools web_fetch: off (off; list it in agent.tools to turn it on)" in status.stdout


def test_a_dead_mcp_server_answers_the_model_with_the_reason(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.responder = tool_result_responder
    fake_openai_thread.add_tool_call("broken__add", {"a": 1, "b": 1})
    env = env_for(tmp_path, fake_openai_thread, BROKEN_SERVER)
    out = run_gateway(["chat", "-m", "add 1 and 1"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    said = (
        "the tool said: error: tool broken__add is unavailable now: MCP server broken: did "
        "not start: command not found: /nonexistent/mcp-server"
    )
    assert out.stdout.startswith(said)
    assert [t for t in fake_openai_thread.chat_requests[0].tools if "broken" in json.dumps(t)] == []
    _, results = persisted_tool_turn(tmp_path / "ws")
    assert len(results) == 1 and "command not found" in results[0]


def test_a_slow_mcp_tool_is_cut_off_and_the_turn_goes_on(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.responder = tool_result_responder
    fake_openai_thread.add_tool_call("demo__slow", {"seconds": 60})
    env = env_for(tmp_path, fake_openai_thread, DEMO_SERVER)
    out = run_gateway(["chat", "-m", "take your time"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "the tool said: error: tool demo__slow timed out after 2s"


def test_web_fetch_reads_a_page_and_refuses_a_hostile_url(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    fake_openai_thread.responder = tool_result_responder
    config = """
[agent]
tools = ["current_time", "web_fetch"]

[tools.web_fetch]
allow_networks = ["127.0.0.1/32"]
"""
    with FakeWeb.in_thread() as site:
        env = env_for(tmp_path, fake_openai_thread, config)
        fake_openai_thread.add_tool_call("web_fetch", {"url": f"{site.url}/article"})
        out = run_gateway(["chat", "-m", "what do otters do?"], env, tmp_path)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"the tool said: URL: {site.url}/article")
        assert ARTICLE_SENTENCE in out.stdout

        port = site.url.rsplit(":", 1)[1]
        hostile = f"{site.url}/redirect?to=http://127.0.0.2:{port}/article"
        fake_openai_thread.add_tool_call("web_fetch", {"url": hostile})
        out = run_gateway(["chat", "-m", "and this one?"], env, tmp_path)
        assert out.stdout.strip() == (
            "the tool said: error: 127.0.0.2 is a loopback address; not fetched"
        )
        assert site.paths == ["/article", f"/redirect?to=http://127.0.0.2:{port}/article"]
    calls, results = persisted_tool_turn(tmp_path / "ws")
    assert [c["arguments"]["url"] for c in calls] == [
        f"{site.url}/article",
        hostile,
    ]
    assert ARTICLE_SENTENCE in results[0]
    assert results[1] == "error: 127.0.0.2 is a loopback address; not fetched"


def test_web_fetch_is_off_unless_listed(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    fake_openai_thread.responder = tool_result_responder
    fake_openai_thread.add_tool_call("web_fetch", {"url": "http://127.0.0.1/"})
    env = env_for(tmp_path, fake_openai_thread, "")
    out = run_gateway(["chat", "-m", "fetch it"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    offered = [t["function"]["name"] for t in fake_openai_thread.chat_requests[0].tools]
    assert "web_fetch" not in offered
    assert out.stdout.strip() == (
        "the tool said: error: tool web_fetch is unavailable now: off; list it in agent.tools "
        "to turn it on"
    )


def test_run_shows_mcp_servers_on_readyz_and_doctor_checks_them(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = env_for(tmp_path, fake_openai_thread, DEMO_SERVER + BROKEN_SERVER)
    env["GATEWAY_HTTP__PORT"] = "0"
    gateway = GatewayProcess(env, tmp_path)
    try:
        # Servers start with the daemon, before it says it is ready.
        gateway.wait_for_line("mcp demo: up with 2 tools (demo__add, demo__slow)", timeout=60)
        port = gateway.wait_ready()
        body: dict[str, Any] = {}

        def shown() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
                body.update(json.load(r))
            return bool(body["components"]["mcp:demo"]["healthy"])

        # A dead tool server is shown, and the gateway stays ready (it still answers).
        wait_until(shown, 60, "mcp:demo healthy on /readyz")
        assert body["ready"] is True and len(body["degraded"]) == 1
        assert body["degraded"][0].startswith("mcp:broken: did not start: command not found")
        broken = body["components"]["mcp:broken"]
        assert not broken["healthy"] and "command not found" in broken["detail"]
        assert gateway.terminate() == 0
    finally:
        gateway.stop()

    checked = run_gateway(["doctor"], env, tmp_path)
    assert checked.returncode != 0
    assert "ok    MCP server demo answers; tools: demo__add, demo__slow" in checked.stdout
    assert (
        "FAIL  MCP server broken (/nonexistent/mcp-server) did not work: command not found"
        in checked.stdout
    )
    assert "ok    tool web_fetch is off" in checked.stdout
