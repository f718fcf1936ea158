"""Benchmark of /stop: how long from /stop reaching the dispatcher until its answer, and
until the stopped turn has recorded what was said, while the turn waits on a slow tool or
on a slow answer from the model (the LLM request in flight).

    .venv/bin/python bench/stop.py            # a table
    .venv/bin/python bench/stop.py --runs 20

The real dispatcher and agent loop, sessions on disk, and the real openai client against
the fake OpenAI server (tests/fakes); the slow tool sleeps a minute unless cancelled.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from loguru import logger  # noqa: E402

from gateway.agent.tools import Tool, ToolContext  # noqa: E402
from gateway.config import load_settings  # noqa: E402
from gateway.daemon import Daemon, Gateway  # noqa: E402
from gateway.llm.types import ToolSpec  # noqa: E402
from gateway.messages import InboundMessage  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI, Reply  # noqa: E402


async def _slow(args: dict[str, Any], context: ToolContext) -> str:
    await anyio.sleep(60)
    return "done"


SLOW = Tool(ToolSpec("slow", "slow", {"type": "object", "properties": {}}), _slow, timeout=120)


async def measure(kind: str, runs: int) -> tuple[list[float], list[float]]:
    answered: list[float] = []
    recorded: list[float] = []
    async with FakeOpenAI() as fake:
        with tempfile.TemporaryDirectory() as tmp:
            env = {
                "OPENAI_BASE_URL": fake.base_url,
                "OPENAI_API_KEY": fake.api_key or "",
                "GATEWAY_WORKSPACE": tmp,
                "GATEWAY_HTTP__PORT": "0",
            }
            daemon = Daemon(Gateway.build(load_settings(None, environ=env)), interactive=False)
            agent = daemon.gateway.agent
            agent.tools.register(SLOW)
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                for i in range(runs):
                    key = f"cli:bench{i}"
                    if kind == "slow tool":
                        fake.add_tool_call("slow", {})
                    else:
                        fake.add(Reply(text="late", delay=60))

                    def message(text: str, key: str = key) -> InboundMessage:
                        return InboundMessage(
                            channel="cli", chat_id=key, text=text, session_key_override=key
                        )

                    turn = await daemon.submit(message("go"))
                    with anyio.fail_after(30):
                        while key not in agent._running:  # noqa: ASYNC110 (the turn starts)
                            await anyio.sleep(0.005)
                    await anyio.sleep(0.2)  # well inside the tool call or the request
                    started = time.perf_counter()
                    stop = await daemon.submit(message("/stop"))
                    await stop.reply()
                    answered.append((time.perf_counter() - started) * 1000)
                    with anyio.fail_after(30):
                        await turn.reply()
                    recorded.append((time.perf_counter() - started) * 1000)
                daemon.stop()
    return answered, recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    logger.remove()
    print(f"/stop latency over {args.runs} runs (ms): median / max")
    print(f"{'turn waits on':<16} {'/stop answered':>18} {'turn recorded':>18}")
    for kind in ("slow tool", "slow model"):
        answered, recorded = anyio.run(measure, kind, args.runs)
        print(
            f"{kind:<16} {statistics.median(answered):>9.1f} / {max(answered):<6.1f} "
            f"{statistics.median(recorded):>9.1f} / {max(recorded):<6.1f}"
        )


if __name__ == "__main__":
    main()
