"""Crash safety: a writer SIGKILLed at random moments loses no acknowledged turn, and
the session keeps working afterwards."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway.llm import LLMMessage
from gateway.sessions import MessageEntry, SessionManager

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("sessions_child.py")
KEY = "crash:key"
ROUNDS = 30


def numbers(folder: Path) -> tuple[list[int], int]:
    session = SessionManager(folder, fsync="never").get(KEY)
    assert session is not None
    report = session.load_report
    assert report.bad_lines == 0 and report.moved_aside is None, report
    entries = session.entries
    # Every entry is on one unbroken chain: nothing was glued or lost mid-file.
    assert len(session.get_branch()) == len(entries)
    child = [
        int(e.message.content.split(":")[1])
        for e in entries
        if isinstance(e, MessageEntry) and e.message.content and e.message.content[0] == "t"
    ]
    return child, len(entries)


def test_acknowledged_turns_survive_sigkill(tmp_path: Path) -> None:
    rng = random.Random(20240501)
    folder = tmp_path / "sessions"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    acked: set[int] = set()
    next_n = 0
    started = time.monotonic()
    for round_no in range(ROUNDS):
        fsync = "always" if round_no % 10 == 9 else "never"
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(folder), KEY, fsync, str(next_n), "0", "t"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        for _ in range(rng.randint(1, 40)):
            line = proc.stdout.readline()
            assert line.startswith("ack "), line
            acked.add(int(line.split()[1]))
        time.sleep(rng.random() * 0.01)  # let it run on: the kill lands anywhere
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()  # acks printed before it died count too
        proc.wait()
        acked.update(int(x.split()[1]) for x in rest.splitlines() if x.startswith("ack "))

        child, _ = numbers(folder)
        assert acked <= set(child), f"round {round_no}: lost {sorted(acked - set(child))}"
        assert child == list(range(len(child)))  # in order, no duplicates, no gaps
        next_n = len(child)

        if round_no % 5 == 4:  # later appends by someone else still work
            s = SessionManager(folder, fsync="always").get_or_create(KEY)
            s.add_message(LLMMessage(role="assistant", content=f"parent after round {round_no}"))
            _, total = numbers(folder)
            assert total == len(s.entries)
    assert len(acked) >= ROUNDS
    assert time.monotonic() - started < 60
