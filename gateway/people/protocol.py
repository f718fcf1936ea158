"""People across channels: which sender ids are one person, and whose DM a session is.

With `memory.scope = "person"`, a direct conversation's memory is its person's: the
same facts in their DMs on two platforms once an operator links the two ids (`gateway
people link CHANNEL:ID CHANNEL:ID`, each id as its channel writes it). The promises kept
here:

- Only direct conversations ever resolve to a person. A group or channel keeps the
  memory of its own session, so what was said in a group never reaches anyone's DM,
  and one person's DM memory never reaches a group.
- A session is known as a person's DM only from a message that person sent in it
  (`note_dm`, called by the agent for non-group messages), never from its key alone.
- A malformed id is refused with one line saying what an id looks like; nothing is
  stored.
"""

from __future__ import annotations

import functools
import re
from typing import Protocol

from gateway.registry import PersonIds, installed

#: The prefix of a person's memory scope (a sender id cannot start with it).
PERSON_SCOPE_PREFIX = "person:"


def person_channels() -> dict[str, PersonIds]:
    """The installed chat platforms people can be linked on, with what a sender id looks
    like on each (their `ChannelSpec.people`)."""
    return {name: spec.people for name, spec in installed().specs.items() if spec.people}


@functools.cache
def dm_channels() -> frozenset[str]:
    """Channels whose direct conversations can belong to a person (a DM's session key
    is the person's sender id there)."""
    return frozenset(name for name, ids in person_channels().items() if ids.dm_keyed)


class PeopleError(ValueError):
    """A user-caused error (a malformed or unknown id); the message says what to do."""


def parse_sender_id(text: str) -> str:
    """`channel:user` checked against what its platform's user ids look like."""
    channel, sep, user = text.strip().partition(":")
    patterns = person_channels()
    known = ", ".join(sorted(patterns))
    if not sep or channel not in patterns:
        raise PeopleError(
            f"{text!r} is not a sender id: write CHANNEL:USER_ID with CHANNEL one of {known}"
        )
    ids = patterns[channel]
    if not re.fullmatch(ids.pattern, user):
        raise PeopleError(f"{text!r} is not a sender id: {ids.hint}")
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
