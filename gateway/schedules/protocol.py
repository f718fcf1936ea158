"""Scheduled jobs (reminders and tasks set from chat) and the protocol of where they live
(`JobStore`): the workspace's schedules.json (`gateway.schedules.store`) or PostgreSQL
(`gateway.schedules.pg_store`). The promises of a run are `gateway.agent.schedule_tools`'s
and `channels.schedules`'."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal, Protocol

from gateway.schedules.schedule import cron_next, zone

#: Metadata of a message a scheduled job sends into its conversation: the job's id.
META_SCHEDULE = "schedule"

Clock = Callable[[], datetime]


def utc_now() -> datetime:
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


class JobStore(Protocol):
    """Where jobs live: a file (`FileJobStore`), or PostgreSQL shared by replicas
    (`gateway.schedules.pg_store.PostgresJobStore`)."""

    def add(self, job: ScheduledJob, *, limit: int) -> bool: ...
    def jobs(self, owner: str | None = None) -> list[ScheduledJob]: ...
    def remove(self, job_id: str, *, owner: str | None = None) -> ScheduledJob | None: ...
    def advance(self, job_id: str, expected: datetime, new_next: datetime | None) -> bool: ...
    def take_run(self, owner: str, day: date, fire_id: str, budget: int) -> RunGrant: ...
