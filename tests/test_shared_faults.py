"""The shared mode when PostgreSQL goes away (a TCP proxy cut between the gateway and a
running PostgreSQL): at start the gateway waits with one log line and /readyz 503; mid-run
a webhook gets a 5xx instead of an acknowledgement for a message it could not journal,
and nothing acknowledged is lost."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import anyio
import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.tcp_proxy import free_port, tcp_proxy
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, base_env, telegram_webhook_env, wait_until

SECRET = "faults-secret"


def readyz(port: int) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.mark.timeout(180)
def test_postgres_down_at_start_and_mid_run(migrated_pg_url: str, tmp_path: Path) -> None:
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(token="999:FAULTS-test") as telegram,
        tcp_proxy("127.0.0.1", 5432, listening=False) as proxy,
    ):
        url = migrated_pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        port = free_port()
        env = (
            base_env(tmp_path / "ws", llm)
            | {
                "GATEWAY_STORAGE__URL": url,
                "GATEWAY_HTTP__PORT": str(port),
            }
            | telegram_webhook_env(telegram, SECRET)
        )
        gateway = GatewayProcess(env, tmp_path)
        try:
            # Down at start: one clear line, a live process that is not ready.
            gateway.wait_for_line("waiting for PostgreSQL")
            status, body = readyz(port)
            assert status == 503 and body["waiting_for"] == "postgresql"
            time.sleep(3.5)  # a few retries: still one line
            assert sum("waiting for PostgreSQL" in line for line in gateway.log) == 1
            assert gateway.proc.poll() is None
            proxy.restore()
            gateway.wait_ready()
            gateway.wait_readyz(port)

            hook = f"http://127.0.0.1:{port}/telegram/webhook"

            def deliver(update: dict[str, object]) -> int:
                async def go() -> int:
                    done = await telegram.deliver_webhook(update, url=hook, http_timeout=20)
                    return done.status

                return anyio.run(go)

            def answered(text: str) -> int:
                return [m.get("text") for m in telegram.sent_messages()].count(f"echo: {text}")

            first = telegram.with_update_id(telegram.user_message(601, "while up", user_id=601))
            assert deliver(first) == 200
            wait_until(lambda: answered("while up") == 1, 20, "the first message answered")

            # Down mid-run: not acknowledged, so Telegram keeps it and retries.
            proxy.cut()
            second = telegram.with_update_id(telegram.user_message(601, "while down", user_id=601))
            status = deliver(second)
            assert status >= 500, status
            wait_until(lambda: readyz(port)[0] == 503, 15, "/readyz to say 503")

            proxy.restore()
            wait_until(lambda: readyz(port)[0] == 200, 20, "/readyz 200 again")
            assert deliver(second) == 200  # Telegram's retry of the same update
            wait_until(lambda: answered("while down") == 1, 20, "the retried message answered")
            assert gateway.terminate() == 0
            assert answered("while up") == 1 and answered("while down") == 1
        finally:
            gateway.stop()
