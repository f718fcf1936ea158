"""Benchmark of big tool outputs: prompt tokens per turn before (today's trimming) and after
(a result over `[agent] tool_output_inline_chars` stored whole, a preview in the context),
and whether the answers stay complete. Prints a table; ``--json`` for machines.

    .venv/bin/python bench/tool_output.py [--turns 12] [--memory-window 10]
        [--context-window N] [--json]

One conversation through the real gateway (`Gateway.build`: the agent loop, sessions in a
file workspace, `web_fetch` with trafilatura, an MCP server over stdio) against local
fakes (tests/fakes): each turn asks for the access code of a web page of 20-60 kB or of
an MCP tool's JSON export (30-55 kB), which is said once, in the middle of the output.
The model is scripted and the same in both runs, a model that uses what it is given: it
calls the tool, answers with the code when it sees it, searches a stored output for it
(`search_tool_output`) when it has a handle, and otherwise says it cannot find it.

- before: `tool_output_inline_chars = 0` and `[tools.web_fetch] max_chars = 12000` (the
  defaults until now): a page is cut at 12,000 characters, any other result in the middle
  at 16,000, and the context cuts a result over a fifth of its budget.
- after: the defaults (6,000 characters inline, a 2,000-character preview).

Prompt tokens are the fake server's count of each request (the tools' definitions
included; `tests/fakes/openai_server.estimate_prompt_tokens`, about 4 characters a
token), summed over the requests of the turn. Memory and the response cache are off, so
the two runs differ in the tool outputs alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from loguru import logger  # noqa: E402

from gateway.agent.tool_outputs import READ_TOOL, SEARCH_TOOL  # noqa: E402
from gateway.agent.tools import ToolContext  # noqa: E402
from gateway.config import load_settings  # noqa: E402
from gateway.daemon import Gateway  # noqa: E402
from gateway.llm.types import ToolCall  # noqa: E402
from gateway.messages import InboundMessage  # noqa: E402
from tests.fakes.openai_server import (  # noqa: E402
    FakeOpenAI,
    FakeToolCall,
    Reply,
    estimate_prompt_tokens,
)
from tests.fakes.web_server import FakeWeb, page_code  # noqa: E402
from tests.mcp_servers.demo import dataset, dataset_code  # noqa: E402

KEY = "cli:bench"
HANDLE = re.compile(r"\[tool output (out_[0-9a-f]{12}):")
STUB = "was taken out of the context to make room"
#: Page sizes (kB) and record counts, in turn order; each turn alternates web and MCP.
PAGES_KB = (20, 35, 60, 25, 45, 30, 55, 40)
RECORDS = (200, 280, 240, 320, 180, 300, 260, 220)
MODES: dict[str, dict[str, str]] = {
    "before": {
        "GATEWAY_AGENT__TOOL_OUTPUT_INLINE_CHARS": "0",
        "GATEWAY_TOOLS__WEB_FETCH__MAX_CHARS": "12000",
    },
    "after": {},
}


@dataclass(frozen=True, slots=True)
class Turn:
    """What one turn asks: the tool to call, its arguments, the code the answer needs."""

    number: int
    tool: str
    arguments: dict[str, Any]
    code: str
    source: str

    @property
    def question(self) -> str:
        return f"Turn {self.number}: what is the access code in {self.source}?"


def plan(turns: int, web: str) -> list[Turn]:
    out: list[Turn] = []
    for n in range(turns):
        if n % 2 == 0:
            kb = PAGES_KB[(n // 2) % len(PAGES_KB)]
            url = f"{web}/long?kb={kb}&seed={n}"
            out.append(Turn(n, "web_fetch", {"url": url}, page_code(n), f"the page {url}"))
        else:
            count = RECORDS[(n // 2) % len(RECORDS)]
            args = {"count": count, "seed": n}
            out.append(Turn(n, "demo__records", args, dataset_code(n), f"dataset {n}"))
    return out


@dataclass(slots=True)
class TurnResult:
    turn: int
    tool: str
    output_chars: int
    requests: int = 0
    prompt_tokens: int = 0
    first_request_tokens: int = 0
    #: Old tool results the turn's requests carried as a one-line stub (at most).
    stubs: int = 0
    answered: bool = False


@dataclass(slots=True)
class Model:
    """The scripted model: the same policy in both runs."""

    turn: Turn | None = None
    results: list[TurnResult] = field(default_factory=list)
    searched: bool = False

    def __call__(self, body: dict[str, Any]) -> Reply | str:
        assert self.turn is not None
        current = self.results[-1]
        tokens = estimate_prompt_tokens(body)
        current.requests += 1
        current.prompt_tokens += tokens
        if current.requests == 1:
            current.first_request_tokens = tokens
        stubs = sum(STUB in str(m.get("content") or "") for m in body["messages"])
        current.stubs = max(current.stubs, stubs)
        last = body["messages"][-1]
        if last["role"] == "user":
            self.searched = False
            call = FakeToolCall(self.turn.tool, self.turn.arguments, f"t{self.turn.number}")
            return Reply(tool_calls=(call,))
        content = str(last.get("content") or "")
        if self.turn.code in content:
            current.answered = True
            return f"The access code is {self.turn.code}."
        stored = HANDLE.match(content)
        if stored is not None and not self.searched:
            self.searched = True
            word = "page" if self.turn.tool == "web_fetch" else "dataset"
            query = f"access code of {word} {self.turn.number}"
            args = {"handle": stored.group(1), "query": query}
            return Reply(tool_calls=(FakeToolCall(SEARCH_TOOL, args, "s"),))
        return "I cannot find the access code in what the tool gave me."


async def read_back_everything(gw: Gateway) -> tuple[int, bool]:
    """Every output stored in the run, read whole through `read_tool_output` and compared
    with what the store holds: (outputs, all equal)."""
    session = await anyio.to_thread.run_sync(gw.sessions.get, KEY)
    assert session is not None
    handles = [
        str(entry.meta["tool_output"]["handle"])
        for entry in session.entries
        if getattr(entry, "meta", None) and "tool_output" in entry.meta  # type: ignore[attr-defined]
    ]
    context = ToolContext(session_key=KEY)
    ok = True
    for handle in handles:
        stored = await anyio.to_thread.run_sync(gw.sessions.outputs.get, KEY, handle)
        parts: list[str] = []
        offset = 0
        while True:
            arguments = {"handle": handle, "offset": offset}
            call = ToolCall(id="r", function_name=READ_TOOL, arguments=arguments)
            text = await gw.agent.tools.execute(call, context)
            header, _, data = text.partition("\n")
            parts.append(data)
            more = re.search(r"continue with offset=(\d+)", header)
            if more is None:
                break
            offset = int(more.group(1))
        ok = ok and "".join(parts) == stored
    return len(handles), ok


async def run(
    mode: str, turns: int, memory_window: int, context_window: int | None
) -> tuple[list[TurnResult], dict[str, Any]]:
    model = Model()
    with tempfile.TemporaryDirectory(prefix="bench-tool-output-") as tmp:
        async with FakeOpenAI(models=("gpt-4o-mini",)) as fake, FakeWeb() as web:
            fake.responder = model
            env = {
                "OPENAI_BASE_URL": fake.base_url,
                "OPENAI_API_KEY": fake.api_key or "",
                "GATEWAY_WORKSPACE": str(Path(tmp) / "ws"),
                "GATEWAY_LLM__MAX_RETRIES": "0",
                "GATEWAY_AGENT__MEMORY_WINDOW": str(memory_window),
                "GATEWAY_AGENT__TOOLS": '["current_time", "web_fetch"]',
                "GATEWAY_TOOLS__WEB_FETCH__ALLOW_NETWORKS": '["127.0.0.0/8"]',
                "GATEWAY_MEMORY__ENABLED": "false",
                "GATEWAY_CACHE__ENABLED": "false",
                **MODES[mode],
            }
            if context_window:
                env["GATEWAY_LLM__CONTEXT_WINDOW"] = str(context_window)
            config = Path(tmp) / "gateway.toml"
            config.write_text(
                "[mcp.servers.demo]\n"
                f"command = {json.dumps(sys.executable)}\n"
                'args = ["-m", "tests.mcp_servers.demo"]\n'
                'tools = ["records"]\n'
                f"env = {{ PYTHONPATH = {json.dumps(str(ROOT))} }}\n"
            )
            settings = load_settings(config, environ=env)
            gw = Gateway.build(settings)
            extra: dict[str, Any] = {}
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(gw.run_services)
                    for turn in plan(turns, web.url):
                        model.turn = turn
                        size = (
                            len(dataset(**turn.arguments))
                            if turn.tool == "demo__records"
                            else turn.arguments["url"]
                        )
                        output = size if isinstance(size, int) else 0
                        model.results.append(TurnResult(turn.number, turn.tool, output))
                        inbound = InboundMessage(
                            channel="cli", chat_id="bench", text=turn.question,
                            session_key_override=KEY,
                        )  # fmt: skip
                        reply = await gw.agent.handle(inbound)
                        if reply.is_error:
                            raise SystemExit(f"turn {turn.number} failed: {reply.text}")
                    if mode == "after":
                        extra["stored"], extra["read_back_whole"] = await read_back_everything(gw)
                    tg.cancel_scope.cancel()
                session = await anyio.to_thread.run_sync(gw.sessions.get, KEY)
                assert session is not None and session.path is not None
                extra["session_bytes"] = session.path.stat().st_size
                for result, entry in zip(model.results, _tool_sizes(session), strict=False):
                    if result.tool == "web_fetch":
                        result.output_chars = entry
            finally:
                await gw.aclose()
    return model.results, extra


def _tool_sizes(session: Any) -> list[int]:
    """The length of each turn's first tool result as the tool gave it (the stored
    output's length when it was stored)."""
    sizes: list[int] = []
    for entry in session.entries:
        message = getattr(entry, "message", None)
        if message is None or message.role != "tool" or message.name in (READ_TOOL, SEARCH_TOOL):
            continue
        meta = getattr(entry, "meta", None) or {}
        stored = meta.get("tool_output")
        sizes.append(int(stored["chars"]) if stored else len(message.content or ""))
    return sizes


def table(before: list[TurnResult], after: list[TurnResult]) -> str:
    rows = [
        "| turn | tool | output (chars) | before: requests | before: prompt tokens "
        "| after: requests | after: prompt tokens | change | after: stubs "
        "| answer before | answer after |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for b, a in zip(before, after, strict=True):
        change = 100 * (a.prompt_tokens - b.prompt_tokens) / b.prompt_tokens
        rows.append(
            f"| {b.turn} | {b.tool} | {a.output_chars:,} | {b.requests} | {b.prompt_tokens:,} "
            f"| {a.requests} | {a.prompt_tokens:,} | {change:+.0f}% | {a.stubs} "
            f"| {'complete' if b.answered else 'NOT FOUND'} "
            f"| {'complete' if a.answered else 'NOT FOUND'} |"
        )
    tb, ta = sum(r.prompt_tokens for r in before), sum(r.prompt_tokens for r in after)
    rows.append(
        f"| all | | | {sum(r.requests for r in before)} | {tb:,} "
        f"| {sum(r.requests for r in after)} | {ta:,} | {100 * (ta - tb) / tb:+.0f}% | "
        f"| {sum(r.answered for r in before)}/{len(before)} "
        f"| {sum(r.answered for r in after)}/{len(after)} |"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--memory-window", type=int, default=10)
    parser.add_argument("--context-window", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logger.remove()
    logging.disable(logging.INFO)  # the HTTP clients' request lines
    window = args.context_window
    before, before_extra = anyio.run(run, "before", args.turns, args.memory_window, window)
    after, after_extra = anyio.run(run, "after", args.turns, args.memory_window, window)
    if args.json:
        print(
            json.dumps(
                {
                    "before": [asdict(r) for r in before],
                    "after": [asdict(r) for r in after],
                    "extra": {"before": before_extra, "after": after_extra},
                }
            )
        )
        return
    shown = f"{window:,} tokens" if window else "32,768 tokens (the default)"
    print(f"{args.turns} turns, memory_window {args.memory_window}, context window {shown}\n")
    print(table(before, after))
    print()
    per = [sum(r.prompt_tokens for r in rs) / sum(r.requests for r in rs) for rs in (before, after)]
    print(f"Prompt tokens per request: {per[0]:,.0f} before, {per[1]:,.0f} after.")
    print(
        f"After: {after_extra['stored']} outputs stored; each read back whole through "
        f"{READ_TOOL}: {'yes' if after_extra['read_back_whole'] else 'NO'}. Session file: "
        f"{before_extra['session_bytes']:,} bytes before, {after_extra['session_bytes']:,} "
        "after (the outputs themselves are beside it)."
    )


if __name__ == "__main__":
    main()
