"""A replica frozen past its lease mid-turn (SIGSTOP), with real `gateway run` processes on
one PostgreSQL: it stores nothing and sends nothing for that conversation when it wakes
(SIGCONT), while the other replica took the conversation over and answered it.

Each scenario freezes replica A at one of the moments that decide what it could still
write or send (docs/scaling.md, "A paused replica"): while the model holds its request,
before the user's message is stored, before a reply is recorded in the outbox (a
command's reply), before it is sent, and before the message is marked answered. The
freeze is deterministic: the fake model holds the request, or A stops itself at a
failpoint (`gateway.failpoints`). Meanwhile B takes the conversation (its lease ran out)
and answers the next messages. Then A resumes. Counted from the outside:

- every user message is in the session once, and so is its reply (no turn stored twice);
- the session and the replies sent to the chat are in arrival order;
- at most one reply is repeated: only when A froze after sending it (before the mark),
  B sends it again from the session (the promise's one extra send);
- A logs that the lease moved on, and the journal owes nothing at the end.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, base_env, telegram_webhook_env, wait_until

pytestmark = pytest.mark.kill

TOKEN = "555:FREEZE-test"
SECRET = "freeze-webhook-secret"
CHAT = 7100
KEY = f"telegram:{CHAT}"
LEASE_TTL = 3.0

#: Scenario -> (where A freezes: a failpoint, or "model" for the held model request).
SCENARIOS = {
    "model": "model",
    "before append": "turn.before_user_append",
    "before outbox": "dispatch.before_outbox",
    "before send": "dispatch.before_send",
    "before mark": "dispatch.before_mark",
}


def process_state(pid: int) -> str:
    """The kernel's one-letter state of `pid` (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def post_update(port: int, telegram: FakeTelegram, text: str) -> int:
    import json
    import urllib.request

    update = telegram.with_update_id(telegram.user_message(CHAT, text, user_id=CHAT))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/telegram/webhook",
        data=json.dumps(update).encode(),
        headers={"Content-Type": "application/json", "X-Telegram-Bot-Api-Secret-Token": SECRET},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


@pytest.fixture
def services() -> Iterator[tuple[FakeOpenAI, FakeTelegram]]:
    with FakeOpenAI.in_thread() as llm, FakeTelegram.in_thread(token=TOKEN) as telegram:
        yield llm, telegram


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_replica_frozen_past_its_lease_writes_and_sends_nothing_when_it_wakes(
    scenario: str,
    migrated_pg_url: str,
    services: tuple[FakeOpenAI, FakeTelegram],
    tmp_path: Path,
) -> None:
    import psycopg

    llm, telegram = services
    point = SCENARIOS[scenario]
    env = (
        base_env(tmp_path / "unused", llm)
        | {
            "GATEWAY_STORAGE__URL": migrated_pg_url,
            "GATEWAY_STORAGE__LEASE_TTL_SECONDS": str(LEASE_TTL),
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_MEMORY__ENABLED": "false",
            "GATEWAY_CACHE__ENABLED": "false",
        }
        | telegram_webhook_env(telegram, SECRET)
    )
    first = "/status" if scenario == "before outbox" else "f m1"
    armed = {} if point == "model" else {"GATEWAY_FAILPOINTS": f"{point}=sigstop@{KEY}"}
    a = GatewayProcess(env | armed | {"GATEWAY_WORKSPACE": str(tmp_path / "a")}, tmp_path)
    b = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / "b")}, tmp_path)
    procs = [a, b]
    try:
        port_a, port_b = a.wait_ready(), b.wait_ready()
        a.wait_readyz(port_a)
        b.wait_readyz(port_b)

        def replies() -> list[str]:
            return [str(m.get("text", "")) for m in telegram.sent_messages(CHAT)]

        if point == "model":
            llm.hold(lambda body: (body.get("messages") or [{}])[-1].get("content") == "f m1")
        assert post_update(port_a, telegram, first) == 200  # journaled on A, A's lease
        if point == "model":
            llm.wait_held(1, timeout=20)
            a.proc.send_signal(signal.SIGSTOP)
        wait_until(lambda: process_state(a.proc.pid) == "T", 20, "replica A frozen")
        frozen = time.monotonic()
        sent_before = len(replies())

        # B takes the conversation once A's lease ran out, and answers the first message
        # (again, where A had sent its reply before the freeze), then two more.
        wait_until(lambda: len(replies()) > sent_before, 30, "B answering the first message")
        assert time.monotonic() - frozen >= LEASE_TTL * 0.8  # not before A's lease ran out
        for n in (2, 3):
            assert post_update(port_b, telegram, f"f m{n}") == 200
            wait_until(lambda n=n: f"echo: f m{n}" in replies(), 20, f"B answering m{n}")

        # A wakes: the model answers its held request, or it goes on from its failpoint.
        llm.release()
        a.proc.send_signal(signal.SIGCONT)
        a.wait_for_line("lease", 20)  # lost (a renewal), or moved on (a write)
        # Both replicas keep serving the conversation, in order, after the wake-up.
        assert post_update(port_a, telegram, "f m4") == 200
        wait_until(lambda: "echo: f m4" in replies(), 20, "m4 answered")
        time.sleep(1.0)  # anything A might still send would be out by now
        for proc in procs:
            assert proc.terminate(30) == 0
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)
            proc.stop()
        log = "".join(line for proc in procs for line in proc.log)
        (tmp_path / "replicas.log").write_text(log)

    with psycopg.connect(migrated_pg_url) as conn:
        rows = conn.execute(
            "SELECT e.body::json->'message'->>'role', e.body::json->'message'->>'content' "
            "FROM gw_session_entries e JOIN gw_sessions s USING (session_id) "
            "WHERE s.key = %s AND e.type = 'message' ORDER BY e.seq",
            (KEY,),
        ).fetchall()
        owed = conn.execute("SELECT count(*) FROM gw_inbound WHERE state <> 'done'").fetchone()
    texts = ["f m1", "f m2", "f m3", "f m4"]
    if scenario == "before outbox":
        texts = texts[1:]  # a command is not stored in the session
    stored = [(str(role), str(content)) for role, content in rows]
    assert stored == [pair for t in texts for pair in (("user", t), ("assistant", f"echo: {t}"))]
    sent = replies()
    expected = [f"echo: {t}" for t in texts]
    if scenario == "before outbox":
        assert len(sent) == 4 and not sent[0].startswith("echo:"), sent  # /status, once
        sent = sent[1:]
    if scenario == "before mark":
        expected = expected[:1] + expected  # sent by A before it froze, again by B
    assert sent == expected
    assert owed == (0,)
    # The model ran A's first turn too (it was frozen mid-turn), but nothing of it was
    # stored or sent: A's log says so.
    assert "lease moved on to another replica" in log
