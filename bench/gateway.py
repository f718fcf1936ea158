"""Benchmark of the in-process gateway path: Dispatcher -> real AgentLoop -> sessions on
disk, with an in-process LLM that answers instantly or after 200 ms. Prints a table with
targets; ``--json`` for machines.

    .venv/bin/python bench/gateway.py [--json] [--quick]

Measured per scenario, each in its own process (so peak RSS is the scenario's own):
- throughput: closed loop, every session sends its next message as soon as the reply to
  the previous one is delivered; turns completed per second over a measuring window.
- added latency: submit -> reply delivered, minus the LLM's own time. In the closed loop
  this includes waiting for a slot of the global cap (sessions > cap queue by design);
  "turn overhead" is the same without that wait (the agent loop and storage only).
- an open-loop row: messages arrive at a fixed rate over 1,000 sessions (what a busy
  gateway sees), so its latency is not inflated by the benchmark's own back-pressure.

Sessions live in a temporary folder with ``fsync = "never"``; inbound dedupe uses the
file store (SQLite) as the daemon does. Logging is switched off, as in the other benches.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp
import anyio
import anyio.lowlevel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from loguru import logger  # noqa: E402

from gateway.agent import AgentConfig, AgentLoop, build_registry  # noqa: E402
from gateway.config import SessionSettings, load_settings  # noqa: E402
from gateway.daemon import SPARE_FILES  # noqa: E402
from gateway.dispatch.dispatcher import Dispatcher  # noqa: E402
from gateway.gcpolicy import GCPolicy  # noqa: E402
from gateway.journal.store import FileDedupeStore  # noqa: E402
from gateway.llm.types import (  # noqa: E402
    LLMMessage,
    LLMResponse,
    StreamDelta,
    TokenUsage,
    ToolSpec,
)
from gateway.messages import InboundMessage, OutboundMessage  # noqa: E402
from gateway.sessions import SessionManager  # noqa: E402
from gateway.storage.seam import open_storage  # noqa: E402

FSYNC: Literal["never"] = "never"
CACHE_SIZE = SessionSettings().max_cache_size  # the default, as `gateway run` uses it
USER_TEXT = "Could you summarize what we talked about so far, in two sentences? " * 2
REPLY_TEXT = "Here is a short answer of about the usual length for a chat reply. " * 4

# Seconds the LLM spent on the current turn: the provider adds to it, the bench handler
# reads it. A context variable reaches the provider through the real AgentLoop.
_llm_time: ContextVar[list[float] | None] = ContextVar("llm_time", default=None)


class BenchProvider:
    """An in-process LLMProvider that answers after `delay` seconds (0: at once)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def chat(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
        tool_choice: str | dict[str, Any] | None = None,
    ) -> LLMResponse:
        start = time.perf_counter()
        if self.delay:
            await anyio.sleep(self.delay)
        message = LLMMessage(
            role="assistant",
            content=REPLY_TEXT,
            usage=TokenUsage(prompt_tokens=100, completion_tokens=60, total_tokens=160),
            model=model,
        )
        cell = _llm_time.get()
        if cell is not None:
            cell[0] += time.perf_counter() - start
        return LLMResponse(message=message, model=model or "bench", finish_reason="stop")

    async def stream(
        self,
        messages: Sequence[LLMMessage],
        *,
        model: str | None = None,
        tools: Sequence[ToolSpec] = (),
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> AsyncIterator[StreamDelta]:
        yield StreamDelta(response=await self.chat(messages, model=model))

    async def aclose(self) -> None:
        return None


@dataclass
class Scenario:
    llm_ms: int
    sessions: int
    cap: int
    warmup: float
    window: float
    rate: float = 0.0  # > 0: open loop at this many messages per second
    turns_per_session: int = 10  # then the slot moves on to a fresh session key
    agent: bool = True  # False: a trivial handler, to see the dispatcher's own cost
    seed_messages: int = 0  # history already in each session before the run


@dataclass
class Outcome:
    turns: int
    seconds: float
    turns_per_s: float
    added_p50_ms: float
    added_p99_ms: float
    overhead_p50_ms: float
    overhead_p99_ms: float
    peak_rss_mb: float
    to_thread_hops_per_turn: float
    history_messages: float  # mean length of the session history a turn started with
    cpu_us_per_turn: float  # process CPU time (all threads) per turn, in the window


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def daemon_sessions(folder: Path) -> SessionManager:
    """The sessions as `gateway run` builds them: the default settings (cache size and
    budget, spare files), with the bench's fsync policy."""
    settings = load_settings(
        None,
        environ={
            "GATEWAY_WORKSPACE": str(folder),
            "GATEWAY_SESSIONS__FSYNC": FSYNC,
            "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        },
    )
    return open_storage(settings).sessions(spare_files=SPARE_FILES)


async def run_scenario(sc: Scenario, folder: Path) -> Outcome:
    sessions = daemon_sessions(folder)
    agent = AgentLoop(
        sessions=sessions,
        provider=BenchProvider(sc.llm_ms / 1000),
        config=AgentConfig(model="bench-model"),
        tools=build_registry(["current_time"]),
    )
    store = FileDedupeStore(folder / "dedupe.sqlite3")
    for slot in range(sc.sessions if sc.seed_messages else 0):
        session = sessions.get_or_create(f"bench:s{slot}-0")
        for n in range(sc.seed_messages):
            seed = (
                LLMMessage(role="user", content=USER_TEXT)
                if n % 2 == 0
                else LLMMessage(role="assistant", content=REPLY_TEXT)
            )
            session.add_message(seed)
    llm_seconds: dict[str, float] = {}
    turn_seconds: dict[str, float] = {}

    async def trivial(msg: InboundMessage) -> OutboundMessage:
        if sc.llm_ms:
            await anyio.sleep(sc.llm_ms / 1000)
        return OutboundMessage(msg.channel, msg.chat_id, REPLY_TEXT, msg.session_key)

    async def handler(msg: InboundMessage) -> OutboundMessage:
        cell = [0.0]
        token = _llm_time.set(cell)
        start = time.perf_counter()
        try:
            if not sc.agent:
                cell[0] = sc.llm_ms / 1000
                return await trivial(msg)
            return await agent.handle(msg)
        finally:
            _llm_time.reset(token)
            assert msg.message_id is not None
            turn_seconds[msg.message_id] = time.perf_counter() - start
            llm_seconds[msg.message_id] = cell[0]

    async def deliver(out: OutboundMessage) -> None:
        return None

    dispatcher = Dispatcher(
        handler, deliver, max_concurrent_turns=sc.cap, dedupe=store, max_queue_per_lane=1000
    )
    measuring = False
    done: list[tuple[float, float, float]] = []  # (end-to-end, llm, turn) per turn
    history: list[int] = []  # messages in the session before each measured turn
    counter = 0
    turns_of_slot = [0] * sc.sessions

    async def one_turn(slot: int) -> None:
        nonlocal counter
        counter += 1
        mid = str(counter)
        # A slot is one concurrent conversation; it moves to a fresh session key every
        # `turns_per_session` turns, so sessions stay as short as compacted ones would.
        generation, turn_in_session = divmod(turns_of_slot[slot], sc.turns_per_session)
        turns_of_slot[slot] += 1
        before = sc.seed_messages * (generation == 0) + 2 * turn_in_session
        chat = f"s{slot}-{generation}"
        msg = InboundMessage(channel="bench", chat_id=chat, text=USER_TEXT, message_id=mid)
        start = time.perf_counter()
        ticket = await dispatcher.submit(msg)
        reply = await ticket.reply()
        elapsed = time.perf_counter() - start
        if reply is None or reply.is_error:
            raise RuntimeError(f"turn failed: {reply}")
        if measuring:
            done.append((elapsed, llm_seconds.pop(mid), turn_seconds.pop(mid)))
            history.append(before)
        else:
            llm_seconds.pop(mid, None)
            turn_seconds.pop(mid, None)

    async def closed_loop(slot: int) -> None:
        while True:
            await one_turn(slot)

    async def open_loop() -> None:
        rng = random.Random(1)
        interval = 1 / sc.rate
        next_at = time.perf_counter()
        async with anyio.create_task_group() as tg:
            while True:
                tg.start_soon(one_turn, rng.randrange(sc.sessions))
                next_at += interval
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)

    hops = _count_thread_hops()
    async with anyio.create_task_group() as tg:
        await tg.start(GCPolicy().run)  # as `gateway run` does once started
        await tg.start(dispatcher.run)
        if sc.rate:
            tg.start_soon(open_loop)
        else:
            for key in range(sc.sessions):
                tg.start_soon(closed_loop, key)
        await anyio.sleep(sc.warmup)
        measuring = True
        hops_before, started, cpu_before = hops[0], time.perf_counter(), _cpu_seconds()
        await anyio.sleep(sc.window)
        measuring = False
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu_before
        hops_in_window = hops[0] - hops_before
        tg.cancel_scope.cancel()
    await store.aclose()
    sessions.close()

    added = [(e2e - llm) * 1000 for e2e, llm, _ in done]
    overhead = [(turn - llm) * 1000 for _, llm, turn in done]
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return Outcome(
        turns=len(done),
        seconds=seconds,
        turns_per_s=len(done) / seconds,
        added_p50_ms=percentile(added, 0.50),
        added_p99_ms=percentile(added, 0.99),
        overhead_p50_ms=percentile(overhead, 0.50),
        overhead_p99_ms=percentile(overhead, 0.99),
        peak_rss_mb=rss_kb / 1024,
        to_thread_hops_per_turn=hops_in_window / max(1, len(done)),
        history_messages=sum(history) / max(1, len(history)),
        cpu_us_per_turn=cpu / max(1, len(done)) * 1e6,
    )


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _count_thread_hops() -> list[int]:
    """Count `anyio.to_thread.run_sync` calls (the agent loop's and the dedupe store's)."""
    import anyio.to_thread as to_thread

    count = [0]
    original = to_thread.run_sync

    async def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return await original(*args, **kwargs)

    to_thread.run_sync = counting  # type: ignore[assignment]
    anyio.to_thread.run_sync = counting  # type: ignore[assignment]
    return count


# --------------------------------------------------------------------------- parts


async def measure_parts() -> dict[str, float]:
    """Microseconds per call of the pieces a turn is made of, one at a time."""
    from gateway.agent.context import ContextBuilder

    builder = ContextBuilder(context_window=32_768, reply_reserve=1024, max_messages=11)

    out: dict[str, float] = {}
    for size in (2, 26, 50, 200, 2000):
        history = [
            LLMMessage(role="user", content=USER_TEXT)
            if n % 2 == 0
            else LLMMessage(role="assistant", content=REPLY_TEXT)
            for n in range(size - 1)
        ] + [LLMMessage(role="user", content=USER_TEXT)]
        repeat = 20 if size > 500 else 200
        start = time.perf_counter()
        for _ in range(repeat):
            builder.build(system_prompt=AgentConfig(model="m").system_prompt, history=history)
        out[f"context build, {size:,}-message history"] = (
            (time.perf_counter() - start) / repeat * 1e6
        )
    repeat = 2000
    start = time.perf_counter()
    for _ in range(repeat):
        await anyio.to_thread.run_sync(int)
    out["one anyio.to_thread hop (idle pool)"] = (time.perf_counter() - start) / repeat * 1e6

    async def echo(msg: InboundMessage) -> OutboundMessage:
        return OutboundMessage(msg.channel, msg.chat_id, "ok", msg.session_key)

    async def drop(out: OutboundMessage) -> None:
        return None

    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-parts-"))
    try:
        for label, store in (
            ("no dedupe", None),
            ("file dedupe", FileDedupeStore(folder / "d.sqlite3")),
        ):
            dispatcher = Dispatcher(echo, drop, dedupe=store)
            async with anyio.create_task_group() as tg:
                await tg.start(dispatcher.run)
                start = time.perf_counter()
                for n in range(repeat):
                    msg = InboundMessage(channel="b", chat_id="x", text="hi", message_id=str(n))
                    await (await dispatcher.submit(msg)).reply()
                    await anyio.lowlevel.checkpoint()  # let the lane finish (and mark the id done)
                elapsed = time.perf_counter() - start
                await dispatcher.drain(5)
            if store is not None:
                await store.aclose()
            out[f"dispatcher round trip, 1 session, {label}"] = elapsed / repeat * 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    out.update(measure_metrics())
    return out


def measure_metrics() -> dict[str, float]:
    """What the metrics cost on the hot path (one turn served over HTTP records a turn
    and a request) and per scrape."""
    from gateway.http.metrics import Metrics

    metrics = Metrics(version="bench")
    reply = OutboundMessage("api", "x", "ok", "api:x")
    repeat = 20_000
    start = time.perf_counter()
    for _ in range(repeat):
        metrics.observe_turn(reply, 0.02)
        metrics.http_requests.labels("POST", "/api/chat", "200").inc()
        metrics.http_request_seconds.labels("/api/chat").observe(0.02)
    recorded = (time.perf_counter() - start) / repeat * 1e6
    repeat = 200
    start = time.perf_counter()
    for _ in range(repeat):
        metrics.render()
    scraped = (time.perf_counter() - start) / repeat * 1e6
    return {
        "metrics: one turn + one HTTP request recorded": recorded,
        "metrics: one scrape rendered": scraped,
    }


async def run_http(sessions: int, clients: int, warmup: float, window: float) -> Outcome:
    """POST /api/chat through the real Daemon (HTTP server, dispatcher, agent, sessions
    and file dedupe), with the instant in-process LLM: what HTTP adds on top."""
    from gateway.daemon import Daemon, Gateway

    folder = Path(tempfile.mkdtemp(prefix="bench-http-"))
    token = "bench-token"
    settings = load_settings(
        None,
        environ={
            "GATEWAY_WORKSPACE": str(folder),
            "GATEWAY_SESSIONS__FSYNC": FSYNC,
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_HTTP__TOKEN": token,
            "GATEWAY_CACHE__ENABLED": "false",
            "GATEWAY_MEMORY__ENABLED": "false",
            "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
        },
    )
    storage = open_storage(settings)
    sessions_mgr = storage.sessions(spare_files=SPARE_FILES)
    provider = BenchProvider(0)
    agent = AgentLoop(
        sessions=sessions_mgr,
        provider=provider,
        config=AgentConfig(model="bench-model"),
        tools=build_registry(["current_time"]),
    )
    gateway = Gateway(settings=settings, agent=agent, storage=storage)
    daemon = Daemon(gateway, interactive=False)
    latencies: list[float] = []
    measuring = False
    rng = random.Random(2)
    headers = {"Authorization": f"Bearer {token}"}
    try:
        async with anyio.create_task_group() as tg:
            port = await tg.start(daemon.run)
            url = f"http://127.0.0.1:{port}/api/chat"
            connector = aiohttp.TCPConnector(limit=clients)
            async with aiohttp.ClientSession(connector=connector) as http:

                async def client() -> None:
                    while True:
                        body = {"session": f"s{rng.randrange(sessions)}", "text": USER_TEXT}
                        start = time.perf_counter()
                        async with http.post(url, json=body, headers=headers) as resp:
                            await resp.read()
                            if resp.status != 200:
                                raise RuntimeError(f"HTTP {resp.status}")
                        if measuring:
                            latencies.append(time.perf_counter() - start)

                async with anyio.create_task_group() as load:
                    for _ in range(clients):
                        load.start_soon(client)
                    await anyio.sleep(warmup)
                    measuring = True
                    started, cpu_before = time.perf_counter(), _cpu_seconds()
                    await anyio.sleep(window)
                    measuring = False
                    seconds = time.perf_counter() - started
                    cpu = _cpu_seconds() - cpu_before
                    load.cancel_scope.cancel()
            daemon.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ms = [x * 1000 for x in latencies]
    return Outcome(
        turns=len(ms),
        seconds=seconds,
        turns_per_s=len(ms) / seconds,
        added_p50_ms=percentile(ms, 0.5),
        added_p99_ms=percentile(ms, 0.99),
        overhead_p50_ms=float("nan"),
        overhead_p99_ms=float("nan"),
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        to_thread_hops_per_turn=float("nan"),
        history_messages=float("nan"),
        cpu_us_per_turn=cpu / max(len(ms), 1) * 1e6,
    )


# --------------------------------------------------------------------------- driver


@dataclass
class Row:
    name: str
    cap: int | None
    turns_per_s: float | None
    added_p50_ms: float | None
    added_p99_ms: float | None
    overhead_p99_ms: float | None
    peak_rss_mb: float | None
    hops: float | None
    history: float | None
    cpu_us: float | None
    target: str = ""
    passed: bool | None = None
    note: str = ""


def run_in_child(sc: Scenario) -> Outcome:
    out = subprocess.run(
        [sys.executable, __file__, "--scenario", json.dumps(asdict(sc))],
        check=True,
        capture_output=True,
        text=True,
    )
    return Outcome(**json.loads(out.stdout))


def scenarios(quick: bool) -> list[tuple[str, Scenario, str]]:
    w, win = (0.3, 1.0) if quick else (0.7, 3.0)
    long = 10**9
    return [
        (
            "dispatcher only (trivial handler), 1,000 sessions",
            Scenario(0, 1000, 8, w, win, agent=False),
            "",
        ),
        (
            "dispatcher only, 1,000 sessions, open loop 1,000/s",
            Scenario(0, 1000, 8, w, win, 1000, agent=False),
            "lat",
        ),
        ("instant LLM, 1 session", Scenario(0, 1, 8, w, win), ""),
        ("instant LLM, 100 sessions", Scenario(0, 100, 8, w, win), ""),
        ("instant LLM, 1,000 sessions", Scenario(0, 1000, 8, w, win), "tput"),
        (
            "instant LLM, 1,000 sessions, open loop 1,000/s",
            Scenario(0, 1000, 8, w, win, 1000),
            "lat",
        ),
        (
            "instant LLM, 1,000 sessions, open loop 300/s",
            Scenario(0, 1000, 8, w, win, 300),
            "",
        ),
        ("200 ms LLM, 1 session", Scenario(200, 1, 8, w, win), ""),
        ("200 ms LLM, 100 sessions", Scenario(200, 100, 8, w, win), "scale"),
        ("200 ms LLM, 1,000 sessions", Scenario(200, 1000, 8, w, win), "scale"),
        ("200 ms LLM, 1,000 sessions", Scenario(200, 1000, 64, w, win), "scale"),
        ("200 ms LLM, 1,000 sessions", Scenario(200, 1000, 256, w, win), "scale"),
        (
            "instant LLM, 1 session of 200+ messages",
            Scenario(0, 1, 8, w, win, turns_per_session=long, seed_messages=200),
            "",
        ),
        (
            "instant LLM, 1 session of 2,000+ messages",
            Scenario(0, 1, 8, w, win, turns_per_session=long, seed_messages=2000),
            "",
        ),
    ]


def judge(kind: str, sc: Scenario, o: Outcome) -> tuple[str, bool | None]:
    if kind == "tput":
        return ">= 1,000 turns/s", o.turns_per_s >= 1000
    if kind == "lat":
        return "added p99 < 5 ms", o.added_p99_ms < 5
    if kind == "scale":
        ideal = min(sc.cap, sc.sessions) / (sc.llm_ms / 1000)
        return f">= 90% of {ideal:,.0f}/s", o.turns_per_s >= 0.9 * ideal
    return "", None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="shorter windows (a smoke run)")
    parser.add_argument("--scenario", help=argparse.SUPPRESS)
    parser.add_argument("--parts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--http", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logger.remove()
    if args.parts:
        print(json.dumps(anyio.run(measure_parts)))
        return 0
    if args.http:
        sessions, clients, warmup, window = json.loads(args.http)
        print(json.dumps(asdict(anyio.run(run_http, sessions, clients, warmup, window))))
        return 0
    if args.scenario:
        sc = Scenario(**json.loads(args.scenario))
        folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
        try:
            outcome = anyio.run(run_scenario, sc, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps(asdict(outcome)))
        return 0

    rows: list[Row] = []
    for name, sc, kind in scenarios(args.quick):
        o = run_in_child(sc)
        target, passed = judge(kind, sc, o)
        rows.append(
            Row(
                name,
                sc.cap,
                o.turns_per_s,
                o.added_p50_ms,
                o.added_p99_ms,
                o.overhead_p99_ms,
                o.peak_rss_mb,
                o.to_thread_hops_per_turn,
                o.history_messages,
                o.cpu_us_per_turn,
                target,
                passed,
            )
        )
    for clients in (1, 64):
        w, win = (0.3, 1.0) if args.quick else (0.7, 3.0)
        out = subprocess.run(
            [sys.executable, __file__, "--http", json.dumps([1000, clients, w, win])],
            check=True,
            capture_output=True,
            text=True,
        )
        o = Outcome(**json.loads(out.stdout))
        rows.append(
            Row(
                f"POST /api/chat, 1,000 sessions, {clients} client(s)",
                8,
                o.turns_per_s,
                o.added_p50_ms,
                o.added_p99_ms,
                None,
                o.peak_rss_mb,
                None,
                None,
                o.cpu_us_per_turn,
                note="HTTP round trip, instant LLM",
            )
        )
    parts_out = subprocess.run(
        [sys.executable, __file__, "--parts"], check=True, capture_output=True, text=True
    )
    parts: dict[str, float] = json.loads(parts_out.stdout)
    all_pass = all(r.passed is not False for r in rows)
    settings = {"fsync": FSYNC, "max_cache_size": CACHE_SIZE, "dedupe": "file (SQLite)"}
    if args.json:
        print(
            json.dumps(
                {
                    "settings": settings,
                    "rows": [asdict(r) for r in rows],
                    "parts_us": parts,
                    "all_pass": all_pass,
                },
                indent=2,
            )
        )
        return 0 if all_pass else 1
    print(
        f"sessions fsync = {FSYNC!r}, session cache = {CACHE_SIZE}, dedupe = file (SQLite), "
        "latencies exclude the LLM's own time"
    )
    width = max(len(r.name) for r in rows)
    header = (
        f"{'scenario':<{width}}  {'cap':>4}  {'turns/s':>8}  {'add p50':>8}  {'add p99':>8}  "
        f"{'turn p99':>8}  {'RSS MB':>6}  {'hops':>4}  {'hist':>5}  {'CPU us':>6}  "
        f"{'target':<18} pass"
    )
    print(header)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        mark = {True: "yes", False: "NO", None: ""}[r.passed]
        print(
            f"{r.name:<{width}}  {fmt(r.cap, '>4')}  {fmt(r.turns_per_s, '>8,.0f')}  "
            f"{fmt(r.added_p50_ms, '>8.2f')}  {fmt(r.added_p99_ms, '>8.2f')}  "
            f"{fmt(r.overhead_p99_ms, '>8.2f')}  {fmt(r.peak_rss_mb, '>6.0f')}  "
            f"{fmt(r.hops, '>4.1f')}  {fmt(r.history, '>5.0f')}  {fmt(r.cpu_us, '>6,.0f')}  "
            f"{r.target:<18} {mark}{r.note}"
        )
    print("(add = submit -> reply delivered minus LLM time, incl. waiting for a cap slot;")
    print(" turn = the handler's own time minus LLM time; hops = to_thread calls per turn;")
    print(" hist = mean messages already in the session when a turn started;")
    print(" CPU us = process CPU time, all threads, per turn: steadier than turns/s on a")
    print(" shared machine; one event loop tops out near 1e6 / CPU us turns per second)")
    print()
    part_width = max(len(name) for name in parts)
    print(f"{'where the time goes (event loop)':<{part_width}}  {'us/call':>8}")
    for name, micros in parts.items():
        print(f"{name:<{part_width}}  {micros:>8,.0f}")
    print()
    print("all targets met" if all_pass else "SOME TARGETS MISSED")
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
