"""The model request's own CPU, side by side: `OpenAIProvider.chat` (its own aiohttp
request with the client's retry rules), the `openai` client's `post` as the provider used
it before (orjson bytes in, the raw answer out; the SDK's aiohttp transport), the client's
`chat.completions.create`, and a bare aiohttp request with the same body and headers
whose JSON answer is read with orjson (the floor). Issue 42 asked for this trial before
the transport was chosen.

    .venv/bin/python bench/llm_transport.py [--calls 2000] [--rounds 5] [--json]

The fake OpenAI-compatible server (tests/fakes/openai_server.py, validation off) runs in
a process of its own, so only the client's CPU is counted: the process CPU time of this
process over `--calls` sequential requests, per request, each variant measured in
`--rounds` alternating rounds (median over rounds). The request is a turn's: a system
prompt, twelve messages of history, the question, and the answer is a short reply with
usage. Wall time per request (p50) is printed too; it includes the server's time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import openai  # noqa: E402
import orjson  # noqa: E402
from fake_llm_process import fake_openai_process  # noqa: E402
from loguru import logger  # noqa: E402

from gateway.llm.openai_provider import OpenAIProvider, response_from_wire  # noqa: E402
from gateway.llm.types import LLMMessage, LLMResponse, TokenUsage  # noqa: E402

MODEL = "gpt-4o-mini"


def turn_messages() -> list[LLMMessage]:
    history = [
        LLMMessage(
            "user" if i % 2 == 0 else "assistant",
            f"message {i} of the conversation, about the weather and the trip to Lisbon",
        )
        for i in range(12)
    ]
    return [
        LLMMessage("system", "You are a helpful assistant in a chat. " * 20),
        *history,
        LLMMessage("user", "and what should I pack for three days there?"),
    ]


async def measure(
    name: str, call: Callable[[], Awaitable[Any]], calls: int
) -> tuple[str, float, float]:
    for _ in range(50):  # warm: connections, caches
        await call()
    walls = []
    cpu = time.process_time()
    for _ in range(calls):
        start = time.perf_counter()
        await call()
        walls.append(time.perf_counter() - start)
    spent = time.process_time() - cpu
    return name, spent / calls * 1e6, statistics.median(walls) * 1e6


async def main(base_url: str, calls: int, rounds: int) -> dict[str, dict[str, float]]:
    if True:
        messages = turn_messages()
        provider = OpenAIProvider(base_url=base_url, api_key=None, model=MODEL, max_retries=0)
        client = openai.AsyncOpenAI(
            base_url=base_url,
            api_key="not-needed",
            max_retries=0,
            http_client=openai.DefaultAioHttpClient(),
        )
        wire = provider._wire_messages(messages)
        body = orjson.dumps({"model": MODEL, "messages": wire})
        headers = {
            "Authorization": "Bearer not-needed",
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        session = aiohttp.ClientSession()

        async def via_provider() -> LLMResponse:
            return await provider.chat(messages)

        async def via_openai() -> Any:
            return await client.chat.completions.create(model=MODEL, messages=wire)

        async def via_client_post() -> LLMResponse | None:
            # OpenAIProvider.chat before it had its own request: the client's post with
            # orjson bytes in and the raw answer out, read by `response_from_wire`.
            answer = await client.post(
                "/chat/completions",
                content=body,
                options={"headers": {"Content-Type": "application/json"}},
                cast_to=bytes,
            )
            return response_from_wire(answer, MODEL)

        async def via_aiohttp() -> LLMResponse:
            async with session.post(
                f"{base_url}/chat/completions", data=body, headers=headers
            ) as response:
                raw = await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
            data = orjson.loads(raw)
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return LLMResponse(
                message=LLMMessage(
                    "assistant",
                    choice["message"].get("content"),
                    usage=TokenUsage(
                        usage.get("prompt_tokens", 0),
                        usage.get("completion_tokens", 0),
                        usage.get("total_tokens", 0),
                    ),
                    model=data.get("model"),
                ),
                model=str(data.get("model") or MODEL),
                finish_reason=choice.get("finish_reason"),
            )

        variants = {
            "OpenAIProvider.chat (its own aiohttp request, retries as the client's)": via_provider,
            "the client's post, orjson in and out (OpenAIProvider.chat before)": via_client_post,
            "the client's chat.completions.create (its pydantic models)": via_openai,
            "a bare aiohttp request + orjson (the floor)": via_aiohttp,
        }
        found: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, call in variants.items():
                _, cpu_us, wall_us = await measure(name, call, calls)
                found[name].append((cpu_us, wall_us))
        await session.close()
        await client.close()
        return {
            name: {
                "cpu_us": statistics.median(c for c, _ in rows),
                "wall_us": statistics.median(w for _, w in rows),
            }
            for name, rows in found.items()
        }


def cli() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logger.remove()
    with fake_openai_process() as base_url:
        results = asyncio.run(main(base_url, args.calls, args.rounds))
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print("| variant | client CPU per request (us) | wall p50 (us) |")
    print("|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['cpu_us']:.0f} | {row['wall_us']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
