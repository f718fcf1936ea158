"""Synapse, the Matrix homeserver, on 127.0.0.1 with SQLite for the Matrix tests: software we
did not write, talked to over the real client-server API.

`scripts/install-synapse.sh` installs it (pinned, in `.synapse-venv`, a venv of its own so
its dependency pins never meet the project's; `.ci/run` calls it). The fixture writes a
homeserver.yaml (no federation, registration closed but for the shared-secret admin API,
rate limits out of the way), starts it once per test session, waits for
`/_matrix/client/versions` and registers users through the shared-secret admin API. The
tests skip without it, with the install command, except under CI=true, where that fails.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fakes._serving import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Where scripts/install-synapse.sh puts Synapse (GATEWAY_TEST_SYNAPSE_VENV overrides).
SYNAPSE_VENV = Path(os.environ.get("GATEWAY_TEST_SYNAPSE_VENV", ROOT / ".synapse-venv"))
INSTALL_HINT = "bash scripts/install-synapse.sh"
SERVER_NAME = "localhost"
#: Synapse starts in a few seconds; a loaded two-core machine may take longer.
START_TIMEOUT = 120.0

_RELAXED = {"per_second": 10_000, "burst_count": 10_000}


def unavailable(reason: str) -> None:
    """Skip, or under CI=true fail: CI must run the Matrix tests against Synapse."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI=true requires Synapse ({INSTALL_HINT}, .ci/run does)")
    pytest.skip(f"{reason}; install it with: {INSTALL_HINT}")


def _config(folder: Path, port: int, shared_secret: str) -> dict[str, Any]:
    return {
        "server_name": SERVER_NAME,
        "public_baseurl": f"http://127.0.0.1:{port}/",
        "pid_file": str(folder / "homeserver.pid"),
        "listeners": [
            {
                "port": port,
                "bind_addresses": ["127.0.0.1"],
                "type": "http",
                "tls": False,
                "x_forwarded": False,
                "resources": [{"names": ["client", "media"], "compress": False}],
            }
        ],
        "database": {"name": "sqlite3", "args": {"database": str(folder / "homeserver.db")}},
        "log_config": str(folder / "log.yaml"),
        "media_store_path": str(folder / "media"),
        "signing_key_path": str(folder / "signing.key"),
        "registration_shared_secret": shared_secret,
        "enable_registration": False,
        # Passwords of throwaway accounts: hashing them at the default cost (12 rounds) made
        # registering most of a conformance scenario's setup.
        "bcrypt_rounds": 4,
        "macaroon_secret_key": secrets.token_hex(16),
        "form_secret": secrets.token_hex(16),
        "report_stats": False,
        "trusted_key_servers": [],
        "suppress_key_server_warning": True,
        "federation_domain_whitelist": [],
        "presence": {"enabled": False},
        "url_preview_enabled": False,
        "enable_metrics": False,
        # Test users send fast; Synapse's defaults would throttle them.
        "rc_message": _RELAXED,
        "rc_registration": _RELAXED,
        "rc_login": {"address": _RELAXED, "account": _RELAXED, "failed_attempts": _RELAXED},
        "rc_joins": {"local": _RELAXED, "remote": _RELAXED},
        "rc_joins_per_room": _RELAXED,
        "rc_invites": {"per_room": _RELAXED, "per_user": _RELAXED, "per_issuer": _RELAXED},
        "rc_admin_redaction": _RELAXED,
        "rc_media_create": _RELAXED,
        "rc_delayed_event_mgmt": _RELAXED,
        "rc_presence": {"per_user": _RELAXED},
    }


_LOG_CONFIG = """\
version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(message)s'
handlers:
  file:
    class: logging.FileHandler
    formatter: precise
    filename: {path}
root:
  level: WARNING
  handlers: [file]
disable_existing_loggers: false
"""


@dataclass
class MatrixUser:
    """A registered account: its id, password and an access token of its own device."""

    user_id: str
    password: str
    access_token: str
    device_id: str


@dataclass
class Synapse:
    """One running Synapse. Its log goes to `log_path`."""

    proc: subprocess.Popen[bytes]
    port: int
    folder: Path
    shared_secret: str
    _names: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "homeserver.log"

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        *,
        token: str | None = None,
        timeout: float = 30,
    ) -> Any:
        """One client-server API call; the decoded JSON answer (HTTPError on 4xx/5xx)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.loads(answer.read() or b"{}")

    def register(
        self, name: str | None = None, *, admin: bool = False, displayname: str | None = None
    ) -> MatrixUser:
        """A new account through the shared-secret admin API (`register_new_matrix_user`'s
        way): a nonce, then the HMAC-SHA1 of nonce, name, password and admin flag; with
        `displayname`, its profile's display name."""
        with self._lock:
            if name is None:
                name = f"user{next(self._names)}_{secrets.token_hex(3)}"
        password = secrets.token_urlsafe(12)
        nonce = self.request("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(self.shared_secret.encode(), digestmod=hashlib.sha1)
        for part in (nonce, name, password):
            mac.update(part.encode())
            mac.update(b"\x00")
        mac.update(b"admin" if admin else b"notadmin")
        body = {
            "nonce": nonce,
            "username": name,
            "password": password,
            "admin": admin,
            "mac": mac.hexdigest(),
        }
        if displayname is not None:
            body["displayname"] = displayname
        answer = self.request("POST", "/_synapse/admin/v1/register", body)
        return MatrixUser(
            str(answer["user_id"]), password, str(answer["access_token"]), answer["device_id"]
        )

    # ---------------------------------------------------------------- a user's actions

    def create_room(
        self, user: MatrixUser, *, invite: list[str] = (), direct: bool = False, **extra: Any
    ) -> str:
        body: dict[str, Any] = {"preset": "private_chat", "invite": list(invite), **extra}
        if direct:
            body["is_direct"] = True
        return str(
            self.request("POST", "/_matrix/client/v3/createRoom", body, token=user.access_token)[
                "room_id"
            ]
        )

    def join(self, user: MatrixUser, room_id: str) -> None:
        quoted = urllib.parse.quote(room_id)
        self.request("POST", f"/_matrix/client/v3/join/{quoted}", {}, token=user.access_token)

    def invite(self, user: MatrixUser, room_id: str, invitee: str) -> None:
        quoted = urllib.parse.quote(room_id)
        self.request(
            "POST",
            f"/_matrix/client/v3/rooms/{quoted}/invite",
            {"user_id": invitee},
            token=user.access_token,
        )

    def send(
        self,
        user: MatrixUser,
        room_id: str,
        content: dict[str, Any] | str,
        *,
        txn: str | None = None,
    ) -> str:
        """Send an m.room.message (a text, or the content given); its event id."""
        if isinstance(content, str):
            content = {"msgtype": "m.text", "body": content}
        quoted = urllib.parse.quote(room_id)
        txn = txn or secrets.token_hex(8)
        answer = self.request(
            "PUT",
            f"/_matrix/client/v3/rooms/{quoted}/send/m.room.message/{txn}",
            content,
            token=user.access_token,
        )
        return str(answer["event_id"])

    def messages(self, user: MatrixUser, room_id: str, limit: int = 1000) -> list[dict[str, Any]]:
        """The room's m.room.message events, oldest first (what a client shows)."""
        quoted = urllib.parse.quote(room_id)
        query = urllib.parse.urlencode(
            {"dir": "b", "limit": limit, "filter": json.dumps({"types": ["m.room.message"]})}
        )
        answer = self.request(
            "GET", f"/_matrix/client/v3/rooms/{quoted}/messages?{query}", token=user.access_token
        )
        return list(reversed(answer.get("chunk") or []))

    def members(self, user: MatrixUser, room_id: str) -> dict[str, str]:
        """user id -> membership of everyone the room knows."""
        quoted = urllib.parse.quote(room_id)
        answer = self.request(
            "GET", f"/_matrix/client/v3/rooms/{quoted}/members", token=user.access_token
        )
        return {
            str(event["state_key"]): str(event["content"].get("membership"))
            for event in answer.get("chunk") or []
        }

    def wait_for(self, check: Any, timeout: float = 30.0, interval: float = 0.2) -> Any:
        """Poll `check()` until it returns something truthy; that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {check}")
            time.sleep(interval)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)


def _answers(port: int) -> bool:
    url = f"http://127.0.0.1:{port}/_matrix/client/versions"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_synapse(folder: Path) -> Synapse:
    """Write the config, start Synapse and wait until it answers; `unavailable` (skip, or
    fail under CI) when it is not installed or does not come up."""
    python = SYNAPSE_VENV / "bin" / "python"
    if not python.is_file():
        unavailable(f"Synapse is not installed ({python} is missing)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    shared_secret = secrets.token_hex(16)
    config = folder / "homeserver.yaml"
    # YAML is a superset of JSON: no YAML library needed to write it.
    config.write_text(json.dumps(_config(folder, port, shared_secret), indent=1))
    (folder / "log.yaml").write_text(_LOG_CONFIG.format(path=folder / "homeserver.log"))
    seed = base64.b64encode(secrets.token_bytes(32)).decode().rstrip("=")
    (folder / "signing.key").write_text(f"ed25519 a_test {seed}\n")
    with (folder / "stdout.log").open("wb") as out:
        proc = subprocess.Popen(
            [str(python), "-m", "synapse.app.homeserver", "--config-path", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=folder,
        )
    server = Synapse(proc, port, folder, shared_secret)
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            out_text = (folder / "stdout.log").read_text(errors="replace")[-3000:]
            unavailable(
                f"Synapse did not start (exit {proc.returncode}); its output:\n{out_text}\n"
                + server.log_tail()
            )
        time.sleep(0.2)
    return server


@pytest.fixture(scope="session")
def synapse(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Synapse]:
    """One Synapse for the whole test session (it starts in seconds, not for free)."""
    server = start_synapse(tmp_path_factory.mktemp("synapse"))
    yield server
    server.stop()
