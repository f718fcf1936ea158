"""`gateway run` as a real subprocess for tests, with its log lines readable as they come."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path


class GatewayProcess:
    """A running `gateway run` (stdin closed: headless) whose stderr is collected."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "run"],
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._lines.put(line)

    def wait_for_line(self, text: str, timeout: float = 20) -> str:
        """The first log line containing `text`; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if text in line:
                return line
        raise AssertionError(f"the gateway never logged {text!r}")

    def wait_ready(self) -> int:
        """Wait for start-up; the HTTP port it listens on."""
        line = self.wait_for_line("gateway ready: http://")
        return int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])

    def stop(self) -> None:
        """Kill it if it still runs (for `finally`)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
