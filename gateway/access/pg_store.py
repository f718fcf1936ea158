"""DM pairing in PostgreSQL: approvals and pending codes shared by every gateway replica.

The same rules as the pairing file (`gateway.access.protocol.PairingBackend`): one live request per
sender, an earlier one winning a race; at most `max_pending` live requests per channel;
an expired request never counts and is dropped by the next write on its channel; a code
approves only a live request of its channel. An approval committed on one replica is
seen by the next message on any replica (`state` reads the tables each time).

Writes on one channel are serialized by a transaction-level advisory lock on the channel,
so the count of live requests and the one-request-per-sender rule hold across replicas.
PostgreSQL errors become `StorageUnavailable` (the access gate then fails closed).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from gateway.access.protocol import (
    ApprovedSender,
    PairingListing,
    PairingState,
    PendingRequest,
    normalize_code,
    pairing_listing,
)
from gateway.plumbing.postgres import StorageUnavailable

if TYPE_CHECKING:
    import psycopg
    from psycopg_pool import ConnectionPool

_CHANNEL_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtext(current_schema() || ':pairing'), hashtext(%s))"
)
_PENDING_COLUMNS = "channel, sender_id, code, created_at, expires_at, chat_id, label"


def _pending(row: tuple[Any, ...]) -> PendingRequest:
    channel, sender, code, created, expires, chat, label = row
    return PendingRequest(
        str(channel), str(sender), str(code), float(created), float(expires), str(chat), str(label)
    )


class PostgresPairingStore:
    """Approved senders and pending codes in PostgreSQL (`PairingBackend`)."""

    def __init__(
        self, pool: ConnectionPool, *, where: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._pool = pool
        self._where = where
        self._clock = clock
        self.load_error: str | None = None  # rows cannot be half-written: nothing to report

    @property
    def where(self) -> str:
        return self._where

    @contextmanager
    def _transaction(self, channel: str | None = None) -> Iterator[psycopg.Connection[Any]]:
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            with self._pool.connection() as conn, conn.transaction():
                if channel is not None:
                    conn.execute(_CHANNEL_LOCK, (channel,))
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise StorageUnavailable(f"PostgreSQL does not answer ({exc})") from None

    # -- reading -------------------------------------------------------------------

    def state(self) -> PairingState:
        """Every approval and every live pending request, read now."""
        with self._transaction() as conn:
            approved = conn.execute(
                "SELECT channel, sender_id, approved_at, label FROM gw_pairing_approved"
            ).fetchall()
            pending = conn.execute(
                f"SELECT {_PENDING_COLUMNS} FROM gw_pairing_pending WHERE expires_at > %s",
                (self._clock(),),
            ).fetchall()
        return PairingState(
            approved={
                (str(c), str(s)): ApprovedSender(str(c), str(s), float(at), str(label))
                for c, s, at, label in approved
            },
            pending=tuple(_pending(tuple(r)) for r in pending),
        )

    def is_approved(self, channel: str, sender_id: str) -> bool:
        with self._transaction() as conn:
            row = conn.execute(
                "SELECT 1 FROM gw_pairing_approved WHERE channel = %s AND sender_id = %s",
                (channel, sender_id),
            ).fetchone()
        return row is not None

    def list(self, channel: str | None = None) -> PairingListing:
        return pairing_listing(self.state(), channel, self._clock())

    # -- writing -------------------------------------------------------------------

    def _drop_expired(self, conn: psycopg.Connection[Any], channel: str, now: float) -> None:
        conn.execute(
            "DELETE FROM gw_pairing_pending WHERE channel = %s AND expires_at <= %s",
            (channel, now),
        )

    def add_pending(self, request: PendingRequest, *, max_pending: int) -> PendingRequest | None:
        """Record `request`; the live request on file for that sender if there is one,
        None when the channel has `max_pending` live ones."""
        with self._transaction(request.channel) as conn:
            now = self._clock()
            self._drop_expired(conn, request.channel, now)
            existing = conn.execute(
                f"SELECT {_PENDING_COLUMNS} FROM gw_pairing_pending "
                "WHERE channel = %s AND sender_id = %s",
                (request.channel, request.sender_id),
            ).fetchone()
            if existing is not None:
                return _pending(tuple(existing))
            count = conn.execute(
                "SELECT count(*) FROM gw_pairing_pending WHERE channel = %s", (request.channel,)
            ).fetchone()
            if count is not None and int(count[0]) >= max_pending:
                return None
            conn.execute(
                f"INSERT INTO gw_pairing_pending ({_PENDING_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (
                    request.channel,
                    request.sender_id,
                    request.code,
                    request.created_at,
                    request.expires_at,
                    request.chat_id,
                    request.label,
                ),
            )
            return request

    def approve(self, channel: str, code: str) -> str | None:
        """Approve the sender holding `code` on `channel`; their id, or None when no
        live request has that code."""
        wanted = normalize_code(code)
        with self._transaction(channel) as conn:
            now = self._clock()
            self._drop_expired(conn, channel, now)
            rows = conn.execute(
                f"SELECT {_PENDING_COLUMNS} FROM gw_pairing_pending WHERE channel = %s",
                (channel,),
            ).fetchall()
            for request in map(_pending, map(tuple, rows)):
                if not secrets.compare_digest(request.code, wanted):
                    continue
                conn.execute(
                    "INSERT INTO gw_pairing_approved (channel, sender_id, approved_at, label) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (channel, sender_id) DO UPDATE SET "
                    "approved_at = EXCLUDED.approved_at, label = EXCLUDED.label",
                    (channel, request.sender_id, now, request.label),
                )
                conn.execute(
                    "DELETE FROM gw_pairing_pending WHERE channel = %s AND sender_id = %s",
                    (channel, request.sender_id),
                )
                return request.sender_id
        return None

    def revoke(self, channel: str, sender_id: str) -> bool:
        """Withdraw an approval (and any pending request of that sender); True if the
        sender was approved."""
        with self._transaction(channel) as conn:
            conn.execute(
                "DELETE FROM gw_pairing_pending WHERE channel = %s AND sender_id = %s",
                (channel, sender_id),
            )
            cur = conn.execute(
                "DELETE FROM gw_pairing_approved WHERE channel = %s AND sender_id = %s",
                (channel, sender_id),
            )
            return bool(cur.rowcount > 0)
