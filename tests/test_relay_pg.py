"""gateway.journal.pg_relay against a real PostgreSQL (a schema per test): the promises of its
module docstring, with two stores standing for two replicas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from gateway.journal.pg_relay import PostgresRelay
from gateway.journal.pg_store import PostgresDedupeStore
from gateway.journal.protocol import RelayRefused, RelayUnanswered

pytestmark = pytest.mark.anyio


@pytest.fixture
async def stores(migrated_pg_url: str) -> AsyncIterator[list[PostgresDedupeStore]]:
    made = [PostgresDedupeStore(migrated_pg_url) for _ in range(2)]
    yield made
    for store in made:
        await store.aclose()


async def test_the_holder_answers_each_key_once_and_a_refusal_says_why(
    stores: list[PostgresDedupeStore],
) -> None:
    holder, asker = (PostgresRelay(store, "role", poll=0.5) for store in stores)
    done: list[dict[str, Any]] = []

    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        if request.get("refuse"):
            raise RelayRefused("not in that room")
        done.append(request)
        return {"n": request["n"] * 2}

    async with anyio.create_task_group() as tg:
        tg.start_soon(holder.listen)
        tg.start_soon(asker.listen)
        tg.start_soon(holder.serve, handle)
        with anyio.fail_after(10):
            await asker.listening.wait()
            deadline = time.monotonic() + 5
            assert await asker.call("k1", {"n": 21}, deadline=deadline) == {"n": 42}
            # Asked again (a retry after a lost answer): the kept answer, no second run.
            assert await asker.call("k1", {"n": 21}, deadline=deadline) == {"n": 42}
            with pytest.raises(RelayRefused, match="not in that room"):
                await asker.call("k2", {"refuse": True}, deadline=deadline)
            # The holder counts a request once its answer is written, and the asker can
            # read that answer before the holder's count goes up.
            while holder.served < 2:  # noqa: ASYNC110 (polling what the holder did)
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert done == [{"n": 21}] and holder.served == 2


async def test_without_a_holder_a_call_gives_up_at_its_deadline_and_the_next_holder_answers(
    stores: list[PostgresDedupeStore],
) -> None:
    asker, late = (PostgresRelay(store, "role", poll=0.2) for store in stores)
    began = time.monotonic()
    with pytest.raises(RelayUnanswered):
        await asker.call("k", {"n": 1}, deadline=time.monotonic() + 0.6)
    assert 0.5 < time.monotonic() - began < 3
    runs: list[int] = []

    async def handle(request: dict[str, Any]) -> dict[str, Any]:
        runs.append(request["n"])
        return {"ok": True}

    async with anyio.create_task_group() as tg:
        tg.start_soon(late.serve, handle)  # a holder came: it finds the request asked
        with anyio.fail_after(10):
            while not runs:  # noqa: ASYNC110 (polling what the holder did)
                await anyio.sleep(0.05)
            assert await asker.call("k", {"n": 1}, deadline=time.monotonic() + 5) == {"ok": True}
        tg.cancel_scope.cancel()
    assert runs == [1]
