"""Session leases between two in-process replicas (real PostgreSQL): a session's messages
run on the replica holding its lease, in journal order, whichever replica took them in;
the holder is told at once (not at the next sweep); a lease lingers, then goes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from gateway.dedupe_pg import PostgresDedupeStore
from gateway.dispatch import Dispatcher
from gateway.messages import InboundMessage, OutboundMessage, reply_for
from gateway.replicas import SessionRouter

pytestmark = pytest.mark.anyio

#: Far longer than a kick takes: a message waiting for the sweep or the linger's end
#: instead of the kick would miss the deadlines below.
SWEEP = 30.0
LINGER = 4.0


class Replica:
    def __init__(self, name: str, url: str, ran: list[tuple[str, str, float]]) -> None:
        self.name = name
        self.store = PostgresDedupeStore(url)

        async def handle(msg: InboundMessage) -> OutboundMessage:
            ran.append((self.name, msg.text, time.monotonic()))
            return reply_for(msg, f"echo: {msg.text}")

        async def deliver(reply: OutboundMessage) -> None:
            pass

        self.dispatcher = Dispatcher(handle, deliver, dedupe=self.store)
        self.router = SessionRouter(
            self.store, self.dispatcher, sweep_interval=SWEEP, linger=LINGER
        )
        self.dispatcher.router = self.router


@asynccontextmanager
async def replicas(url: str, ran: list[tuple[str, str, float]]) -> AsyncIterator[list[Replica]]:
    made = [Replica("a", url, ran), Replica("b", url, ran)]
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


def message(n: int) -> InboundMessage:
    return InboundMessage(
        channel="telegram", chat_id="77", sender_id="77", text=f"m{n}", message_id=f"77:{n}"
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
