"""Session leases between two in-process replicas (real PostgreSQL): a session's messages
run on the replica holding its lease, in journal order, whichever replica took them in;
the holder is told at once (not at the next sweep); a lease lingers, then goes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from gateway.access.pg_store import PostgresPairingStore
from gateway.access.policy import AccessGate, ChannelAccessPolicy
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.router import SessionRouter, reply_note
from gateway.journal.pg_store import PostgresDedupeStore
from gateway.journal.protocol import dedupe_key
from gateway.messages import (
    META_REPLAYED,
    META_REPLY_WANTED,
    META_SESSION_CURRENT,
    InboundMessage,
    OutboundMessage,
    reply_for,
)

pytestmark = pytest.mark.anyio

#: Far longer than a kick takes: a message waiting for the sweep or the linger's end
#: instead of the kick would miss the deadlines below.
SWEEP = 30.0
LINGER = 4.0


class Replica:
    def __init__(
        self,
        name: str,
        url: str,
        ran: list[tuple[str, str, float]],
        gate: anyio.Event | None = None,
        access: AccessGate | None = None,
        **router_options: float,
    ) -> None:
        self.name = name
        self.store = PostgresDedupeStore(url)

        self.flags: dict[str, tuple[bool, bool]] = {}

        async def handle(msg: InboundMessage) -> OutboundMessage:
            ran.append((self.name, msg.text, time.monotonic()))
            meta = msg.metadata
            self.flags[msg.text] = (
                bool(meta.get(META_REPLAYED)),
                bool(meta.get(META_SESSION_CURRENT)),
            )
            if gate is not None and msg.text.startswith("slow"):
                await gate.wait()
            return reply_for(msg, f"echo: {msg.text}")

        self.sent: list[OutboundMessage] = []

        async def deliver(reply: OutboundMessage) -> None:
            self.sent.append(reply)

        self.dispatcher = Dispatcher(handle, deliver, dedupe=self.store, access=access)
        options: dict[str, float] = {"sweep_interval": SWEEP, "linger": LINGER}
        self.router = SessionRouter(self.store, self.dispatcher, **(options | router_options))
        self.dispatcher.router = self.router


@asynccontextmanager
async def replicas(
    url: str,
    ran: list[tuple[str, str, float]],
    gate: anyio.Event | None = None,
    access: Callable[[], AccessGate] | None = None,
    **router_options: float,
) -> AsyncIterator[list[Replica]]:
    made = [
        Replica(name, url, ran, gate, access() if access else None, **router_options)
        for name in ("a", "b")
    ]
    async with anyio.create_task_group() as tg:
        for r in made:
            await tg.start(r.dispatcher.run)
            await tg.start(r.router.run)
        try:
            yield made
        finally:
            tg.cancel_scope.cancel()
    for r in made:
        await r.store.aclose()
    # Once (CI, 2026-11-29) the event loop's close hung after a test of this file: a task
    # that outlived it never finished its cancellation. Name what is left, for next time.
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task() and "pytest" not in repr(task.get_coro()):
            print(f"left running after the replicas stopped: {task!r}")
            task.print_stack(limit=8)


def message(
    n: int,
    chat: str = "77",
    text: str | None = None,
    *,
    channel: str = "telegram",
    reply_wanted: bool = False,
) -> InboundMessage:
    """A platform message, or with `reply_wanted` one whose sender waits for the reply
    on its request (`/api/chat`)."""
    return InboundMessage(
        channel=channel,
        chat_id=chat,
        sender_id=chat,
        text=text or f"m{n}",
        message_id=f"{chat}:{n}",
        metadata={META_REPLY_WANTED: True} if reply_wanted else {},
    )


async def wait_for(predicate: Callable[[], bool], seconds: float) -> None:
    with anyio.fail_after(seconds):
        while not predicate():  # noqa: ASYNC110  (the handler runs in another replica's task)
            await anyio.sleep(0.01)


async def test_the_lease_holder_runs_what_another_replica_took_in_at_once(
    migrated_pg_url: str,
) -> None:
    ran: list[tuple[str, str, float]] = []
    async with replicas(migrated_pg_url, ran) as (a, b):
        await a.dispatcher.submit(message(1))
        await wait_for(lambda: len(ran) == 1, 5)
        assert ran[0][:2] == ("a", "m1")  # a took it in and holds the session's lease
        # Within a's linger, b takes the session's next messages in: b cannot get the
        # lease, so a must be told (NOTIFY) and run them, in order, long before a sweep.
        sent = time.monotonic()
        for n in (2, 3, 4):
            await b.dispatcher.submit(message(n))
        await wait_for(lambda: len(ran) == 4, 5)
        assert [(who, text) for who, text, _ in ran] == [
            ("a", "m1"),
            ("a", "m2"),
            ("a", "m3"),
            ("a", "m4"),
        ]
        assert ran[-1][2] - sent < 2.0  # told at once, not at the linger's end
        # After the linger the lease goes: the next message runs where it was taken in.
        await anyio.sleep(LINGER + 1.0)
        await b.dispatcher.submit(message(5))
        await wait_for(lambda: len(ran) == 5, 5)
        assert ran[-1][:2] == ("b", "m5")
    # What a pump finds first may have been handed over before (replayed: the session is
    # read afresh and searched for the turn); what comes after, under the lease held
    # since, is new and the cached session current. (replayed, current) per message:
    assert a.flags == {
        "m1": (True, False),
        "m2": (False, True),
        "m3": (False, True),
        "m4": (False, True),
    }
    assert b.flags == {"m5": (True, False)}  # b's first turn of a session a wrote to


async def answered(store: PostgresDedupeStore, seconds: float = 5) -> None:
    """Until the journal holds no unanswered message: a turn's answered mark commits
    a moment after its handler ran, and a message taken in meanwhile sees the one before
    it still journaled (then the pump, which forgot it once marked, reads the journal:
    right, and not what the test below counts)."""
    with anyio.fail_after(seconds):
        while await store.unanswered():  # noqa: ASYNC110  (marked by another task)
            await anyio.sleep(0.01)


async def test_a_message_taken_in_where_its_session_runs_is_handed_over_without_a_read(
    migrated_pg_url: str,
) -> None:
    """The journal's round trip looks at the session's other journaled messages: when
    this replica's pump knows them all (or there are none), the message is next in
    journal order and is handed to the pump, with no journal read. A message the pump
    does not know (journaled by a replica that died before telling anyone) sends it
    back to the journal, and the order holds."""
    ran: list[tuple[str, str, float]] = []
    async with replicas(migrated_pg_url, ran) as (a, b):
        for n in (1, 2, 3):
            await a.dispatcher.submit(message(n))
            await wait_for(lambda n=n: len(ran) == n, 5)
            await answered(a.store)
        assert (a.router.handed, a.router.reads) == (3, 0)
        # m4 taken in elsewhere: its replica cannot lease the session and kicks a,
        # whose pump reads the journal for it.
        await b.dispatcher.submit(message(4))
        await wait_for(lambda: len(ran) == 4, 5)
        await answered(a.store)
        assert a.router.reads >= 1 and b.router.handed == 0
        # m5 is journaled by a replica that dies before telling anyone (no lease asked,
        # no kick): a's look, when a takes m6 in, finds it unknown and reads the journal.
        dead = PostgresDedupeStore(migrated_pg_url)
        try:
            dead_msg = message(5)
            assert not await dead.take_in(str(dedupe_key(dead_msg)), dead_msg)
        finally:
            await dead.aclose()
        reads, handed = a.router.reads, a.router.handed
        await a.dispatcher.submit(message(6))
        await wait_for(lambda: len(ran) == 6, 5)
        await answered(a.store)
        assert a.router.reads > reads and a.router.handed == handed
        assert [(who, text) for who, text, _ in ran] == [("a", f"m{n}") for n in range(1, 7)]
        # Known again: the next message is handed over.
        await a.dispatcher.submit(message(7))
        await wait_for(lambda: len(ran) == 7, 5)
        assert a.router.handed == handed + 1
    # The first message's session is read afresh (it may have been handed over before);
    # the rest, handed over under the lease held since, find the session current.
    assert a.flags["m1"] == (True, False)
    assert all(a.flags[f"m{n}"] == (False, True) for n in (2, 3, 4, 6, 7))


async def test_a_lease_a_claim_takes_while_its_replica_stops_is_withdrawn_too(
    migrated_pg_url: str,
) -> None:
    """A claim asked for the session's lease before replica a began to stop, and its
    statement commits after a withdrew its leases: a withdraws that lease too, so b's
    sweep runs the message within a sweep or two, not after the lease's 10 s."""
    import psycopg

    ran: list[tuple[str, str, float]] = []
    async with replicas(migrated_pg_url, ran, sweep_interval=0.2) as (a, _b):
        msg = message(1)
        ask = a.router.lease_ask(msg.session_key)
        assert ask is not None and ask.take
        await a.router.stop()
        key = str(dedupe_key(msg))
        assert not await a.store.take_in(key, msg, ask)
        assert ask.taken is True  # the orphan: nobody renews it
        a.router.journaled_here(msg.session_key, key, ask)
        await wait_for(lambda: len(ran) == 1, 3)
        assert ran[0][:2] == ("b", "m1")
    with psycopg.connect(migrated_pg_url) as conn:
        row = conn.execute(
            "SELECT owner FROM gw_session_leases WHERE session_key = %s", (msg.session_key,)
        ).fetchone()
    assert row is None or row[0] != a.router.replica_id


async def test_turns_longer_than_the_lease_keep_their_leases_renewed(
    migrated_pg_url: str,
) -> None:
    """Three turns on replica a outlast the lease four times over, while b sweeps five
    times a second for sessions without a live lease: a's one renewal statement keeps all
    three, so b never runs them (which would run a turn twice, at once) nor their next
    messages, which b took in and a runs after each turn, in order."""
    import psycopg

    ttl = 1.2
    ran: list[tuple[str, str, float]] = []
    gate = anyio.Event()
    chats = ("81", "82", "83")
    async with replicas(migrated_pg_url, ran, gate, lease_ttl=ttl, sweep_interval=0.2) as (a, b):
        for chat in chats:
            await a.dispatcher.submit(message(1, chat, f"slow {chat}"))
        await wait_for(lambda: len(ran) == 3, 5)
        for chat in chats:
            await b.dispatcher.submit(message(2, chat, f"next {chat}"))
        await anyio.sleep(4 * ttl)
        assert sorted(text for _, text, _ in ran) == [f"slow {c}" for c in chats]
        with psycopg.connect(migrated_pg_url) as conn:
            leases = conn.execute(
                "SELECT session_key, owner, expires_at > extract(epoch FROM clock_timestamp())"
                " FROM gw_session_leases ORDER BY 1"
            ).fetchall()
        assert leases == [(f"telegram:{c}", a.router.replica_id, True) for c in chats]
        assert b.router.takeovers == 0

        gate.set()
        await wait_for(lambda: len(ran) == 6, 5)
    for chat in chats:
        assert [(who, text) for who, text, _ in ran if text.endswith(chat)] == [
            ("a", f"slow {chat}"),
            ("a", f"next {chat}"),
        ]


async def test_an_api_reply_outlives_its_waiter_so_a_retry_elsewhere_gets_it(
    migrated_pg_url: str,
) -> None:
    """An `/api/chat` message taken in on b runs on a (a holds the session). b's waiter
    gets the reply; should b die before its client hears it, the client's retry with the
    same id reaches a, which must give the same reply without running the turn again.
    The message is marked answered and the reply kept in one statement."""
    import psycopg

    from gateway.journal.protocol import dedupe_key

    ran: list[tuple[str, str, float]] = []
    async with replicas(migrated_pg_url, ran) as (a, b):
        await a.dispatcher.submit(message(1, "91"))
        await wait_for(lambda: len(ran) == 1, 5)
        api = message(2, "91", "question", reply_wanted=True)
        ticket = await b.dispatcher.submit(api)
        with anyio.fail_after(5):
            first = await ticket.reply()
        assert first is not None and first.text == "echo: question"
        key = dedupe_key(api)
        assert key is not None
        with psycopg.connect(migrated_pg_url) as conn:
            state = conn.execute(
                "SELECT state, reply->>'text' FROM gw_inbound WHERE dedupe_key = %s", (key,)
            ).fetchone()
        assert state == ("done", "echo: question")
        # The retry: a duplicate on a, answered from the row, twice over if need be.
        again = await a.dispatcher.submit(api)
        assert again.status.value == "duplicate"
        for router in (a.router, b.router):
            with anyio.fail_after(2):
                reply = await router.wait_reply(key)
            assert reply is not None and reply.text == "echo: question"
    assert [text for _, text, _ in ran] == ["m1", "question"]  # the turn ran once


async def test_a_forwarded_api_reply_rides_in_its_notification(
    migrated_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """b forwards two `/api/chat` messages to a (the session's holder). The small reply
    comes to b inside the NOTIFY: b reads no row. The large one (over NOTIFY's payload
    limit) is announced without it, and b reads it from the row."""
    ran: list[tuple[str, str, float]] = []
    async with replicas(migrated_pg_url, ran) as (a, b):
        await a.dispatcher.submit(message(1, "93"))
        await wait_for(lambda: len(ran) == 1, 5)
        reads: list[str] = []
        original = b.router.published

        async def counted(key: str) -> OutboundMessage | None:
            reads.append(key)
            return await original(key)

        monkeypatch.setattr(b.router, "published", counted)
        small = await b.dispatcher.submit(message(2, "93", "small", reply_wanted=True))
        with anyio.fail_after(5):
            reply = await small.reply()
        assert reply is not None and reply.text == "echo: small"
        assert reads == []
        big_text = "big " + "\u00e9" * 5000  # 10 kB in UTF-8
        big = await b.dispatcher.submit(message(3, "93", big_text, reply_wanted=True))
        with anyio.fail_after(5):
            reply = await big.reply()
        assert reply is not None and reply.text == f"echo: {big_text}"
        assert len(reads) == 1
    assert [who for who, _, _ in ran] == ["a", "a", "a"]


@pytest.mark.parametrize("key", ["api:s1:42", "api:a:b\nc:9", "x", "api:\u00e9\u00e9:1", ""])
def test_a_reply_notification_gives_back_its_key_and_reply(key: str) -> None:
    for reply in ('{"text": "hi: there"}', ""):
        assert reply_note(f"{len(key)}:{key}{reply}") == (key, reply)
    assert reply_note("no-length-here") == ("no-length-here", "")


async def test_a_strangers_redelivered_message_gets_one_pairing_code_across_replicas(
    migrated_pg_url: str,
) -> None:
    """Access is checked before a message is journaled; a refused message is still
    claimed, so the platform's redelivery to the other replica is a duplicate: one
    pairing code, never a second, and no turn. An allowed sender's message delivered
    to both runs once."""
    from gateway.plumbing.postgres import sync_pool

    pool = sync_pool(migrated_pg_url, max_size=2)
    pool.open(wait=True)
    policy = ChannelAccessPolicy(dm_policy="pairing", allow_from=frozenset({"5"}))

    def gate() -> AccessGate:
        return AccessGate({"telegram": policy}, PostgresPairingStore(pool, where="test"))

    ran: list[tuple[str, str, float]] = []
    try:
        async with replicas(migrated_pg_url, ran, access=gate) as (a, b):
            stranger = message(1, "66", "hello?")
            first = await a.dispatcher.submit(stranger)
            again = await b.dispatcher.submit(stranger)
            assert (first.status.value, again.status.value) == ("denied", "duplicate")
            friend = message(1, "5", "hi")
            tickets = [await r.dispatcher.submit(friend) for r in (a, b)]
            assert [t.status.value for t in tickets] == ["accepted", "duplicate"]
            await wait_for(lambda: len(ran) == 1, 5)
            await anyio.sleep(0.5)
            notices = [m.text for m in a.sent + b.sent if m.chat_id == "66"]
    finally:
        pool.close()
    assert len(notices) == 1 and "pairing code" in notices[0].lower(), notices
    assert [text for _, text, _ in ran] == ["hi"]


async def test_two_deployments_in_two_schemas_of_one_database_keep_apart(
    migrated_pg_url: str,
) -> None:
    """Advisory locks and NOTIFY are database-wide: each deployment (schema) must still
    get its own Telegram poller, and another schema's kicks must not reach its pumps."""
    import psycopg

    from gateway.journal.pg_cursors import run_as_leader
    from gateway.plumbing.postgres import connect, migrate
    from tests.local_pg import PG_URL, schema_url

    other_schema = "gwtest_other_" + str(time.time_ns())[-9:]
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {other_schema}")
    other_url = schema_url(other_schema)
    try:
        with connect(other_url) as conn:
            migrate(conn)
        leaders: list[str] = []
        release = anyio.Event()

        async def lead(name: str) -> None:
            leaders.append(name)
            await release.wait()

        async with anyio.create_task_group() as tg:
            for name, url in (("one", migrated_pg_url), ("two", other_url)):
                tg.start_soon(run_as_leader, url, "telegram-poller", lambda n=name: lead(n))
            await wait_for(lambda: len(leaders) == 2, 10)
            release.set()
        assert sorted(leaders) == ["one", "two"]

        ran: list[tuple[str, str, float]] = []
        async with replicas(migrated_pg_url, ran) as (a, _):
            await a.dispatcher.submit(message(1, "95"))
            await wait_for(lambda: len(ran) == 1, 5)
            assert "telegram:95" in a.router._pumps  # lingering with the lease
            with psycopg.connect(other_url, autocommit=True) as conn:
                # The other deployment's replica cannot take the same key's lease there
                # (someone holds it) and kicks the holder: in its own schema only.
                conn.execute("INSERT INTO gw_session_leases VALUES ('telegram:95', 'x', 1e12)")
                conn.execute("SELECT pg_notify('gw_kicks.' || current_schema(), 'telegram:95')")
            await anyio.sleep(0.5)
            wake = a.router._pumps.get("telegram:95")
            assert wake is not None and not wake.is_set()
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {other_schema} CASCADE")


@pytest.mark.parametrize("api", [False, True], ids=["platform", "api"])
async def test_a_lost_database_mid_turn_neither_drops_the_lease_nor_the_mark(
    migrated_pg_url: str, api: bool
) -> None:
    """Replica a loses PostgreSQL while a turn runs (the proxy cut): the turn's
    answered-mark fails. Back within the lease time, a marks it again itself; the lease
    stays a's throughout, so b (sweeping five times a second) never runs the message.
    An `/api/chat` message is never marked answered without its reply: a client's retry
    on b gets it."""
    import psycopg

    from gateway.journal.protocol import dedupe_key
    from tests.fakes.tcp_proxy import tcp_proxy
    from tests.local_pg import PG_URL

    authority = PG_URL.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = authority.partition(":")
    ran: list[tuple[str, str, float]] = []
    gate = anyio.Event()
    with tcp_proxy(host, int(port or 5432)) as proxy:
        proxied = migrated_pg_url.replace(authority, f"127.0.0.1:{proxy.port}", 1)
        a = Replica("a", proxied, ran, gate, linger=0.5, lease_ttl=6.0, sweep_interval=0.2)
        b = Replica("b", migrated_pg_url, ran, None, linger=0.5, lease_ttl=6.0, sweep_interval=0.2)
        async with anyio.create_task_group() as tg:
            for r in (a, b):
                await tg.start(r.dispatcher.run)
                await tg.start(r.router.run)
            msg = message(1, "97", "slow one")
            if api:
                msg = message(1, "user97", "slow one", channel="api", reply_wanted=True)
            await a.dispatcher.submit(msg)
            await wait_for(lambda: len(ran) == 1, 5)
            proxy.cut()
            gate.set()  # the turn ends; its mark cannot reach the database
            await anyio.sleep(2.0)
            proxy.restore()
            key = dedupe_key(msg)

            def state() -> object:
                with psycopg.connect(migrated_pg_url) as conn:
                    row = conn.execute(
                        "SELECT state FROM gw_inbound WHERE dedupe_key = %s", (key,)
                    ).fetchone()
                return row[0] if row else None

            await wait_for(lambda: state() == "done", 10)
            if api:
                assert key is not None
                with anyio.fail_after(2):
                    reply = await b.router.wait_reply(key)
                assert reply is not None and reply.text == "echo: slow one"
            await anyio.sleep(1.0)
            tg.cancel_scope.cancel()
        for r in (a, b):
            await r.store.aclose()
    assert [(who, text) for who, text, _ in ran] == [("a", "slow one")]
    assert b.router.takeovers == 0
    assert [m.text for m in a.sent] == ["echo: slow one"]


async def test_a_replica_that_lost_a_lease_hands_over_what_has_not_begun(
    migrated_pg_url: str,
) -> None:
    """a holds a session and runs a slow turn with two more messages fed behind it;
    its lease goes to another replica (as when a starves past the lease time). a stops
    feeding and takes back the two that have not begun; the turn in progress ends on a
    behind its fence (`gateway.plumbing.fence`): its reply is not sent and its message
    is not marked answered. The next holder runs all three, once each, in order."""
    import psycopg

    ran: list[tuple[str, str, float]] = []
    gate = anyio.Event()
    async with replicas(migrated_pg_url, ran, gate, sweep_interval=0.2) as (a, b):
        await a.dispatcher.submit(message(1, "98", "slow 1"))
        await wait_for(lambda: len(ran) == 1, 5)
        for n in (2, 3):
            await a.dispatcher.submit(message(n, "98"))
        await wait_for(lambda: a.router.fed == 3, 5)
        stolen = time.monotonic()
        with psycopg.connect(migrated_pg_url, autocommit=True) as conn:
            # Taken over: by a replica that then goes quiet, its lease running out soon.
            conn.execute(
                "UPDATE gw_session_leases SET owner = 'elsewhere', "
                "expires_at = extract(epoch FROM clock_timestamp()) + 1.5 "
                "WHERE session_key = 'telegram:98'"
            )
        await a.router.renew()  # finds the lease gone
        await anyio.sleep(0.3)
        gate.set()
        await wait_for(lambda: len(ran) == 4, 10)
        await anyio.sleep(0.5)
    # The three ran once each on the next holder, in order, only once the quiet holder's
    # lease had run out (on whichever replica's sweep came first), not on a's old pump
    # meanwhile; a's own run of the first sent nothing.
    assert [text for _, text, _ in ran] == ["slow 1", "slow 1", "m2", "m3"]
    assert ran[0][0] == "a"
    assert ran[1][2] - stolen >= 1.4, ran[1][2] - stolen
    assert sum(m.text == "echo: slow 1" for r in (a, b) for m in r.sent) == 1
