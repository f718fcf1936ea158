"""One QQ event connection among replicas (real PostgreSQL): exactly one replica holds
the OneBot implementation's universal connection (it would write every event to each
one); every replica sends replies over an `/api` connection of its own. When the holder
is killed, a standby connects within seconds and reads back, through the history, what
was written meanwhile: nothing lost, nothing twice."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fakes.onebot_server import DEFAULT_TOKEN, FakeOneBot
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until

pytestmark = pytest.mark.kill

ROLE = "is now the qq websocket"
ALICE, BOB = 20001, 20002


def texts_of(fake: FakeOneBot, conversation: str | None = None) -> list[str]:
    return [
        "".join(str(s["data"].get("text", "")) for s in record.segments)
        for record in fake.bot_messages()
        if conversation is None or record.conversation == conversation
    ]


@pytest.mark.timeout(180)
def test_a_standby_takes_over_the_event_connection_when_its_holder_dies(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    with FakeOpenAI.in_thread() as llm, FakeOneBot.in_thread() as fake:
        fake.add_friend(ALICE, "Alice")
        fake.add_friend(BOB, "Bob")
        env = base_env(tmp_path / "unused", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__QQ__ENABLED": "true",
            "GATEWAY_CHANNELS__QQ__URL": fake.url.replace("http://", "ws://"),
            "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN": DEFAULT_TOKEN,
            "GATEWAY_CHANNELS__QQ__DM_POLICY": "open",
            "GATEWAY_STORAGE__URL": migrated_pg_url,
        }
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:

            def answered(texts: list[str]) -> bool:
                sent = texts_of(fake)
                return all(f"echo: {t}" in sent for t in texts)

            wait_until(lambda: any(ROLE in line for p in replicas for line in p.log), 20)
            first = [f"before {n}" for n in range(5)]
            for text in first:
                fake.user_message(ALICE, text)
            fake.user_message(BOB, "hello")
            wait_until(lambda: answered([*first, "hello"]), 30, "the first messages answered")
            holders = [p for p in replicas if any(ROLE in line for line in p.log)]
            assert len(holders) == 1
            holder = holders[0]
            standby = replicas[1 - replicas.index(holder)]
            assert fake.event_connections == 1  # one event connection for the fleet

            holder.kill()
            killed_at = time.monotonic()
            wait_until(lambda: fake.event_connections == 0, 10, "the holder's connection gone")
            second = [f"after {n}" for n in range(5)]
            for text in second:  # while no replica holds the event connection
                fake.user_message(ALICE, text)
            fake.user_message(BOB, "still there?")
            wait_until(lambda: answered([*second, "still there?"]), 40, "the standby to take over")
            took = time.monotonic() - killed_at
            standby.wait_for_line(ROLE, timeout=1)
            assert took < 20, f"takeover took {took:.1f}s"
            sent = texts_of(fake)
            for text in [*first, *second, "hello", "still there?"]:
                assert sent.count(f"echo: {text}") == 1, text
            in_order = texts_of(fake, f"private:{ALICE}")
            assert in_order == [f"echo: {t}" for t in [*first, *second]]
            wait_until(lambda: fake.event_connections == 1, 10, "one event connection left")
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()
