"""Benchmark of one-shot commands' start-up: wall time of a fresh `gateway` process for
each command a person types, beside `python -c pass` on the same interpreter, as ratios
measured in one run. Prints a table with the goals of issue 26.

    .venv/bin/python bench/startup.py                      # 9 rounds, a table
    .venv/bin/python bench/startup.py --runs 15 --sessions 1000
    .venv/bin/python bench/startup.py --code /tmp/other    # another checkout's gateway
    .venv/bin/python bench/startup.py --code /tmp/before --code .   # both, in one run

Rows: `python -c pass`; `import gateway.cli`; `gateway --help`; `gateway sessions list` on
a workspace of `--sessions` sessions (10 messages each); `gateway chat -m` answered from
the shared response cache (the fake OpenAI server of tests/fakes in a thread; a first
call fills the cache, every measured call is checked to have made no request); and
`gateway chat -m` refused for want of an LLM (no OPENAI_*: exit 78). The rounds run the
commands in turn, so a busy machine slows every row alike; each row is the median.
`--code` runs the `gateway` package of another checkout (by PYTHONPATH) with this one's
interpreter; given more than once, each round runs every row of every checkout in turn
(one after the other for each row), and the table puts them side by side with each
checkout's time as a ratio of the first's: before and after a change, in one run.

The commands run with bytecode caches, as an installed package has them (the warm-up
round writes them, PYTHONDONTWRITEBYTECODE or not). `--no-bytecode` removes the checkout's
own caches (`__pycache__` under gateway/, channels/ and tests/) and writes none, so each
start compiles the gateway's modules from source, as a checkout run with
PYTHONDONTWRITEBYTECODE=1 does; the interpreter's and the libraries' caches stay.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from tests.fakes.openai_server import FakeOpenAI  # noqa: E402

EXIT_CONFIG = 78
QUESTION = "what is DNS?"


Check = Callable[[subprocess.CompletedProcess[str]], str | None]


@dataclass
class Row:
    """One measured command: its argv and environment, and a check of its output."""

    name: str
    argv: list[str]
    env: dict[str, str]
    check: Check
    goal: str = ""
    #: the goal as a test of (median seconds, ratio to `python -c pass`)
    meets: Callable[[float, float], bool] | None = None
    #: a new argv for each run, when runs must differ
    fresh: Callable[[], list[str]] | None = None
    samples: list[float] | None = None


def gateway_argv(*args: str) -> list[str]:
    """`gateway ARGS` as installed (the console script beside this interpreter), else
    `python -m gateway.cli ARGS`."""
    script = Path(sys.executable).with_name("gateway")
    if script.exists():
        return [sys.executable, str(script), *args]
    return [sys.executable, "-m", "gateway.cli", *args]


#: Set by main(): the environment variables that decide where bytecode comes from.
BYTECODE: dict[str, str] = {}


def clean_env(code: Path, workspace: Path) -> dict[str, str]:
    """This process's environment without the developer's GATEWAY_*/OPENAI_* (and with
    `BYTECODE`'s choice), running the gateway package of `code` on `workspace`."""
    skip = ("GATEWAY_", "OPENAI_", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(skip)}
    return env | BYTECODE | {"PYTHONPATH": str(code), "GATEWAY_WORKSPACE": str(workspace)}


def fill_sessions(workspace: Path, count: int) -> None:
    """`count` sessions of 10 messages in `workspace`, written by the session manager."""
    from gateway.llm import LLMMessage
    from gateway.sessions import SessionManager

    manager = SessionManager(workspace / "sessions", fsync="never")
    try:
        for i in range(count):
            session = manager.get_or_create(f"telegram:{100_000 + i}")
            for _ in range(5):
                session.add_message(LLMMessage(role="user", content="u" * 80))
                session.add_message(LLMMessage(role="assistant", content="a" * 240))
    finally:
        manager.close()


def expect(
    code: int, *, lines: int | None = None, stdout: str | None = None, stderr: str = ""
) -> Check:
    """A check: the exit code, and the number of output lines or the output's text."""

    def check(done: subprocess.CompletedProcess[str]) -> str | None:
        if done.returncode != code:
            return f"exit {done.returncode}, not {code}: {done.stderr.strip()[-300:]}"
        if lines is not None and len(done.stdout.splitlines()) != lines:
            return f"{len(done.stdout.splitlines())} lines, not {lines}"
        if stdout is not None and done.stdout.strip() != stdout:
            return f"printed {done.stdout.strip()!r}, not {stdout!r}"
        if stderr not in done.stderr:
            return f"stderr {done.stderr.strip()!r} does not say {stderr!r}"
        return None

    return check


def drop_bytecode(code: Path) -> None:
    """Remove the bytecode caches of the checkout's own packages."""
    for package in ("gateway", "channels", "tests"):
        for cache in (code / package).rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)


def run_once(row: Row, cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(row.argv, env=row.env, cwd=cwd, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    problem = row.check(done)
    if problem:
        raise SystemExit(f"{row.name}: {problem}")
    return elapsed


def rows_of(code: Path, tmp: Path, listing: Path, fake: FakeOpenAI, sessions: int) -> list[Row]:
    """The measured commands, run with the gateway of `code`; its own folders under `tmp`."""
    llm = clean_env(code, tmp / "chat") | {
        "OPENAI_BASE_URL": fake.base_url,
        "OPENAI_API_KEY": fake.api_key or "",
    }
    answer = f"echo: {QUESTION}"
    chats = iter(range(1_000_000))

    def cached_chat() -> list[str]:
        # A new session each time: only a standalone question is answered from the
        # shared cache.
        return gateway_argv("chat", "--session", f"bench{next(chats)}", "-m", QUESTION)

    return [
        Row("python -c pass", [sys.executable, "-c", "pass"], clean_env(code, tmp), expect(0)),
        Row(
            "import gateway.cli",
            [sys.executable, "-c", "import gateway.cli"],
            clean_env(code, tmp),
            expect(0),
        ),
        Row(
            "gateway --help",
            gateway_argv("--help"),
            clean_env(code, tmp),
            expect(0),
            goal="within 2x",
            meets=lambda seconds, ratio: ratio <= 2.0,
        ),
        Row(
            f"gateway sessions list ({sessions:,})",
            gateway_argv("sessions", "list"),
            clean_env(code, listing),
            expect(0, lines=sessions),
            goal="< 0.5 s",
            meets=lambda seconds, ratio: seconds < 0.5,
        ),
        Row("gateway chat -m (cached)", [], llm, expect(0, stdout=answer), fresh=cached_chat),
        Row(
            "gateway chat -m (no LLM set)",
            gateway_argv("chat", "-m", QUESTION),
            clean_env(code, tmp / "nollm"),
            expect(EXIT_CONFIG, stderr="No LLM API key"),
        ),
    ]


def measure(args: argparse.Namespace, tmp: Path) -> list[list[Row]]:
    """Each checkout's rows (`--code`, in order), measured in the same rounds."""
    listing = tmp / "listing"
    fill_sessions(listing, args.sessions)
    with FakeOpenAI.in_thread() as fake:
        tables = []
        for i, code in enumerate(args.code):
            own = tmp / f"code{i}"
            own.mkdir()
            tables.append(rows_of(Path(code), own, listing, fake, args.sessions))
        # Row by row, each checkout in turn: a busy moment slows both alike.
        order = [table[n] for n in range(len(tables[0])) for table in tables]
        cwd = tmp / "cwd"  # no gateway.toml here: every run uses the defaults
        cwd.mkdir()
        # A first round, not counted, fills the cache (the cached chat's first call) and
        # warms the page cache and the bytecode caches.
        for row in order:
            row.argv = row.fresh() if row.fresh else row.argv
            run_once(row, cwd)
        requests = len(fake.chat_requests)
        for row in order:
            row.samples = []
        for _ in range(args.runs):
            for row in order:
                row.argv = row.fresh() if row.fresh else row.argv
                assert row.samples is not None
                row.samples.append(run_once(row, cwd))
        if len(fake.chat_requests) != requests:
            raise SystemExit("a measured `gateway chat -m` asked the model: not a cache hit")
    return tables


def results_of(rows: list[Row]) -> list[dict[str, Any]]:
    """Each row's median, its ratio to `python -c pass` (the first row) and its goal."""
    base = statistics.median(rows[0].samples or [])
    results = []
    for row in rows:
        median = statistics.median(row.samples or [])
        ratio = median / base
        met = None if row.meets is None else row.meets(median, ratio)
        results.append(
            {"command": row.name, "median_s": median, "ratio": ratio, "goal": row.goal, "met": met}
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="rounds (default 9)")
    parser.add_argument("--sessions", type=int, default=1000, help="sessions to list")
    parser.add_argument(
        "--code",
        action="append",
        help="the checkout whose gateway runs (default this one); again for another, "
        "measured in the same rounds",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--no-bytecode", action="store_true", help="compile the gateway's modules at each start"
    )
    args = parser.parse_args()
    args.code = [str(Path(code).resolve()) for code in args.code or [ROOT]]
    tmp = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    if args.no_bytecode:
        sys.dont_write_bytecode = True  # this process imports from the checkout too
        BYTECODE["PYTHONDONTWRITEBYTECODE"] = "1"
        for code in args.code:
            drop_bytecode(Path(code))
    try:
        tables = measure(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    checkouts = [
        {"code": code, "rows": results_of(rows)}
        for code, rows in zip(args.code, tables, strict=True)
    ]
    if args.json:
        head = {"bytecode": not args.no_bytecode, "runs": args.runs}
        if len(checkouts) == 1:
            print(json.dumps({"code": args.code[0], **head, "rows": checkouts[0]["rows"]}))
        else:
            print(json.dumps({**head, "checkouts": checkouts}))
        return
    bytecode = "no bytecode caches" if args.no_bytecode else "with bytecode caches"
    if len(checkouts) == 1:
        print(f"start-up of one-shot commands: {args.code[0]}, {bytecode}, median of {args.runs}")
        print(f"{'command':<34} {'median':>8} {'x pass':>7}  {'goal':<10} met")
        for r in checkouts[0]["rows"]:
            met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
            print(
                f"{r['command']:<34} {r['median_s']:>7.3f}s {r['ratio']:>6.1f}x  "
                f"{r['goal']:<10} {met}"
            )
        return
    labels = [chr(ord("A") + i) for i in range(len(checkouts))]
    print(f"start-up of one-shot commands, {bytecode}, median of {args.runs}, in the same rounds")
    for label, code in zip(labels, args.code, strict=True):
        print(f"  {label}: {code}")
    head = f"{'command':<34}"
    for label in labels:
        head += f" {label:>8} {'x pass':>7} {'met':>3} "
    head += "".join(f" {label + '/A':>5}" for label in labels[1:])
    print(f"{head}  goal")
    for n, first in enumerate(checkouts[0]["rows"]):
        line = f"{first['command']:<34}"
        for checkout in checkouts:
            r = checkout["rows"][n]
            met = "" if r["met"] is None else ("yes" if r["met"] else "NO")
            line += f" {r['median_s']:>7.3f}s {r['ratio']:>6.1f}x {met:>3} "
        for checkout in checkouts[1:]:
            line += f" {checkout['rows'][n]['median_s'] / first['median_s']:>5.2f}"
        print(f"{line}  {first['goal']}")


if __name__ == "__main__":
    main()
