"""Slack across replicas: two `gateway run` processes share PostgreSQL, each with its own
Socket Mode connection (or its own Events API endpoint behind a load balancer). Slack sends
each event to one connection and may send its retry to the other one (or, over HTTP, the
balancer may route the retry to the other replica), even while the first delivery is still
being handled. Counted from the outside (the fake Slack's posts, the database):

- every message is answered exactly once, and stored once with one turn;
- each conversation's messages are stored in the order the user sent them.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_server import FakeSlack
from tests.gateway_process import GatewayProcess, base_env, wait_until

USERS = 6
PER_USER = 5
QUIET = 1.5  # how long "no second answer comes" is watched for


def slack_replica_env(
    workspace: Path, llm: FakeOpenAI, slack: FakeSlack, mode: str, storage_url: str
) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_STORAGE__URL": storage_url,
        "GATEWAY_CHANNELS__SLACK__ENABLED": "true",
        "GATEWAY_CHANNELS__SLACK__MODE": mode,
        "GATEWAY_CHANNELS__SLACK__BOT_TOKEN": slack.bot_token,
        "GATEWAY_CHANNELS__SLACK__APP_TOKEN": slack.app_token,
        "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET": slack.signing_secret,
        "GATEWAY_CHANNELS__SLACK__BASE_URL": slack.api_url,
        "GATEWAY_CHANNELS__SLACK__DM_POLICY": "open",
    }


def echoed(slack: FakeSlack) -> tuple[list[str], list[str]]:
    """(the texts answered, in reply order with repeats; every other reply)."""
    answered, other = [], []
    for posted in slack.posted_messages():
        text = str(posted.get("text", ""))
        (answered if text.startswith("echo: ") else other).append(text.removeprefix("echo: "))
    return answered, other


def user_id(u: int) -> str:
    return f"U0REPL{u:04d}"


def text_of(u: int, n: int) -> str:
    return f"r{u} m{n}"


async def send_socket(slack: FakeSlack, rng: random.Random) -> None:
    """Each user sends its messages one after the other (the next once the previous was
    acknowledged), all users at once. Every other message is also retried at once over
    the other connection: both replicas hold the same event at the same time."""

    async def user(u: int) -> None:
        for n in range(PER_USER):
            connections = slack.socket_numbers
            first = rng.choice(connections)
            payload = slack.dm_message(user_id(u), text_of(u, n))
            envelopes = [await slack.socket_event(payload, connection=first)]
            if n % 2 == 0:
                other = next(c for c in connections if c != first)
                envelopes.append(await slack.redeliver(envelopes[0], connection=other))
            async with asyncio.timeout(30):
                for envelope in envelopes:
                    await slack.wait_for_ack(envelope["envelope_id"])

    await asyncio.gather(*(user(u) for u in range(USERS)))


async def send_http(slack: FakeSlack, urls: list[str], rng: random.Random) -> None:
    """As `send_socket`, over the Events API: the first delivery to one replica, and
    every other message's retry (``X-Slack-Retry-Num: 1``) to the other one at once."""

    async def user(u: int) -> None:
        for n in range(PER_USER):
            first = rng.randrange(len(urls))
            payload = slack.dm_message(user_id(u), text_of(u, n))
            attempts: list[Any] = [slack.post_event(urls[first], payload)]
            if n % 2 == 0:
                other = urls[1 - first]
                attempts.append(slack.post_event(other, payload, retry_num=1))
            for delivery in await asyncio.gather(*attempts):
                assert 200 <= delivery.status < 300, delivery

    await asyncio.gather(*(user(u) for u in range(USERS)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["socket", "http"])
def test_two_replicas_answer_each_slack_event_once_in_order(
    migrated_pg_url: str, tmp_path: Path, mode: str
) -> None:
    import psycopg

    rng = random.Random(7)
    sent = [text_of(u, n) for u in range(USERS) for n in range(PER_USER)]
    with FakeOpenAI.in_thread() as llm, FakeSlack.in_thread() as slack:
        env = slack_replica_env(tmp_path / "ws", llm, slack, mode, migrated_pg_url)
        replicas: list[GatewayProcess] = []
        try:
            ports = []
            for i in range(2):
                proc = GatewayProcess(
                    env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path
                )
                replicas.append(proc)
                port = proc.wait_ready()
                proc.wait_readyz(port)
                ports.append(port)
            if mode == "socket":
                wait_until(
                    lambda: len(slack.socket_numbers) == 2, 30, "two Socket Mode connections"
                )
                asyncio.run(send_socket(slack, rng))
                # Both replicas took events in (each acknowledges on its own connection).
                assert {ack.connection for ack in slack.acks} == set(slack.socket_numbers)
            else:
                urls = [f"http://127.0.0.1:{port}/slack/events" for port in ports]
                asyncio.run(send_http(slack, urls, rng))

            def replies() -> list[str]:
                return echoed(slack)[0]

            try:
                wait_until(lambda: set(replies()) >= set(sent), 60, "every message answered")
            except AssertionError:
                missing = sorted(set(sent) - set(replies()))
                logs = "\n".join(line for proc in replicas for line in proc.log[-60:])
                raise AssertionError(f"not answered: {missing}\n{logs}") from None
            # A second answer would come from the replica that lost the race: wait for it.
            asyncio.run(asyncio.sleep(QUIET))
            answered, other = echoed(slack)
            for proc in replicas:
                assert proc.terminate(60) == 0
        finally:
            for proc in replicas:
                proc.stop()

    assert other == []
    twice = {text: n for text, n in Counter(answered).items() if n > 1}
    assert twice == {}, f"answered more than once: {twice}"
    assert sorted(answered) == sorted(sent)

    with psycopg.connect(migrated_pg_url) as conn:
        rows = conn.execute(
            "SELECT s.key, e.body::json->'message'->>'role', e.body::json->'message'->>'content'"
            " FROM gw_session_entries e JOIN gw_sessions s USING (session_id)"
            " WHERE e.type = 'message' AND s.key LIKE 'slack:%' ORDER BY s.key, e.seq"
        ).fetchall()
        states = conn.execute("SELECT state, count(*) FROM gw_inbound GROUP BY 1").fetchall()
    by_session: dict[str, list[tuple[str, str]]] = {}
    for key, role, content in rows:
        by_session.setdefault(key, []).append((role, content))
    assert len(by_session) == USERS
    for turns in by_session.values():
        user = turns[0][1].split()[0]
        expected = [text_of(int(user[1:]), n) for n in range(PER_USER)]
        # One user entry and one answer per message, in the order the user sent them.
        assert turns == [x for t in expected for x in (("user", t), ("assistant", f"echo: {t}"))]
    assert states == [("done", len(sent))]
