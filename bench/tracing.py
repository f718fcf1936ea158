"""Benchmark of tracing's cost: the gateway process's CPU time per turn with tracing off,
and on, exporting every span over OTLP/HTTP to a local receiver.

    .venv/bin/python bench/tracing.py [--turns 200] [--rounds 3]

Each row is one `gateway run` (file mode, a private workspace) answering `--turns`
/api/chat turns one after another through the fake OpenAI server; the fake and the
receiver run in this process, so the CPU counted (user + system, from /proc) is the
gateway's alone. 20 warm-up turns are not counted; the modes alternate, `--rounds` times,
and the table shows medians (the machine's other load moves single runs by ~1 ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import timeit
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.testing.process import process_cpu_seconds as gateway_cpu  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI  # noqa: E402
from tests.fakes.otlp_receiver import otlp_receiver  # noqa: E402
from tests.gateway_process import GatewayProcess, base_env  # noqa: E402

TOKEN = "bench-tracing-token-0123456789"
WARMUP = 20


def chat(port: int, n: int) -> None:
    body = json.dumps({"session": f"bench{n % 8}", "text": f"question {n}", "id": f"b-{n}"})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/chat",
        data=body.encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def run(turns: int, endpoint: str | None) -> tuple[float, float]:
    """(CPU ms per turn, wall ms per turn) of one gateway."""
    with FakeOpenAI.in_thread() as llm, tempfile.TemporaryDirectory() as folder:
        env = base_env(Path(folder) / "ws", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_HTTP__TOKEN": TOKEN,
            "GATEWAY_CACHE__ENABLED": "false",
        }
        if endpoint is not None:
            env["GATEWAY_TELEMETRY__OTLP_ENDPOINT"] = endpoint
        gateway = GatewayProcess(env, Path(folder))
        try:
            port = gateway.wait_ready()
            for n in range(WARMUP):
                chat(port, n)
            cpu, wall = gateway_cpu(gateway.proc.pid), time.perf_counter()
            for n in range(WARMUP, WARMUP + turns):
                chat(port, n)
            cpu = gateway_cpu(gateway.proc.pid) - cpu
            wall = time.perf_counter() - wall
            gateway.terminate()
        finally:
            gateway.stop()
    return cpu * 1000 / turns, wall * 1000 / turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="gateways per mode, alternated")
    args = parser.parse_args()
    off: list[tuple[float, float]] = []
    on: list[tuple[float, float]] = []
    spans = 0
    with otlp_receiver() as (url, received):
        for _ in range(args.rounds):
            off.append(run(args.turns, None))
            before = len(received)
            on.append(run(args.turns, url))
            spans = len(received) - before
    rows = [("off", off, 0), ("on, OTLP/HTTP to a local receiver", on, spans)]
    total = args.turns + WARMUP
    print(f"{args.rounds} gateways per mode, {args.turns} turns each; medians")
    print(f"| tracing | CPU ms/turn | wall ms/turn | spans received per gateway ({total} turns) |")
    print("|---|---|---|---|")
    for name, runs, count in rows:
        cpu_ms = statistics.median(cpu for cpu, _ in runs)
        wall_ms = statistics.median(wall for _, wall in runs)
        print(f"| {name} | {cpu_ms:.2f} | {wall_ms:.2f} | {count} |")
    added = statistics.median(c for c, _ in on) - statistics.median(c for c, _ in off)
    print(f"\nadded CPU per turn with tracing on: {added:+.2f} ms")
    print("CPU ms/turn of each gateway, off:", " ".join(f"{c:.2f}" for c, _ in off))
    print("CPU ms/turn of each gateway, on: ", " ".join(f"{c:.2f}" for c, _ in on))
    print(f"tracing off, one span site (`with telemetry().span(...)`): {off_span_ns():.0f} ns")


def off_span_ns() -> float:
    """What a span costs while tracing is off: the call and the shared no-op object."""
    from gateway.telemetry import telemetry

    def site() -> None:
        with telemetry().span("gateway.turn", parent=None) as span:
            span.set_attribute("k", 1)

    return min(timeit.repeat(site, number=100_000, repeat=5)) / 100_000 * 1e9


if __name__ == "__main__":
    main()
