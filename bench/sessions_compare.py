"""Before/after table of the session layer (issue 42): two checkouts side by side, their
runs alternating, times as medians and instructions from callgrind.

    .venv/bin/python bench/sessions_compare.py --code /work/wt/perf-base --code . \\
        [--rounds 5] [--instructions] [--markdown]

Rows, each run in a child process of `bench/sessions.py` importing the checkout's
`gateway` (``BENCH_CODE``):
- 1,000 users x 20 turns at once on one event loop, ``fsync="batch"`` (the default) and
  ``"never"``: wall and CPU seconds (issue 42's goal: 2 s with batch);
- a turn (a message pair appended and acknowledged, ``"batch"``) on a 10,000-message
  session, from a thread (goal: kept);
- a cold load of a 10,000-message session (goal: 5 ms on the issue's machine), the
  same with its context built, and one that finds no sidecar index (and writes it).
Each round runs every row of every checkout in turn, so a busy machine slows both alike.

``--instructions`` adds user-space instructions counted by ``valgrind --tool=callgrind``
(steady where seconds are not): per turn of the concurrent rows (300 users minus 100
users, over 4,000 turns, so start-up cancels out) and per cold load (16 loads minus 1,
over 15). Kernel work (fsync, write) is not in these counts; the CPU seconds have it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().with_name("sessions.py")


def child(code: Path, *args: str) -> dict[str, float]:
    env = dict(os.environ, BENCH_CODE=str(code.resolve()))
    out = subprocess.run(
        [sys.executable, str(BENCH), *args], check=True, capture_output=True, text=True, env=env
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def instructions(code: Path, script: str) -> int:
    """User-space instructions of ``python -c script`` importing ``code``'s gateway."""
    with tempfile.TemporaryDirectory(prefix="cg-") as tmp:
        out = Path(tmp) / "cg.out"
        env = dict(os.environ, BENCH_CODE=str(code.resolve()), CG_DIR=tmp)
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-c",
                script,
            ],
            check=True,
            capture_output=True,
            env=env,
        )
        match = re.search(r"^(?:summary|totals): (\d+)", out.read_text(), re.M)
        assert match is not None
        return int(match[1])


PRELUDE = f"""
import os, sys, json
from pathlib import Path
sys.path.insert(0, {str(BENCH.parent)!r})
sys.argv = ["x"]
import sessions as b
from loguru import logger
logger.remove()
tmp = Path(os.environ["CG_DIR"])
"""


def concurrent_script(mode: str, users: int) -> str:
    return PRELUDE + f"b.concurrent_users(tmp / 's', {mode!r}, users={users}, turns=20)\n"


def cold_script(loads: int) -> str:
    return (
        PRELUDE
        + "seed = b.SessionManager(tmp / 's', fsync='never')\n"
        + "b.grow(seed.get_or_create('plain'), 10_000)\nseed.close()\n"
        + "b.SessionManager(tmp / 's', fsync='never').get('plain')\n"  # writes an index
        + f"for _ in range({loads}):\n"
        + "    assert b.SessionManager(tmp / 's', fsync='never').get('plain') is not None\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code", type=Path, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--instructions", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    codes: list[Path] = args.code
    names = [_label(c) for c in codes]
    rows: dict[str, list[list[float]]] = {}

    def add(row: str, i: int, value: float) -> None:
        rows.setdefault(row, [[] for _ in codes])[i].append(value)

    root = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    try:
        for r in range(args.rounds):
            for mode in ("batch", "never"):
                for i, code in enumerate(codes):
                    got = child(
                        code, "--concurrent", str(root / f"c-{mode}-{r}-{i}"), "--fsync", mode
                    )
                    add(f"1,000 users x 20 turns, fsync={mode} (s)", i, got["seconds"])
                    add(f"1,000 users x 20 turns, fsync={mode} (CPU s)", i, got["cpu"])
                    shutil.rmtree(root / f"c-{mode}-{r}-{i}", ignore_errors=True)
            for i, code in enumerate(codes):
                got = child(code, "--turn", str(root / f"turn-{i}-{r}"))
                add("turn (pair + save) @ 10,000 msgs, batch (ms)", i, got["turn_ms"])
                shutil.rmtree(root / f"turn-{i}-{r}", ignore_errors=True)
            for i, code in enumerate(codes):
                got = child(code, "--cold", str(root / f"cold-{i}"))
                add("cold load, 10,000 msgs (ms)", i, got["cold_ms"])
                add("cold load + context, 10,000 msgs (ms)", i, got["context_ms"])
                add("cold load, no index yet (writes it), 10,000 msgs (ms)", i, got["unindexed_ms"])
        if args.instructions:
            for i, code in enumerate(codes):
                for mode in ("batch", "never"):
                    small = instructions(code, concurrent_script(mode, 100))
                    large = instructions(code, concurrent_script(mode, 300))
                    add(f"instructions per turn, fsync={mode}", i, (large - small) / 4_000)
                one = instructions(code, cold_script(1))
                many = instructions(code, cold_script(16))
                add("instructions per cold load, 10,000 msgs (M)", i, (many - one) / 15 / 1e6)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    head = ["measure", *names]
    if len(codes) > 1:
        head += [f"{n} / {names[0]}" for n in names[1:]]
    table = [head]
    for row, samples in rows.items():
        medians = [statistics.median(s) for s in samples]
        cells = [row, *(_fmt(m) for m in medians)]
        cells += [f"{m / medians[0]:.2f}x" for m in medians[1:]]
        table.append(cells)
    if args.markdown:
        print("| " + " | ".join(table[0]) + " |")
        print("|" + "---|" * len(table[0]))
        for cells in table[1:]:
            print("| " + " | ".join(cells) + " |")
    else:
        widths = [max(len(r[c]) for r in table) for c in range(len(head))]
        for cells in table:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"\n{args.rounds} rounds, medians; checkouts alternating within each round")
    return 0


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


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


if __name__ == "__main__":
    sys.exit(main())
