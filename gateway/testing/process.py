"""`gateway run` as a real process for the conformance kit: started, SIGKILLed (also where
it stopped itself at a failpoint), stopped with SIGTERM and started again on one
workspace, its log kept for failure messages."""

from __future__ import annotations

import fcntl
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import gateway

__all__ = [
    "GatewayProcess",
    "GatewayRuns",
    "child_pythonpath",
    "process_cpu_seconds",
    "wait_until",
]

READY_LINE = "gateway ready: http://"
#: A cold start imports for seconds, more on a busy machine.
START_TIMEOUT = 90.0


#: One byte per port of this file is locked (POSIX record locks) by the process that
#: picked the port, until it exits: every test process on the machine sees it.
_PORTS_FILE = Path(os.environ.get("TMPDIR", "/tmp")) / "gateway-test-ports.lock"
_ports_lock = threading.Lock()
_ports_fd: int | None = None
_ports_taken: dict[int, None] = {}  # oldest first
#: A process holds at most this many (the oldest goes first): the range below the
#: ephemeral ports stays open to the other test processes however long a run is.
_PORTS_HELD = 2_000


def _reserve(port: int) -> bool:
    """Hold `port` for this process's life (or until it has picked `_PORTS_HELD` more):
    False when another process (or thread) of this machine picked it first. The locks
    go with the process, however it ends."""
    global _ports_fd
    with _ports_lock:
        if port in _ports_taken:
            return False
        if _ports_fd is None:
            _ports_fd = os.open(_PORTS_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.lockf(_ports_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        except OSError:
            return False
        _ports_taken[port] = None
        if len(_ports_taken) > _PORTS_HELD:
            oldest = next(iter(_ports_taken))
            del _ports_taken[oldest]
            fcntl.lockf(_ports_fd, fcntl.LOCK_UN, 1, oldest)
        return True


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` so far (Linux's /proc; 0 once it is gone): the
    benchmarks' measure of a gateway's (or a database's) work."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, for a server that must keep its
    address across restarts (where port 0 would not do): below the kernel's ephemeral
    range. A port inside it can be taken meanwhile by a connection toward it that gets it
    as its own source port (TCP's self-connect): a platform's retries toward a stopped
    gateway did that, and the restarted gateway found its port in use.

    The port is reserved for this process until it exits (`_reserve`): a server that is
    stopped for a while (a gateway killed and started again, a proxy cut and restored)
    finds its port still its own, where another test process picking at random found it
    free and took it meanwhile (seen in CI, with the tests spread over workers)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as found:
            low = int(found.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.randrange(10_000, max(10_001, low))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        if _reserve(port):
            return port
    raise RuntimeError("no free TCP port below the ephemeral range")


def wait_until(
    predicate: Callable[[], object], timeout: float = 20, what: str = "condition"
) -> None:
    """Poll `predicate` every 50 ms until it is true; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what or 'condition'} not met within {timeout:g}s")


def child_pythonpath() -> str:
    """PYTHONPATH for a gateway that imports the same code as this process: the folder
    holding the `gateway` package this process imported, then this process's own
    entries (a project's source folders), each unless it is inside the interpreter's
    installation (which the child finds by itself), then whatever PYTHONPATH held."""
    installed = tuple(
        str(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}
    )
    entries: list[str] = []
    for entry in [str(Path(gateway.__file__).parents[1]), *sys.path]:
        if not entry or not Path(entry).is_dir():
            continue
        resolved = str(Path(entry).resolve())
        if not resolved.startswith(installed) and resolved not in entries:
            entries.append(resolved)
    if os.environ.get("PYTHONPATH"):
        entries.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(entries)


class GatewayProcess:
    """One `gateway run` (stdin closed: no terminal chat) whose stderr is collected."""

    def __init__(
        self, env: Mapping[str, str], cwd: Path, *, python_args: Sequence[str] = ()
    ) -> None:
        """`python_args`: the interpreter's own, before ``-m gateway.cli run`` (a
        benchmark's ``-m cProfile -o FILE``)."""
        self.proc = subprocess.Popen(
            [sys.executable, *python_args, "-m", "gateway.cli", "run"],
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, name="gateway-log", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._lines.put(line)

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def wait_for_line(self, text: str, timeout: float = 20) -> str:
        """The next log line containing `text` (reading on from the lines already
        waited past); AssertionError, with the last lines, after `timeout` or when the
        process ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if text in line:
                return line
        raise AssertionError(
            f"the gateway never logged {text!r} (exit code {self.proc.poll()}); its last "
            f"lines:\n{self.tail(20)}"
        )

    def wait_logged(self, text: str, timeout: float = 20) -> str:
        """A line containing `text` logged at any time so far, or within `timeout`
        (unlike `wait_for_line`, which reads on from the lines already waited past)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.log):
                if text in line:
                    return line
            if time.monotonic() >= deadline or self.proc.poll() is not None:
                raise AssertionError(
                    f"the gateway never logged {text!r}; its last lines:\n{self.tail(20)}"
                )
            time.sleep(0.05)

    def wait_ready(self, timeout: float = START_TIMEOUT, *, readyz: bool = True) -> int:
        """Wait for the ready line, then (with `readyz`) for /readyz to answer 200 (every
        channel up); the HTTP port."""
        deadline = time.monotonic() + timeout
        try:
            line = self.wait_for_line(READY_LINE, timeout)
        except AssertionError as exc:
            raise AssertionError(f"the gateway never became ready: {exc}") from None
        port = int(line.split("http://", 1)[1].split()[0].rsplit(":", 1)[1])
        if readyz:
            self.wait_readyz(port, max(1.0, deadline - time.monotonic()))
        return port

    def wait_readyz(self, port: int, timeout: float = START_TIMEOUT) -> None:
        """Poll ``GET /readyz`` until it answers 200 (every channel is up)."""

        def ready() -> bool:
            try:
                url = f"http://127.0.0.1:{port}/readyz"
                with urllib.request.urlopen(url, timeout=1) as answer:
                    return bool(answer.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, timeout, f"/readyz 200 on port {port}")

    def peak_memory_mb(self) -> float | None:
        """The process's peak resident memory so far (Linux's VmHWM), None where the
        system does not say."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text(encoding="ascii")
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    def cpu_seconds(self) -> float:
        """The process's user + system CPU so far (`process_cpu_seconds`)."""
        return process_cpu_seconds(self.proc.pid)

    def wait_stopped(self, failpoint: str, timeout: float = START_TIMEOUT) -> None:
        """Wait until the process stopped itself at `failpoint` (its SIGSTOP,
        `gateway.failpoints`); AssertionError, with its last lines, when it ended first or
        never got there."""

        def stopped() -> bool:
            try:
                pid, status = os.waitpid(self.proc.pid, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:  # reaped already: it ended
                raise AssertionError(f"the gateway ended before failpoint {failpoint}") from None
            if pid == 0:
                return False
            if os.WIFSTOPPED(status):
                return True
            self.proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here
            raise AssertionError(
                f"the gateway exited ({self.proc.returncode}) before it stopped at "
                f"failpoint {failpoint}"
            )

        try:
            wait_until(stopped, timeout, f"the gateway stopped at failpoint {failpoint}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; its last lines:\n{self.tail()}") from None

    def kill(self) -> None:
        """SIGKILL: nothing runs after this instant, no drain, no flush."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM (drain, then stop); the exit code."""
        self.begin_stop()
        return self.wait_exit(timeout)

    def begin_stop(self) -> None:
        """SIGTERM without waiting: the gateway drains while the caller goes on."""
        self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = 60) -> int:
        """The exit code, once the process has ended."""
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Kill it if it still runs (for cleanup)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class GatewayRuns:
    """The gateway processes of one scenario, one at a time on one workspace: started,
    killed, stopped and started again, always cleaned up (`stop_all`)."""

    def __init__(self, env: Mapping[str, str], cwd: Path) -> None:
        self.env = dict(env)
        self.cwd = cwd
        self.current: GatewayProcess | None = None
        self.processes: list[GatewayProcess] = []
        self.kills = 0
        self.port: int | None = None
        #: The exit code of the last SIGTERM (None: never stopped that way).
        self.exit_code: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("no gateway has been started")
        return f"http://127.0.0.1:{self.port}"

    def launch(self, extra: Mapping[str, str] | None = None) -> GatewayProcess:
        """Start a gateway process without waiting for it (`extra`: variables for this
        one only)."""
        if self.current is not None and self.current.proc.poll() is None:
            raise RuntimeError("a gateway is running already: one per workspace")
        self.current = GatewayProcess(self.env | dict(extra or {}), self.cwd)
        self.processes.append(self.current)
        return self.current

    def start(self) -> GatewayProcess:
        """Start a gateway process and wait until it is ready."""
        process = self.launch()
        self.port = process.wait_ready()
        return process

    def kill(self) -> None:
        assert self.current is not None, "no gateway to kill"
        self.current.kill()
        self.kills += 1

    def kill_at(self, failpoint: str) -> None:
        """Start a gateway that stops itself the first time any session reaches
        `failpoint` (``GATEWAY_FAILPOINTS``), and SIGKILL it there: the worst moment, made
        to happen rather than hoped for."""
        process = self.launch({"GATEWAY_FAILPOINTS": f"{failpoint}=sigstop"})
        process.wait_stopped(failpoint)
        self.kill()

    def terminate(self) -> int:
        assert self.current is not None, "no gateway to stop"
        self.exit_code = self.current.terminate()
        return self.exit_code

    def stop_all(self) -> None:
        for process in self.processes:
            process.stop()

    def save_logs(self, directory: Path) -> Path:
        """Each process's log in `directory` (``gateway-<n>.log``, in start order)."""
        directory.mkdir(parents=True, exist_ok=True)
        for n, process in enumerate(self.processes):
            (directory / f"gateway-{n}.log").write_text("".join(process.log), encoding="utf-8")
        return directory
