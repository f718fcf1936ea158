"""Kill tests of the Teams webhook's side of the promise, with a real `gateway run` and the
fake Teams: Teams sends an activity that got no 200 once more, and then never, so what
the kit cannot run for Teams (its kill scenarios write while the gateway is down, which
Teams would not deliver) is checked here at the moments Teams does cover.

- A kill between the journal and the 200 (the failpoint `teams.before_ack`): Teams, without
  its 200, sends the activity again to the next gateway, which answers it once, from the
  journal; the message is stored once.
- A gateway SIGKILLed while people write, and back before Teams' retry: every message Teams
  considers delivered is answered, at most once more per kill, and stored once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.teams_server import APP_ID, APP_PASSWORD, FakeTeams
from tests.gateway_process import base_env
from tests.test_kill_delivery import TOKEN, Gateways, session_entries

pytestmark = pytest.mark.kill


def teams_env(workspace: Path, llm: FakeOpenAI, fake: FakeTeams, port: int) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": str(port),  # fixed: Teams posts to the messaging endpoint
        "GATEWAY_CHANNELS__TEAMS__ENABLED": "true",
        "GATEWAY_CHANNELS__TEAMS__APP_ID": APP_ID,
        "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD": APP_PASSWORD,
        "GATEWAY_CHANNELS__TEAMS__OPENID_METADATA_URL": fake.openid_metadata_url,
        "GATEWAY_CHANNELS__TEAMS__TOKEN_URL": fake.token_url,
        "GATEWAY_CHANNELS__TEAMS__DM_POLICY": "open",
    }


def answers(fake: FakeTeams) -> list[str]:
    return [t for post in fake.posts() for t in TOKEN.findall(post.text)]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(0.1)


@pytest.mark.timeout(180)
def test_a_kill_between_the_journal_and_the_200_is_answered_once_after_teams_retry(
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "ws"
    port = free_port()
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTeams.in_thread(ack_timeout=3.0, retry_delay=8.0) as fake,
    ):
        fake.bot_url = f"http://127.0.0.1:{port}/api/messages"
        env = teams_env(workspace, llm, fake, port)
        run = Gateways(env | {"GATEWAY_FAILPOINTS": "teams.before_ack=sigstop"}, tmp_path)
        try:
            run.start()
            ada = fake.add_person("Ada")
            chat = fake.personal_chat(ada)
            first = fake.deliver_soon(fake.message(ada, chat, "u000 m0001 hello"))
            assert run.current is not None
            run.current.wait_logged("failpoint teams.before_ack reached", timeout=30)
            run.kill()
            run.env = env
            run.start()  # up before Teams' one retry
            delivery = first.result(timeout=30)
            assert [a.failure is None for a in delivery.attempts] == [False, True]
            fake.deliver_soon(fake.message(ada, chat, "u000 m0002 again")).result(timeout=30)
            wait_for(lambda: len(answers(fake)) >= 2, 60, "both answered")
            time.sleep(1.5)  # an answer that should not come
            run.terminate()
        finally:
            run.stop()
        assert answers(fake) == ["u000 m0001", "u000 m0002"]
        user, assistant = session_entries(workspace / "sessions")
        assert user["u000 m0001"] == 1 and assistant["u000 m0001"] == 1
        assert run.exit_code == 0


@pytest.mark.timeout(240)
def test_kills_while_people_write_lose_nothing_teams_handed_over(tmp_path: Path) -> None:
    """Eight people write 48 messages at about 8 a second; the gateway is SIGKILLed twice
    and started again at once (Teams retries each activity once, 4 s later). Every
    message Teams delivered is answered, stored once, at most once more per kill."""
    workspace = tmp_path / "ws"
    port = free_port()
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTeams.in_thread(ack_timeout=3.0, retry_delay=4.0) as fake,
    ):
        fake.bot_url = f"http://127.0.0.1:{port}/api/messages"
        run = Gateways(teams_env(workspace, llm, fake, port), tmp_path)
        people = [fake.add_person(f"P{n}") for n in range(8)]
        chats = [fake.personal_chat(p) for p in people]
        futures = []
        try:
            run.start()
            for n in range(48):
                user = n % 8
                text = f"u{user:03d} m{n:04d}"
                futures.append(fake.deliver_soon(fake.message(people[user], chats[user], text)))
                time.sleep(0.125)
                if n in (15, 31):
                    run.kill()
                    run.start()
            deliveries = [f.result(timeout=60) for f in futures]
            delivered = {
                TOKEN.findall(str(d.activity["text"]))[0] for d in deliveries if d.delivered
            }
            wait_for(lambda: delivered <= set(answers(fake)), 90, "every delivered message")
            time.sleep(1.5)
            run.terminate()
        finally:
            run.stop()
        got = answers(fake)
        user, _ = session_entries(workspace / "sessions")
        assert delivered <= set(got)
        assert all(user[token] <= 1 for token in user)
        assert all(got.count(token) <= 1 + run.kills for token in set(got))
        assert len(got) - len(set(got)) <= run.kills * 8
        assert run.exit_code == 0
        # What Teams dropped (both attempts met a dead gateway) is Teams' loss, not ours.
        dropped = [d for d in deliveries if d.dropped]
        assert len(dropped) + len(delivered) == 48
