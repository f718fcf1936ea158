"""One memory per person: sender ids linked across channels (file and PostgreSQL stores),
the person memory scope through the agent with the real openai client against the fake
server, group memory kept out of every DM, and `gateway people` on the command line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from gateway.people.commands import cli_link, cli_unlink
from gateway.people.pg_store import PostgresPeopleStore
from gateway.people.protocol import PeopleError, PeopleStore, parse_sender_id
from gateway.people.store import FilePeopleStore
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply
from tests.test_cli_e2e import llm_env, run_gateway

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("telegram:abc", "a Telegram user id is a number"),
        ("telegram:-1001", "a Telegram user id is a number"),
        ("slack:u123", "a Slack user id looks like slack:U0123ABC"),
        ("slack:C0GENERAL", "a Slack user id looks like"),
        ("42", "write CHANNEL:USER_ID"),
        ("whatsapp:42", "CHANNEL one of discord, matrix, mattermost, qq, slack, telegram"),
        ("discord:42", "a Discord user id is a number of 16 to 20 digits"),
        ("", "write CHANNEL:USER_ID"),
    ],
)
def test_a_malformed_id_is_refused_with_what_an_id_looks_like(raw: str, says: str) -> None:
    with pytest.raises(PeopleError, match=says):
        parse_sender_id(raw)


@pytest.fixture(params=["files", "postgres"])
def open_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[Callable[[], PeopleStore]]:
    """Each call is a new process (or replica) over the same storage."""
    if request.param == "files":
        yield lambda: FilePeopleStore(tmp_path / "people.json")
        return
    from gateway.plumbing.postgres import sync_pool

    with sync_pool(request.getfixturevalue("migrated_pg_url"), max_size=2) as pool:
        pool.wait()
        yield lambda: PostgresPeopleStore(pool)


def test_links_merge_unlink_and_are_seen_by_another_process(
    open_store: Callable[[], PeopleStore],
) -> None:
    first, second = open_store(), open_store()
    assert second.person_of("telegram:42") == "telegram:42"  # before any link
    assert cli_link(first, ["telegram:42", "slack:U0ALICE"]).startswith(
        "linked as one person (slack:U0ALICE)"
    )
    assert second.person_of("telegram:42") == "slack:U0ALICE"
    # Linking a third id to either one joins the same person.
    first.link(["telegram:42", "slack:W0ALICEWORK"])
    assert second.people() == {
        "slack:U0ALICE": ["slack:U0ALICE", "slack:W0ALICEWORK", "telegram:42"]
    }
    assert cli_unlink(second, "slack:U0ALICE") == "unlinked slack:U0ALICE"
    assert first.people() == {"slack:W0ALICEWORK": ["slack:W0ALICEWORK", "telegram:42"]}
    first.unlink("telegram:42")
    assert second.people() == {}  # one id alone is nobody's link
    with pytest.raises(PeopleError, match="is not linked to anyone"):
        cli_unlink(first, "telegram:42")
    with pytest.raises(PeopleError, match="two or more ids"):
        cli_link(first, ["telegram:42"])
    with pytest.raises(PeopleError):
        cli_link(first, ["telegram:42", "slack:nope"])
    assert first.people() == {}  # a refused link stores nothing
    first.note_dm("slack:D0ALICE", "slack:U0ALICE")
    assert second.dm_owner("slack:D0ALICE") == "slack:U0ALICE"
    assert second.dm_owner("slack:C0GENERAL") is None


def message(channel: str, chat: str, sender: str, text: str, *, group: bool) -> InboundMessage:
    return InboundMessage(
        channel=channel, chat_id=chat, sender_id=sender, text=text, metadata={"is_group": group}
    )


def remember(content: str) -> Reply:
    return Reply(
        tool_calls=(FakeToolCall("remember", {"content": content, "category": "learned_fact"}),)
    )


def sent_text(fake: FakeOpenAI) -> str:
    return json.dumps(fake.chat_requests[-1].messages)


async def test_a_persons_memory_follows_them_across_dms_and_never_into_groups(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, memory__scope="person")
    gw = Gateway.build(settings)
    people = gw.agent.people
    assert people is not None
    people.link(["telegram:42", "slack:U0ALICE"])
    alice_tg = message("telegram", "42", "42", "remember my cat", group=False)
    alice_slack = message("slack", "D0ALICE", "U0ALICE", "what is my cat called?", group=False)
    bob_dm = message("telegram", "77", "77", "anything about launches?", group=False)
    group = message("telegram", "-100", "42", "remember the launch code", group=True)
    try:
        fake_openai.add(remember("Alice's cat is called Miso"))
        await gw.agent.handle(alice_tg)
        await gw.agent.handle(alice_slack)
        assert "Miso" in sent_text(fake_openai)  # Telegram fact, Slack DM: same person
        fake_openai.add(remember("the launch code is 7421"))
        await gw.agent.handle(group)
        in_group = sent_text(fake_openai)
        await gw.agent.handle(alice_slack)
        alice_after = sent_text(fake_openai)
        await gw.agent.handle(bob_dm)
        bob = sent_text(fake_openai)
        memory = gw.agent.memory
        assert memory is not None
        scopes = {
            key: memory.scope_for(key)
            for key in ("telegram:42", "slack:D0ALICE", "telegram:-100", "telegram:77")
        }
    finally:
        await gw.aclose()
    assert scopes == {
        "telegram:42": "person:slack:U0ALICE",
        "slack:D0ALICE": "person:slack:U0ALICE",
        "telegram:-100": "telegram:-100",  # a group keeps its own memory
        "telegram:77": "person:telegram:77",  # unlinked: a person of one id
    }
    # Group memory never reaches a DM, of the person who said it or anyone else; and a
    # DM's memory never reaches the group.
    assert "7421" not in alice_after and "7421" not in bob
    assert "Miso" not in in_group and "Miso" not in bob


def test_people_commands_and_their_bad_input(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread) | {"GATEWAY_MEMORY__SCOPE": "person"}

    def people(*args: str) -> Any:
        return run_gateway(["people", *args], env, tmp_path)

    linked = people("link", "telegram:42", "slack:U0ALICE")
    assert linked.returncode == 0, linked.stderr
    assert (
        linked.stdout.strip() == "linked as one person (slack:U0ALICE): slack:U0ALICE, telegram:42"
    )
    assert people("list").stdout.strip() == "slack:U0ALICE: slack:U0ALICE telegram:42"
    bad = people("link", "telegram:42", "slack:not-an-id")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().endswith("a Slack user id looks like slack:U0123ABC")
    assert len(bad.stderr.strip().splitlines()) == 1
    assert people("unlink", "telegram:42").stdout.strip() == "unlinked telegram:42"
    assert people("list").stdout.strip().startswith("No linked people yet")
    missing = people("unlink", "telegram:42")
    assert missing.returncode == 2 and "is not linked to anyone" in missing.stderr


def _link_many(path: str, worker: int, count: int, go: Any) -> None:
    store = FilePeopleStore(Path(path))
    go.wait(60)  # every process starts linking at the same moment
    for i in range(count):
        store.link([f"telegram:{worker}{i:03d}", f"slack:U{worker}X{i:03d}"])


def test_concurrent_links_from_several_processes_lose_none(tmp_path: Path) -> None:
    """Each change is a read-modify-write of people.json under its flock: processes
    linking at the same moment (operators, a gateway noting a DM) never drop one."""
    import multiprocessing

    path = tmp_path / "people.json"
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    workers = [spawn.Process(target=_link_many, args=(str(path), w, 40, go)) for w in range(1, 5)]
    for process in workers:
        process.start()
    time.sleep(3)  # let them import
    go.set()
    for process in workers:
        process.join(120)
        assert process.exitcode == 0
    people = FilePeopleStore(path).people()
    assert len(people) == 4 * 40
    assert people["slack:U1X000"] == ["slack:U1X000", "telegram:1000"]
    assert (tmp_path / "people.json.lock").exists()
