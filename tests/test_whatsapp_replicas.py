"""WhatsApp in the shared mode: two real `gateway run` replicas over one PostgreSQL behind
a "load balancer" that sends each delivery to either of them. A message Meta delivers to
both is answered once, and the statuses of replies one replica sent, delivered to the
other, update the same messages in `gw_whatsapp_sent`."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import pytest

from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.whatsapp_server import FakeWhatsApp
from tests.gateway_process import GatewayProcess, wait_until
from tests.test_whatsapp_kill import whatsapp_env


@pytest.mark.timeout(180)
def test_every_replica_takes_deliveries_and_answers_each_message_once(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    import psycopg

    with (
        FakeOpenAI.in_thread() as llm,
        FakeWhatsApp.in_thread(retry_delays=(0.5, 1.0, 2.0), ack_timeout=5) as fake,
    ):
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{p}/whatsapp/webhook" for p in ports]
        replicas = [
            GatewayProcess(
                whatsapp_env(tmp_path / f"ws{n}", llm, fake, port)
                | {"GATEWAY_STORAGE__URL": migrated_pg_url},
                tmp_path,
            )
            for n, port in enumerate(ports)
        ]
        try:
            for replica in replicas:
                replica.wait_readyz(replica.wait_ready())
            # Statuses go through the second replica, whoever sent the message.
            fake.webhook_url = urls[1]
            people = [f"4915100000{n:03d}" for n in range(4)]
            texts = [f"{who} says {n}" for n in range(3) for who in people]
            futures: list[concurrent.futures.Future[Any]] = []
            for n, text in enumerate(texts):
                payload = fake.text_message(text.split()[0], text)
                futures.append(fake.deliver_soon(payload, urls[n % 2]))
                if n % 3 == 0:  # Meta delivers this one to the other replica too
                    futures.append(fake.deliver_soon(payload, urls[(n + 1) % 2]))
            concurrent.futures.wait(futures, timeout=30)
            assert all(f.result().delivered for f in futures)

            def answered() -> list[str]:
                return [s.text for s in fake.sent if s.type == "text"]

            wait_until(lambda: len(answered()) >= len(texts), 30, "every message answered")

            def delivered() -> bool:
                with psycopg.connect(migrated_pg_url) as conn:
                    rows = conn.execute("SELECT status FROM gw_whatsapp_sent").fetchall()
                return len(rows) == len(texts) and {r[0] for r in rows} == {"delivered"}

            wait_until(delivered, 20, "every reply's statuses recorded")
            for replica in replicas:
                assert replica.terminate() == 0
        finally:
            for replica in replicas:
                replica.stop()
        assert sorted(answered()) == sorted(f"echo: {t}" for t in texts)  # once each
        with psycopg.connect(migrated_pg_url) as conn:
            windows = conn.execute("SELECT count(*) FROM gw_whatsapp_windows").fetchone()
        assert windows == (len(people),)
