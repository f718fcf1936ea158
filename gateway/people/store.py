"""Who is who in the workspace: `people.json`, replaced atomically under a file lock."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway.fsutil import atomic_write_text, ensure_private_dir, file_lock
from gateway.people.protocol import PeopleError, canonical_ids

PEOPLE_FILE = "people.json"


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
            person = canonical_ids(sorted(members))
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
                    links[member] = canonical_ids(rest)
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
