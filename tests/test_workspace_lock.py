"""One gateway per workspace (`gateway.storage.workspace.WorkspaceLock`): a second `gateway run` on
a workspace is refused in one line naming the first one's pid and address; commands that
only read run beside it, commands that change the workspace say it must be stopped first;
`gateway doctor` reports it; a SIGKILLed gateway leaves no stale lock. With real
processes, as a user meets it (a systemd unit plus a manual start)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.storage.workspace import EXIT_BUSY, LOCK_FILE, WorkspaceBusy, WorkspaceLock, holder
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import ROOT, GatewayProcess, base_env


def gateway(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture
def llm() -> Iterator[FakeOpenAI]:
    with FakeOpenAI.in_thread() as fake:
        yield fake


def test_a_second_gateway_on_a_workspace_is_refused_and_readers_run_beside(
    llm: FakeOpenAI, tmp_path: Path
) -> None:
    env = base_env(tmp_path / "ws", llm) | {"GATEWAY_HTTP__PORT": "0"}
    first = GatewayProcess(env, tmp_path)
    try:
        port = first.wait_ready()
        # A second daemon (its own free port: the workspace, not the port, is shared).
        started = time.monotonic()
        second = gateway(env, tmp_path, "run")
        assert second.returncode == EXIT_BUSY, second.stderr
        assert time.monotonic() - started < 30
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, second.stderr
        assert f"pid {first.proc.pid}" in lines[0]
        assert f"http://127.0.0.1:{port}" in lines[0]
        assert "stop it first" in lines[0] and str(tmp_path / "ws") in lines[0]
        # Readers run beside it.
        listed = gateway(env, tmp_path, "sessions", "list")
        assert listed.returncode == 0, listed.stderr
        doctor = gateway(env, tmp_path, "doctor")
        assert f"a gateway is running on this workspace (pid {first.proc.pid}" in doctor.stdout
        # Writers say it must be stopped first, and change nothing.
        for args in (
            ("sessions", "delete", "cli:direct", "--yes"),
            ("sessions", "fork", "cli:direct"),
            ("memory", "forget", "cli:direct", "f1"),
            ("chat", "-m", "hello"),
        ):
            refused = gateway(env, tmp_path, *args)
            assert refused.returncode == EXIT_BUSY, (args, refused.stderr)
            assert f"pid {first.proc.pid}" in refused.stderr and "stop it first" in refused.stderr
        # The refused chat never reached the model (the doctor's one-token probe of a
        # local model server did, and is the only request).
        assert [r.body["messages"] for r in llm.chat_requests if r.body] in (
            [],
            [[{"role": "user", "content": "Say OK."}]],
        )
        # The daemon kept running all along.
        assert first.proc.poll() is None
    finally:
        first.kill()
    # SIGKILL leaves no stale lock: the next start takes the workspace at once.
    again = GatewayProcess(env, tmp_path)
    try:
        again.wait_ready()
        assert holder(tmp_path / "ws") is not None
    finally:
        assert again.terminate(30) == 0
    assert holder(tmp_path / "ws") is None


def test_doctor_finds_the_port_taken_by_the_gateway_it_checks(
    llm: FakeOpenAI, tmp_path: Path
) -> None:
    """The doctor listens on the configured port to check it; the running gateway of the
    same workspace holds that port: that is reported as fine, not as a conflict."""
    from tests.fakes._serving import free_port

    port = free_port()
    env = base_env(tmp_path / "ws", llm) | {"GATEWAY_HTTP__PORT": str(port)}
    first = GatewayProcess(env, tmp_path)
    try:
        first.wait_ready()
        doctor = gateway(env, tmp_path, "doctor")
        assert f"the running gateway listens on http://127.0.0.1:{port}" in doctor.stdout
        assert "cannot listen" not in doctor.stdout
    finally:
        first.terminate(30)


def test_the_lock_names_its_holder_and_goes_with_it(tmp_path: Path) -> None:
    folder = tmp_path / "ws"
    assert holder(folder) is None  # nothing made by looking
    assert not folder.exists()
    lock = WorkspaceLock(folder).acquire("gateway run", doing="run refused", fix="stop it")
    lock.announce("http://127.0.0.1:8080")
    found = holder(folder)
    assert found is not None and found.pid == os.getpid() and found.command == "gateway run"
    assert found.url == "http://127.0.0.1:8080"
    assert oct((folder / LOCK_FILE).stat().st_mode & 0o777) == oct(0o600)
    # flock is per open file: a second acquire in this process conflicts like another's.
    with pytest.raises(WorkspaceBusy) as refused:
        WorkspaceLock(folder).acquire("gateway chat", doing="chat refused", fix="stop it", wait=0.1)
    assert f"pid {os.getpid()}" in str(refused.value) and "http://127.0.0.1:8080" in str(
        refused.value
    )
    lock.release()
    assert holder(folder) is None
    WorkspaceLock(folder).acquire("gateway chat", doing="x", fix="y").release()


def test_a_child_process_does_not_keep_the_lock(tmp_path: Path) -> None:
    """An MCP server the gateway started outlives it: it must not hold the lock on."""
    folder = tmp_path / "ws"
    lock = WorkspaceLock(folder).acquire("gateway run", doing="x", fix="y")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], cwd=ROOT)
    try:
        lock.release()
        assert holder(folder) is None
        WorkspaceLock(folder).acquire("gateway run", doing="x", fix="y", wait=0.1).release()
    finally:
        child.kill()
        child.wait()
