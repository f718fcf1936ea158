"""Where the email channel keeps how far it has read each mailbox: the folder's
UIDVALIDITY and the highest UID it has taken in. A file in the workspace
(`email-state.json`, replaced atomically), or a PostgreSQL row per mailbox in the shared
mode (`gw_email_mailboxes`), so a replica that takes over the mailbox goes on where the
previous one stopped.

The mark is only ever raised, and only for mail that is journaled (or settled): losing a
write of it costs a few messages fetched again, which the journal drops as duplicates.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio.to_thread
from loguru import logger

from gateway.fsutil import atomic_write_text

STATE_FILE = "email-state.json"
FILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class MailboxMark:
    """How far a folder was read: every message with `uid <= last_uid` under this
    `uidvalidity` is in the journal, settled, or was there before the first start."""

    uidvalidity: int
    last_uid: int


class MailboxState(Protocol):
    """The marks of the mailboxes the channel reads, by mailbox name (user@host/folder)."""

    async def load(self, mailbox: str) -> MailboxMark | None: ...

    async def save(self, mailbox: str, mark: MailboxMark) -> None: ...


class FileMailboxState:
    """Marks in a JSON file in the workspace; one gateway per workspace writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # Unreadable: start as at the first start (unseen mail; the journal drops
            # what it has already answered). Replaced by the next save.
            logger.error("email: {} is unreadable ({}); reading unseen mail again", self.path, exc)
            return {}
        boxes = data.get("mailboxes") if isinstance(data, dict) else None
        return boxes if isinstance(boxes, dict) else {}

    async def load(self, mailbox: str) -> MailboxMark | None:
        boxes = await anyio.to_thread.run_sync(self._read)
        entry = boxes.get(mailbox)
        if not isinstance(entry, dict):
            return None
        try:
            return MailboxMark(int(entry["uidvalidity"]), int(entry["last_uid"]))
        except (TypeError, KeyError, ValueError):
            return None

    async def save(self, mailbox: str, mark: MailboxMark) -> None:
        def write() -> None:
            boxes = self._read()
            boxes[mailbox] = {"uidvalidity": mark.uidvalidity, "last_uid": mark.last_uid}
            text = json.dumps({"version": FILE_VERSION, "mailboxes": boxes}, indent=1)
            atomic_write_text(self.path, text + "\n")

        await anyio.to_thread.run_sync(write)


Connect = Callable[[], AbstractAsyncContextManager[Any]]


class PostgresMailboxState:
    """Marks in `gw_email_mailboxes`, shared by the replicas (one of which reads the
    mailbox at a time). A save never lowers a mark of the same UIDVALIDITY: a replica
    that was paused past its role cannot move another one's mark back."""

    def __init__(self, connection: Connect) -> None:
        self._connection = connection

    async def load(self, mailbox: str) -> MailboxMark | None:
        async with self._connection() as conn:
            cur = await conn.execute(
                "SELECT uidvalidity, last_uid FROM gw_email_mailboxes WHERE mailbox = %s",
                (mailbox,),
            )
            row = await cur.fetchone()
        return None if row is None else MailboxMark(int(row[0]), int(row[1]))

    async def save(self, mailbox: str, mark: MailboxMark) -> None:
        async with self._connection() as conn:
            await conn.execute(
                "INSERT INTO gw_email_mailboxes (mailbox, uidvalidity, last_uid) "
                "VALUES (%s, %s, %s) ON CONFLICT (mailbox) DO UPDATE SET "
                "uidvalidity = EXCLUDED.uidvalidity, last_uid = CASE "
                "WHEN gw_email_mailboxes.uidvalidity = EXCLUDED.uidvalidity "
                "THEN GREATEST(gw_email_mailboxes.last_uid, EXCLUDED.last_uid) "
                "ELSE EXCLUDED.last_uid END, updated_at = now()",
                (mailbox, mark.uidvalidity, mark.last_uid),
            )
