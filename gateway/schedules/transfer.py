"""Scheduled work's part of `gateway storage import|export` (`gateway.storage.transfer`):
one item per heartbeat job's last run and per scheduled job."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.plumbing.items import (
    DamagedFile,
    Outcome,
    Transfer,
    read_state_file,
    rows_to_import,
    write_state_file,
)
from gateway.schedules.protocol import ScheduledJob
from gateway.schedules.runs import STATE_FILE as HEARTBEAT_STATE_FILE
from gateway.schedules.runs import dump_run_times, parse_run_times
from gateway.schedules.store import JOBS_FILE, dump_jobs, parse_jobs

if TYPE_CHECKING:
    import psycopg


def _parse_runs(text: str) -> dict[str, datetime]:
    runs = parse_run_times(text)
    for job, when in runs.items():
        if when.tzinfo is None:
            raise ValueError(f"job {job!r}: the last run {when.isoformat()} has no time zone")
    return runs


def _describe_run(job: str, when: datetime) -> tuple[str, str]:
    return job, f"last run {when.astimezone(UTC).isoformat()}"


def import_heartbeat(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Each heartbeat job's last run into ``gw_heartbeat_runs``, so that the fleet makes
    up a missed run once instead of running every job at its first start."""
    path = workspace / HEARTBEAT_STATE_FILE
    runs = rows_to_import(transfer, "heartbeat", path, lambda: read_state_file(path, _parse_runs))
    if runs is None:
        return
    for n, (job, when) in enumerate(sorted(runs.items()), start=1):
        item, detail = _describe_run(job, when)
        outcome: Outcome = "moved"
        with conn.transaction():
            stored = conn.execute(
                "INSERT INTO gw_heartbeat_runs (job, last_run) VALUES (%s, %s) "
                "ON CONFLICT (job) DO NOTHING RETURNING job",
                (job, when),
            ).fetchone()
            if stored is None:
                row = conn.execute(
                    "SELECT last_run FROM gw_heartbeat_runs WHERE job = %s", (job,)
                ).fetchone()
                assert row is not None
                if row[0] == when:
                    outcome, detail = "present", "already imported"
                elif row[0] > when:
                    outcome = "present"
                    detail = f"the database has a later run ({row[0].astimezone(UTC).isoformat()})"
                else:
                    outcome = "conflict"
                    detail = (
                        f"the database has an earlier run ({row[0].astimezone(UTC).isoformat()}); "
                        "nothing changed on either side"
                    )
        transfer.note("heartbeat", outcome, item, detail, (n, len(runs)))


def export_heartbeat(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Each job's last run as the workspace's heartbeat-state.json (times in UTC)."""
    path = workspace / HEARTBEAT_STATE_FILE
    rows = conn.execute("SELECT job, last_run FROM gw_heartbeat_runs ORDER BY job").fetchall()
    runs = {str(job): when.astimezone(UTC) for job, when in rows}
    transfer.start("heartbeat", len(runs), path)
    if not runs:
        return
    try:
        existing = read_state_file(path, _parse_runs)
    except DamagedFile:
        existing = {}
    write_state_file(
        "heartbeat", path, runs, existing, dump_run_times(runs).encode(), _describe_run, transfer
    )


def _parse_schedules(text: str) -> dict[str, ScheduledJob]:
    jobs = parse_jobs(text)
    if len(jobs) != len(json.loads(text)["jobs"]):
        raise ValueError("a job id is repeated")
    return jobs


def _describe_job(job_id: str, job: ScheduledJob) -> tuple[str, str]:
    return f"{job_id} ({job.owner})", f"{job.kind}, next {job.next_run.isoformat()}"


def _ran_since(stored: ScheduledJob, mine: ScheduledJob) -> bool:
    """Whether ``stored`` is ``mine`` moved on by its runs (a repeating job that fired)."""
    return (
        stored.runs > mine.runs
        and stored.next_run > mine.next_run
        and replace(stored, runs=mine.runs, next_run=mine.next_run) == mine
    )


def import_schedules(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Reminders and scheduled tasks (schedules.json) into ``gw_schedules``, one per job.
    The per-conversation limit is not applied: what the file holds is kept."""
    path = workspace / JOBS_FILE
    jobs = rows_to_import(
        transfer, "schedules", path, lambda: read_state_file(path, _parse_schedules)
    )
    if jobs is None:
        return
    for n, (job_id, job) in enumerate(sorted(jobs.items()), start=1):
        item, detail = _describe_job(job_id, job)
        outcome: Outcome = "moved"
        with conn.transaction():
            created = conn.execute(
                "INSERT INTO gw_schedules (id, owner, next_run, job) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (id) DO NOTHING RETURNING id",
                (job.id, job.owner, job.next_run, json.dumps(job.to_dict())),
            ).fetchone()
            if created is None:
                row = conn.execute("SELECT job FROM gw_schedules WHERE id = %s", (job_id,))
                stored = ScheduledJob.from_dict(_json_value(row.fetchone()))
                if stored == job:
                    outcome, detail = "present", "already imported"
                elif _ran_since(stored, job):
                    outcome = "present"
                    detail = f"the database has run it {stored.runs - job.runs} more times since"
                else:
                    outcome = "conflict"
                    detail = (
                        f"the database has another job under this id ({stored.describe()}); "
                        "nothing changed on either side"
                    )
        transfer.note("schedules", outcome, item, detail, (n, len(jobs)))


def _json_value(row: tuple[Any, ...] | None) -> Any:
    assert row is not None
    return row[0] if not isinstance(row[0], str) else json.loads(row[0])


def export_schedules(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Every job as the workspace's schedules.json."""
    path = workspace / JOBS_FILE
    found = [
        ScheduledJob.from_dict(_json_value(row))
        for row in conn.execute("SELECT job FROM gw_schedules ORDER BY id").fetchall()
    ]
    jobs = {job.id: job for job in found}
    transfer.start("schedules", len(jobs), path)
    if not jobs:
        return
    try:
        existing = read_state_file(path, _parse_schedules)
    except DamagedFile:
        existing = {}
    data = dump_jobs(jobs.values()).encode()
    write_state_file("schedules", path, jobs, existing, data, _describe_job, transfer)
