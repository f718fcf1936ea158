"""Benchmark of the queue modes: a message sent while a turn runs its tool (500 ms), per
mode, how long until the model sees it and until it is answered, and what it cost.

    .venv/bin/python bench/queue_modes.py            # a table
    .venv/bin/python bench/queue_modes.py --runs 20

The real daemon (dispatcher and agent loop, sessions on disk) and the real openai client
against the fake OpenAI server (tests/fakes), which answers at once: the first call of
each turn asks for the tool, the next one answers. The second message is sent 100 ms
into the tool call. "seen" is from sending it until a model request carries it; "answered"
until its reply is ready; "calls" and "replies" are per pair of messages.
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
from tests.fakes.openai_server import FakeOpenAI  # noqa: E402

TOOL_SECONDS = 0.5
SEND_AFTER = 0.1
MODES = ("followup", "collect", "steer", "interrupt")


async def _work(args: dict[str, Any], context: ToolContext) -> str:
    await anyio.sleep(TOOL_SECONDS)
    return "done"


WORK = Tool(ToolSpec("work", "work", {"type": "object", "properties": {}}), _work, timeout=60)


def _carries(fake: FakeOpenAI, text: str, after: int) -> bool:
    return any(
        any(m.get("content") == text for m in request.messages if m.get("role") == "user")
        for request in fake.chat_requests[after:]
    )


async def measure(mode: str, runs: int) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"seen": [], "answered": [], "calls": [], "replies": []}
    async with FakeOpenAI() as fake:
        with tempfile.TemporaryDirectory() as tmp:
            env = {
                "OPENAI_BASE_URL": fake.base_url,
                "OPENAI_API_KEY": fake.api_key or "",
                "GATEWAY_WORKSPACE": tmp,
                "GATEWAY_HTTP__PORT": "0",
                "GATEWAY_MEMORY__AUTO_CONSOLIDATE": "false",
                "GATEWAY_DISPATCH__MODE": mode,
            }
            daemon = Daemon(Gateway.build(load_settings(None, environ=env)), interactive=False)
            agent = daemon.gateway.agent
            agent.tools.register(WORK)
            async with anyio.create_task_group() as tg:
                await tg.start(daemon.run)
                for i in range(runs):
                    key = f"cli:bench{i}"
                    fake.add_tool_call("work", {})
                    before = len(fake.chat_requests)

                    def message(text: str, key: str = key) -> InboundMessage:
                        return InboundMessage(
                            channel="cli", chat_id=key, text=text, session_key_override=key
                        )

                    first = await daemon.submit(message(f"first {i}"))
                    with anyio.fail_after(30):
                        while key not in agent._running:  # noqa: ASYNC110 (the turn starts)
                            await anyio.sleep(0.002)
                    await anyio.sleep(SEND_AFTER)  # inside the tool call
                    text = f"second {i}"
                    started = time.perf_counter()
                    second = await daemon.submit(message(text))
                    with anyio.fail_after(30):
                        while not _carries(fake, text, before):  # noqa: ASYNC110
                            await anyio.sleep(0.002)
                    found["seen"].append((time.perf_counter() - started) * 1000)
                    with anyio.fail_after(30):
                        answer = await second.reply()
                    found["answered"].append((time.perf_counter() - started) * 1000)
                    with anyio.fail_after(30):
                        reply = await first.reply()
                    found["calls"].append(len(fake.chat_requests) - before)
                    found["replies"].append(1 if answer is reply else 2)
                daemon.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    logger.remove()
    print(
        f"A message sent {SEND_AFTER * 1000:.0f} ms into a {TOOL_SECONDS * 1000:.0f} ms tool "
        f"call, {args.runs} runs (ms: median / max)"
    )
    print(f"{'mode':<10} {'seen by the model':>18} {'answered':>16} {'calls':>6} {'replies':>8}")
    for mode in MODES:
        found = anyio.run(measure, mode, args.runs)
        seen, answered = found["seen"], found["answered"]
        print(
            f"{mode:<10} {statistics.median(seen):>9.1f} / {max(seen):<6.1f} "
            f"{statistics.median(answered):>7.1f} / {max(answered):<6.1f} "
            f"{statistics.mean(found['calls']):>6.1f} {statistics.mean(found['replies']):>8.1f}"
        )


if __name__ == "__main__":
    main()
