"""Consolidation with replicas: two gateways sharing sessions and memory in PostgreSQL
never consolidate the same span twice (`PostgresConsolidationGuard`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from gateway.agent.consolidation import Consolidator
from gateway.llm.openai_provider import OpenAIProvider
from gateway.memory.pg_store import PostgresConsolidationGuard, PostgresMemoryStore
from gateway.sessions import SessionManager
from gateway.sessions.pg_store import PostgresSessions
from tests.fakes.openai_server import FakeOpenAI
from tests.test_consolidation import compactions, consolidation_reply, fill

KEY = "telegram:1"


class Replica:
    """What one gateway holds: its own pool, session cache, memory and consolidator."""

    def __init__(self, pool: Any, provider: OpenAIProvider, name: str, guarded: bool) -> None:
        self.pool = pool
        self.sessions = SessionManager.shared(PostgresSessions(self.pool))
        self.memory = PostgresMemoryStore(self.pool)
        guard = PostgresConsolidationGuard(self.pool, name) if guarded else None
        self.consolidator = Consolidator(
            self.sessions,
            self.memory,
            provider,
            model="gpt-4o-mini",
            memory_window=4,
            context_window=100_000,
            timeout=5.0,
            guard=guard,
        )

    def close(self) -> None:
        self.sessions.close()


@pytest.fixture
def replicas(pg_pools: Any, provider: OpenAIProvider) -> Iterator[Any]:
    made: list[Replica] = []

    def make(name: str, *, guarded: bool = True) -> Replica:
        replica = Replica(pg_pools(), provider, name, guarded)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        replica.close()


@pytest.mark.anyio
async def test_two_replicas_at_once_consolidate_a_span_once(
    replicas: Any, fake_openai: FakeOpenAI
) -> None:
    a, b = replicas("a"), replicas("b")
    fill(a.sessions.get_or_create(KEY), 8)
    assert b.sessions.get(KEY) is not None  # b has the session cached too
    for _ in range(2):
        fake_openai.add(
            consolidation_reply("they chatted", [("learned_fact", "Likes tea")], delay=0.5)
        )
    outcomes = []

    async def run(replica: Replica) -> None:
        outcomes.append(await replica.consolidator.consolidate_now(KEY))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, a)
        tg.start_soon(run, b)
    assert sorted(o.status for o in outcomes) == ["busy", "compacted"]
    assert len(fake_openai.chat_requests) == 1  # the model was asked once
    fresh = replicas("c").sessions.get(KEY)
    assert len(compactions(fresh)) == 1
    memory = a.memory.for_session(KEY)
    assert memory.search_memory("tea") == ["- [learned_fact] Likes tea"]
    assert len(memory.search_history("chatted")) == 1


@pytest.mark.anyio
async def test_a_span_consolidated_elsewhere_is_not_summarized_again(
    replicas: Any, fake_openai: FakeOpenAI
) -> None:
    a, b = replicas("a"), replicas("b")
    fill(a.sessions.get_or_create(KEY), 8)
    fake_openai.add(consolidation_reply("first", [("learned_fact", "Likes tea")]))
    assert (await a.consolidator.consolidate_now(KEY)).status == "compacted"
    # b runs afterwards: it reads a's compaction and finds nothing left to do.
    outcome = await b.consolidator.consolidate_now(KEY)
    assert outcome.status == "not_needed"
    assert len(fake_openai.chat_requests) == 1
    assert a.memory.for_session(KEY).search_memory("tea") == ["- [learned_fact] Likes tea"]


@pytest.mark.anyio
async def test_the_recorded_span_refuses_a_plan_made_before_it(
    replicas: Any, fake_openai: FakeOpenAI
) -> None:
    """Belt and braces: a commit whose span the shared state already covers writes
    nothing, even if the lock was lost (a replica's connection dropped mid-run)."""
    a = replicas("a")
    session = a.sessions.get_or_create(KEY)
    fill(session, 8)
    assert a.consolidator.guard is not None
    lease = a.consolidator.guard.acquire(KEY)
    assert lease is not None
    branch = [e.id for e in session.get_branch()]
    lease.record(session.session_id, branch[-2], summarized=14, facts=0)
    lease.release()
    fake_openai.add(consolidation_reply("again", [("learned_fact", "Likes tea")]))
    outcome = await a.consolidator.consolidate_now(KEY)
    assert outcome.status == "busy"
    assert compactions(a.sessions.get(KEY)) == []
    assert a.memory.for_session(KEY).search_memory("tea") == []
