"""How far the email channel has read each mailbox: the folder's UIDVALIDITY and the
highest UID it has taken in, kept as a channel cursor (`gateway.journal.cursors`): the
workspace's cursor file, or in the shared mode `gw_channel_cursors`, written on the
connection that holds the "email watcher" role, so a replica that lost the role cannot
write it any more and the one that took over goes on from it.

The mark is only ever raised, and only for mail that is journaled (or settled): losing a
write of it costs a few messages fetched again, which the journal drops as duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.journal.protocol import CursorStore

#: Cursor names of the email channel: `email:<user>@<host>/<folder>`.
CURSOR_PREFIX = "email:"


@dataclass(frozen=True, slots=True)
class MailboxMark:
    """How far a folder was read: every message with `uid <= last_uid` under this
    `uidvalidity` is in the journal, settled, or was there before the first start."""

    uidvalidity: int
    last_uid: int

    def encode(self) -> str:
        return f"{self.uidvalidity}:{self.last_uid}"

    @classmethod
    def decode(cls, value: str | None) -> MailboxMark | None:
        """The mark a cursor holds; None for none, or one this build cannot read (the
        channel then starts as at a first start: unseen mail, the journal drops what it
        answered)."""
        if value is None:
            return None
        validity, sep, uid = value.partition(":")
        if not sep or not validity.isdigit() or not uid.isdigit():
            return None
        return cls(int(validity), int(uid))


class MailboxMarks:
    """The marks of the mailboxes the channel reads, in a cursor store."""

    def __init__(self, store: CursorStore) -> None:
        self.store = store

    async def load(self, mailbox: str) -> MailboxMark | None:
        return MailboxMark.decode(await self.store.load(CURSOR_PREFIX + mailbox))

    async def save(self, mailbox: str, mark: MailboxMark) -> None:
        await self.store.save(CURSOR_PREFIX + mailbox, mark.encode())
