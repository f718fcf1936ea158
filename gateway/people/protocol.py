"""People across channels: which sender ids are one person, and whose DM a session is.

With `memory.scope = "person"`, a direct conversation's memory is its person's: the
same facts in their Telegram DM and their Slack DM once an operator links the two ids
(`gateway people link telegram:42 slack:U123`). The promises kept here:

- Only direct conversations ever resolve to a person. A group or channel keeps the
  memory of its own session, so what was said in a group never reaches anyone's DM,
  and one person's DM memory never reaches a group.
- A session is known as a person's DM only from a message that person sent in it
  (`note_dm`, called by the agent for non-group messages), never from its key alone.
- A malformed id is refused with one line saying what an id looks like; nothing is
  stored.
"""

from __future__ import annotations

import re
from typing import Protocol

#: Channels whose direct conversations can belong to a person.
DM_CHANNELS = frozenset({"telegram", "slack", "matrix", "discord"})

#: The prefix of a person's memory scope (a sender id cannot start with it).
PERSON_SCOPE_PREFIX = "person:"

# What a sender id looks like on each platform people can be linked on.
_ID_PATTERNS = {
    "telegram": (
        re.compile(r"[1-9][0-9]{0,19}"),
        "a Telegram user id is a number, e.g. telegram:42",
    ),
    "slack": (re.compile(r"[UW][A-Z0-9]{2,20}"), "a Slack user id looks like slack:U0123ABC"),
    "matrix": (
        re.compile(r"@[a-z0-9._=/+-]+:[A-Za-z0-9.-]+(:[0-9]{1,5})?"),
        "a Matrix user id looks like matrix:@alice:example.org",
    ),
    "discord": (
        re.compile(r"[1-9][0-9]{15,19}"),
        "a Discord user id is a number of 16 to 20 digits, e.g. discord:80351110224678912",
    ),
}


class PeopleError(ValueError):
    """A user-caused error (a malformed or unknown id); the message says what to do."""


def parse_sender_id(text: str) -> str:
    """`channel:user` checked against what its platform's user ids look like."""
    channel, sep, user = text.strip().partition(":")
    known = ", ".join(sorted(_ID_PATTERNS))
    if not sep or channel not in _ID_PATTERNS:
        raise PeopleError(
            f"{text!r} is not a sender id: write CHANNEL:USER_ID with CHANNEL one of {known}"
        )
    pattern, example = _ID_PATTERNS[channel]
    if not pattern.fullmatch(user):
        raise PeopleError(f"{text!r} is not a sender id: {example}")
    return f"{channel}:{user}"


class PeopleStore(Protocol):
    """Links between sender ids and the owners of DM sessions (blocking calls)."""

    def link(self, ids: list[str]) -> str:
        """Make `ids` (already parsed) one person, merging the people they belong to;
        returns the person's id (the smallest id among them)."""

    def unlink(self, sender_id: str) -> bool:
        """Take `sender_id` out of its person; False if it was not linked."""

    def people(self) -> dict[str, list[str]]:
        """Every person with two or more ids: person id -> its ids."""

    def person_of(self, sender_id: str) -> str:
        """The person `sender_id` belongs to (itself when not linked)."""

    def note_dm(self, session_key: str, sender_id: str) -> None:
        """Remember that `session_key` is `sender_id`'s direct conversation."""

    def dm_owner(self, session_key: str) -> str | None: ...


def canonical_ids(ids: list[str]) -> str:
    return min(ids)


def person_scope(people: PeopleStore, session_key: str) -> str:
    """The memory scope of `session_key` in the person mode: its DM owner's person, or
    the session's own scope (groups, and sessions nobody was seen writing to directly)."""
    owner = people.dm_owner(session_key)
    if owner is None:
        return session_key
    return PERSON_SCOPE_PREFIX + people.person_of(owner)
