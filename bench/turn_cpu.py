"""The whole turn's CPU in the gateway process, through the real HTTP path: `gateway run`
(the CLI, headless) with a fake OpenAI-compatible server on 127.0.0.1 in a process of its
own, sequential `POST /api/chat` turns over 50 conversations, each question new (no cache
hit). The gateway process's CPU (user + system, from /proc) per turn, after a warm-up;
the configurations switch parts off one at a time so the table says what each costs.

    .venv/bin/python bench/turn_cpu.py [--turns 300] [--runs 3] [--only NAME] [--json]
    .venv/bin/python bench/turn_cpu.py --code /tmp/before   # and another checkout, alternating
    .venv/bin/python bench/turn_cpu.py --keep-alive   # one connection, as an API client's pool

This is issue 42's measure ("300 sequential /api/chat turns over 50 conversations: 3.0-3.5
ms of the gateway process's CPU per turn"). Each configuration is a fresh workspace and
process; the median of `--runs` runs is printed, runs of the configurations alternating.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This checkout first (bench/gateway.py would shadow the package); bench/ is the
# script's own folder, for fake_llm_process.
sys.path.insert(0, str(ROOT))

from fake_llm_process import fake_openai_process  # noqa: E402

from gateway.testing.process import GatewayProcess  # noqa: E402

TOKEN = "bench-token"

#: name -> the environment that makes it (on top of the defaults).
CONFIGURATIONS: dict[str, dict[str, str]] = {
    "default (cache with near-duplicates, memory with dense recall)": {},
    "near-duplicate cache off": {"GATEWAY_CACHE__NEAR_DUPLICATES": "false"},
    "cache off": {"GATEWAY_CACHE__ENABLED": "false"},
    "cache off, memory's dense recall off": {
        "GATEWAY_CACHE__ENABLED": "false",
        "GATEWAY_MEMORY__DENSE_RECALL": "false",
    },
    "cache and memory off": {
        "GATEWAY_CACHE__ENABLED": "false",
        "GATEWAY_MEMORY__ENABLED": "false",
    },
    # What the session appends' durability costs (not a configuration to run: a turn
    # is then acknowledged before it is on disk).
    "cache and memory off, sessions fsync never": {
        "GATEWAY_CACHE__ENABLED": "false",
        "GATEWAY_MEMORY__ENABLED": "false",
        "GATEWAY_SESSIONS__FSYNC": "never",
    },
}

#: Words the questions are made of: each question is new to the cache.
WORDS = [
    "weather",
    "trip",
    "lisbon",
    "pack",
    "shoes",
    "rain",
    "museum",
    "dinner",
    "train",
    "ticket",
    "hotel",
    "budget",
    "friend",
    "beach",
    "morning",
    "evening",
    "coffee",
    "market",
    "bridge",
    "tram",
    "river",
    "castle",
    "music",
    "book",
]


HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def chat_body(session: str, text: str) -> bytes:
    return json.dumps({"session": session, "text": text}).encode()


def ask(port: int, session: str, text: str) -> None:
    """One turn on a new connection (urllib's way: connect, ask, close)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/chat", data=chat_body(session, text), headers=HEADERS
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()


class KeptConnection:
    """Turns on one kept-alive connection, as an API client's pool sends them (the
    `openai` client, httpx, aiohttp): `--keep-alive`."""

    def __init__(self, port: int) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def __call__(self, port: int, session: str, text: str) -> None:
        self._conn.request("POST", "/api/chat", body=chat_body(session, text), headers=HEADERS)
        response = self._conn.getresponse()
        data = response.read()
        if response.status != 200:
            raise RuntimeError(f"/api/chat answered {response.status}: {data[:200]!r}")

    def close(self) -> None:
        self._conn.close()


def question(n: int) -> str:
    words = [WORDS[(n * 7 + i * 3) % len(WORDS)] for i in range(6)]
    return f"question {n}: what about the {' '.join(words)}?"


def run_once(
    base_url: str,
    env_extra: dict[str, str],
    turns: int,
    warmup: int,
    profile: str | None = None,
    code: str | None = None,
    keep_alive: bool = False,
) -> float:
    with tempfile.TemporaryDirectory(prefix="bench-turn-") as workspace:
        env = {
            **os.environ,
            **({"PYTHONPATH": code} if code else {}),
            "GATEWAY_WORKSPACE": workspace,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "",
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_HTTP__TOKEN": TOKEN,
            **env_extra,
        }
        # With `profile`, the whole process under cProfile (start-up included).
        python_args = ("-m", "cProfile", "-o", profile) if profile else ()
        gateway = GatewayProcess(env, Path(workspace), python_args=python_args)
        try:
            port = gateway.wait_ready()
            kept = KeptConnection(port) if keep_alive else None
            send = kept or ask
            try:
                for n in range(warmup):
                    send(port, f"s{n % 50}", question(100_000 + n))
                time.sleep(2.0)  # background work of the warm-up (embeddings, facts) settles
                before = gateway.cpu_seconds()
                for n in range(turns):
                    send(port, f"s{n % 50}", question(n))
                return (gateway.cpu_seconds() - before) / turns * 1e3
            finally:
                if kept is not None:
                    kept.close()
        finally:
            try:
                gateway.terminate(30)
            finally:
                gateway.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", help="run the configurations whose name contains this")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", help="write the gateway's cProfile stats here (one run)")
    parser.add_argument(
        "--keep-alive",
        action="store_true",
        help="send the turns on one kept-alive connection (an API client's pool) instead "
        "of a new connection a turn (urllib's way)",
    )
    parser.add_argument(
        "--code",
        action="append",
        help="also run another checkout's gateway package (by PYTHONPATH), alternating",
    )
    args = parser.parse_args()
    chosen = {k: v for k, v in CONFIGURATIONS.items() if not args.only or args.only in k}
    checkouts: list[str | None] = [None, *(args.code or [])]
    samples: dict[str, list[float]] = {}
    with fake_openai_process() as base_url:
        for _ in range(args.runs):
            for name, extra in chosen.items():
                for code in checkouts:
                    row = name if code is None else f"{name} [{code}]"
                    samples.setdefault(row, []).append(
                        run_once(
                            base_url,
                            extra,
                            args.turns,
                            args.warmup,
                            args.profile,
                            code,
                            args.keep_alive,
                        )
                    )
    if args.json:
        print(json.dumps(samples, indent=2))
        return 0
    how = "one kept-alive connection" if args.keep_alive else "a new connection a turn"
    print(
        f"{args.turns} sequential POST /api/chat turns over 50 conversations ({how}), "
        f"{args.runs} runs"
    )
    print("| configuration | gateway CPU per turn (ms), median | runs |")
    print("|---|---|---|")
    for name, values in samples.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values):.2f} | {runs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
