"""A private Dovecot (Debian's dovecot-imapd) on 127.0.0.1 for the email tests: software we
did not write, run as a child process with its own configuration in a temporary folder
(never the system service).

Each instance has its own ports (IMAP with STARTTLS, and IMAPS), a passwd-file with the
test users, maildir storage in the folder, a self-signed certificate made by `openssl` at
start (the tests hand it to the gateway as `tls_ca_file`) and IDLE, which Dovecot always
offers. The tests skip without Dovecot, with the command that installs it, except under
CI=true, where that fails: `.ci/run` installs it (scripts/install-dovecot.sh).
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fakes._serving import free_port

INSTALL = "bash scripts/install-dovecot.sh (apt-get install -y dovecot-imapd)"
DOVECOT = "/usr/sbin/dovecot"
DH_FILE = Path("/usr/share/dovecot/dh.pem")
START_TIMEOUT = 30.0


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: CI must run these tests against Dovecot."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires Dovecot (.ci/run installs it)")
    pytest.skip(f"{reason}; install it with {INSTALL}")


def dovecot_missing() -> str | None:
    if not Path(DOVECOT).is_file() and shutil.which("dovecot") is None:
        return "Dovecot is not installed"
    if shutil.which("openssl") is None:
        return "openssl is not installed (it makes the test certificate)"
    return None


def _mail_owner() -> tuple[str, str, int, int]:
    """(internal user, login user, uid, gid) Dovecot runs with. As root: Debian's own
    `dovecot` and `dovenull` accounts (Dovecot refuses mail access as uid 0); as anyone
    else: that user for everything (a rootless instance)."""
    if os.geteuid() == 0:
        owner = pwd.getpwnam("dovecot")
        return "dovecot", "dovenull", owner.pw_uid, owner.pw_gid
    me = pwd.getpwuid(os.geteuid())
    return me.pw_name, me.pw_name, me.pw_uid, me.pw_gid


def _make_certificate(folder: Path) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
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
class Dovecot:
    """One running `dovecot -F -c <config>`; its log is `log_path`."""

    root: Path
    proc: subprocess.Popen[bytes]
    imap_port: int  # plain IMAP, STARTTLS offered
    imaps_port: int  # TLS from the first byte
    ca_file: Path
    users: dict[str, str]
    log_path: Path
    internal_user: str = ""
    _clients: list[object] = field(default_factory=list)

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def client(self, user: str, *, folder: str | None = "INBOX") -> object:
        """A logged-in IMAPClient (IMAPS) for `user`, `folder` selected."""
        from imapclient import IMAPClient

        client = IMAPClient(
            self.host, port=self.imaps_port, ssl=True, ssl_context=self.tls_context(), timeout=30
        )
        client.login(user, self.users[user])
        if folder is not None:
            client.select_folder(folder)
        return client

    def append(
        self, user: str, raw: bytes, *, folder: str = "INBOX", flags: tuple[bytes, ...] = ()
    ) -> None:
        """Deliver `raw` into `user`'s `folder` (IMAP APPEND, as a sender's server would)."""
        client = self.client(user, folder=None)
        try:
            client.append(folder, raw, flags=flags)  # type: ignore[attr-defined]
        finally:
            client.logout()  # type: ignore[attr-defined]

    def messages(self, user: str, folder: str = "INBOX") -> list[tuple[int, set[bytes], bytes]]:
        """(uid, flags, raw message) of every message in `folder`, by UID."""
        client = self.client(user, folder=None)
        try:
            client.select_folder(folder, readonly=True)  # type: ignore[attr-defined]
            uids = client.search(["ALL"])  # type: ignore[attr-defined]
            if not uids:
                return []
            data = client.fetch(uids, ["FLAGS", "BODY.PEEK[]"])  # type: ignore[attr-defined]
            # \Recent is the server's note about this session, not a flag of the message.
            return [
                (uid, set(data[uid][b"FLAGS"]) - {b"\\Recent"}, data[uid][b"BODY[]"])
                for uid in sorted(data)
            ]
        finally:
            client.logout()  # type: ignore[attr-defined]

    def create_folder(self, user: str, folder: str) -> None:
        client = self.client(user, folder=None)
        try:
            client.create_folder(folder)  # type: ignore[attr-defined]
        finally:
            client.logout()  # type: ignore[attr-defined]

    def renumber(self, user: str, folder: str = "INBOX") -> None:
        """Give `folder` a new UIDVALIDITY (as a server restored from backup or a
        rebuilt index does), keeping its messages and their flags: Dovecot's maildir keeps
        both in `dovecot-uidlist`, whose first line holds the UIDVALIDITY. Stops and
        starts the server around the change."""
        self.stop()
        maildir = self.root / "mail" / user
        if folder != "INBOX":
            maildir = maildir / f".{folder}"
        uidlist = maildir / "dovecot-uidlist"
        lines = uidlist.read_text().splitlines()
        head = lines[0].split()
        for i, part in enumerate(head):
            if part.startswith("V"):
                head[i] = f"V{int(part[1:]) + 1000}"
        lines[0] = " ".join(head)
        uidlist.write_text("\n".join(lines) + "\n")
        for index in maildir.glob("dovecot.index*"):
            index.unlink()
        self.proc = _launch(self.root, self.log_path)
        _wait_up(self)

    def restart(self, *, down_for: float = 0.0) -> None:
        """Crash the server (SIGKILL to it and every process it started, whose
        connections go with them), wait `down_for` seconds, start it again (same ports,
        same mail): clients see their connections drop and the port refuse meanwhile."""
        for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(15)
        time.sleep(down_for)
        self.proc = _launch(self.root, self.log_path)
        _wait_up(self)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (from /proc), deepest last."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = [child for child, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    return found


def _launch(root: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [
                DOVECOT if Path(DOVECOT).is_file() else "dovecot",
                "-F",
                "-c",
                str(root / "dovecot.conf"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _greets(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            return sock.recv(64).startswith(b"* OK")
    except OSError:
        return False


def _wait_up(server: Dovecot) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not _greets(server.imap_port):
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            unavailable(f"dovecot did not start; its log:\n{server.log_tail()}")
        time.sleep(0.1)


def start_dovecot(users: dict[str, str]) -> Dovecot:
    """Start a private Dovecot with `users` (name -> password); `unavailable` when it is
    not installed or does not come up."""
    if (reason := dovecot_missing()) is not None:
        unavailable(reason)
    internal, login, uid, gid = _mail_owner()
    # Not under pytest's tmp_path: its folders are private to root, and Dovecot's mail
    # processes run as `dovecot`.
    root = Path(tempfile.mkdtemp(prefix="gw-dovecot-"))
    root.chmod(0o755)
    for sub in ("run", "state", "mail"):
        (root / sub).mkdir()
    os.chown(root / "mail", uid, gid)
    cert, key = _make_certificate(root)
    key.chmod(0o600)
    passwd = root / "users"
    passwd.write_text(
        "".join(
            f"{name}:{{PLAIN}}{password}:{uid}:{gid}::{root / 'mail' / name}\n"
            for name, password in users.items()
        )
    )
    imap_port, imaps_port = free_port(), free_port()
    log_path = root / "dovecot.log"
    dh = f"ssl_dh = <{DH_FILE}\n" if DH_FILE.is_file() else ""
    (root / "dovecot.conf").write_text(
        f"""\
protocols = imap
listen = 127.0.0.1
base_dir = {root / "run"}
state_dir = {root / "state"}
log_path = {log_path}
default_internal_user = {internal}
default_internal_group = {grp.getgrgid(pwd.getpwnam(internal).pw_gid).gr_name}
default_login_user = {login}
ssl = yes
ssl_cert = <{cert}
ssl_key = <{key}
{dh}auth_mechanisms = plain login
disable_plaintext_auth = yes
mail_location = maildir:~
first_valid_uid = {min(uid, 100)}
passdb {{
  driver = passwd-file
  args = username_format=%u {passwd}
}}
userdb {{
  driver = passwd-file
  args = username_format=%u {passwd}
}}
service imap-login {{
  chroot =
  inet_listener imap {{
    address = 127.0.0.1
    port = {imap_port}
  }}
  inet_listener imaps {{
    address = 127.0.0.1
    port = {imaps_port}
    ssl = yes
  }}
}}
service anvil {{
  chroot =
}}
protocol imap {{
  imap_idle_notify_interval = 10 secs
}}
"""
    )
    server = Dovecot(
        root=root,
        proc=_launch(root, log_path),
        imap_port=imap_port,
        imaps_port=imaps_port,
        ca_file=cert,
        users=dict(users),
        log_path=log_path,
        internal_user=internal,
    )
    try:
        _wait_up(server)
    except BaseException:  # skipped or failed: its log tail is in the message
        shutil.rmtree(root, ignore_errors=True)
        raise
    return server


@contextlib.contextmanager
def running_dovecot(users: dict[str, str]) -> Iterator[Dovecot]:
    server = start_dovecot(users)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)
