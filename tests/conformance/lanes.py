"""Deliveries as a platform makes them to a webhook (or a socket): one conversation's
events one at a time, in the order people wrote them, each one retried by the platform's
own rules until it got through or the platform gave up; conversations in parallel.

A platform that retries events (Slack's Events API, Meta's webhooks) does not promise
their order across retries; people who write one message after another at a human pace
see them in order all the same, because each retry comes a fixed time after its own
event. The kit writes a conversation's messages milliseconds apart, so a driver that
started every delivery at once would measure the race between them, not the gateway:
`Lanes` keeps a conversation's next event until its last one is settled.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["Lanes"]

Deliver = Callable[[Any], Awaitable[object]]


class Lanes:
    """A thread with an event loop of its own, and a queue of events per lane (a
    conversation's name), each drained by `deliver` (a coroutine that makes one event's
    whole delivery, retries included). `put` is called from any thread."""

    def __init__(self, deliver: Deliver, name: str = "kit-deliveries") -> None:
        self._deliver = deliver
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._workers: list[asyncio.Task[None]] = []
        self.failures: list[str] = []  # a delivery that raised (a bug in the driver)
        self._pending = 0  # events put and not yet through their whole delivery
        self._counting = threading.Lock()  # `put` runs in the kit's thread, deliveries here

    @property
    def busy(self) -> bool:
        """Whether an event put is still being delivered (retries included)."""
        return self._pending > 0

    def start(self) -> None:
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=self._name, daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread

    def stop(self) -> None:
        """Cancel what is still being delivered and stop the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel() -> None:
            for worker in self._workers:
                worker.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        self._loop = self._thread = None
        self._queues, self._workers = {}, []
        self._pending = 0

    def put(self, lane: str, event: Any) -> None:
        """Deliver `event` after every event put in `lane` before it."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the deliveries are not running")
        with self._counting:  # counted here, not in the loop: `busy` is true at once
            self._pending += 1
        loop.call_soon_threadsafe(self._enqueue, lane, event)

    def _enqueue(self, lane: str, event: Any) -> None:
        queue = self._queues.get(lane)
        if queue is None:
            queue = self._queues[lane] = asyncio.Queue()
            self._workers.append(asyncio.ensure_future(self._drain(lane, queue)))
        queue.put_nowait(event)

    async def _drain(self, lane: str, queue: asyncio.Queue[Any]) -> None:
        while True:
            event = await queue.get()
            try:
                await self._deliver(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures.append(f"{lane}: {exc!r}")
            finally:
                with self._counting:
                    self._pending -= 1
