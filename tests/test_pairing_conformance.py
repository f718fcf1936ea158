"""Pairing through both backends (`gateway.access.protocol.PairingBackend`): the workspace file and
PostgreSQL. Two store instances over the same storage stand for the daemon and the
operator's CLI, or for two replicas: an approval given through one counts in the other."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.access.commands import cli_pairing_approve, cli_pairing_list
from gateway.access.policy import (
    PAIRING_FULL_TEXT,
    AccessGate,
    Allow,
    Challenge,
    ChannelAccessPolicy,
    Deny,
)
from gateway.access.protocol import PairingBackend, PendingRequest, new_pairing_code
from gateway.access.store import PairingStore
from gateway.messages import InboundMessage

NOW = 1_700_000_000.0
PAIRING = ChannelAccessPolicy(dm_policy="pairing", pairing_resend_interval=0)


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


MakeStore = Callable[[], PairingBackend]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["file", "postgres"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[MakeStore]:
    """Store instances over one storage (one pairing file; one PostgreSQL schema)."""
    if request.param == "file":

        def make() -> PairingBackend:
            return PairingStore(tmp_path / "ws" / "pairing.json", clock=clock)

    else:
        from gateway.access.pg_store import PostgresPairingStore

        pools = request.getfixturevalue("pg_pools")

        def make() -> PairingBackend:
            return PostgresPairingStore(pools(), where="postgresql", clock=clock)

    yield make


def dm(sender: str, channel: str = "telegram") -> InboundMessage:
    return InboundMessage(channel=channel, chat_id=sender, sender_id=sender, text="hi")


@pytest.mark.anyio
async def test_an_approval_through_one_store_counts_in_the_other(
    make_store: MakeStore, clock: Clock
) -> None:
    replica_a, replica_b, cli = make_store(), make_store(), make_store()
    gate_a = AccessGate({"telegram": PAIRING}, replica_a, clock=clock)
    gate_b = AccessGate({"telegram": PAIRING}, replica_b, clock=clock)
    first = await gate_a.check(dm("42"))
    assert isinstance(first, Challenge) and first.is_new
    # The same stranger on the other replica gets the same pending code, not a new one.
    again = await gate_b.check(dm("42"))
    assert isinstance(again, Challenge) and again.code == first.code and not again.is_new
    assert first.code in cli_pairing_list(cli, "telegram")
    assert "Approved 42" in cli_pairing_approve(cli, "telegram", first.code.lower())
    assert isinstance(await gate_a.check(dm("42")), Allow)
    assert isinstance(await gate_b.check(dm("42")), Allow)
    assert replica_b.is_approved("telegram", "42") and not replica_b.is_approved("slack", "42")
    assert replica_a.approve("telegram", first.code) is None  # one-time
    assert replica_b.revoke("telegram", "42") and not replica_a.revoke("telegram", "42")
    assert isinstance(await gate_a.check(dm("42")), Challenge)


@pytest.mark.anyio
async def test_codes_expire_everywhere(make_store: MakeStore, clock: Clock) -> None:
    store, other = make_store(), make_store()
    gate = AccessGate({"telegram": PAIRING}, store, clock=clock)
    old = await gate.check(dm("42"))
    assert isinstance(old, Challenge)
    clock.now += PAIRING.pairing_ttl + 1
    assert other.approve("telegram", old.code) is None
    assert other.list().pending == ()
    new = await gate.check(dm("42"))
    assert isinstance(new, Challenge) and new.is_new and new.code != old.code
    assert [r.code for r in other.list().pending] == [new.code]


@pytest.mark.anyio
async def test_pending_requests_are_bounded_per_channel_across_stores(
    make_store: MakeStore, clock: Clock
) -> None:
    policy = ChannelAccessPolicy(
        dm_policy="pairing", max_pending=3, pairing_ttl=100, pairing_resend_interval=0
    )
    gates = [
        AccessGate({"telegram": policy, "slack": policy}, make_store(), clock=clock)
        for _ in range(2)
    ]
    for n in range(3):
        assert isinstance(await gates[n % 2].check(dm(f"s{n}")), Challenge)
        clock.now += 10
    refused = await gates[1].check(dm("s3"))
    assert isinstance(refused, Deny) and refused.reply == PAIRING_FULL_TEXT
    assert isinstance(await gates[0].check(dm("x", channel="slack")), Challenge)
    clock.now += 75  # s0's request has expired, the others not yet
    assert isinstance(await gates[1].check(dm("s3")), Challenge)
    assert isinstance(await gates[0].check(dm("s4")), Deny)


def test_concurrent_writers_lose_nothing_and_one_request_per_sender_wins(
    make_store: MakeStore,
) -> None:
    stores = [make_store(), make_store()]
    results: dict[str, list[str]] = {"a": [], "b": []}

    def request(store: PairingBackend, name: str) -> None:
        for n in range(25):
            for sender in (f"{name}{n}", f"both{n}"):
                got = store.add_pending(
                    PendingRequest("telegram", sender, new_pairing_code(), NOW, NOW + 3600),
                    max_pending=1000,
                )
                assert got is not None
                if sender.startswith("both"):
                    results[name].append(got.code)

    threads = [
        threading.Thread(target=request, args=(store, name))
        for store, name in zip(stores, "ab", strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pending = make_store().list().pending
    assert len(pending) == 75
    assert results["a"] == results["b"]  # both writers were told the same code per sender


@pytest.mark.anyio
async def test_postgresql_down_closes_the_gate(clock: Clock) -> None:
    pytest.importorskip("psycopg_pool")
    from psycopg_pool import ConnectionPool

    from gateway.access.pg_store import PostgresPairingStore

    pool = ConnectionPool("postgresql://postgres@127.0.0.1:1/none", timeout=0.5, open=False)
    pool.open(wait=False)
    try:
        store = PostgresPairingStore(pool, where="postgresql://127.0.0.1:1/none", clock=clock)
        gate = AccessGate({"telegram": PAIRING}, store, clock=clock)
        decision = await gate.check(dm("42"))
        assert isinstance(decision, Deny) and "pairing state unusable" in decision.reason
    finally:
        pool.close()
