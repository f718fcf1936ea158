"""A command run on a pseudo-terminal, typed at like a person would, for tests.

The child is a session leader whose controlling terminal is the pty, so the kernel's
line discipline does what it does for a real terminal: Ctrl-C typed while the child is
in cooked mode becomes SIGINT for it. The reading side answers cursor position
requests (ESC [6n) as a terminal emulator does.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

# Becomes the session's controlling terminal (the child already called setsid), then
# runs the command.
_WITH_CTTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
_FORWARD = re.compile(rb"\x1b\[(\d*)C")  # cursor forward: shown as the spaces it skips
_ANSI = re.compile(
    rb"\x1b\[[0-9;?<=>]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[=>()][0-9A-Za-z]?"
)
CTRL_C = b"\x03"
CTRL_D = b"\x04"


class Terminal:
    """`argv` running on a pty of `rows` x `cols`; `screen` is what it printed, without
    escape sequences."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path, rows: int = 24, cols: int = 120
    ) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WITH_CTTY, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env | {"TERM": "xterm"},
            cwd=cwd,
            start_new_session=True,
        )
        os.close(slave)
        self._master = master
        self._raw = bytearray()
        self._changed = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            if b"\x1b[6n" in data:
                os.write(self._master, b"\x1b[1;1R")
            with self._changed:
                self._raw += data
                self._changed.notify_all()
            if not data:
                return

    @property
    def screen(self) -> str:
        with self._changed:
            raw = bytes(self._raw)
        raw = _FORWARD.sub(lambda m: b" " * int(m.group(1) or 1), raw)
        return _ANSI.sub(b"", raw).replace(b"\r", b"").decode("utf-8", "replace")

    def mark(self) -> int:
        """A position in `screen`: `expect(..., after=mark)` looks only past it."""
        return len(self.screen)

    def expect(self, text: str, *, after: int = 0, timeout: float = 20) -> int:
        """Wait until `text` appears in `screen` past `after`; where it ends."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = self.screen.find(text, after)
                if found >= 0:
                    return found + len(text)
                if self.proc.poll() is not None:
                    # Output may still wait in the pty after the exit: a second more.
                    deadline = min(deadline, time.monotonic() + 1)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{text!r} never appeared; the terminal shows:\n{self.screen[-2000:]}"
                    )
                self._changed.wait(min(left, 0.2))

    def type(self, data: bytes) -> None:
        os.write(self._master, data)

    def wait(self, timeout: float = 30) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        try:
            os.close(self._master)
        except OSError:
            pass
