"""The shared inbound journal across replicas (real PostgreSQL): one claim wins, a dead
replica's claims and journal are taken over exactly once, a live one's are waited for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from gateway.journal.pg_store import PostgresDedupeStore
from gateway.journal.protocol import ClaimBusy, LeaseAsk, dedupe_key
from gateway.messages import InboundMessage
from tests.test_dedupe import Clock

pytestmark = pytest.mark.anyio


Replica = Callable[..., PostgresDedupeStore]


@pytest.fixture
async def replica(migrated_pg_url: str) -> AsyncIterator[Replica]:
    made: list[PostgresDedupeStore] = []

    def make(clock: Clock | None = None, **kw: float) -> PostgresDedupeStore:
        store = PostgresDedupeStore(migrated_pg_url, clock=clock or Clock(), **kw)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield make
    for store in made:
        await store._pool.close()  # a "crashed" replica never withdrew: just drop its pool


def message(n: int, at: float) -> InboundMessage:
    return InboundMessage(
        channel="telegram",
        chat_id="42",
        sender_id="42",
        text=f"m{n}",
        message_id=str(n),
        received_at=at,
    )


def key_of(msg: InboundMessage) -> str:
    key = dedupe_key(msg)
    assert key is not None
    return key


async def test_of_three_replicas_claiming_at_once_exactly_one_wins(replica: Replica) -> None:
    stores = [replica(claim_wait=5.0) for _ in range(3)]
    wins: dict[str, int] = {}

    async def claim(store: PostgresDedupeStore, n: int) -> None:
        msg = message(n, 1.0)
        if not await store.seen_or_add(key_of(msg)):
            wins[msg.text] = wins.get(msg.text, 0) + 1
            await store.journal(key_of(msg), msg)  # the losers wait for this, then see it

    async with anyio.create_task_group() as tg:
        for n in range(30):
            for store in stores:
                tg.start_soon(claim, store, n)
    assert wins == {f"m{n}": 1 for n in range(30)}


async def test_a_dead_replicas_unjournaled_claim_is_taken_over(replica: Replica) -> None:
    dead_clock = Clock()
    dead = replica(dead_clock)
    assert await dead.seen_or_add("k") is False  # then it dies before journaling
    alive = replica(Clock(dead_clock.now + 20))  # 20 s later: the dead one stopped beating
    assert await alive.seen_or_add("k") is False
    assert await alive.seen_or_add("k") is True


async def test_a_live_replicas_claim_is_waited_for_not_called_a_duplicate(
    replica: Replica,
) -> None:
    clock = Clock()
    first, second = replica(clock), replica(clock, claim_wait=0.3)
    msg = message(1, clock.now)
    assert await first.seen_or_add(key_of(msg)) is False
    # Not journaled yet: a redelivery must not be confirmed as a duplicate.
    with pytest.raises(ClaimBusy):
        await second.seen_or_add(key_of(msg))

    async def journal_soon() -> None:
        await anyio.sleep(0.1)
        await first.journal(key_of(msg), msg)

    async with anyio.create_task_group() as tg:
        tg.start_soon(journal_soon)
        second.claim_wait = 5.0
        assert await second.seen_or_add(key_of(msg)) is True  # journaled: now a duplicate


async def test_a_dead_replicas_journal_is_replayed_once_oldest_first(replica: Replica) -> None:
    dead_clock = Clock()
    dead = replica(dead_clock)
    msgs = [message(n, dead_clock.now + at) for n, at in ((1, 3.0), (2, 1.0), (3, 2.0))]
    for msg in msgs:
        assert await dead.seen_or_add(key_of(msg)) is False
        await dead.journal(key_of(msg), msg)
    later = Clock(dead_clock.now + 30)
    survivors = [replica(later), replica(later)]
    got: list[list[str]] = [[], []]

    async def replay(n: int) -> None:
        got[n] = [u.message.text for u in await survivors[n].unanswered()]

    async with anyio.create_task_group() as tg:
        tg.start_soon(replay, 0)
        tg.start_soon(replay, 1)
    assert sorted(got, key=len) == [[], ["m2", "m3", "m1"]]
    # The one that took them owns them now: asking again gives them again, to it only.
    owner = survivors[0] if got[0] else survivors[1]
    other = survivors[1] if got[0] else survivors[0]
    assert [u.message.text for u in await owner.unanswered()] == ["m2", "m3", "m1"]
    assert await other.unanswered() == []


async def test_a_live_replicas_journal_is_left_alone(replica: Replica) -> None:
    clock = Clock()
    busy, other = replica(clock), replica(clock)
    msg = message(1, clock.now)
    await busy.seen_or_add(key_of(msg))
    await busy.journal(key_of(msg), msg)
    assert await other.unanswered() == []


async def test_a_drained_replica_hands_over_at_once(replica: Replica) -> None:
    clock = Clock()
    leaving, staying = replica(clock), replica(clock)
    owed, unconfirmed = message(1, clock.now), message(2, clock.now)
    await leaving.seen_or_add(key_of(owed))
    await leaving.journal(key_of(owed), owed)
    await leaving.seen_or_add(key_of(unconfirmed))  # claimed, never journaled
    await leaving.aclose()
    assert [u.message for u in await staying.unanswered()] == [owed]
    # The platform still holds the unjournaled one: its redelivery is new, not a duplicate.
    assert await staying.seen_or_add(key_of(unconfirmed)) is False


async def test_an_answered_message_is_a_duplicate_everywhere_until_ttl(replica: Replica) -> None:
    clock = Clock()
    one, two = replica(clock, ttl=100), replica(clock, ttl=100)
    msg = message(1, clock.now)
    await one.seen_or_add(key_of(msg))
    await one.journal(key_of(msg), msg)
    await one.mark_done(key_of(msg))
    assert await two.seen_or_add(key_of(msg)) is True
    assert await two.unanswered() == []
    clock.now += 101
    assert await two.seen_or_add(key_of(msg)) is False


async def test_an_unreadable_journal_row_leaves_the_queue_and_is_kept(replica: Replica) -> None:
    """A session must not wait forever behind a row nobody can read: it leaves the
    queue (marked answered, its text kept until the ttl) and the rest runs."""
    from gateway.dispatch.dispatcher import Dispatcher
    from gateway.dispatch.router import SessionRouter

    async def never(message: InboundMessage) -> Any:
        raise AssertionError("nothing runs here")

    store = replica()
    good, bad = message(1, 1.0), message(2, 2.0)
    for msg in (good, bad):
        await store.seen_or_add(key_of(msg))
        await store.journal(key_of(msg), msg)
    async with store.connection() as conn:
        await conn.execute(
            'UPDATE gw_inbound SET message = \'{"not": "a message"}\'::json WHERE dedupe_key = %s',
            (key_of(bad),),
        )
    router = SessionRouter(store, Dispatcher(never, never))
    owed = await router._owed(good.session_key)
    assert [entry.message for _, entry in owed] == [good]
    async with store.connection() as conn:
        cur = await conn.execute(
            "SELECT state, message::text FROM gw_inbound WHERE dedupe_key = %s", (key_of(bad),)
        )
        state, kept = await cur.fetchone()  # type: ignore[misc]
    assert state == "done" and "a message" in kept
    assert [entry.message for _, entry in await router._owed(good.session_key)] == [good]


async def test_a_delivery_of_a_message_another_replica_is_journaling_is_not_taken(
    replica: Replica,
) -> None:
    """The dispatcher answers `ClaimBusy` with "not taken" (the platform sends it again),
    as no error: nothing failed, the other replica is a few milliseconds from its journal."""
    from gateway.dispatch.dispatcher import Dispatcher
    from gateway.dispatch.lanes import SubmitStatus

    async def never(message: Any) -> Any:
        raise AssertionError("nothing runs here")

    clock = Clock()
    first, second = replica(clock), replica(clock, claim_wait=0.2)
    msg = message(1, clock.now)
    assert await first.seen_or_add(key_of(msg)) is False  # claimed, not yet journaled
    dispatcher = Dispatcher(never, never, dedupe=second)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        ticket = await dispatcher.submit(msg)
        assert ticket.status is SubmitStatus.RETRY_LATER and not ticket.taken
        stats = dispatcher.stats()
        assert stats.not_taken == 1 and stats.dedupe_errors == 0
        tg.cancel_scope.cancel()


async def test_take_in_claims_and_journals_in_one_step_with_the_claims_rules(
    replica: Replica,
) -> None:
    """`take_in` (claim and journal at once, for an allowed message): one of three
    replicas wins each message and journals it; a live replica's unjournaled claim is
    waited for (ClaimBusy past `claim_wait`), a dead one's is taken over; the journaled
    message is what the dead replica's successor replays."""
    stores = [replica(claim_wait=5.0) for _ in range(3)]
    wins: dict[str, int] = {}

    async def take(store: PostgresDedupeStore, n: int) -> None:
        msg = message(n, 1.0)
        if not await store.take_in(key_of(msg), msg):
            wins[msg.text] = wins.get(msg.text, 0) + 1

    async with anyio.create_task_group() as tg:
        for n in range(30):
            for store in stores:
                tg.start_soon(take, store, n)
    assert wins == {f"m{n}": 1 for n in range(30)}

    clock = Clock()
    first, second = replica(clock), replica(clock, claim_wait=0.3)
    msg = message(100, clock.now)
    assert await first.seen_or_add(key_of(msg)) is False  # claimed, not journaled
    with pytest.raises(ClaimBusy):
        await second.take_in(key_of(msg), msg)

    dead_clock = Clock()
    dead = replica(dead_clock)
    late = message(200, dead_clock.now)
    assert await dead.seen_or_add(key_of(late)) is False  # then it dies
    heir = replica(Clock(dead_clock.now + 20))
    assert await heir.take_in(key_of(late), late) is False
    assert await heir.take_in(key_of(late), late) is True
    replayed = [entry.message.text for entry in await heir.unanswered()]
    assert "m200" in replayed


async def test_take_in_asked_for_the_lease_takes_it_or_kicks_its_holder(
    replica: Replica, migrated_pg_url: str
) -> None:
    """With a `LeaseAsk`, the same round trip takes the session's lease when it is free,
    expired or already ours; when another replica holds it live, that holder is kicked
    (NOTIFY on the schema's kick channel) and the lease stays with it. A duplicate asks
    nothing of the lease."""
    import psycopg

    a, b = replica(), replica()
    kicks = "gw_kicks_test"
    with psycopg.connect(migrated_pg_url, autocommit=True) as listener:
        schema = listener.execute("SELECT current_schema()").fetchone()
        assert schema is not None
        listener.execute(f'LISTEN "{kicks}.{schema[0]}"')

        def owner(session: str) -> str | None:
            row = listener.execute(
                "SELECT owner FROM gw_session_leases WHERE session_key = %s", (session,)
            ).fetchone()
            return None if row is None else str(row[0])

        first, second, third = message(1, 1.0), message(2, 1.0), message(3, 1.0)
        ask = LeaseAsk(ttl=10.0, kicks=kicks)
        assert await a.take_in(key_of(first), first, ask) is False
        assert ask.taken is True and owner(first.session_key) == a.replica_id
        # The look at the session's other journaled messages: none yet; the message
        # as a read of its row gives it.
        assert ask.others == [] and ask.entry is not None
        assert ask.entry.message == first and ask.entry.reply is None
        # Ours already: taken again (renewed), no kick; the first is still journaled.
        again = LeaseAsk(ttl=10.0, kicks=kicks)
        assert await a.take_in(key_of(second), second, again) is False
        assert again.taken is True and again.others == [key_of(first)]
        # A pump of a runs the session: only the look (the lease left as it is).
        look = LeaseAsk(ttl=10.0, kicks=kicks, take=False)
        fifth = message(5, 1.0)
        assert await a.take_in(key_of(fifth), fifth, look) is False
        assert look.taken is None and sorted(look.others or ()) == sorted(
            [key_of(first), key_of(second)]
        )
        # More than `look` others: not listed (the pump reads the journal instead).
        short = LeaseAsk(ttl=10.0, kicks=kicks, take=False, look=2)
        sixth = message(6, 1.0)
        assert await a.take_in(key_of(sixth), sixth, short) is False
        assert short.others is None and short.entry is None
        # b takes the next one in: a keeps the lease and is kicked to run it.
        other = LeaseAsk(ttl=10.0, kicks=kicks)
        assert await b.take_in(key_of(third), third, other) is False
        assert other.taken is False and owner(third.session_key) == a.replica_id
        notes = list(listener.notifies(timeout=2.0, stop_after=1))
        assert [n.payload for n in notes] == [third.session_key]
        # A duplicate: nothing journaled, the lease left alone.
        dup = LeaseAsk(ttl=10.0, kicks=kicks)
        assert await b.take_in(key_of(third), third, dup) is True
        assert dup.taken is None and owner(third.session_key) == a.replica_id
        # An expired lease is taken over by whoever takes a message in.
        listener.execute("UPDATE gw_session_leases SET expires_at = 0")
        fourth = message(4, 1.0)
        late = LeaseAsk(ttl=10.0, kicks=kicks)
        assert await b.take_in(key_of(fourth), fourth, late) is False
        assert late.taken is True and owner(fourth.session_key) == b.replica_id
