"""People's part of `gateway storage import|export` (`gateway.storage.transfer`): one item
per person with all its ids, one per direct conversation's owner."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.people.store import PEOPLE_FILE, dump_people, parse_people
from gateway.plumbing.items import (
    DamagedFile,
    Outcome,
    Transfer,
    read_state_file,
    rows_to_import,
    write_state_file,
)

if TYPE_CHECKING:
    import psycopg


#: ("person", person id) -> the ids linked as that person (sorted), or
#: ("dm", session key) -> the sender whose direct conversation it is
PeopleRows = dict[tuple[str, str], tuple[str, ...] | str]


def _people_file_rows(path: Path) -> PeopleRows | None:
    """people.json's rows (`_people_rows`); None when there is no file."""
    data = read_state_file(path, parse_people)
    return _people_rows(data) if data is not None else None


def _people_rows(data: dict[str, dict[str, str]]) -> PeopleRows:
    groups: dict[str, list[str]] = {}
    for sender, person in data["links"].items():
        groups.setdefault(person, []).append(sender)
    rows: PeopleRows = {("person", p): tuple(sorted(ids)) for p, ids in sorted(groups.items())}
    rows.update({("dm", key): sender for key, sender in sorted(data["dms"].items())})
    return rows


def _people_data(rows: PeopleRows) -> dict[str, dict[str, str]]:
    data: dict[str, dict[str, str]] = {"links": {}, "dms": {}}
    for (_, name), value in rows.items():
        if isinstance(value, tuple):
            data["links"].update(dict.fromkeys(value, name))
        else:
            data["dms"][name] = value
    return data


def _describe_people(which: tuple[str, str], value: tuple[str, ...] | str) -> tuple[str, str]:
    name = which[1]
    if isinstance(value, tuple):
        return f"person {name}", f"linked ids {', '.join(value)}"
    return f"dm {name}", f"the direct conversation of {value}"


def _store_person(
    conn: psycopg.Connection[Any], person: str, ids: tuple[str, ...]
) -> tuple[Outcome, str]:
    conn.execute("LOCK TABLE gw_people IN SHARE ROW EXCLUSIVE MODE")  # as `link` does
    stored = dict(
        conn.execute(
            "SELECT sender_id, person FROM gw_people WHERE sender_id = ANY(%s) OR person = %s",
            (list(ids), person),
        ).fetchall()
    )
    if not stored:
        conn.cursor().executemany(
            "INSERT INTO gw_people (sender_id, person) VALUES (%s, %s)",
            [(sender, person) for sender in ids],
        )
        return "moved", f"linked ids {', '.join(ids)}"
    if set(stored.values()) == {person} and set(ids) <= set(stored):
        more = len(stored) - len(ids)
        return "present", "already imported" + (
            f"; the database links {more} more ids to them" if more else ""
        )
    there = ", ".join(f"{s} -> {p}" for s, p in sorted(stored.items()))
    return "conflict", (
        f"the database links these ids otherwise ({there}); nothing changed on either side"
    )


def import_people(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """People links and DM owners (people.json) into ``gw_people`` and ``gw_people_dms``:
    one item per person (all its ids, in one transaction: a person is never half linked)
    and one per direct conversation."""
    path = workspace / PEOPLE_FILE
    rows = rows_to_import(transfer, "people", path, lambda: _people_file_rows(path))
    if rows is None:
        return
    for n, (which, value) in enumerate(rows.items(), start=1):
        item, detail = _describe_people(which, value)
        outcome: Outcome = "moved"
        with conn.transaction():
            if isinstance(value, tuple):
                outcome, detail = _store_person(conn, which[1], value)
            else:
                created = conn.execute(
                    "INSERT INTO gw_people_dms (session_key, sender_id) VALUES (%s, %s) "
                    "ON CONFLICT (session_key) DO NOTHING RETURNING session_key",
                    (which[1], value),
                ).fetchone()
                if created is None:
                    row = conn.execute(
                        "SELECT sender_id FROM gw_people_dms WHERE session_key = %s", (which[1],)
                    ).fetchone()
                    assert row is not None
                    if row[0] == value:
                        outcome, detail = "present", "already imported"
                    else:
                        outcome = "conflict"
                        detail = (
                            f"the database has it as {row[0]}'s; nothing changed on either side"
                        )
        transfer.note("people", outcome, item, detail, (n, len(rows)))


def export_people(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """People links and DM owners as the workspace's people.json."""
    path = workspace / PEOPLE_FILE
    links = conn.execute("SELECT sender_id, person FROM gw_people").fetchall()
    dms = conn.execute("SELECT session_key, sender_id FROM gw_people_dms").fetchall()
    data = {
        "links": {str(s): str(p) for s, p in links},
        "dms": {str(k): str(s) for k, s in dms},
    }
    rows = _people_rows(data)
    transfer.start("people", len(rows), path)
    if not rows:
        return
    try:
        there = read_state_file(path, parse_people)
        existing = _people_rows(there) if there is not None else None
    except DamagedFile:
        existing = {}
    data_bytes = dump_people(_people_data(rows)).encode()
    write_state_file("people", path, rows, existing, data_bytes, _describe_people, transfer)
