"""A real MCP server (official SDK) for the tests: stdio by default, or streamable HTTP.

    python -m tests.mcp_servers.demo                      # stdio
    python -m tests.mcp_servers.demo http PORT            # streamable HTTP at /mcp

Tools: `add`, `echo_env` (a variable of its environment), `slow` (sleeps), `fail`
(raises), `crash` (the process exits mid-call), `records` (a big JSON export whose access
code, `dataset_code(seed)`, is in its middle record only). With DEMO_PID_FILE set it writes its
pid there; with DEMO_FAIL_STARTS=N and DEMO_COUNTER=path it exits at start the first N
times (counted in that file), to test restarts with backoff.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError


def _fail_at_start() -> None:
    failures = int(os.environ.get("DEMO_FAIL_STARTS", "0"))
    counter = os.environ.get("DEMO_COUNTER")
    if not failures or not counter:
        return
    path = Path(counter)
    starts = int(path.read_text()) if path.exists() else 0
    path.write_text(str(starts + 1))
    if starts < failures:
        print(f"demo: refusing to start ({starts + 1} of {failures})", file=sys.stderr)
        sys.exit(1)


server = MCPServer("demo")


def dataset_code(seed: int) -> str:
    """The access code `records(count, seed)` holds, in its middle record."""
    return f"DS-{seed:03d}-{(seed * 104729) % 100000:05d}"


def dataset(count: int, seed: int) -> str:
    """`count` records as pretty JSON (as many MCP servers answer), the code in the middle."""
    rows: list[dict[str, object]] = [
        {
            "id": f"{seed}-{i}",
            "station": f"district {i % 17}",
            "adults": i * 13 % 97,
            "young": i * 7 % 31,
            "water_celsius": 10 + i % 9,
            "note": "counted at dawn",
        }
        for i in range(count)
    ]
    rows[count // 2]["note"] = f"the access code of dataset {seed} is {dataset_code(seed)}"
    return json.dumps({"dataset": seed, "records": rows}, indent=2)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


@server.tool()
def echo_env(name: str) -> str:
    """The value of an environment variable of the server (or '(unset)')."""
    return os.environ.get(name, "(unset)")


@server.tool()
async def slow(seconds: float) -> str:
    """Wait, then say so."""
    await anyio.sleep(seconds)
    return f"slept {seconds:g}s"


@server.tool()
def records(count: int, seed: int) -> str:
    """A survey export: `count` records as JSON."""
    return dataset(count, seed)


@server.tool()
def fail() -> str:
    """Always fails, saying why (a ToolError's message reaches the client)."""
    raise ToolError("the demo tool failed on purpose")


@server.tool()
def crash() -> str:
    """The server process exits in the middle of the call."""
    print("demo: crashing on purpose", file=sys.stderr, flush=True)
    os._exit(3)


def main() -> None:
    _fail_at_start()
    pid_file = os.environ.get("DEMO_PID_FILE")
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()


if __name__ == "__main__":
    main()
