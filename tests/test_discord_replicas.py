"""One Discord Gateway connection among replicas (real PostgreSQL): exactly one replica
holds it (Discord would send every event to each connection); the others send replies
through the HTTP API. When the holder is killed, a standby takes the connection over
within seconds and reads back what was written meanwhile: nothing lost, nothing twice."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, discord_env, wait_until

pytestmark = pytest.mark.kill

ROLE = "is now the discord gateway"


@pytest.mark.timeout(180)
def test_a_standby_takes_over_the_gateway_connection_when_its_holder_dies(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    with FakeOpenAI.in_thread() as llm, FakeDiscord.in_thread() as fake:
        alice, bob = fake.add_user("alice"), fake.add_user("bob")
        dm_a, dm_b = fake.dm_channel(alice), fake.dm_channel(bob)
        env = discord_env(tmp_path / "unused", llm, fake) | {
            "GATEWAY_STORAGE__URL": migrated_pg_url
        }
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:

            def answered(texts: list[str]) -> bool:
                sent = [m["content"] for m in fake.bot_messages()]
                return all(f"echo: {t}" in sent for t in texts)

            wait_until(lambda: any(ROLE in line for p in replicas for line in p.log), 20)
            first = [f"before {n}" for n in range(5)]
            for text in first:
                fake.user_message(dm_a, alice, text)
            fake.user_message(dm_b, bob, "hello")
            wait_until(lambda: answered([*first, "hello"]), 30, "the first messages answered")
            holders = [p for p in replicas if any(ROLE in line for line in p.log)]
            assert len(holders) == 1
            holder = holders[0]
            standby = replicas[1 - replicas.index(holder)]
            assert any("standing by" in line for line in standby.log)
            assert len(fake.identified_connections()) == 1  # one connection for the fleet

            holder.kill()
            killed_at = time.monotonic()
            second = [f"after {n}" for n in range(5)]
            for text in second:  # while no replica holds the connection
                fake.user_message(dm_a, alice, text)
            fake.user_message(dm_b, bob, "still there?")
            wait_until(lambda: answered([*second, "still there?"]), 40, "the standby to take over")
            took = time.monotonic() - killed_at
            standby.wait_for_line(ROLE, timeout=1)
            assert took < 20, f"takeover took {took:.1f}s"
            sent = [m["content"] for m in fake.bot_messages()]
            for text in [*first, *second, "hello", "still there?"]:
                assert sent.count(f"echo: {text}") == 1, text
            in_order = [m["content"] for m in fake.bot_messages(dm_a)]
            assert in_order == [f"echo: {t}" for t in [*first, *second]]
            live = [c for c in fake.connections if not c.closed and c.session is not None]
            assert len(live) == 1  # the standby's, and only that one
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()
