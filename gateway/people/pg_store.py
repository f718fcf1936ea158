"""Who is who in PostgreSQL (`gw_people`), shared by replicas."""

from __future__ import annotations

from typing import Any

from gateway.people.protocol import canonical_ids


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
            person = canonical_ids(members)
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
                    "UPDATE gw_people SET person = %s WHERE person = %s",
                    (canonical_ids(rest), row[0]),
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
