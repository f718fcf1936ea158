"""One IRC connection among replicas (real PostgreSQL, a real ngIRCd): exactly one replica
holds the nick's connection (a second would be a second nick, answering everything
again); a turn run on the other replica has its reply sent by the holder (the relay).
When the holder is killed, a standby takes the connection over within seconds and answers
what is written once the bot is back on the server: nothing twice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until
from tests.ngircd_server import IrcPerson, Ngircd, running_ngircd

pytestmark = pytest.mark.kill

ROLE = "is now the irc connection"
BOT = "replbot"


@pytest.fixture
def ngircd() -> Iterator[Ngircd]:
    with running_ngircd() as server:
        yield server


def irc_env(workspace: Path, llm: FakeOpenAI, server: Ngircd) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_CHANNELS__IRC__ENABLED": "true",
        "GATEWAY_CHANNELS__IRC__HOST": "127.0.0.1",
        "GATEWAY_CHANNELS__IRC__PORT": str(server.tls_port),
        "GATEWAY_CHANNELS__IRC__TLS_CA_FILE": str(server.ca_file),
        "GATEWAY_CHANNELS__IRC__NETWORK": "repl",
        "GATEWAY_CHANNELS__IRC__NICK": BOT,
        "GATEWAY_CHANNELS__IRC__LINE_INTERVAL_SECONDS": "0.34",
        "GATEWAY_CHANNELS__IRC__DM_POLICY": "open",
    }


def bot_lines(person: IrcPerson) -> list[str]:
    return [text for _, sender, _, text in person.received() if sender.startswith(BOT)]


def bot_is_there(server: Ngircd, watcher: IrcPerson) -> bool:
    """The bot holds its nick on the server (ISON answers with it)."""
    before = len(watcher.lines)
    watcher.send(f"ISON {BOT}")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        for line in watcher.lines[before:]:
            if " 303 " in line:
                return line.rstrip().endswith(BOT) or f" :{BOT}" in line
        time.sleep(0.05)
    return False


@pytest.mark.timeout(240)
def test_one_replica_holds_the_nick_and_a_standby_takes_it_over(
    migrated_pg_url: str, tmp_path: Path, ngircd: Ngircd
) -> None:
    with FakeOpenAI.in_thread() as llm:
        env = irc_env(tmp_path / "unused", llm, ngircd) | {"GATEWAY_STORAGE__URL": migrated_pg_url}
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:
            wait_until(lambda: any(ROLE in line for p in replicas for line in p.log), 30)
            watcher = ngircd.person("watcher")
            wait_until(lambda: bot_is_there(ngircd, watcher), 30, "the bot on the server")
            people = [ngircd.person(f"person{n}") for n in range(4)]
            first = [(p, f"before {p.nick} {n}") for n in range(2) for p in people]
            for person, text in first:
                person.say(BOT, text)
            wait_until(
                lambda: all(f"echo: {t}" in bot_lines(p) for p, t in first),
                60,
                "the first messages answered",
            )
            holders = [p for p in replicas if any(ROLE in line for line in p.log)]
            assert len(holders) == 1
            holder = holders[0]
            standby = replicas[1 - replicas.index(holder)]
            assert any("standing by" in line for line in standby.log)
            registered = ngircd.log_path.read_text(errors="replace").count(f'User "{BOT}!')
            assert registered == 1  # one connection for the fleet

            holder.kill()
            killed_at = time.monotonic()
            standby.wait_for_line(ROLE, timeout=30)
            wait_until(lambda: bot_is_there(ngircd, watcher), 60, "the standby's connection")
            took = time.monotonic() - killed_at
            second = [(p, f"after {p.nick}") for p in people]
            for person, text in second:
                person.say(BOT, text)
            wait_until(
                lambda: all(f"echo: {t}" in bot_lines(p) for p, t in second),
                60,
                "the standby to answer",
            )
            assert took < 40, f"takeover took {took:.1f}s"
            for person in people:
                got = bot_lines(person)
                mine = [t for p, t in [*first, *second] if p is person]
                assert [g.removeprefix("echo: ") for g in got] == mine  # once each, in order
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()
