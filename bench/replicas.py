"""Replicas over PostgreSQL: turns/s with 1, 2 and 3 `gateway run` processes, and what the
shared mode adds to a turn's latency against the file mode. Prints a table (``--json``).

    .venv/bin/python bench/replicas.py [--json] [--quick]

1. Throughput: N replicas share one PostgreSQL (a fresh schema) and Redis; the fake model
   answers after 200 ms, from a process of its own as a real server would (in a thread of
   this process it waited for the load generator's GIL: 206 ms for a 200 ms answer at 70
   turns/s); each replica runs at most 8 turns at once (the default cap), so
   the ideal is 40 turns/s per replica. Closed loop: 48 clients per replica, each with its
   own session, post `/api/chat` to the replicas in turn (as a load balancer would).
   Goal: at least 90% of the ideal at each step. The control row runs three replicas
   that share nothing (each on its own workspace files): what this machine gives three
   replicas with no shared state at all, so the gap to it is the shared mode's own.
   The harness (load generator, fake model) runs on uvloop, as `gateway run` does.
2. Latency: one replica, the model (in its own process) answering at once, an open loop
   of 200 turns/s (the
   issue's rate) and of 50 turns/s (`--rates`) over 400 sessions for a fixed time; p50 /
   p99 of the `/api/chat` round trip in the file mode and in the shared mode. Goal: the
   shared mode's p99 at most 5 ms above the file mode's. A 503 (not taken in now) is
   retried after its Retry-After with the same id, as the chat API asks, and counted. On
   a 2-core machine that also
   runs PostgreSQL, the load generator and the fake model, 200 turns/s is more than either
   mode serves, so that row compares two backlogs; the 50 turns/s row is the latency.
3. Cost per turn in the shared mode: one replica behind a counting wire proxy
   (`tests.fakes.pg_wire_counter`), 16 clients, the model answering at once: PostgreSQL
   round trips and statements per turn, and CPU milliseconds per turn of the gateway, of
   PostgreSQL (every `postgres` process on the machine: other users' work shows up here)
   and of this benchmark process (load generator and fake model), from /proc.

Everything runs on this machine's loopback: the replicas, the fakes, PostgreSQL and the
load generator share its cores, so read the numbers as a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from gateway.testing.process import process_cpu_seconds  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI, Reply, echo_responder  # noqa: E402
from tests.fakes.pg_wire_counter import PgWireCounter  # noqa: E402
from tests.gateway_process import GatewayProcess, base_env  # noqa: E402

PG_URL = os.environ.get("GATEWAY_BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("GATEWAY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
TOKEN = "bench-replicas-token-0123456789"
CAP = 8
LLM_DELAY = 0.2

T = TypeVar("T")


def run_harness(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` for the harness (load generator, fake model) on uvloop when it is
    installed, as `gateway run` runs: the harness shares the machine's two cores with
    what it measures, and a real model server and real clients would be elsewhere."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency on Linux and macOS
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@dataclass(frozen=True)
class Row:
    what: str
    value: float
    unit: str
    goal: str
    met: bool | None


@dataclass(frozen=True)
class ModelProcess:
    """The fake model served from a process of its own (`model_process`)."""

    base_url: str
    api_key: str | None
    pid: int


def serve_model(delay: float) -> None:
    """`--serve-model DELAY`: the fake model, its URL and key printed as one JSON line,
    served until standard input closes (`model_process`'s child)."""

    def answer(body: dict[str, Any]) -> Reply:
        echoed = echo_responder(body)
        return Reply(text=echoed if isinstance(echoed, str) else echoed.text, delay=delay)

    async def serve() -> None:
        async with FakeOpenAI(responder=answer) as fake:
            print(json.dumps([fake.base_url, fake.api_key]), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    run_harness(serve())


@contextmanager
def model_process(delay: float) -> Iterator[ModelProcess]:
    """The fake model (answering `echo: ...` after `delay` seconds) in its own process."""
    import subprocess

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve-model", str(delay)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        if not line:
            raise RuntimeError("the fake model process did not start")
        base_url, api_key = json.loads(line)
        yield ModelProcess(base_url, api_key, child.pid)
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()


def fresh_schema() -> tuple[str, str]:
    import psycopg

    schema = "gwbench_" + uuid.uuid4().hex[:10]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in PG_URL else "?"
    return schema, f"{PG_URL}{sep}options=-csearch_path%3D{schema}"


def drop_schema(schema: str) -> None:
    import psycopg

    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def env_for(
    workdir: Path, llm: FakeOpenAI | ModelProcess, storage_url: str | None
) -> dict[str, str]:
    env = base_env(workdir / "ws", llm, llm_timeout=30) | {  # type: ignore[arg-type]
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_HTTP__TOKEN": TOKEN,
        "GATEWAY_MEMORY__ENABLED": "false",
        "GATEWAY_CACHE__ENABLED": "false",
        "GATEWAY_DISPATCH__MAX_CONCURRENT_TURNS": str(CAP),
        "GATEWAY_LOG__LEVEL": "WARNING",
    }
    if storage_url:
        env["GATEWAY_STORAGE__URL"] = storage_url
    return env


def start(env: dict[str, str], workdir: Path, n: int) -> tuple[list[GatewayProcess], list[str]]:
    procs, urls = [], []
    for i in range(n):
        proc = GatewayProcess(
            env | {"GATEWAY_WORKSPACE": str(workdir / f"ws{i}"), "GATEWAY_LOG__LEVEL": "INFO"},
            workdir,
        )
        port = proc.wait_ready()
        proc.wait_readyz(port)
        procs.append(proc)
        urls.append(f"http://127.0.0.1:{port}/api/chat")
    return procs, urls


def stop(procs: list[GatewayProcess]) -> None:
    for proc in procs:
        proc.terminate(60)


#: 503 answers (not taken in now, or still running) the clients retried, as the chat API
#: asks: after Retry-After, with the same id. Counted; the latency includes the wait.
RETRIED = [0]


async def post(http: aiohttp.ClientSession, url: str, session: str, text: str) -> float:
    started = time.perf_counter()
    body = {"session": session, "text": text, "id": uuid.uuid4().hex}
    while True:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with http.post(url, json=body, headers=headers) as resp:
            data = await resp.json()
            if resp.status == 503:
                RETRIED[0] += 1
                await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
                continue
            if resp.status != 200 or not str(data.get("reply", "")).startswith("echo: "):
                raise RuntimeError(f"bad answer {resp.status} from {url}: {data} ({session})")
        return time.perf_counter() - started


async def closed_loop(urls: list[str], clients: int, seconds: float) -> float:
    """Turns/s with `clients` clients each sending its next message once answered."""
    return (await closed_loop_count(urls, clients, seconds))[1]


async def closed_loop_count(urls: list[str], clients: int, seconds: float) -> tuple[int, float]:
    """Turns done and turns/s with `clients` clients each sending its next message once
    answered."""
    done = 0
    deadline = time.perf_counter() + seconds
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits) as http:

        async def client(c: int) -> None:
            nonlocal done
            n = 0
            while time.perf_counter() < deadline:
                await post(http, urls[(c + n) % len(urls)], f"c{c}", f"turn {n}")
                n += 1
                done += 1

        began = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        return done, done / (time.perf_counter() - began)


async def open_loop(url: str, rate: float, seconds: float, sessions: int) -> list[float]:
    """Round-trip times of turns started at a fixed `rate`, whatever the answers' pace
    (a failed turn raises: a latency is only worth reporting for correct answers)."""
    latencies: list[float] = []
    limits = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=limits) as http:
        tasks = []
        began = time.perf_counter()
        for n in range(int(rate * seconds)):
            due = began + n / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)

            async def one(k: int = n) -> None:
                latencies.append(await post(http, url, f"s{k % sessions}", f"turn {k}"))

            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    return latencies


def postgres_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "postgres":
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@dataclass
class CpuMeter:
    """CPU seconds used by the gateways, PostgreSQL and this process between two reads."""

    gateways: list[int]
    start: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def read(self) -> tuple[float, float, float]:
        gw = sum(process_cpu_seconds(pid) for pid in self.gateways)
        pg = sum(process_cpu_seconds(pid) for pid in postgres_pids())
        t = os.times()
        return gw, pg, t.user + t.system

    def __enter__(self) -> CpuMeter:
        self.start = self.read()
        return self

    def used(self) -> tuple[float, float, float]:
        now = self.read()
        return now[0] - self.start[0], now[1] - self.start[1], now[2] - self.start[2]

    def __exit__(self, *exc: object) -> None:
        return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


@dataclass(frozen=True)
class TurnCost:
    round_trips: float
    statements: float
    connections: int
    cpu_gateway_ms: float
    cpu_postgres_ms: float
    cpu_bench_ms: float


def turn_cost(seconds: float) -> TurnCost:
    """Round trips and CPU per turn of one shared-mode replica (see the docstring)."""
    schema, url = fresh_schema()
    host_url = PG_URL.split("://", 1)[1].split("/", 1)
    authority = host_url[0].rsplit("@", 1)[-1]
    host, _, port = authority.partition(":")
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            FakeOpenAI.in_thread() as llm,
            PgWireCounter.in_thread(host, int(port or 5432)) as wire,
        ):
            proxied = url.replace(authority, f"127.0.0.1:{wire.listen_port}", 1)
            procs, urls = start(env_for(Path(tmp), llm, proxied), Path(tmp), 1)
            try:
                run_harness(closed_loop(urls, 16, 2.0))  # warm up: pools filled
                rt0, st0, conn0 = wire.snapshot()
                wire.texts.clear()
                with CpuMeter([p.proc.pid for p in procs]) as cpu:
                    turns, _ = run_harness(closed_loop_count(urls, 16, seconds))
                    gw, pg, me = cpu.used()
                rt, st, conns = wire.snapshot()
                if os.environ.get("GATEWAY_BENCH_STATEMENTS"):
                    for text, n in wire.texts.most_common(40):
                        print(f"{n / turns:8.2f}  {text}", file=sys.stderr)
            finally:
                stop(procs)
    finally:
        drop_schema(schema)
    return TurnCost(
        round_trips=(rt - rt0) / turns,
        statements=(st - st0) / turns,
        connections=conns - conn0,
        cpu_gateway_ms=gw / turns * 1000,
        cpu_postgres_ms=pg / turns * 1000,
        cpu_bench_ms=me / turns * 1000,
    )


def machine_busy() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine so far (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def throughput(replicas: int, seconds: float, shared: bool = True) -> tuple[float, float]:
    """Turns/s of `replicas` replicas, and how busy the machine's CPUs were meanwhile.
    `shared` False: each replica on its own workspace files, sharing nothing (what this
    machine gives with no shared state at all)."""

    schema, url = fresh_schema() if shared else ("", "")
    try:
        with tempfile.TemporaryDirectory() as tmp, model_process(LLM_DELAY) as llm:
            procs, urls = start(env_for(Path(tmp), llm, url or None), Path(tmp), replicas)
            try:
                run_harness(closed_loop(urls, 6 * CAP * replicas, 2.0))  # warm up
                busy0, total0 = machine_busy()
                rate = run_harness(closed_loop(urls, 6 * CAP * replicas, seconds))
                busy1, total1 = machine_busy()
                return rate, (busy1 - busy0) / max(1, total1 - total0)
            finally:
                stop(procs)
    finally:
        if schema:
            drop_schema(schema)


def latency(shared: bool, seconds: float, rate: float) -> list[float]:
    schema, url = fresh_schema() if shared else ("", "")
    try:
        with tempfile.TemporaryDirectory() as tmp, model_process(0.0) as llm:
            procs, urls = start(env_for(Path(tmp), llm, url or None), Path(tmp), 1)
            try:
                run_harness(open_loop(urls[0], rate / 2, 2.0, 400))  # warm up
                return run_harness(open_loop(urls[0], rate, seconds, 400))
            finally:
                stop(procs)
    finally:
        if schema:
            drop_schema(schema)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--quick", action="store_true", help="shorter runs (noisier)")
    parser.add_argument(
        "--only", choices=("cost", "throughput", "latency"), help="run one part only"
    )
    parser.add_argument(
        "--rates",
        type=lambda text: [float(r) for r in text.split(",")],
        default=[200.0, 50.0],
        help="open-loop rates for the latency rows (default 200,50)",
    )
    parser.add_argument("--serve-model", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_model is not None:
        serve_model(args.serve_model)
        return 0
    seconds = 6.0 if args.quick else 15.0
    rows: list[Row] = []
    if args.only in (None, "cost"):
        cost = turn_cost(seconds)
        for what, value, unit in (
            ("PostgreSQL round trips per turn", cost.round_trips, "RT"),
            ("PostgreSQL statements per turn", cost.statements, "stmts"),
            ("connections opened while measuring", cost.connections, "conns"),
            ("CPU per turn, gateway", cost.cpu_gateway_ms, "ms"),
            ("CPU per turn, postgres (machine-wide)", cost.cpu_postgres_ms, "ms"),
            ("CPU per turn, bench (load + fake model)", cost.cpu_bench_ms, "ms"),
        ):
            rows.append(Row(what, round(value, 2), unit, "-", None))
    for n in (1, 2, 3) if args.only in (None, "throughput") else ():
        rate, busy = throughput(n, seconds)
        ideal = n * CAP / LLM_DELAY
        rows.append(
            Row(
                f"machine CPU busy, {n} replica{'s' if n > 1 else ''}",
                round(busy * 100),
                "%",
                "-",
                None,
            )
        )
        rows.append(
            Row(
                f"turns/s, {n} replica{'s' if n > 1 else ''} (ideal {ideal:.0f})",
                round(rate, 1),
                "turns/s",
                f">= {0.9 * ideal:.0f} (90% of ideal)",
                rate >= 0.9 * ideal,
            )
        )
    if args.only in (None, "throughput"):
        # The control: three replicas that share nothing, each on its own files. What
        # they reach is this machine's ceiling for three replicas, whatever the design.
        rate, busy = throughput(3, seconds, shared=False)
        rows.append(
            Row("machine CPU busy, 3 file-mode replicas", round(busy * 100), "%", "-", None)
        )
        rows.append(
            Row(
                "turns/s, 3 file-mode replicas sharing nothing (control)",
                round(rate, 1),
                "turns/s",
                "-",
                None,
            )
        )
    # The rate, and one this 2-core machine can serve in both modes (at 200
    # turns/s both queue here, and the difference of two backlogs is not a latency).
    for rate in args.rates if args.only in (None, "latency") else []:
        RETRIED[0] = 0
        files = latency(False, seconds, rate)
        files_retried = RETRIED[0]
        shared = latency(True, seconds, rate)
        for name, count in (("file", files_retried), ("shared", RETRIED[0] - files_retried)):
            rows.append(
                Row(f"503s retried at {rate:g} turns/s, {name} mode", count, "answers", "-", None)
            )
        for name, values in (("file mode", files), ("shared mode", shared)):
            for q in (0.5, 0.99):
                label = f"p{round(q * 100)} at {rate:g} turns/s, {name}"
                rows.append(Row(label, round(pct(values, q), 2), "ms", "-", None))
        added = pct(shared, 0.99) - pct(files, 0.99)
        rows.append(
            Row(
                f"p99 added by the shared mode at {rate:g} turns/s",
                round(added, 2),
                "ms",
                "<= 5",
                added <= 5,
            )
        )
        rows.append(
            Row(
                f"mean round trip at {rate:g} turns/s, shared mode",
                round(statistics.fmean(shared) * 1000, 2),
                "ms",
                "-",
                None,
            )
        )
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        width = max(len(r.what) for r in rows)
        print(f"{'what':<{width}}  {'value':>9}  unit     goal                    met")
        for r in rows:
            met = "-" if r.met is None else ("yes" if r.met else "NO")
            print(f"{r.what:<{width}}  {r.value:>9}  {r.unit:<7}  {r.goal:<22}  {met}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
