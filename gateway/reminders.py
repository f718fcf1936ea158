"""Reminders and scheduled tasks set from chat: the job store, the chat tools, the runner.

A person asks in a conversation ("remind me at 9 to call Ann", "every weekday at 8
summarize my notes"); the model calls `schedule`, and at the due time the job's text
comes back into that conversation as a message (through the dispatcher, like a
heartbeat run), so its answer is stored there and delivered to the chat.

The promises kept here:
- a job is on disk, with the session that owns it and where to answer, before the
  tool says it is scheduled; it survives restarts;
- a due time fires once: the run goes through the dispatcher under an id made of the
  job and its due time (journaled and deduplicated like a platform message), and only
  then is the job advanced by a compare-and-set on its due time; a crash in between
  resubmits the same id, which the journal recognizes;
- a due time missed while the gateway was down fires once at start if it is at most
  `max_late` old (a cron job fires once, not once per missed time), else it is skipped
  and logged;
- a conversation holds at most `max_per_conversation` jobs, and sees and cancels only
  its own; operators see and cancel all (`gateway schedules list|cancel`);
- a repeating job runs at most every `min_interval` (by its cron expression: the least
  gap between two runs in a row, `gateway.schedule.cron_rhythm`) and at most
  `max_runs_per_day` times a day, or it is refused when it is set, with a reason the
  model can relay;
- a conversation's jobs run at most `max_runs_per_day` times a day (a day in the
  default zone) between them; a run past that is skipped and logged, and the first one
  skipped in a day is answered, without the model, with a note saying so. Each run is
  counted once by its fire id, whichever replica fires it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import anyio.abc
from loguru import logger

from gateway.access import META_MENTIONED
from gateway.agent.tools import Tool, ToolContext
from gateway.channel import Submit
from gateway.fsutil import atomic_write_text
from gateway.llm.types import ToolSpec
from gateway.messages import META_NOTICE, InboundMessage, OutboundMessage, root_session_key
from gateway.schedule import cron_next, cron_rhythm, parse_cron, parse_interval, zone

#: The jobs, in the workspace folder (the file mode).
JOBS_FILE = "schedules.json"
#: Metadata of a message a scheduled job sends into its conversation: the job's id.
META_SCHEDULE = "schedule"

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


#: The order `_address` writes a job's address fields in.
_ADDRESS_FIELDS = ("channel", "chat_id", "sender_id", "thread_kind", "thread_id")


def _address_in_order(raw: dict[str, str | None]) -> dict[str, str | None]:
    """The address with its fields in `_address`'s order (unknown ones after, sorted):
    PostgreSQL's jsonb keeps no key order, and a job read back from it must be written
    to schedules.json exactly as the file mode wrote it."""
    known = {k: raw[k] for k in _ADDRESS_FIELDS if k in raw}
    return known | {k: raw[k] for k in sorted(raw) if k not in known}


@dataclass(frozen=True, slots=True)
class ScheduledJob:
    """One job: what to say, when (once `at`, or `cron` in `timezone`), whose it is
    (`owner`, a session key) and where its runs go (`address`, the inbound fields)."""

    id: str
    owner: str
    text: str
    timezone: str
    next_run: datetime  # aware, UTC
    created_at: datetime
    address: dict[str, str | None]
    cron: str | None = None
    runs: int = 0

    @property
    def kind(self) -> str:
        return f"cron '{self.cron}'" if self.cron else "once"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["next_run"] = self.next_run.isoformat()
        data["created_at"] = self.created_at.isoformat()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScheduledJob:
        return cls(
            id=str(data["id"]),
            owner=str(data["owner"]),
            text=str(data["text"]),
            timezone=str(data["timezone"]),
            next_run=datetime.fromisoformat(data["next_run"]).astimezone(UTC),
            created_at=datetime.fromisoformat(data["created_at"]).astimezone(UTC),
            address=_address_in_order(data["address"]),
            cron=data.get("cron"),
            runs=int(data.get("runs", 0)),
        )

    def local(self, when: datetime) -> str:
        return when.astimezone(zone(self.timezone)).strftime("%Y-%m-%d %H:%M %Z")

    def describe(self) -> str:
        """One line for the model and for operators."""
        return f"{self.id}: {self.kind}, next {self.local(self.next_run)}: {self.text}"

    def fire_id(self) -> str:
        """The message id of the run due at `next_run`: the same after any restart.
        (It ends in a word: channels read a trailing number as a platform message id.)"""
        return f"schedule:{self.id}@{int(self.next_run.timestamp())}:run"

    def after_run(self, now: datetime) -> datetime | None:
        """The next due time after a run (or a skip) at `now`; None for a one-off."""
        if self.cron is None:
            return None
        tz = zone(self.timezone)
        return cron_next(self.cron, max(now, self.next_run).astimezone(tz)).astimezone(UTC)


#: What a due run may do under its conversation's daily budget: run; be skipped with a
#: note to the person (the first run skipped that day); be skipped quietly.
RunGrant = Literal["run", "note", "skip"]


def grant_run(counted: list[str], noted: str | None, fire_id: str, budget: int) -> RunGrant:
    """The grant for run `fire_id`, given the fire ids that ran on its conversation's
    day (`counted`) and the one answered with a note (`noted`). The same run asked
    again (a retry, another replica) gets the same grant; the store records a new one."""
    if fire_id in counted:
        return "run"
    if fire_id == noted:
        return "note"
    if len(counted) < budget:
        return "run"
    return "note" if noted is None else "skip"


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


class JobStore(Protocol):
    """Where jobs live: a file (`FileJobStore`), or PostgreSQL shared by replicas
    (`gateway.reminders_pg.PostgresJobStore`)."""

    def add(self, job: ScheduledJob, *, limit: int) -> bool: ...
    def jobs(self, owner: str | None = None) -> list[ScheduledJob]: ...
    def remove(self, job_id: str, *, owner: str | None = None) -> ScheduledJob | None: ...
    def advance(self, job_id: str, expected: datetime, new_next: datetime | None) -> bool: ...
    def take_run(self, owner: str, day: date, fire_id: str, budget: int) -> RunGrant: ...


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


@dataclass(frozen=True, slots=True)
class ScheduleLimits:
    """The `[schedules]` settings."""

    timezone: str = "UTC"
    max_per_conversation: int = 20
    max_late: timedelta = timedelta(hours=24)
    min_interval: timedelta = timedelta(minutes=15)
    max_runs_per_day: int = 48


class ScheduleError(ValueError):
    """A schedule the model asked for that cannot be made; the message says why."""


def when_from(args: dict[str, Any], timezone: str, now: datetime) -> tuple[datetime, str | None]:
    """(first due time in UTC, cron or None) from the tool's `at` | `in` | `cron`."""
    given = [k for k in ("at", "in", "cron") if args.get(k)]
    if len(given) != 1:
        raise ScheduleError("give exactly one of 'at' (a local time), 'in' (e.g. '20m') or 'cron'")
    tz = zone(timezone)
    if args.get("cron"):
        cron = parse_cron(str(args["cron"]))
        return cron_next(cron, now.astimezone(tz)).astimezone(UTC), cron
    if args.get("in"):
        return now + parse_interval(str(args["in"])), None
    try:
        at = datetime.fromisoformat(str(args["at"]))
    except ValueError:
        raise ScheduleError(
            f"'at' {args['at']!r}: use a local date and time like '2026-05-01T09:30'"
        ) from None
    at = at.replace(tzinfo=tz) if at.tzinfo is None else at
    if at <= now:
        raise ScheduleError(f"'at' {args['at']!r} is in the past ({timezone})")
    return at.astimezone(UTC), None


def _span(delta: timedelta) -> str:
    """A duration as a person says it, exactly: "15 minutes", "2 hours", "1 day"."""
    minutes = int(delta.total_seconds() // 60)
    for unit, size in (("day", 1440), ("hour", 60), ("minute", 1)):
        if minutes >= size and minutes % size == 0:
            count = minutes // size
            return f"{count} {unit}{'s' if count != 1 else ''}"
    return f"{int(delta.total_seconds())} seconds"


def check_rhythm(cron: str, limits: ScheduleLimits) -> None:
    """Refuse (ScheduleError, saying why and what would do) a repeating job that runs
    more often than `min_interval` or more times a day than a conversation's jobs may."""
    rhythm = cron_rhythm(cron)
    if rhythm.min_gap < limits.min_interval:
        least = _span(limits.min_interval)
        raise ScheduleError(
            f"cron '{cron}' runs as often as every {_span(rhythm.min_gap)}; a repeating job "
            f"may run at most every {least} here. Use a cron whose runs are at least {least} "
            "apart, or 'at'/'in' for a single reminder"
        )
    if rhythm.runs_per_day > limits.max_runs_per_day:
        raise ScheduleError(
            f"cron '{cron}' runs {rhythm.runs_per_day} times a day; the jobs of a conversation "
            f"may run {limits.max_runs_per_day} times a day in all here. Use fewer times a day "
            "(fewer hours, or a longer step)"
        )


def _address(context: ToolContext) -> dict[str, str | None]:
    inbound = context.inbound
    if inbound is None:
        return {"channel": "system", "chat_id": root_session_key(context.session_key)}
    return {
        "channel": inbound.channel,
        "chat_id": inbound.chat_id,
        "sender_id": inbound.sender_id,
        "thread_kind": inbound.thread_kind,
        "thread_id": inbound.thread_id,
    }


class Reminders:
    """The chat tools over a store; `changed` wakes the runner when a job is added."""

    def __init__(self, store: JobStore, limits: ScheduleLimits, *, clock: Clock = _utc_now):
        self.store = store
        self.limits = limits
        self.clock = clock
        self.changed = anyio.Event()

    def _notify(self) -> None:
        self.changed.set()

    def tools(self) -> list[Tool]:
        return [
            Tool(SCHEDULE_SPEC, self._schedule),
            Tool(LIST_SPEC, self._list),
            Tool(CANCEL_SPEC, self._cancel),
        ]

    async def _schedule(self, args: dict[str, Any], context: ToolContext) -> str:
        text = str(args.get("text") or "").strip()
        if not text:
            return "error: schedule needs the 'text' to say (or the task to do) when due"
        timezone = str(args.get("timezone") or self.limits.timezone)
        try:
            zone(timezone)
            first, cron = when_from(args, timezone, self.clock())
            if cron is not None:
                # Up to a few hundred ms of cron times for a rare expression: off the loop.
                await anyio.to_thread.run_sync(check_rhythm, cron, self.limits)
        except ValueError as exc:
            return f"error: {exc}"
        owner = root_session_key(context.session_key)
        job = ScheduledJob(
            id=uuid.uuid4().hex[:8],
            owner=owner,
            text=text,
            timezone=timezone,
            next_run=first,
            created_at=self.clock(),
            address=_address(context),
            cron=cron,
        )
        limit = self.limits.max_per_conversation
        added = await anyio.to_thread.run_sync(lambda: self.store.add(job, limit=limit))
        if not added:
            return (
                f"error: this conversation has {limit} scheduled jobs, the most allowed; "
                "cancel one first (list_schedules shows them)"
            )
        logger.info("job {} scheduled ({}), next {}", job.id, job.kind, job.next_run.isoformat())
        self._notify()
        return f"scheduled {job.describe()}"

    async def _list(self, args: dict[str, Any], context: ToolContext) -> str:
        owner = root_session_key(context.session_key)
        jobs = await anyio.to_thread.run_sync(lambda: self.store.jobs(owner))
        if not jobs:
            return "no scheduled jobs in this conversation"
        return "\n".join(job.describe() for job in jobs)

    async def _cancel(self, args: dict[str, Any], context: ToolContext) -> str:
        job_id = str(args.get("id") or "").strip()
        owner = root_session_key(context.session_key)
        job = await anyio.to_thread.run_sync(lambda: self.store.remove(job_id, owner=owner))
        if job is None:
            return f"error: no job {job_id!r} in this conversation (list_schedules shows them)"
        logger.info("job {} cancelled from chat", job.id)
        return f"cancelled {job.describe()}"


SCHEDULE_SPEC = ToolSpec(
    name="schedule",
    description=(
        "Schedule a reminder or a task in this conversation: at the due time `text` comes "
        "back to you here as a message, and your answer goes to the user. Give exactly "
        "one of: at (a local date and time, e.g. 2026-05-01T09:30), in (a delay like "
        "'20m', '2h', '1d'), cron (5 fields, e.g. '0 8 * * mon-fri', repeats)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": "What to remind of, or the task."},
            "at": {"type": "string", "description": "Local date and time, once."},
            "in": {"type": "string", "description": "Delay from now, once: 20m, 2h, 1d."},
            "cron": {"type": "string", "description": "Repeating, 5-field cron."},
            "timezone": {"type": "string", "description": "IANA zone, e.g. Europe/Berlin."},
        },
        "required": ["text"],
        "additionalProperties": False,
    },
)
LIST_SPEC = ToolSpec(
    name="list_schedules",
    description="The reminders and scheduled tasks of this conversation, soonest first.",
    parameters={"type": "object", "properties": {}, "additionalProperties": False},
)
CANCEL_SPEC = ToolSpec(
    name="cancel_schedule",
    description="Cancel a reminder or scheduled task of this conversation by its id.",
    parameters={
        "type": "object",
        "properties": {"id": {"type": "string", "description": "The job's id."}},
        "required": ["id"],
        "additionalProperties": False,
    },
)


class ScheduleRunner:
    """Fires due jobs into their conversations through the dispatcher. The daemon runs
    it like a channel (supervised, shown on /readyz); replies go to the job's own
    channel, never through `send`."""

    name = "schedules"
    #: Longest sleep between two looks at the store (jobs added by another process).
    POLL = 30.0

    def __init__(self, reminders: Reminders) -> None:
        self.reminders = reminders
        self.fired = 0
        self.skipped = 0

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        reminders = self.reminders
        while True:
            reminders.changed = anyio.Event()
            jobs = await anyio.to_thread.run_sync(reminders.store.jobs)
            now = reminders.clock()
            for job in jobs:
                if job.next_run <= now:
                    await self._fire(job, submit, now)
            jobs = await anyio.to_thread.run_sync(reminders.store.jobs)
            now = reminders.clock()
            wait = min([(j.next_run - now).total_seconds() for j in jobs] + [self.POLL])
            # At least a moment: a job that could not be queued is tried again, not spun on.
            with anyio.move_on_after(max(wait, 1.0)):
                await reminders.changed.wait()

    async def _fire(self, job: ScheduledJob, submit: Submit, now: datetime) -> None:
        store = self.reminders.store
        with logger.contextualize(session=job.owner):
            late = now - job.next_run
            if late > self.reminders.limits.max_late:
                logger.warning(
                    "job {} missed its time by {} (longer than the limit): skipped",
                    job.id,
                    late,
                )
                self.skipped += 1
            elif not await self._run_in_budget(job, submit, late):
                return  # not queued: tried again shortly
            new_next = job.after_run(now)
            await anyio.to_thread.run_sync(lambda: store.advance(job.id, job.next_run, new_next))

    async def _run_in_budget(self, job: ScheduledJob, submit: Submit, late: timedelta) -> bool:
        """Submit the run, or its note when the conversation's daily budget is used up,
        or nothing past that. False when the dispatcher did not take it."""
        limits = self.reminders.limits
        store = self.reminders.store
        # The day the run was due on: every replica counts it on the same one.
        day = job.next_run.astimezone(zone(limits.timezone)).date()
        budget = limits.max_runs_per_day
        grant = await anyio.to_thread.run_sync(
            lambda: store.take_run(job.owner, day, job.fire_id(), budget)
        )
        if grant != "skip":
            message = self._message(job) if grant == "run" else self._notice(job, budget)
            ticket = await submit(message)
            status = getattr(ticket, "status", None)  # the dispatcher's SubmitStatus
            if not ticket.taken or status in ("rejected_full", "rejected_draining"):
                logger.error("job {} could not be queued; trying again shortly", job.id)
                return False
        if grant == "run":
            logger.info("job {} fired ({} late)", job.id, late)
            self.fired += 1
        else:
            told = "the person is told" if grant == "note" else "the person was told before"
            logger.warning(
                "job {} skipped: this conversation's jobs ran {} times on {}, the daily budget; {}",
                job.id,
                budget,
                day,
                told,
            )
            self.skipped += 1
        return True

    def _notice(self, job: ScheduledJob, budget: int) -> InboundMessage:
        """The run's message, answered (without the model) with the note that it and the
        rest of the day's runs are skipped."""
        what = job.text if len(job.text) <= 60 else job.text[:59] + "…"
        note = (
            f"I skipped the scheduled job {job.id} ({what}): the scheduled jobs of this "
            f"conversation have run {budget} time{'s' if budget != 1 else ''} today, the most "
            "a day allows here. The "
            f"rest of today's runs are skipped too; they go on tomorrow "
            f"({self.reminders.limits.timezone} time)."
        )
        message = self._message(job)
        return replace(message, metadata={**message.metadata, META_NOTICE: note})

    def _message(self, job: ScheduledJob) -> InboundMessage:
        address = job.address
        kind = "reminder" if job.cron is None else f"scheduled task ({job.cron})"
        return InboundMessage(
            channel=str(address["channel"]),
            chat_id=str(address["chat_id"]),
            text=f"[{kind} {job.id}, set {job.local(job.created_at)}] {job.text}",
            sender_id=str(address.get("sender_id") or ""),
            # The same id for the same due time, whatever happens: journaled, it runs once.
            message_id=job.fire_id(),
            thread_kind=address.get("thread_kind"),
            thread_id=address.get("thread_id"),
            session_key_override=job.owner,
            # The conversation asked for it: a group's mention rule lets it through.
            metadata={META_SCHEDULE: job.id, META_MENTIONED: True},
        )

    async def send(self, message: OutboundMessage) -> None:
        logger.warning("a reply addressed to the schedules runner was dropped")
