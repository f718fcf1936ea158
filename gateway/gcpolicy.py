"""Garbage collection for a daemon whose promise is latency.

CPython's cyclic collector stops the world, and a collection costs about half a
microsecond per object it traverses (more on a machine with slow memory). With the
default thresholds a gateway that holds a few thousand conversations in memory runs a
young collection every ~140 turns (0.3-0.5 ms), a middle one every ~1,400 turns
(5-10 ms) and a full one every few seconds at load (60-150 ms over the whole heap):
measured by ``bench/gateway.py``, those full collections alone put the p99 of a turn
at 40-110 ms. Almost nothing the gateway keeps is cyclic garbage (a turn leaves none:
the objects that outlive it are the messages the session cache holds, freed by
reference counting when a session leaves the cache), so most of that work finds
nothing.

`GCPolicy` (what ``gateway run`` uses):
- after start-up, one full collection, then `gc.freeze`: modules, settings and models
  are never traversed again;
- young collections stay automatic with a small threshold (`YOUNG` objects: well
  under a millisecond each);
- the older generations are not collected automatically;
- a full collection runs on a timer (`FULL_EVERY` seconds) to reclaim whatever cycles
  outlived a young collection (an exception kept with its traceback, say): one pause
  of tens of milliseconds every few minutes instead of several a minute.

Leaving the policy restores the thresholds and unfreezes, so an embedding process (the
tests) gets its collector back as it was.
"""

from __future__ import annotations

import gc
import time

import anyio
from loguru import logger

YOUNG = 1000  # objects allocated (net) between two young collections
FULL_EVERY = 600.0  # seconds between two timed full collections
_NEVER = 1_000_000_000  # a threshold for the older generations that is never reached


class GCPolicy:
    def __init__(self, *, young: int = YOUNG, full_every: float = FULL_EVERY) -> None:
        self.young = young
        self.full_every = full_every
        self.full_collections = 0  # timed full collections so far (tests, metrics)
        self.last_full_seconds = 0.0

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Apply the policy until cancelled, then restore the collector."""
        previous = gc.get_threshold()
        gc.collect()
        gc.freeze()
        gc.set_threshold(self.young, _NEVER, _NEVER)
        try:
            task_status.started()
            while True:
                await anyio.sleep(self.full_every)
                self.collect_full()
        finally:
            gc.set_threshold(*previous)
            gc.unfreeze()

    def collect_full(self) -> int:
        """One full collection (frozen start-up objects aside); returns what it freed."""
        started = time.perf_counter()
        freed = gc.collect()
        self.last_full_seconds = time.perf_counter() - started
        self.full_collections += 1
        logger.debug(
            "full garbage collection: {} objects freed in {:.1f} ms",
            freed,
            self.last_full_seconds * 1000,
        )
        return freed
