"""Scheduled jobs in the workspace: schedules.json, replaced atomically under a file lock
(the daemon and `gateway schedules cancel` both write it)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

from loguru import logger

from gateway.fsutil import atomic_write_text
from gateway.schedules.protocol import RunGrant, ScheduledJob, grant_run

#: The jobs, in the workspace folder (the file mode).
JOBS_FILE = "schedules.json"


def parse_jobs(text: str) -> dict[str, ScheduledJob]:
    """The jobs of a schedules.json text by id (of a repeated id, the last); ValueError
    (saying what) when the text or any job in it cannot be read."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or not isinstance(raw.get("jobs"), list):
        raise ValueError('expected a JSON object with a "jobs" list')
    jobs: dict[str, ScheduledJob] = {}
    for n, data in enumerate(raw["jobs"], start=1):
        try:
            job = ScheduledJob.from_dict(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"job {n} is unreadable ({type(exc).__name__}: {exc})") from None
        jobs[job.id] = job
    return jobs


def dump_jobs(jobs: Iterable[ScheduledJob], runs: dict[str, Any] | None = None) -> str:
    """schedules.json's text for `jobs` (soonest first) and the day's run ledgers."""
    ordered = sorted(jobs, key=lambda j: (j.next_run, j.id))
    data: dict[str, Any] = {"jobs": [j.to_dict() for j in ordered]}
    if runs:
        data["runs"] = runs
    return json.dumps(data, indent=1) + "\n"


def _parse_runs(text: str) -> dict[str, dict[str, Any]]:
    """The run ledgers of a schedules.json text: owner -> day -> {"runs", "noted"}. A
    ledger that cannot be read is dropped (it holds a day's counts, no jobs)."""
    raw = json.loads(text).get("runs")
    if not isinstance(raw, dict):
        return {}
    return {
        owner: {
            day: ledger
            for day, ledger in days.items()
            if isinstance(ledger, dict) and isinstance(ledger.get("runs"), list)
        }
        for owner, days in raw.items()
        if isinstance(days, dict)
    }


class FileJobStore:
    """Jobs in `<workspace>/schedules.json`, read fresh and changed under an exclusive
    `flock` (the running gateway and `gateway schedules cancel` share the file), written
    by temp file and rename. A damaged file is moved aside, never overwritten."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._thread_lock = threading.Lock()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _read(self) -> tuple[dict[str, ScheduledJob], dict[str, dict[str, Any]]]:
        """The jobs by id, and the run ledgers (owner -> day -> counts)."""
        try:
            text = self.path.read_text(encoding="utf-8")
            return parse_jobs(text), _parse_runs(text)
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError) as exc:
            aside = self.path.with_name(
                f"{self.path.name}.corrupt-{int(datetime.now().timestamp())}"
            )
            logger.error("schedules file {} unreadable ({}); moved to {}", self.path, exc, aside)
            with contextlib.suppress(OSError):
                self.path.rename(aside)
            return {}, {}

    def _write(self, jobs: dict[str, ScheduledJob], runs: dict[str, dict[str, Any]]) -> None:
        atomic_write_text(self.path, dump_jobs(jobs.values(), runs))

    def add(self, job: ScheduledJob, *, limit: int) -> bool:
        """Store `job`; False (nothing stored) when its owner holds `limit` jobs."""
        with self._locked():
            jobs, runs = self._read()
            if sum(j.owner == job.owner for j in jobs.values()) >= limit:
                return False
            jobs[job.id] = job
            self._write(jobs, runs)
            return True

    def jobs(self, owner: str | None = None) -> list[ScheduledJob]:
        """All jobs (or `owner`'s), soonest first."""
        with self._locked():
            jobs = self._read()[0].values()
        found = [j for j in jobs if owner is None or j.owner == owner]
        return sorted(found, key=lambda j: (j.next_run, j.id))

    def remove(self, job_id: str, *, owner: str | None = None) -> ScheduledJob | None:
        """Cancel a job (only if `owner`'s, when given); the job, or None if there is none."""
        with self._locked():
            jobs, runs = self._read()
            job = jobs.get(job_id)
            if job is None or (owner is not None and job.owner != owner):
                return None
            del jobs[job_id]
            self._write(jobs, runs)
            return job

    def advance(self, job_id: str, expected: datetime, new_next: datetime | None) -> bool:
        """Compare-and-set: if the job is still due at `expected`, move it to `new_next`
        (None: it is done and removed). False when it changed or went meanwhile."""
        with self._locked():
            jobs, runs = self._read()
            job = jobs.get(job_id)
            if job is None or job.next_run != expected:
                return False
            if new_next is None:
                del jobs[job_id]
            else:
                jobs[job_id] = replace(job, next_run=new_next, runs=job.runs + 1)
            self._write(jobs, runs)
            return True

    def take_run(self, owner: str, day: date, fire_id: str, budget: int) -> RunGrant:
        """`grant_run` for run `fire_id` on `owner`'s `day`, recorded."""
        with self._locked():
            jobs, runs = self._read()
            ledger = runs.setdefault(owner, {}).setdefault(
                day.isoformat(), {"runs": [], "noted": None}
            )
            grant = grant_run(ledger["runs"], ledger.get("noted"), fire_id, budget)
            if grant == "run" and fire_id not in ledger["runs"]:
                ledger["runs"].append(fire_id)
            elif grant == "note":
                ledger["noted"] = fire_id
            # Two days are kept: a run counts on the day it was due, and one missed for
            # longer than that (a max_late past a day) starts a fresh count.
            kept = (day - timedelta(days=1)).isoformat()
            for days in runs.values():
                for old in [d for d in days if d < kept]:
                    del days[old]
            self._write(jobs, {o: days for o, days in runs.items() if days})
            return grant
