"""The schedule runner: fires due jobs into their conversations through the dispatcher,
run by the daemon like a channel (see `gateway.agent.schedule_tools` for the promises)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import anyio
import anyio.abc
from loguru import logger

from gateway.agent.schedule_tools import Reminders
from gateway.channel import Submit
from gateway.messages import (
    META_MENTIONED,
    META_NOTICE,
    InboundMessage,
    OutboundMessage,
)
from gateway.schedules.protocol import META_SCHEDULE, ScheduledJob
from gateway.schedules.schedule import zone


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
