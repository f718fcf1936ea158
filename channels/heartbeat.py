"""Heartbeat jobs: scheduled prompts that run in their own `system:heartbeat:<job>`
session and deliver the reply to a chat, unless the reply is only the all-is-well token.

Promises: a job never runs inside a user's session; a job still running is not started
again; runs missed while the gateway was down are made up once, not once per interval
(the last run of each job is kept in `<workspace>/heartbeat-state.json`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import anyio
import anyio.abc
from loguru import logger

from gateway.channel import Submit
from gateway.messages import InboundMessage, OutboundMessage
from gateway.schedules.runs import HeartbeatState, RunState
from gateway.schedules.schedule import Schedule

CHANNEL = "system"

CHAT_PREFIX = "heartbeat:"

DEFAULT_OK_TOKEN = "HEARTBEAT_OK"

Route = Callable[[OutboundMessage], Awaitable[None]]

Clock = Callable[[], datetime]

Sleep = Callable[[float], Awaitable[None]]


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class HeartbeatJob:
    """One job: when it runs, what it asks, and where a reply that matters goes."""

    name: str
    schedule: Schedule
    prompt: str | None = None
    prompt_file: Path | None = None
    deliver_to: str | None = None  # "telegram:<chat>", "slack:<channel>", or None
    ok_token: str = DEFAULT_OK_TOKEN

    @property
    def chat_id(self) -> str:
        return CHAT_PREFIX + self.name

    def read_prompt(self) -> str | None:
        if self.prompt_file is None:
            return self.prompt
        try:
            return self.prompt_file.read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            logger.warning("heartbeat {}: cannot read {}: {}", self.name, self.prompt_file, exc)
            return None


def is_all_is_well(reply: str, token: str) -> bool:
    """True when `reply` says nothing but `token` (ignoring case, whitespace, quotes,
    Markdown emphasis and final punctuation): such replies are not delivered."""
    stripped = re.sub(r"^[\s`*_\"'.!]+|[\s`*_\"'.!]+$", "", reply)
    return stripped.casefold() == token.casefold()


def split_target(target: str) -> tuple[str, str]:
    """'telegram:123' -> ('telegram', '123'); 'slack:C1:thread:17.2' keeps the rest."""
    channel, sep, chat = target.partition(":")
    if not sep or not channel or not chat:
        raise ValueError(f"deliver_to {target!r}: use channel:chat, e.g. 'telegram:123456'")
    return channel, chat


class HeartbeatChannel:
    """Runs each job on its schedule through the dispatcher, like any inbound message."""

    name = CHANNEL

    def __init__(
        self,
        jobs: Mapping[str, HeartbeatJob],
        *,
        state_path: Path,
        route: Route,
        clock: Clock = _utc_now,
        sleep: Sleep = anyio.sleep,
        state: RunState | None = None,
    ) -> None:
        self.jobs = dict(jobs)
        self.state: RunState = state or HeartbeatState(state_path)
        self._route = route
        self._clock = clock
        self._sleep = sleep
        self.suppressed = 0
        self.delivered = 0

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        async with anyio.create_task_group() as tg:
            for job in self.jobs.values():
                tg.start_soon(self._job_loop, job, submit)
            task_status.started()

    async def _job_loop(self, job: HeartbeatJob, submit: Submit) -> None:
        with logger.contextualize(session=f"{CHANNEL}:{job.chat_id}"):
            while True:
                last = await self.state.alast_run(job.name)
                due = job.schedule.next_run(last, self._clock())
                # A timer can fire early (timer slack, the wall clock stepped by NTP).
                # Run only once the clock shows the due time: the run is then recorded
                # at or after it, so the same slot can never come due a second time.
                while (now := self._clock()) < due:
                    await self._sleep((due - now).total_seconds())
                started = self._clock()
                # Compare-and-set on the last run: of several replicas due at once,
                # exactly one records this run and runs it; the others read it and
                # wait for the next one.
                if await self.state.claim(job.name, last, started):
                    await self.run_job(job, submit, started=started)

    async def run_job(
        self, job: HeartbeatJob, submit: Submit, *, started: datetime | None = None
    ) -> None:
        """One run, awaited to the end: the loop cannot start the job again meanwhile.
        With `started`, the run was claimed (recorded) already."""
        claimed = started is not None
        started = started or self._clock()
        prompt = job.read_prompt()
        if prompt is None:
            logger.warning("heartbeat {}: no prompt; skipped", job.name)
        else:
            logger.info("heartbeat {} runs", job.name)
            ticket = await submit(
                InboundMessage(
                    channel=CHANNEL,
                    chat_id=job.chat_id,
                    text=prompt,
                    sender_id="heartbeat",
                    # One id per run: journaled like a platform message, so a run a
                    # crash interrupts is replayed, never started twice.
                    message_id=f"{job.name}@{started.isoformat()}",
                )
            )
            if not ticket.taken:
                # The gateway is full or stopping: this run is skipped, the next one
                # comes at its time.
                logger.warning(
                    "heartbeat {}: not queued (the gateway is full or stopping)", job.name
                )
            await ticket.reply()
        if not claimed:
            await self.state.claim(job.name, await self.state.alast_run(job.name), started)

    async def send(self, message: OutboundMessage) -> None:
        """A job's reply: delivered to its target unless it is only the all-is-well token."""
        job = self.jobs.get(message.chat_id.removeprefix(CHAT_PREFIX))
        if job is None:
            logger.warning("reply for unknown heartbeat chat {}", message.chat_id)
            return
        if not message.is_error and is_all_is_well(message.text, job.ok_token):
            self.suppressed += 1
            logger.info("heartbeat {}: all is well, nothing delivered", job.name)
            return
        if job.deliver_to is None:
            logger.info("heartbeat {} replied (no delivery target): {}", job.name, message.text)
            return
        channel, chat_id = split_target(job.deliver_to)
        self.delivered += 1
        await self._route(
            OutboundMessage(
                channel=channel,
                chat_id=chat_id,
                text=message.text,
                session_key=message.session_key,
                is_error=message.is_error,
                metadata={"heartbeat": job.name},
            )
        )
