"""Kill tests of the delivery promise on Discord, whose Gateway confirms nothing and
replays nothing to a new process: the real `gateway run` against the fake Discord
(which keeps Discord's rules: a new session gets no events from before it, only the
HTTP API's history has them) is SIGKILLed while people write, kept down while they
go on writing, and restarted. Every message must be answered once after the restart
(the backfill), stored once, in order per conversation.

Counted from the outside as in tests/test_kill_delivery.py (whose counting this
reuses): the session files of the workspace and the messages the fake Discord holds.
Each scenario prints ``KILL-DELIVERY discord-...: sent=... lost=... stored_twice=...``;
``KILL_SEED`` and ``KILL_SCALE`` work as there.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pytest

from tests.fakes.discord_server import FakeDiscord
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import base_env, wait_until
from tests.test_kill_delivery import (  # noqa: F401 (gateways and report are fixtures)
    SEED,
    TOKEN,
    Gateways,
    Message,
    Tally,
    gateways,
    kill_schedule,
    plan_messages,
    pushing,
    report,
    scaled,
    session_entries,
    settle,
    slow_echo,
)

pytestmark = pytest.mark.kill


class World:
    """The fake Discord's people and places: user n writes in its own DM, except the
    last `in_servers` users, who each mention the bot in a server channel of their own
    (so every user's messages form one conversation, whose order is checked)."""

    def __init__(self, fake: FakeDiscord, users: int, in_servers: int) -> None:
        self.fake = fake
        guild = fake.add_guild("Kill test")
        self.people = [fake.add_user(f"u{n:03d}") for n in range(users)]
        first_server_user = users - in_servers
        self.places = [
            fake.dm_channel(person)
            if n < first_server_user
            else fake.add_text_channel(guild, f"room-{n:03d}")
            for n, person in enumerate(self.people)
        ]
        self.in_server = [n >= first_server_user for n in range(users)]

    def send(self, message: Message) -> None:
        person, place = self.people[message.user], self.places[message.user]
        if self.in_server[message.user]:
            bot = self.fake.bot_id
            self.fake.user_message(place, person, f"<@{bot}> {message.text}", mentions=[bot])
        else:
            self.fake.user_message(place, person, message.text)

    def replies(self) -> tuple[list[str], list[str]]:
        """(message texts answered, in the order the replies were made, with repeats;
        every other reply)."""
        return echoed(m["content"] for m in self.fake.bot_messages())


def echoed(texts: Iterable[str]) -> tuple[list[str], list[str]]:
    """The fake model echoes what it was asked, after the speaker's name in a server."""
    answered, other = [], []
    for text in texts:
        found = TOKEN.search(text) if text.startswith("echo: ") else None
        if found:
            answered.append(found.group())
        else:
            other.append(text)
    return answered, other


def discord_env(workspace: Path, llm: FakeOpenAI, fake: FakeDiscord) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_CHANNELS__DISCORD__ENABLED": "true",
        "GATEWAY_CHANNELS__DISCORD__TOKEN": fake.token,
        "GATEWAY_CHANNELS__DISCORD__API_URL": fake.api_url,
        "GATEWAY_CHANNELS__DISCORD__GATEWAY_URL": fake.gateway_url,
        "GATEWAY_CHANNELS__DISCORD__DM_POLICY": "open",
        "GATEWAY_CHANNELS__DISCORD__GROUP_POLICY": "open",
    }


def progress_of(world: World, sent: Sequence[Message]) -> Callable[[], tuple[bool, int, bool]]:
    wanted = {m.text for m in sent}

    def progress() -> tuple[bool, int, bool]:
        answered, _ = world.replies()
        return wanted <= set(answered), len(answered), False

    return progress


def say_repeats(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """How many replies the restarts sent again that Discord recognized by their nonce
    (and so did not post twice): printed after the scenario's summary."""
    with capsys.disabled():
        repeats = world.fake.nonce_repeats
        print(f"KILL-DELIVERY discord: nonce_repeats={repeats} (replies sent again, not posted)")


def tally_of(
    scenario: str,
    world: World,
    sent: Sequence[Message],
    workspace: Path,
    run: Gateways,
    started: float,
) -> Tally:
    user, assistant = session_entries(workspace / "sessions")
    answered, other = world.replies()
    fake = world.fake
    record = [
        f"connection {c.number} {c.path} identified={c.identified} resumed={c.resumed} "
        f"closed_by={c.closed_by!r}"
        for c in fake.connections
    ] + [f"{c.at:.3f} {c.method} {c.status}" for c in fake.calls]
    return Tally(
        scenario=scenario,
        logs=run.save_logs(workspace.parent / "logs", record),
        sent=sent,
        user_entries=user,
        assistant_entries=assistant,
        reply_order=[(text,) for text in answered],  # one message per reply
        other_replies=other,
        kills=run.kills,
        seconds=time.monotonic() - started,
        exit_code=run.exit_code,
    )


def introduce(world: World, run: Gateways, count: int) -> list[Message]:
    """Everyone writes once while the gateway is up, and is answered: a DM the bot
    never saw cannot be found after a crash (Discord lists no DM channels to a bot)."""
    intro = [Message(n, n) for n in range(count)]
    for message in intro:
        world.send(message)
    wanted = {m.text for m in intro}
    try:
        wait_until(lambda: wanted <= set(world.replies()[0]), 60, "everyone's first answer")
    except AssertionError:
        missing = wanted - set(world.replies()[0])
        log = "".join(run.current.log[-60:]) if run.current else ""
        raise AssertionError(f"{len(missing)} unanswered: {sorted(missing)[:5]}\n{log}") from None
    return intro


@pytest.mark.timeout(420)
def test_discord_backlog_written_while_down_survives_kills_right_after_start(
    tmp_path: Path,
    gateways: Callable[[dict[str, str]], Gateways],  # noqa: F811 (the imported fixture)
    report: Callable[[Tally], None],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """30 people have talked to the bot; the gateway is SIGKILLed, and 300 messages
    arrive while it is down (no session will ever replay them). It is then started and
    SIGKILLed 0-300 ms after it is ready, three times, while it reads them back, and
    finally left to finish: each of the 300 is answered once, in order."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    users = scaled(30)
    with (
        FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm,
        FakeDiscord.in_thread() as fake,
    ):
        world = World(fake, users, in_servers=max(1, users // 6))
        run = gateways(discord_env(workspace, llm, fake))
        run.start()
        started = time.monotonic()
        intro = introduce(world, run, users)
        run.kill()
        backlog = [
            Message(m.user, m.number + users) for m in plan_messages(scaled(300), users, rng)
        ]
        for message in backlog:
            world.send(message)
        for _ in range(3):
            run.start()
            time.sleep(rng.uniform(0.0, 0.3))
            run.kill()
        run.start()
        sent = intro + backlog
        settle(progress_of(world, sent))
        run.terminate()
        tally = tally_of("discord-backlog", world, sent, workspace, run, started)
    report(tally)
    say_repeats(world, capsys)
    tally.check_promise()


@pytest.mark.timeout(600)
def test_discord_traffic_survives_kills_and_downtime_while_it_flows(
    tmp_path: Path,
    gateways: Callable[[dict[str, str]], Gateways],  # noqa: F811 (the imported fixture)
    report: Callable[[Tally], None],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    """60 people write about 12 messages a second while the gateway is SIGKILLed four
    times at random moments (turns in flight, messages on their way from the Gateway,
    positions not saved yet) and kept down 1-3 s each time while they go on writing;
    after each restart the backfill brings what the lost sessions never delivered."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    users, count, rate, kills = scaled(60), scaled(600), 12.0, 4
    with (
        FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm,
        FakeDiscord.in_thread() as fake,
    ):
        world = World(fake, users, in_servers=max(1, users // 6))
        run = gateways(discord_env(workspace, llm, fake))
        run.start()
        started = time.monotonic()
        intro = introduce(world, run, users)
        traffic = [Message(m.user, m.number + users) for m in plan_messages(count, users, rng)]
        with pushing(traffic, rate, world.send) as seconds:
            for offset in kill_schedule(kills, seconds, rng):
                run.sleep_until_due(started + offset, min_up=2.0)
                run.kill()
                time.sleep(rng.uniform(1.0, 3.0))  # down: people go on writing
                run.start()
        sent = intro + traffic
        settle(progress_of(world, sent))
        run.terminate()
        tally = tally_of("discord-traffic", world, sent, workspace, run, started)
    report(tally)
    say_repeats(world, capsys)
    tally.check_promise()
