"""Read positions (gateway.cursors): every backend keeps the same promise, a position
saved is the one loaded, across a reopen and across processes of the shared mode."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway.cursors import CursorStore, FileCursorStore, MemoryCursorStore, PostgresCursorStore

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "file", "postgres"])
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Callable[[], CursorStore], Clock]]:
    """A factory of stores over the same state (a reopen, or another replica)."""
    clock = Clock()
    opened: list[CursorStore] = []
    closers = []
    if request.param == "memory":
        shared = MemoryCursorStore(clock)

        def make() -> CursorStore:
            return shared

    elif request.param == "file":

        def make() -> CursorStore:
            store = FileCursorStore(tmp_path / "cursors.sqlite", clock=clock, durable=True)
            opened.append(store)
            return store

    else:
        from gateway.dedupe_pg import PostgresDedupeStore

        url = request.getfixturevalue("migrated_pg_url")

        def make() -> CursorStore:
            journal = PostgresDedupeStore(url)
            closers.append(journal)
            return PostgresCursorStore(journal.connection, clock=clock)

    yield make, clock
    for store in opened:
        await store.aclose()
    for journal in closers:
        await journal.aclose()


async def test_a_saved_position_is_the_one_loaded_after_a_reopen(
    stores: tuple[Callable[[], CursorStore], Clock],
) -> None:
    make, clock = stores
    first = make()
    assert await first.load("discord") == {}
    await first.save("discord", {"111": "5", "222": "9"})
    clock.now = 2000.0
    await first.save("discord", {"111": "7"})
    await first.save("matrix", {"!room": "s1_2_3"})
    await first.aclose()
    again = make()
    loaded = await again.load("discord")
    assert {k: v.position for k, v in loaded.items()} == {"111": "7", "222": "9"}
    assert loaded["111"].updated_at == 2000.0 and loaded["222"].updated_at == 1000.0
    assert {k: v.position for k, v in (await again.load("matrix")).items()} == {"!room": "s1_2_3"}
    await again.forget("discord", ["222", "333"])
    assert set(await make().load("discord")) == {"111"}
    await again.save("discord", {})  # nothing to save: no error, no change
    assert set(await make().load("discord")) == {"111"}
