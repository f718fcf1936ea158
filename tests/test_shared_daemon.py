"""`gateway run` in the shared mode against real PostgreSQL: Telegram messages are journaled,
answered and stored in the database, and a restarted gateway answers none of them twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until


@pytest.mark.timeout(120)
def test_telegram_turns_are_journaled_answered_and_stored_in_postgresql(
    migrated_pg_url: str, tmp_path: Path
) -> None:
    import psycopg

    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(token="555:SHARED-test") as telegram,
    ):
        env = telegram_env(tmp_path / "ws", llm, telegram) | {
            "GATEWAY_STORAGE__URL": migrated_pg_url
        }
        texts = [f"user {chat} says {n}" for chat in (701, 702) for n in range(3)]
        pushed = []
        for text in texts:
            chat = int(text.split()[1])
            pushed.append(telegram.push_update(telegram.user_message(chat, text, user_id=chat)))

        def answered() -> bool:
            sent = {m.get("text") for m in telegram.sent_messages()}
            return all(f"echo: {t}" in sent for t in texts)

        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_readyz(gateway.wait_ready())
            wait_until(answered, 30, "every message answered")
            assert gateway.terminate() == 0
        finally:
            gateway.stop()

        with psycopg.connect(migrated_pg_url) as conn:
            states = conn.execute("SELECT state, count(*) FROM gw_inbound GROUP BY 1").fetchall()
            stored = conn.execute(
                "SELECT e.body::json->'message'->>'content' FROM gw_session_entries e "
                "JOIN gw_sessions s USING (session_id) WHERE e.type = 'message' "
                "ORDER BY s.key, e.seq"
            ).fetchall()
            replicas = conn.execute("SELECT count(*) FROM gw_replicas").fetchone()
        assert states == [("done", 6)]
        said = [text for (text,) in stored]
        assert said == [x for t in texts for x in (t, f"echo: {t}")]
        assert replicas == (0,)  # a drained replica withdraws
        assert not list((tmp_path / "ws" / "sessions").glob("*.jsonl"))

        # The same messages arrive again (a new update carrying a message id already
        # answered): the shared dedupe knows them, on a fresh gateway with an empty
        # workspace, and answers none of them twice.
        before = len(telegram.sent_messages())
        for update in pushed:
            again = {k: v for k, v in update.items() if k != "update_id"}
            telegram.push_update(again)
        restarted = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / "ws2")}, tmp_path)
        try:
            restarted.wait_readyz(restarted.wait_ready())
            wait_until(lambda: not telegram.pending_updates, 20, "the updates confirmed")
            assert restarted.terminate() == 0
        finally:
            restarted.stop()
        assert len(telegram.sent_messages()) == before
