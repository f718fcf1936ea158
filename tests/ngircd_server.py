"""A private ngIRCd (Debian's ngircd) on 127.0.0.1 for the IRC tests: software we did not
write, run as a child process with its own configuration in a temporary folder (never the
system service).

Each instance has two ports, plain and TLS (a self-signed certificate made by `openssl` at
start, which the tests hand the gateway as `tls_ca_file`), no DNS or ident lookups (a
connection registers at once), nicks of up to 30 characters and no limit on connections
per address (every person of a test connects from 127.0.0.1). Everything else is ngIRCd's
own default: its flood control (at most 3 commands a second from a client with more
waiting, the rest held in its buffers: ngIRCd reads no further ahead than one command's
length), its ping timeouts, its CASEMAPPING (ascii).

`IrcPerson` is a person on it: a plain socket client that registers, joins, writes
PRIVMSGs and reads what it is sent, from the test's thread.

Measured here (tests of the bot and bench/channels.py rely on it): a client that sends 60
lines at once has them relayed 3 a second (the last after 21 s); one that sends a line
every 0.34 s has each relayed at once.

The tests skip without ngIRCd, with the command that installs it, except under CI=true,
where that fails: `.ci/run` installs it (scripts/install-ngircd.sh).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fakes._serving import free_port

INSTALL = "bash scripts/install-ngircd.sh (apt-get install -y ngircd)"
NGIRCD = "/usr/sbin/ngircd"
START_TIMEOUT = 20.0
SERVER_NAME = "irc.kit.test"


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: CI must run these tests against ngIRCd."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires ngIRCd (.ci/run installs it)")
    pytest.skip(f"{reason}; install it with {INSTALL}")


def ngircd_missing() -> str | None:
    if not Path(NGIRCD).is_file() and shutil.which("ngircd") is None:
        return "ngIRCd is not installed"
    if shutil.which("openssl") is None:
        return "openssl is not installed (it makes the test certificate)"
    return None


def make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@dataclass
class Ngircd:
    """One running `ngircd --nodaemon --config <file>`; its output is `log_path`."""

    root: Path
    proc: subprocess.Popen[bytes]
    port: int  # plain IRC
    tls_port: int  # TLS from the first byte
    ca_file: Path
    log_path: Path
    people: list[IrcPerson] = field(default_factory=list)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def person(self, nick: str, *, channels: tuple[str, ...] = ()) -> IrcPerson:
        """A person connected (plain port), registered as `nick`, in `channels`."""
        person = IrcPerson(self.host, self.port, nick)
        for name in channels:
            person.join(name)
        self.people.append(person)
        return person

    def stop(self) -> None:
        for person in self.people:
            person.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def restart(self, *, down_for: float = 0.0) -> None:
        """Stop the server (every connection drops), wait `down_for`, start it again on
        the same ports."""
        self.stop()
        self.people.clear()
        time.sleep(down_for)
        self.proc = _launch(self.root, self.log_path)
        _wait_up(self)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _launch(root: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [
                NGIRCD if Path(NGIRCD).is_file() else "ngircd",
                "--nodaemon",
                "--config",
                str(root / "ngircd.conf"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def _greets(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING :up\r\n")
            return bool(sock.recv(64))
    except OSError:
        return False


def _wait_up(server: Ngircd) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not _greets(server.port):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            unavailable(f"ngircd did not start; its output:\n{server.log_tail()}")
        time.sleep(0.1)


def start_ngircd(*, extra_limits: str = "") -> Ngircd:
    """Start a private ngIRCd; `unavailable` when it is not installed or does not come up."""
    if (reason := ngircd_missing()) is not None:
        unavailable(reason)
    root = Path(tempfile.mkdtemp(prefix="gw-ngircd-"))
    root.chmod(0o755)
    cert, key = make_certificate(root)
    # As root ngIRCd drops to ServerUID after reading its configuration; the test key is
    # readable by it (it is made for this run and thrown away after).
    cert.chmod(0o644)
    key.chmod(0o644)
    port, tls_port = free_port(), free_port()
    log_path = root / "ngircd.log"
    user = "irc" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    (root / "ngircd.conf").write_text(
        f"""\
[Global]
    Name = {SERVER_NAME}
    Info = the gateway's test server
    Listen = 127.0.0.1
    Ports = {port}
    MotdPhrase = a private ngIRCd for the gateway's tests
    PidFile = {root / "ngircd.pid"}
    ServerUID = {user}
    ServerGID = {user if os.geteuid() != 0 else "irc"}
[Limits]
    MaxConnectionsIP = 0
    MaxJoins = 0
    MaxNickLength = 30
    PingTimeout = 120
    PongTimeout = 20
{extra_limits}
[Options]
    DNS = no
    Ident = no
    PAM = no
    SyslogFacility = local7
[SSL]
    CertFile = {cert}
    KeyFile = {key}
    Ports = {tls_port}
"""
    )
    server = Ngircd(
        root=root,
        proc=_launch(root, log_path),
        port=port,
        tls_port=tls_port,
        ca_file=cert,
        log_path=log_path,
    )
    try:
        _wait_up(server)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server


@contextlib.contextmanager
def running_ngircd(*, extra_limits: str = "") -> Iterator[Ngircd]:
    server = start_ngircd(extra_limits=extra_limits)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


class IrcPerson:
    """A person on the server: one blocking socket, registered as `nick`. A thread reads
    what the server sends (answering its PINGs) into `lines`; `say` writes a PRIVMSG
    (`pace`: then waits that long, as a person types)."""

    def __init__(
        self, host: str, port: int, nick: str, *, tls_ca: Path | None = None, pace: float = 0.0
    ) -> None:
        self.nick = nick
        self.pace = pace
        raw = socket.create_connection((host, port), timeout=10)
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=str(tls_ca))
            raw = context.wrap_socket(raw, server_hostname="localhost")
        # Blocking from now on: a person may stay silent for long, and a read that timed
        # out would end their reader (and they would miss what they are sent after).
        raw.settimeout(None)
        self.sock = raw
        self.lines: list[str] = []
        self.stamps: list[float] = []  # when each line came (time.time())
        self._cond = threading.Condition()
        self._closed = False
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"irc-{nick}", daemon=True)
        self._reader.start()
        self.send(f"NICK {nick}")
        self.send(f"USER {nick} 0 * :Person {nick}")
        self.wait_for(lambda line: f" 001 {nick} " in line, what="registration")

    def send(self, line: str) -> None:
        with self._send_lock:
            self.sock.sendall(line.encode() + b"\r\n")

    def say(self, target: str, text: str) -> None:
        self.send(f"PRIVMSG {target} :{text}")
        if self.pace:
            time.sleep(self.pace)

    def join(self, channel: str) -> None:
        self.send(f"JOIN {channel}")
        self.wait_for(lambda line: f" 366 {self.nick} " in line, what=f"joining {channel}")

    def _read(self) -> None:
        buffer = b""
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            buffer += data
            *complete, buffer = buffer.split(b"\r\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace")
                if line.startswith("PING "):
                    with contextlib.suppress(OSError):
                        self.send("PONG " + line[5:])
                with self._cond:
                    self.lines.append(line)
                    self.stamps.append(time.time())
                    self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, predicate: object, *, timeout: float = 15.0, what: str = "a line") -> str:
        check = predicate if callable(predicate) else (lambda line: predicate in line)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if check(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise AssertionError(
                        f"{self.nick}: no {what} within {timeout:g}s; last lines: {self.lines[-8:]}"
                    )
                self._cond.wait(left)

    def received(self) -> list[tuple[float, str, str, str]]:
        """(when, sender nick, target, text) of every PRIVMSG and NOTICE this person got."""
        found = []
        with self._cond:
            lines = list(zip(self.stamps, self.lines, strict=True))
        for stamp, line in lines:
            if not line.startswith(":"):
                continue
            prefix, _, rest = line[1:].partition(" ")
            command, _, rest = rest.partition(" ")
            if command not in ("PRIVMSG", "NOTICE"):
                continue
            target, _, text = rest.partition(" :")
            found.append((stamp, prefix.split("!", 1)[0], target, text))
        return found

    def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(OSError):
            self.send("QUIT :bye")
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
