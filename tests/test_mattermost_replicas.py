"""One Mattermost WebSocket among replicas (real PostgreSQL): exactly one replica holds it
(Mattermost would send every event to each connection); the others send replies through
the REST API. When the holder is killed, a standby takes the WebSocket over within
seconds and reads back what was written meanwhile: nothing lost, nothing twice."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fakes.mattermost_server import FakeMattermost
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until

pytestmark = pytest.mark.kill

ROLE = "is now the mattermost websocket"


@pytest.mark.timeout(180)
def test_a_standby_takes_over_the_websocket_when_its_holder_dies(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    with FakeOpenAI.in_thread() as llm, FakeMattermost.in_thread() as fake:
        alice, bob = (str(fake.add_user(name)["id"]) for name in ("alice", "bob"))
        dm_a = str(fake.dm_channel(alice, fake.bot_id)["id"])
        dm_b = str(fake.dm_channel(bob, fake.bot_id)["id"])
        env = base_env(tmp_path / "unused", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__MATTERMOST__ENABLED": "true",
            "GATEWAY_CHANNELS__MATTERMOST__URL": fake.url,
            "GATEWAY_CHANNELS__MATTERMOST__TOKEN": fake.bot_token,
            "GATEWAY_CHANNELS__MATTERMOST__DM_POLICY": "open",
            "GATEWAY_STORAGE__URL": migrated_pg_url,
        }
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:

            def answered(texts: list[str]) -> bool:
                sent = [p["message"] for p in fake.bot_posts()]
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
            assert fake.connections == 1  # one WebSocket for the fleet

            holder.kill()
            killed_at = time.monotonic()
            second = [f"after {n}" for n in range(5)]
            for text in second:  # while no replica holds the WebSocket
                fake.user_message(dm_a, alice, text)
            fake.user_message(dm_b, bob, "still there?")
            wait_until(lambda: answered([*second, "still there?"]), 40, "the standby to take over")
            took = time.monotonic() - killed_at
            standby.wait_for_line(ROLE, timeout=1)
            assert took < 20, f"takeover took {took:.1f}s"
            sent = [p["message"] for p in fake.bot_posts()]
            for text in [*first, *second, "hello", "still there?"]:
                assert sent.count(f"echo: {text}") == 1, text
            in_order = [p["message"] for p in fake.bot_posts() if p["channel_id"] == dm_a]
            assert in_order == [f"echo: {t}" for t in [*first, *second]]
            wait_until(lambda: fake.connections == 1, 10, "one WebSocket left")
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()
