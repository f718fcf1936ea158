"""Benchmark of the session store: per-turn persist cost, write amplification, cold
load, many sessions, listing. Prints a table with targets; ``--json`` for machines.

    .venv/bin/python bench/sessions.py [--json] [--code OTHER_CHECKOUT]

Issue 29's rows: 1,000 users x 20 turns through the session API on one event loop
(`aget_or_create`, `aadd_message`: how the gateway runs turns), with ``fsync="batch"``
(the default: a group commit) and ``"never"``, each in a child process. With ``--code``
(e.g. a ``git worktree`` of turn 2's commit) the same rows run against that checkout
too, alternating with ours, and the table gives both and their ratio (medians).

Issue 42's before/after table comes from `bench/sessions_compare.py`, which runs this
file's ``--concurrent``, ``--turn`` and ``--cold`` rows for two checkouts alternating
(with callgrind instruction counts); results and commands in
`bench/results/sessions-i42.md`.

A turn is a user message (80 chars) and an assistant reply (240 chars) appended with
`Session.add_message`. Everything runs in a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from inspect import signature
from pathlib import Path

# A child run for another checkout (--code) imports that checkout's gateway.
sys.path.insert(0, os.environ.get("BENCH_CODE") or str(Path(__file__).resolve().parents[1]))

from loguru import logger

from gateway.llm import LLMMessage
from gateway.sessions import Session, SessionManager
from gateway.sessions.store import encode_line

USER = LLMMessage(role="user", content="u" * 80)
ASSISTANT = LLMMessage(role="assistant", content="a" * 240)


@dataclass
class Result:
    name: str
    value: float
    unit: str
    target: str = ""
    passed: bool | None = None


def turn(session: Session) -> None:
    session.add_message(USER)
    session.add_message(ASSISTANT)


def grow(session: Session, messages: int) -> None:
    while session.message_count < messages:
        turn(session)


def per_turn_ms(session: Session, turns: int) -> tuple[float, float]:
    samples = []
    for _ in range(turns):
        start = time.perf_counter()
        turn(session)
        samples.append(time.perf_counter() - start)
    return statistics.mean(samples) * 1e3, statistics.median(samples) * 1e3


def bench_turns(root: Path) -> list[Result]:
    results: list[Result] = []
    for mode, turns in (("never", 300), ("batch", 60), ("always", 60)):
        costs = {}
        for size in (100, 1_000, 10_000):
            folder = root / f"turns-{mode}-{size}"
            seed = SessionManager(folder, fsync="never")
            grow(seed.get_or_create("bench"), size)
            seed.close()
            session = SessionManager(folder, fsync=mode).get_or_create("bench")  # type: ignore[arg-type]
            turn(session)  # warm up (opens the file)
            mean, _median = per_turn_ms(session, turns)
            costs[size] = mean
            target, ok = "", None
            if mode == "never":
                target, ok = "< 0.3 ms", mean < 0.3
            results.append(
                Result(f"per-turn persist, fsync={mode}, {size:,} msgs", mean, "ms", target, ok)
            )
        ratio = costs[10_000] / costs[100]
        results.append(
            Result(
                f"per-turn cost 10,000 vs 100 msgs, fsync={mode}",
                ratio,
                "x",
                "<= 1.5x" if mode == "never" else "",
                ratio <= 1.5 if mode == "never" else None,
            )
        )
    return results


def bench_bytes(root: Path) -> list[Result]:
    session = SessionManager(root / "bytes", fsync="never").get_or_create("bench")
    grow(session, 1_000)
    assert session.path is not None
    before = session.path.stat().st_size
    entries_bytes = 0
    for _ in range(100):
        a = session.add_message(USER)
        b = session.add_message(ASSISTANT)
        entries_bytes += len(encode_line(a).encode()) + len(encode_line(b).encode())
    written = session.path.stat().st_size - before
    payload = 100 * sum(len(json.dumps(m.to_dict()).encode()) for m in (USER, ASSISTANT))
    ratio = written / entries_bytes
    return [
        Result("bytes written per turn", written / 100, "B"),
        Result("bytes written / entry lines", ratio, "x", "<= 1.5x", ratio <= 1.5),
        Result("bytes written / message JSON alone", written / payload, "x"),
    ]


def timed(fn: Callable[[], object], repeat: int = 7) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def bench_load(root: Path) -> list[Result]:
    folder = root / "load"
    seed = SessionManager(folder, fsync="never")
    grow(seed.get_or_create("plain"), 10_000)
    compacted = seed.get_or_create("compacted")
    grow(compacted, 10_000)
    compacted.prune_to_window(50)
    seed.close()
    size = (folder / "plain.jsonl").stat().st_size

    def load(key: str) -> Session:
        session = SessionManager(folder, fsync="never").get(key)
        assert session is not None
        return session

    cold = timed(lambda: load("plain"))
    full = timed(lambda: load("plain").build_context())
    short = timed(lambda: load("compacted").build_context())
    return [
        Result(f"cold load, 10,000 msgs ({size / 1e6:.1f} MB)", cold, "ms", "< 20 ms", cold < 20),
        Result("cold load + context of all 10,000 msgs", full, "ms"),
        Result("cold load + context, compacted to 50 msgs", short, "ms"),
    ]


def many_sessions(folder: Path, cache_size: int) -> dict[str, float]:
    """1,000 sessions x 20 turns, round robin. With a cache of 200 sessions (a tenth of
    the default) every turn misses the cache and reloads its session from disk: the
    worst case."""
    manager = SessionManager(folder, max_cache_size=cache_size, fsync="never")
    keys = [f"telegram:{100000 + i}" for i in range(1_000)]
    start = time.perf_counter()
    for _ in range(20):
        for key in keys:
            turn(manager.get_or_create(key))
    elapsed = time.perf_counter() - start
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    listing = timed(lambda: SessionManager(folder).list_sessions())
    assert len(SessionManager(folder).list_sessions()) == 1_000
    return {"seconds": elapsed, "peak_rss_mb": rss_kb / 1024, "list_ms": listing}


def run_many(root: Path, cache_size: int, runs: int = 3) -> dict[str, float]:
    """Best of ``runs`` (a shared machine's noise only ever adds time), each in a child
    process in a fresh folder, so peak RSS is this workload's alone."""
    results = []
    for run in range(runs):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--many",
                str(root / f"many-{cache_size}-{run}"),
                "--cache",
                str(cache_size),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results.append(json.loads(out))
    best = min(results, key=lambda r: r["seconds"])
    best["list_ms"] = min(r["list_ms"] for r in results)
    return best


def bench_many(root: Path) -> list[Result]:
    worst = run_many(root, 200)
    warm = run_many(root, 1_000)
    return [
        Result(
            "1,000 sessions x 20 turns (cache 200: all misses)",
            worst["seconds"],
            "s",
            "< 2 s",
            worst["seconds"] < 2,
        ),
        Result("  peak RSS of that process", worst["peak_rss_mb"], "MB"),
        Result("1,000 sessions x 20 turns (cache 1,000)", warm["seconds"], "s"),
        Result("  peak RSS of that process", warm["peak_rss_mb"], "MB"),
        Result(
            "list_sessions, 1,000 sessions",
            worst["list_ms"],
            "ms",
            "< 30 ms",
            worst["list_ms"] < 30,
        ),
    ]


def concurrent_users(
    folder: Path, fsync: str, users: int = 1_000, turns: int = 20
) -> tuple[float, float]:
    """`users` conversations taking `turns` turns each at once on one event loop, through
    the session API the gateway uses there; (seconds, CPU seconds of the process)."""
    import anyio

    async def run() -> tuple[float, float]:
        manager = SessionManager(folder, fsync=fsync)  # type: ignore[arg-type]
        keys = [f"telegram:{100000 + i}" for i in range(users)]

        # As the agent loop does: the user's message deferred into the reply's round
        # (a checkout from before deferred appends makes each durable on its own).
        deferred = {"defer": True} if "defer" in signature(Session.aadd_message).parameters else {}

        async def user(key: str) -> None:
            for _ in range(turns):
                session = await manager.aget_or_create(key)
                await session.aadd_message(USER, **deferred)
                await session.aadd_message(ASSISTANT)

        start, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as group:
            for key in keys:
                group.start_soon(user, key)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        manager.close()
        return elapsed, cpu

    return anyio.run(run)


def cold_loads(folder: Path, runs: int = 15) -> dict[str, float]:
    """Median ms of loading a 10,000-message session in a fresh `SessionManager` (the
    file is written first, once), and with its context built; and of a load that finds
    no sidecar index (``.index/``: removed before each; that load writes it anew)."""
    if not (folder / "plain.jsonl").exists():
        seed = SessionManager(folder, fsync="never")
        grow(seed.get_or_create("plain"), 10_000)
        seed.close()

    def load() -> Session:
        session = SessionManager(folder, fsync="never").get("plain")
        assert session is not None
        return session

    def unindexed() -> float:
        shutil.rmtree(folder / ".index", ignore_errors=True)
        start = time.perf_counter()
        load()
        return time.perf_counter() - start

    load()  # the first load after the file was written (may write the index)
    return {
        "cold_ms": timed(load, runs),
        "context_ms": timed(lambda: load().build_context(), runs),
        "unindexed_ms": statistics.median(unindexed() for _ in range(runs)) * 1e3,
    }


def turn_at_10k(folder: Path, turns: int = 60) -> dict[str, float]:
    """Median ms of one turn (a message pair, each appended and acknowledged under the
    default ``fsync="batch"``) on a 10,000-message session, from a thread."""
    if not (folder / "plain.jsonl").exists():
        seed = SessionManager(folder, fsync="never")
        grow(seed.get_or_create("plain"), 10_000)
        seed.close()
    manager = SessionManager(folder)
    session = manager.get_or_create("plain")
    turn(session)  # warm up (opens the file)
    _mean, median = per_turn_ms(session, turns)
    manager.close()
    return {"turn_ms": median}


def _child(args: list[str], code: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    if code is not None:
        env["BENCH_CODE"] = str(code)
    out = subprocess.run(
        [sys.executable, __file__, *args], check=True, capture_output=True, text=True, env=env
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def bench_concurrent(root: Path, code: Path | None, rounds: int = 3) -> list[Result]:
    """Issue 29's rows (module doc): medians of `rounds`, ours and `code`'s alternating.
    The CPU time is the steadier figure on a shared machine; the wall time is what a
    batch fsync's waits add."""
    results: list[Result] = []
    sides: list[tuple[str, Path | None]] = [("ours", None)]
    if code is not None:
        sides.append((_label(code), code))
    for mode in ("batch", "never"):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
        for run in range(rounds):
            for name, which in sides:
                folder = root / f"concurrent-{mode}-{run}-{name}"
                runs[name].append(_child(["--concurrent", str(folder), "--fsync", mode], which))
        for what, unit in (("seconds", "s"), ("cpu", "s CPU")):
            ours = statistics.median(r[what] for r in runs["ours"])
            label = "" if what == "seconds" else " (CPU)"
            results.append(
                Result(f"1,000 users x 20 turns at once, fsync={mode}{label}", ours, unit)
            )
            for name, _ in sides[1:]:
                theirs = statistics.median(r[what] for r in runs[name])
                ratio = ours / theirs
                results.append(Result(f"  same at {name}", theirs, unit))
                # Within 10%: the noise of a shared machine between two medians of 3.
                results.append(Result(f"  ours / {name}", ratio, "x", "<= 1.1", ratio <= 1.1))
    return results


def _label(code: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return code.name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to make the temporary folder (default: TMPDIR)",
    )
    parser.add_argument(
        "--code", type=Path, help="another checkout (e.g. turn 2's) to run issue 29's rows against"
    )
    parser.add_argument("--only-concurrent", action="store_true", help="run only issue 29's rows")
    parser.add_argument("--many", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=int, default=200, help=argparse.SUPPRESS)
    parser.add_argument("--concurrent", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--fsync", default="batch", help=argparse.SUPPRESS)
    parser.add_argument("--cold", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--turn", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logger.remove()
    if args.many:
        print(json.dumps(many_sessions(args.many, args.cache)))
        return 0
    if args.turn:
        print(json.dumps(turn_at_10k(args.turn)))
        return 0
    if args.cold:
        print(json.dumps(cold_loads(args.cold)))
        return 0
    if args.concurrent:
        seconds, cpu = concurrent_users(args.concurrent, args.fsync)
        print(json.dumps({"seconds": seconds, "cpu": cpu}))
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench-sessions-", dir=args.dir))
    try:
        results = bench_concurrent(root, args.code)
        if not args.only_concurrent:
            results += bench_turns(root) + bench_bytes(root) + bench_load(root) + bench_many(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    all_pass = all(r.passed is not False for r in results)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "all_pass": all_pass}, indent=2))
    else:
        width = max(len(r.name) for r in results)
        print(f"{'measure':<{width}}  {'value':>10}  {'target':<9} pass")
        for r in results:
            mark = {True: "yes", False: "NO", None: ""}[r.passed]
            value = f"{r.value:.3f} {r.unit}" if r.value < 100 else f"{r.value:.0f} {r.unit}"
            print(f"{r.name:<{width}}  {value:>10}  {r.target:<9} {mark}")
        print("all targets met" if all_pass else "SOME TARGETS MISSED")
    return 0 if all_pass else 1


if __name__ == "__main__":
    sys.exit(main())
