"""`gateway run` in the shared mode against real PostgreSQL: Telegram messages are journaled,
answered and stored in the database, and a restarted gateway answers none of them twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


@pytest.mark.anyio
async def test_an_api_message_another_replica_is_taking_in_is_answered_503_not_null(
    make_settings: Any, fake_openai: Any, migrated_pg_url: str, tmp_path: Path
) -> None:
    """A client's retry that reaches a replica while another one holds the message's claim
    (not journaled: it may be a few milliseconds away, or dead) is told to send it again
    (503 + Retry-After), as a webhook is: "no reply" would tell it the message was handled,
    and it would be lost. Sent again once the claim is gone, it is answered."""
    import aiohttp
    import anyio

    from gateway.daemon import Daemon, Gateway
    from gateway.journal.pg_store import PostgresDedupeStore
    from gateway.messages import InboundMessage

    token = "shared-api-token-0123456789abcdef"
    settings = make_settings(
        fake_openai, http__port=0, http__token=token, storage__url=migrated_pg_url
    )
    other = PostgresDedupeStore(migrated_pg_url, claim_wait=0.2)
    held = InboundMessage(
        channel="api", chat_id="held", sender_id="api", text="x", message_id="m-1"
    )
    from gateway.journal.protocol import dedupe_key

    key = dedupe_key(held)
    assert key is not None
    daemon = Daemon(Gateway.build(settings), interactive=False)
    body = {"session": "held", "text": "are you there?", "id": "m-1"}
    headers = {"Authorization": f"Bearer {token}"}
    try:
        assert await other.seen_or_add(key) is False  # claimed elsewhere, not journaled
        async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
            port = await tg.start(daemon.run)
            url = f"http://127.0.0.1:{port}/api/chat"
            async with http.post(url, json=body, headers=headers) as resp:
                refused = (resp.status, resp.headers.get("Retry-After"), await resp.json())
            await other.release(key)  # the other replica gave the claim up
            async with http.post(url, json=body, headers=headers) as resp:
                answered = (resp.status, await resp.json())
            daemon.stop()
    finally:
        await other.aclose()
    assert refused[:2] == (503, "1") and "send it again" in refused[2]["error"]
    assert answered == (
        200,
        {"session": "api:held", "reply": "echo: are you there?", "error": False},
    )


@pytest.mark.anyio
async def test_a_stop_taken_in_by_another_replica_stops_the_turn_where_it_runs(
    make_settings: Any, fake_openai: Any, migrated_pg_url: str, tmp_path: Path
) -> None:
    """Two replicas. A turn runs on a (a slow model answer); the sender's /stop reaches
    b, which runs no turn of that conversation: b passes the stop to a (the session's
    lease holder), a's turn ends at once, and the sender is told it is being stopped."""
    import time

    import aiohttp
    import anyio

    from gateway.agent.loop import STOP_IDLE_TEXT, STOP_PASSED_TEXT
    from gateway.daemon import Daemon, Gateway
    from tests.fakes.openai_server import Reply

    token = "shared-api-token-0123456789abcdef"
    common = {"http__port": 0, "http__token": token, "storage__url": migrated_pg_url}
    a = Daemon(Gateway.build(make_settings(fake_openai, **common)), interactive=False)
    b_settings = make_settings(fake_openai, workspace=tmp_path / "ws-b", **common)
    b = Daemon(Gateway.build(b_settings), interactive=False)
    fake_openai.add(Reply(text="a long answer", delay=30.0))
    headers = {"Authorization": f"Bearer {token}"}
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        url_a = f"http://127.0.0.1:{await tg.start(a.run)}/api/chat"
        url_b = f"http://127.0.0.1:{await tg.start(b.run)}/api/chat"
        answers: list[tuple[float, dict[str, Any]]] = []

        async def ask_a() -> None:
            body = {"session": "slow", "text": "tell me everything"}
            async with http.post(url_a, json=body, headers=headers) as resp:
                answers.append((time.monotonic(), await resp.json()))

        tg.start_soon(ask_a)
        with anyio.fail_after(10):
            while "api:slow" not in a.gateway.agent._running:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        stopped_at = time.monotonic()
        body = {"session": "slow", "text": "/stop"}
        async with http.post(url_b, json=body, headers=headers) as resp:
            told = await resp.json()
        with anyio.fail_after(10):
            while not answers:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        # Nothing runs for another conversation: b says so and passes nothing on.
        async with http.post(
            url_b, json={"session": "idle", "text": "/stop"}, headers=headers
        ) as resp:
            idle = await resp.json()
        a.stop()
        b.stop()
    assert told["reply"] == STOP_PASSED_TEXT
    assert answers[0][0] - stopped_at < 5  # long before the model's 30 s answer
    assert answers[0][1]["reply"] != "a long answer"
    assert idle["reply"] == STOP_IDLE_TEXT


@pytest.mark.anyio
async def test_every_model_call_of_a_shared_turn_is_in_the_ledger_when_it_answers(
    make_settings: Any, fake_openai: Any, migrated_pg_url: str
) -> None:
    """The shared mode writes a turn's usage in the statement of its reply's append: by
    the time `/api/chat` answers, the call is in `gw_usage`, once per call."""
    import aiohttp
    import anyio
    import psycopg

    from gateway.daemon import Daemon, Gateway

    token = "shared-api-token-0123456789abcdef"
    settings = make_settings(
        fake_openai,
        http__port=0,
        http__token=token,
        storage__url=migrated_pg_url,
    )
    daemon = Daemon(Gateway.build(settings), interactive=False)
    headers = {"Authorization": f"Bearer {token}"}
    seen: list[tuple[int, int]] = []
    async with anyio.create_task_group() as tg, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{await tg.start(daemon.run)}/api/chat"
        for n in range(3):
            body = {"session": "metered", "text": f"question {n}"}
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 200
            with psycopg.connect(migrated_pg_url) as conn:
                row = conn.execute(
                    "SELECT calls, prompt_tokens FROM gw_usage WHERE session_key = 'api:metered'"
                ).fetchone()
            seen.append((int(row[0]), int(row[1])) if row else (0, 0))
        daemon.stop()
    assert [calls for calls, _ in seen] == [1, 2, 3]
    assert seen[0][1] > 0 and seen[2][1] > seen[1][1] > seen[0][1]
