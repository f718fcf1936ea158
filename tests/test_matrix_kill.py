"""The Matrix kill tests of the delivery promise (docs/delivery.md) that the conformance
kit does not cover: the real `gateway run` syncs from a real Synapse (tests/synapse_server.py)
while test users write to it, and is SIGKILLed at the worst moments, or while it holds the
"matrix sync" role among replicas.

The kit runs the promise's shapes on Matrix (tests/conformance/test_matrix_conformance.py,
over the same Synapse): DMs, groups, threads, backlogs written while the gateway was down,
and SIGKILL mid-batch. What stays here, and why the kit cannot do it:

- kills at the failpoints just before and just after a batch's since token is stored
  (`matrix.before_cursor`, `matrix.after_cursor`): the worst moments of Matrix's own
  confirmation, which a platform-blind kit cannot name;
- the same kills in end-to-end encrypted rooms, users writing from encrypting clients
  (tests/matrix_peer.py): the device's crypto state must be durable across a kill, and
  the kit's driver plays people with plain clients;
- a standby replica taking the sync role, and the device's keys, over from PostgreSQL:
  the kit runs one gateway on one workspace.

Deleted, for the kit does it: the test of 300 messages from 20 users with three random
kills while they flow. The kit's `kill_mid_batch_loses_nothing_and_stores_nothing_twice`
replaces it (four people, two kills while turns are in flight, messages written while
the gateway is down; `--kit-scale=10` writes 320) and asserts at least as much: nothing
lost, stored twice, unanswered or run by the model twice; each conversation in order; at
most one repeat per message and per conversation per kill (four conversations: at most
four per kill, where the old test allowed eight); no post that answers no message, none
in the wrong room, no ping; the last gateway exits 0 on SIGTERM.

Counted from the outside, as tests/test_kill_delivery.py counts Telegram and Slack: the
user and assistant entries in the session files, and the bot's messages in every room as
Synapse holds them (`/messages`). The summary lines (``KILL-DELIVERY matrix-confirm: ...``)
print past pytest's capture with lost / stored twice / answered twice / order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from channels.matrix.channel import UNREADABLE_NOTICE
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until
from tests.matrix_peer import PeerThread, start_peer
from tests.synapse_server import MatrixUser, Synapse
from tests.test_kill_delivery import (
    SEED,
    Gateways,
    Message,
    Tally,
    echoed,
    plan_messages,
    pushing,
    scaled,
    session_entries,
    settle,
    slow_echo,
)

pytestmark = pytest.mark.kill


def matrix_env(
    workspace: Path, llm: FakeOpenAI, synapse: Synapse, bot: MatrixUser
) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": "0",
        "GATEWAY_CHANNELS__MATRIX__ENABLED": "true",
        "GATEWAY_CHANNELS__MATRIX__HOMESERVER": synapse.url,
        "GATEWAY_CHANNELS__MATRIX__USER_ID": bot.user_id,
        "GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN": bot.access_token,
        "GATEWAY_CHANNELS__MATRIX__SYNC_TIMEOUT": "1",
        "GATEWAY_CHANNELS__MATRIX__DM_POLICY": "open",
    }


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Gateways]]:
    made: list[Gateways] = []

    def make(env: dict[str, str]) -> Gateways:
        made.append(Gateways(env, tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.stop()


class Rooms:
    """One DM room per test user with the bot, and what the bot said in each."""

    def __init__(self, synapse: Synapse, bot: MatrixUser, users: list[MatrixUser]) -> None:
        self.synapse = synapse
        self.bot = bot
        self.users = users
        self.rooms = [synapse.create_room(u, invite=[bot.user_id], direct=True) for u in users]
        self._last_poll = 0.0
        self._last: tuple[bool, int, bool] = (False, -1, True)

    def wait_joined(self, timeout: float = 60) -> None:
        for user, room in zip(self.users, self.rooms, strict=True):
            self.synapse.wait_for(
                lambda u=user, r=room: self.synapse.members(u, r).get(self.bot.user_id) == "join",
                timeout,
            )

    def send(self, message: Message) -> None:
        self.synapse.send(self.users[message.user], self.rooms[message.user], message.text)

    def bot_texts(self) -> list[str]:
        """The bot's messages, room by room, each room's in the order Synapse keeps."""
        texts: list[str] = []
        for user, room in zip(self.users, self.rooms, strict=True):
            for event in self.synapse.messages(user, room):
                if event["sender"] == self.bot.user_id:
                    texts.append(str(event["content"].get("body", "")))
        return texts

    def progress(self, sent: list[Message]) -> Callable[[], tuple[bool, int, bool]]:
        wanted = {m.text for m in sent}

        def check() -> tuple[bool, int, bool]:
            # Reading every room costs a request each: at most once a second.
            if time.monotonic() - self._last_poll >= 1.0:
                self._last_poll = time.monotonic()
                texts = self.bot_texts()
                answered, _ = echoed(texts)
                self._last = (wanted <= set(answered), len(texts), False)
            return self._last

        return check


def stopped(pid: int) -> bool:
    """Has process `pid` stopped itself (SIGSTOP at a failpoint)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state == "T"


@pytest.mark.timeout(420)
def test_matrix_kills_just_before_and_just_after_the_token_is_stored(
    tmp_path: Path,
    synapse: Synapse,
    runs: Callable[[dict[str, str]], Gateways],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worst moments, made deterministic with failpoints: the gateway stops itself
    right after a batch's messages are journaled but before its since token is stored
    (the batch comes again: nothing may be stored twice), or right after the token is
    stored (nothing of the batch may be lost), and is SIGKILLed there; six times,
    alternating, while 120 messages from 10 users flow (30 s)."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    # Four a second: the messages must still be flowing at the sixth start (a failpoint
    # is reached only by a sync that brings some), however slowly a loaded machine
    # starts the gateways.
    count, rate = scaled(120), 4.0
    bot = synapse.register()
    users = [synapse.register() for _ in range(scaled(10))]
    sent = plan_messages(count, len(users), rng)
    points = ["matrix.before_cursor", "matrix.after_cursor"] * 3
    with FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm:
        env = matrix_env(workspace, llm, synapse, bot)
        run = runs(env | {"GATEWAY_FAILPOINTS": f"{points[0]}=sigstop"})
        process = run.start()  # joining the rooms takes no message: no failpoint yet
        rooms = Rooms(synapse, bot, users)
        rooms.wait_joined()
        started = time.monotonic()
        with pushing(sent, rate, rooms.send):
            for n, point in enumerate(points):
                if n:
                    run.env = env | {"GATEWAY_FAILPOINTS": f"{point}=sigstop"}
                    process = run.launch()  # it may stop itself before /readyz answers
                deadline = time.monotonic() + 40
                while not stopped(process.proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert stopped(process.proc.pid), f"{point} was never reached"
                run.kill()
            run.env = env
            run.start()
        settle(rooms.progress(sent))
        run.terminate()
        user_entries, assistant_entries = session_entries(workspace / "sessions")
        answered, other = echoed(rooms.bot_texts())
        tally = Tally(
            scenario="matrix-confirm",
            logs=run.save_logs(tmp_path / "logs", []),
            sent=sent,
            user_entries=user_entries,
            assistant_entries=assistant_entries,
            reply_order=answered,
            other_replies=other,
            kills=run.kills,
            seconds=time.monotonic() - started,
            exit_code=run.exit_code,
        )
    with capsys.disabled():
        print(f"\n{tally.summary()}")
    tally.check_promise()


@pytest.mark.timeout(180)
def test_one_replica_syncs_and_a_standby_takes_over_from_the_stored_token(
    migrated_pg_url: str, tmp_path: Path, synapse: Synapse
) -> None:
    """Shared mode: two replicas, one holds the "matrix sync" role and syncs (two would
    answer every message twice); when it is SIGKILLed, the standby takes the role, starts
    from the since token the first one stored in PostgreSQL, and answers what was sent
    meanwhile, each message once. (A second conversation: the first one's session lease
    stays with the dead replica for the lease time, docs/scaling.md.)"""
    import psycopg

    bot = synapse.register()
    alice, bob = synapse.register(), synapse.register()
    with FakeOpenAI.in_thread() as llm:
        env = matrix_env(tmp_path / "unused", llm, synapse, bot) | {
            "GATEWAY_STORAGE__URL": migrated_pg_url
        }
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:
            room = synapse.create_room(alice, invite=[bot.user_id], direct=True)
            other = synapse.create_room(bob, invite=[bot.user_id], direct=True)
            synapse.wait_for(lambda: synapse.members(alice, room).get(bot.user_id) == "join")
            synapse.wait_for(lambda: synapse.members(bob, other).get(bot.user_id) == "join")

            def said() -> list[str]:
                return [
                    e["content"].get("body")
                    for user, where in ((alice, room), (bob, other))
                    for e in synapse.messages(user, where)
                    if e["sender"] == bot.user_id
                ]

            def answered(texts: list[str]) -> bool:
                replies = said()
                return all(f"echo: {t}" in replies for t in texts)

            first = [f"before {n}" for n in range(5)]
            for text in first:
                synapse.send(alice, room, text)
            wait_until(lambda: answered(first), 30, "the first messages answered")
            leaders = [p for p in replicas if any("is now the matrix sync" in x for x in p.log)]
            assert len(leaders) == 1
            leader = leaders[0]
            standby = replicas[1 - replicas.index(leader)]
            assert any("standing by" in line for line in standby.log)
            with psycopg.connect(migrated_pg_url) as conn:
                row = conn.execute(
                    "SELECT value FROM gw_channel_cursors WHERE name = %s",
                    (f"matrix:{bot.user_id}",),
                ).fetchone()
            assert row is not None and row[0].startswith("s")

            leader.kill()
            killed_at = time.monotonic()
            second = [f"after {n}" for n in range(5)]
            for text in second:
                synapse.send(bob, other, text)
            wait_until(lambda: answered(second), 30, "the standby to take over")
            took = time.monotonic() - killed_at
            standby.wait_for_line("is now the matrix sync", timeout=1)
            assert took < 10, f"takeover took {took:.1f}s"
            replies = said()
            for text in first + second:
                assert replies.count(f"echo: {text}") == 1, (text, replies)
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()


# --------------------------------------------------------------------------- encrypted rooms


class EncryptedRooms:
    """One encrypted DM room per test user with the bot, each user with an encrypting
    client of their own (tests/matrix_peer.py) on the `PeerThread`'s event loop; what the
    bot said is read by decrypting it, as the users' clients show it."""

    def __init__(
        self, synapse: Synapse, bot: MatrixUser, count: int, folder: Path, thread: PeerThread
    ) -> None:
        self.bot = bot
        self.thread = thread
        self.peers = [
            thread.run(start_peer(synapse, synapse.register(), folder / f"peer{i}"))
            for i in range(count)
        ]
        self.rooms = [thread.run(peer.encrypted_room([bot.user_id])) for peer in self.peers]
        self._last_poll = 0.0
        self._last: tuple[bool, int, bool] = (False, -1, True)

    def wait_joined(self, timeout: float = 60) -> None:
        for peer, room in zip(self.peers, self.rooms, strict=True):
            self.thread.run(peer.wait_member(room, self.bot.user_id, timeout), timeout + 5)

    def send(self, message: Message) -> None:
        self.thread.run(self.peers[message.user].send(self.rooms[message.user], message.text))

    def bot_texts(self) -> list[str]:
        def read() -> list[str]:
            return [
                m.body
                for peer, room in zip(self.peers, self.rooms, strict=True)
                for m in peer.messages(room, self.bot.user_id)
            ]

        return self.thread.call(read)

    def undecryptable(self) -> list[str]:
        return self.thread.call(lambda: [e for p in self.peers for e in p.undecryptable])

    def progress(self, sent: list[Message]) -> Callable[[], tuple[bool, int, bool]]:
        wanted = {m.text for m in sent}

        def check() -> tuple[bool, int, bool]:
            if time.monotonic() - self._last_poll >= 0.5:
                self._last_poll = time.monotonic()
                texts = self.bot_texts()
                answered, _ = echoed(texts)
                self._last = (wanted <= set(answered), len(texts), False)
            return self._last

        return check


@pytest.fixture
def peer_thread() -> Iterator[PeerThread]:
    thread = PeerThread()
    yield thread
    thread.close(thread.peers)


@pytest.mark.timeout(420)
def test_encrypted_rooms_survive_kills_just_before_and_just_after_the_token_is_stored(
    tmp_path: Path,
    synapse: Synapse,
    runs: Callable[[dict[str, str]], Gateways],
    peer_thread: PeerThread,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The failpoint kills of the test above, in end-to-end encrypted rooms: every user
    writes from an encrypting client of their own, the gateway decrypts with its device's
    keys and answers encrypted. A message journaled before a kill comes again after the
    restart and must still decrypt (the room keys were durable before the token moved
    on), and so must the same sessions' later messages: nothing lost, nothing stored or
    answered twice beyond the promise, and no "could not read" notice."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    count, rate = scaled(60), 6.0
    bot = synapse.register()
    sent = plan_messages(count, scaled(5), rng)
    points = ["matrix.before_cursor", "matrix.after_cursor"] * 2
    with FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm:
        env = matrix_env(workspace, llm, synapse, bot)
        run = runs(env | {"GATEWAY_FAILPOINTS": f"{points[0]}=sigstop"})
        process = run.start()
        rooms = EncryptedRooms(synapse, bot, scaled(5), tmp_path / "peers", peer_thread)
        peer_thread.peers.extend(rooms.peers)
        rooms.wait_joined()
        started = time.monotonic()
        with pushing(sent, rate, rooms.send):
            for n, point in enumerate(points):
                if n:
                    run.env = env | {"GATEWAY_FAILPOINTS": f"{point}=sigstop"}
                    process = run.launch()
                deadline = time.monotonic() + 40
                while not stopped(process.proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert stopped(process.proc.pid), f"{point} was never reached"
                run.kill()
            run.env = env
            run.start()
        settle(rooms.progress(sent))
        run.terminate()
        user_entries, assistant_entries = session_entries(workspace / "sessions")
        answered, other = echoed(rooms.bot_texts())
        tally = Tally(
            scenario="matrix-encrypted-confirm",
            logs=run.save_logs(tmp_path / "logs", []),
            sent=sent,
            user_entries=user_entries,
            assistant_entries=assistant_entries,
            reply_order=answered,
            other_replies=other,
            kills=run.kills,
            seconds=time.monotonic() - started,
            exit_code=run.exit_code,
        )
    with capsys.disabled():
        print(f"\n{tally.summary()}")
    tally.check_promise()
    assert UNREADABLE_NOTICE not in other, "a journaled message could not be decrypted again"
    assert rooms.undecryptable() == [], "a reply of the bot could not be decrypted"


@pytest.mark.timeout(240)
def test_a_standby_takes_over_the_device_keys_of_encrypted_rooms_from_postgresql(
    migrated_pg_url: str, tmp_path: Path, synapse: Synapse, peer_thread: PeerThread
) -> None:
    """Shared mode, encrypted rooms: the leader received the users' room keys; SIGKILLed,
    its standby takes the "matrix sync" role and the device's keys from PostgreSQL, and
    decrypts the same Megolm sessions' next messages (their keys are not sent again) and
    answers them encrypted, each once."""
    bot = synapse.register()
    with FakeOpenAI.in_thread() as llm:
        env = matrix_env(tmp_path / "unused", llm, synapse, bot) | {
            "GATEWAY_STORAGE__URL": migrated_pg_url
        }
        replicas = []
        for i in range(2):
            proc = GatewayProcess(env | {"GATEWAY_WORKSPACE": str(tmp_path / f"ws{i}")}, tmp_path)
            proc.wait_readyz(proc.wait_ready())
            replicas.append(proc)
        try:
            rooms = EncryptedRooms(synapse, bot, 2, tmp_path / "peers", peer_thread)
            peer_thread.peers.extend(rooms.peers)
            rooms.wait_joined()

            def answered(texts: list[str]) -> bool:
                replies = rooms.bot_texts()
                return all(f"echo: {t}" in replies for t in texts)

            first = [Message(user, n) for n in range(4) for user in (0, 1)]
            for message in first:
                rooms.send(message)
            wait_until(lambda: answered([m.text for m in first]), 30, "the first messages")
            leaders = [p for p in replicas if any("is now the matrix sync" in x for x in p.log)]
            assert len(leaders) == 1
            leader = leaders[0]
            standby = replicas[1 - replicas.index(leader)]
            leader.kill()
            # The second user's conversation: the first one's lease stays with the dead
            # replica for the lease time (docs/scaling.md).
            second = [Message(1, n) for n in range(10, 15)]
            for message in second:
                rooms.send(message)
            wait_until(lambda: answered([m.text for m in second]), 40, "the standby's answers")
            standby.wait_for_line("is now the matrix sync", timeout=1)
            assert not any("new encryption keys made" in line for line in standby.log)
            replies = rooms.bot_texts()
            for message in first + second:
                assert replies.count(f"echo: {message.text}") == 1, (message, replies)
            assert rooms.undecryptable() == []
            assert standby.terminate() == 0
        finally:
            for proc in replicas:
                proc.stop()
