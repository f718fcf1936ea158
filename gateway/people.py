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

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from gateway.fsutil import atomic_write_text, ensure_private_dir, file_lock

PEOPLE_FILE = "people.json"
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


def _canonical(ids: list[str]) -> str:
    return min(ids)


def parse_people(text: str) -> dict[str, dict[str, str]]:
    """people.json's `{"links": {id: person}, "dms": {session key: id}}`; ValueError
    (saying what) when the text is not that shape."""
    raw: Any = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    data: dict[str, dict[str, str]] = {}
    for part in ("links", "dms"):
        found = raw.get(part) or {}
        if not isinstance(found, dict):
            raise ValueError(f"{part!r} must be an object")
        bad = sum(not isinstance(k, str) or not isinstance(v, str) for k, v in found.items())
        if bad:
            raise ValueError(f"{bad} unreadable {part} entries (ids must be strings)")
        data[part] = dict(found)
    return data


def dump_people(data: dict[str, dict[str, str]]) -> str:
    """people.json's text for `data` (keys sorted)."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


class FilePeopleStore:
    """`people.json` in the workspace: {"links": {id: person}, "dms": {key: id}},
    rewritten atomically on each change (changes are rare: an operator's command, a
    person's first DM message). Every change is a fresh read, the change and the write
    under an exclusive `flock` on `people.json.lock` (as the pairing file's): two
    processes changing it at once (two `gateway people link`, a gateway noting a DM)
    never lose one of the changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, str]] = {"links": {}, "dms": {}}
        self._stamp: tuple[int, int, int] | None = None

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, dict[str, str]]]:
        """The data as on disk now, to change and save, held by this process alone."""
        with self._lock:
            ensure_private_dir(self.path.parent)
            with file_lock(self.lock_path):
                self._stamp = None  # read again: the stat may not show another's write
                yield self._load()

    def _load(self) -> dict[str, dict[str, str]]:
        # One stat per call: a link made by `gateway people link` in another process
        # is seen by a running gateway at its next look-up.
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._data, self._stamp = {"links": {}, "dms": {}}, None
            return self._data
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                self._data = parse_people(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise PeopleError(f"{self.path} cannot be read ({exc}); fix or move it") from None
            self._stamp = stamp
        return self._data

    def _save(self, data: dict[str, dict[str, str]]) -> None:
        atomic_write_text(self.path, dump_people(data))
        st = os.stat(self.path)
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)

    def link(self, ids: list[str]) -> str:
        with self._changing() as data:
            links = data["links"]
            people = {links.get(i, i) for i in ids}
            members = set(ids) | {i for i, p in links.items() if p in people}
            person = _canonical(sorted(members))
            for member in members:
                links[member] = person
            self._save(data)
            return person

    def unlink(self, sender_id: str) -> bool:
        with self._changing() as data:
            links = data["links"]
            person = links.pop(sender_id, None)
            if person is None:
                return False
            rest = sorted(i for i, p in links.items() if p == person)
            for member in rest:
                # The person is renamed after its smallest remaining id; one left alone
                # is no longer linked to anyone.
                if len(rest) == 1:
                    del links[member]
                else:
                    links[member] = _canonical(rest)
            self._save(data)
            return True

    def people(self) -> dict[str, list[str]]:
        with self._lock:
            out: dict[str, list[str]] = {}
            for sender, person in self._load()["links"].items():
                out.setdefault(person, []).append(sender)
            return {p: sorted(ids) for p, ids in sorted(out.items())}

    def person_of(self, sender_id: str) -> str:
        with self._lock:
            return self._load()["links"].get(sender_id, sender_id)

    def note_dm(self, session_key: str, sender_id: str) -> None:
        with self._lock:
            if self._load()["dms"].get(session_key) == sender_id:
                return  # the common case: no lock file, no write
        with self._changing() as data:
            if data["dms"].get(session_key) == sender_id:
                return
            data["dms"][session_key] = sender_id
            self._save(data)

    def dm_owner(self, session_key: str) -> str | None:
        with self._lock:
            return self._load()["dms"].get(session_key)


class PostgresPeopleStore:
    """The shared mode's links (`gw_people`, `gw_people_dms`; migration 0009)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def link(self, ids: list[str]) -> str:
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("LOCK TABLE gw_people IN SHARE ROW EXCLUSIVE MODE")
            rows = conn.execute(
                "SELECT sender_id FROM gw_people WHERE person IN "
                "(SELECT person FROM gw_people WHERE sender_id = ANY(%s))",
                (ids,),
            ).fetchall()
            members = sorted(set(ids) | {r[0] for r in rows})
            person = _canonical(members)
            for member in members:
                conn.execute(
                    "INSERT INTO gw_people (sender_id, person) VALUES (%s, %s) "
                    "ON CONFLICT (sender_id) DO UPDATE SET person = excluded.person",
                    (member, person),
                )
            return person

    def unlink(self, sender_id: str) -> bool:
        with self._pool.connection() as conn, conn.transaction():
            conn.execute("LOCK TABLE gw_people IN SHARE ROW EXCLUSIVE MODE")
            row = conn.execute(
                "DELETE FROM gw_people WHERE sender_id = %s RETURNING person", (sender_id,)
            ).fetchone()
            if row is None:
                return False
            rest = sorted(
                r[0]
                for r in conn.execute(
                    "SELECT sender_id FROM gw_people WHERE person = %s", (row[0],)
                ).fetchall()
            )
            if len(rest) == 1:
                conn.execute("DELETE FROM gw_people WHERE sender_id = %s", (rest[0],))
            elif rest:
                conn.execute(
                    "UPDATE gw_people SET person = %s WHERE person = %s", (_canonical(rest), row[0])
                )
            return True

    def people(self) -> dict[str, list[str]]:
        with self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT person, sender_id FROM gw_people ORDER BY person, sender_id"
            ).fetchall()
        out: dict[str, list[str]] = {}
        for person, sender in rows:
            out.setdefault(str(person), []).append(str(sender))
        return out

    def person_of(self, sender_id: str) -> str:
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT person FROM gw_people WHERE sender_id = %s", (sender_id,)
            ).fetchone()
        return str(row[0]) if row else sender_id

    def note_dm(self, session_key: str, sender_id: str) -> None:
        with self._pool.connection() as conn:
            conn.execute(
                "INSERT INTO gw_people_dms (session_key, sender_id) VALUES (%s, %s) "
                "ON CONFLICT (session_key) DO UPDATE SET sender_id = excluded.sender_id",
                (session_key, sender_id),
            )

    def dm_owner(self, session_key: str) -> str | None:
        with self._pool.connection() as conn:
            row = conn.execute(
                "SELECT sender_id FROM gw_people_dms WHERE session_key = %s", (session_key,)
            ).fetchone()
        return str(row[0]) if row else None


def person_scope(people: PeopleStore, session_key: str) -> str:
    """The memory scope of `session_key` in the person mode: its DM owner's person, or
    the session's own scope (groups, and sessions nobody was seen writing to directly)."""
    owner = people.dm_owner(session_key)
    if owner is None:
        return session_key
    return PERSON_SCOPE_PREFIX + people.person_of(owner)


def cli_link(people: PeopleStore, raw_ids: list[str]) -> str:
    if len(raw_ids) < 2:
        raise PeopleError(
            "link needs two or more ids, e.g. gateway people link telegram:42 slack:U123"
        )
    ids = [parse_sender_id(raw) for raw in raw_ids]
    person = people.link(ids)
    members = people.people().get(person, ids)
    return f"linked as one person ({person}): {', '.join(members)}"


def cli_unlink(people: PeopleStore, raw_id: str) -> str:
    sender = parse_sender_id(raw_id)
    if not people.unlink(sender):
        raise PeopleError(
            f"{sender} is not linked to anyone; `gateway people list` shows the links"
        )
    return f"unlinked {sender}"


def cli_list(people: PeopleStore) -> str:
    found = people.people()
    if not found:
        return "No linked people yet (gateway people link ID ID ...)."
    return "\n".join(f"{person}: {' '.join(ids)}" for person, ids in found.items())
