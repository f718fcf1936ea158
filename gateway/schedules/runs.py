"""The heartbeat jobs' last runs: `heartbeat-state.json` in the workspace (`HeartbeatState`),
or a table shared by replicas (`gateway.schedules.pg_store.SharedRunState`), behind one
`RunState` protocol. A downtime is noticed across restarts, and of several replicas due
at once exactly one runs each job (`claim` is a compare-and-set)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
from loguru import logger

from gateway.fsutil import atomic_write_text

#: The last run of each job, in the workspace folder (the file mode).
STATE_FILE = "heartbeat-state.json"


class RunState(Protocol):
    """Last run time of each job: a file here, a table shared by replicas elsewhere."""

    async def alast_run(self, job: str) -> datetime | None: ...
    async def claim(self, job: str, expected: datetime | None, when: datetime) -> bool: ...


def parse_run_times(text: str) -> dict[str, datetime]:
    """The `{job: ISO time}` object of heartbeat-state.json; ValueError when it is not one."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object of job names and times")
    runs: dict[str, datetime] = {}
    for job, when in raw.items():
        if not isinstance(when, str):
            raise ValueError(f"job {job!r}: the last run is not a time")
        runs[job] = datetime.fromisoformat(when)
    return runs


def dump_run_times(runs: Mapping[str, datetime]) -> str:
    """heartbeat-state.json's text for `runs` (jobs sorted)."""
    return json.dumps({job: when.isoformat() for job, when in sorted(runs.items())})


class HeartbeatState:
    """Last run time of each job, persisted so downtime is noticed across restarts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: dict[str, datetime] = {}
        try:
            self._last = parse_run_times(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            aside = path.with_name(f"{path.name}.corrupt-{int(datetime.now().timestamp())}")
            logger.error("heartbeat state {} unreadable ({}); moved to {}", path, exc, aside)
            try:
                path.rename(aside)
            except OSError:
                pass

    def last_run(self, job: str) -> datetime | None:
        return self._last.get(job)

    async def alast_run(self, job: str) -> datetime | None:
        return self.last_run(job)

    async def claim(self, job: str, expected: datetime | None, when: datetime) -> bool:
        """Record a run of `job` starting `when` if its last run is still `expected`;
        False when another run was recorded meanwhile (it is not this one's turn)."""
        if self._last.get(job) != expected:
            return False
        await anyio.to_thread.run_sync(self.record, job, when)
        return True

    def record(self, job: str, when: datetime) -> None:
        self._last[job] = when
        try:
            atomic_write_text(self.path, dump_run_times(self._last))
        except OSError as exc:
            logger.error("heartbeat state not saved: {}", exc)
