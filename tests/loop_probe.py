"""Helpers for tests that prove the event loop keeps running while work waits: another
process's lock, held from a thread, and a ticker that counts the loop's turns."""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio


def _hold(take: Callable[[], Callable[[], None]], seconds: float) -> threading.Thread:
    """Run `take` (which acquires a lock and returns its release) in a thread, keep the
    lock `seconds`, then release; returns once the lock is held."""
    held = threading.Event()

    def hold() -> None:
        release = take()
        held.set()
        time.sleep(seconds)
        release()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    return thread


def hold_flock(path: Path, seconds: float) -> threading.Thread:
    """Another open file description (as another process would) holds `path`'s flock."""

    def take() -> Callable[[], None]:
        fd = os.open(path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return lambda: os.close(fd)  # closing releases the lock

    return _hold(take, seconds)


def hold_sqlite_write_lock(path: Path, seconds: float) -> threading.Thread:
    """Another connection (as another process would) holds the database's write lock."""

    def take() -> Callable[[], None]:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")

        def release() -> None:
            conn.execute("COMMIT")
            conn.close()

        return release

    return _hold(take, seconds)


class Ticks:
    count = 0


@asynccontextmanager
async def loop_ticks() -> AsyncIterator[Ticks]:
    """Count 10 ms sleeps the loop completes while the body awaits: a blocked loop
    counts none."""
    ticks = Ticks()

    async def tick() -> None:
        while True:
            ticks.count += 1
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        yield ticks
        tg.cancel_scope.cancel()
