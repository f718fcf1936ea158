"""The daemon's garbage-collection policy: applied while it runs, undone after."""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest

from gateway.gcpolicy import GCPolicy

pytestmark = pytest.mark.anyio


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


async def test_policy_applies_and_restores_the_collector() -> None:
    before = gc.get_threshold()
    policy = GCPolicy(young=1234, full_every=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(policy.run)
        young, middle, old = gc.get_threshold()
        assert young == 1234
        assert middle > 10**6 and old > 10**6  # older generations: timed, not automatic
        assert gc.get_freeze_count() > 0  # start-up objects are frozen
        # A cycle that outlived a young collection is reclaimed by the timed full one.
        a, b = Node(), Node()
        a.other, b.other = b, a
        probe = weakref.ref(a)
        gc.collect(0)  # it survives a young collection: promoted
        del a, b
        gc.collect(0)
        assert probe() is not None  # young collections no longer look at it
        done = policy.full_collections
        await anyio.sleep(0.3)  # several timed full collections (every 0.05 s)
        assert policy.full_collections > done
        assert probe() is None
        tg.cancel_scope.cancel()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_a_full_collection_frees_cycles() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    assert GCPolicy().collect_full() >= 2
