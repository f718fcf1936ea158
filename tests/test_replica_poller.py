"""One Telegram poller among replicas (real PostgreSQL): in polling mode exactly one
replica calls getUpdates (Telegram allows one consumer per bot: a second one is a 409
conflict); when it is killed, a standby takes over within seconds and nothing is lost."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until

pytestmark = pytest.mark.kill


@pytest.mark.timeout(180)
def test_a_standby_takes_over_polling_when_the_poller_dies(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(token="888:POLLER-test") as telegram,
    ):
        env = telegram_env(tmp_path / "unused", llm, telegram) | {
            "GATEWAY_STORAGE__URL": migrated_pg_url
        }
        gateways = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            gateways.append(proc)
        try:

            def answered(texts: list[str]) -> bool:
                sent = {m.get("text") for m in telegram.sent_messages()}
                return all(f"echo: {t}" in sent for t in texts)

            first = [f"before {n}" for n in range(5)]
            for text in first:
                telegram.push_update(telegram.user_message(501, text, user_id=501))
            wait_until(lambda: answered(first), 30, "the first messages answered")
            leaders = [g for g in gateways if any("is now the telegram poller" in x for x in g.log)]
            assert len(leaders) == 1
            leader = leaders[0]
            standby = gateways[1 - gateways.index(leader)]
            assert any("standing by" in line for line in standby.log)

            leader.kill()
            killed_at = time.monotonic()
            second = [f"after {n}" for n in range(5)]
            for text in second:
                telegram.push_update(telegram.user_message(502, text, user_id=502))
            wait_until(lambda: answered(second), 30, "the standby to take over")
            took = time.monotonic() - killed_at
            standby.wait_for_line("is now the telegram poller", timeout=1)
            assert took < 10, f"takeover took {took:.1f}s"
            conflicts = [p for p in telegram.polls if "409" in str(p.outcome)]
            assert not conflicts, conflicts[:3]
            sent = [m.get("text") for m in telegram.sent_messages()]
            for text in first + second:
                assert sent.count(f"echo: {text}") == 1, text
            assert standby.terminate() == 0
        finally:
            for proc in gateways:
                proc.stop()
