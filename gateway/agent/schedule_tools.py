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
  gap between two runs in a row, `gateway.schedules.schedule.cron_rhythm`) and at most
  `max_runs_per_day` times a day, or it is refused when it is set, with a reason the
  model can relay;
- a conversation's jobs run at most `max_runs_per_day` times a day (a day in the
  default zone) between them; a run past that is skipped and logged, and the first one
  skipped in a day is answered, without the model, with a note saying so. Each run is
  counted once by its fire id, whichever replica fires it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import anyio.abc
from loguru import logger

from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import ToolSpec
from gateway.messages import (
    root_session_key,
)
from gateway.schedules.protocol import Clock, JobStore, ScheduledJob, utc_now
from gateway.schedules.schedule import cron_next, cron_rhythm, parse_cron, parse_interval, zone


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

    def __init__(self, store: JobStore, limits: ScheduleLimits, *, clock: Clock = utc_now):
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
