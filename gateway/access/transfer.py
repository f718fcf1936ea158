"""Pairing's part of `gateway storage import|export` (`gateway.storage.transfer`): one item
per approval or pending code."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.access.protocol import ApprovedSender, PairingState, PendingRequest
from gateway.access.store import PAIRING_FILE, dump_pairing, parse_pairing
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


def _parse_pairing(text: str) -> PairingState:
    state, bad = parse_pairing(json.loads(text))
    if bad:
        raise ValueError(f"{bad} unreadable entries")
    return state


def _pairing_file_rows(path: Path) -> dict[tuple[str, str, str], tuple[Any, ...]] | None:
    """The pairing file's rows (`_pairing_rows`); None when there is no file."""
    state = read_state_file(path, _parse_pairing)
    return _pairing_rows(state) if state is not None else None


def _pairing_rows(state: PairingState) -> dict[tuple[str, str, str], tuple[Any, ...]]:
    """Every approval and pending request by (table, channel, sender)."""
    rows: dict[tuple[str, str, str], tuple[Any, ...]] = {}
    for a in state.approved.values():
        rows[("approved", a.channel, a.sender_id)] = (a.approved_at, a.label)
    for r in state.pending:
        rows.setdefault(
            ("pending", r.channel, r.sender_id),
            (r.code, r.chat_id, r.label, r.created_at, r.expires_at),
        )
    return rows


def _describe_pairing(which: tuple[str, str, str], row: tuple[Any, ...]) -> tuple[str, str]:
    table, channel, sender = which
    if table == "approved":
        return f"approved {channel}:{sender}", f"approved at {_when(row[0])}"
    return f"pending {channel}:{sender}", f"code expires {_when(row[4])}"


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


_APPROVED = (
    "SELECT approved_at, label FROM gw_pairing_approved WHERE channel = %s AND sender_id = %s"
)

_PENDING = (
    "SELECT code, chat_id, label, created_at, expires_at FROM gw_pairing_pending "
    "WHERE channel = %s AND sender_id = %s"
)


def import_pairing(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """The pairing file's approvals and pending codes (expired ones too: the next write
    on their channel drops them, as in the file) into PostgreSQL, one row per item."""
    path = workspace / PAIRING_FILE
    rows = rows_to_import(transfer, "pairing", path, lambda: _pairing_file_rows(path))
    if rows is None:
        return
    for n, (which, row) in enumerate(rows.items(), start=1):
        table, channel, sender = which
        item, detail = _describe_pairing(which, row)
        with conn.transaction():
            stored = conn.execute(
                (_APPROVED if table == "approved" else _PENDING) + " FOR UPDATE",
                (channel, sender),
            ).fetchone()
            outcome: Outcome
            if stored is not None:
                same = tuple(stored) == row
                outcome = "present" if same else "conflict"
                detail = (
                    "already imported"
                    if same
                    else "the database has another one; nothing changed on either side"
                )
            elif table == "approved":
                conn.execute(
                    "INSERT INTO gw_pairing_approved (channel, sender_id, approved_at, label) "
                    "VALUES (%s, %s, %s, %s)",
                    (channel, sender, *row),
                )
                outcome = "moved"
            else:
                conn.execute(
                    "INSERT INTO gw_pairing_pending (channel, sender_id, code, chat_id, label, "
                    "created_at, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    (channel, sender, *row),
                )
                outcome = "moved"
        transfer.note("pairing", outcome, item, detail, (n, len(rows)))


def export_pairing(conn: psycopg.Connection[Any], workspace: Path, transfer: Transfer) -> None:
    """Approvals and pending codes as the workspace's pairing file."""
    path = workspace / PAIRING_FILE
    approved = conn.execute(
        "SELECT channel, sender_id, approved_at, label FROM gw_pairing_approved "
        "ORDER BY channel, approved_at, sender_id"
    ).fetchall()
    pending = conn.execute(
        "SELECT channel, sender_id, code, created_at, expires_at, chat_id, label "
        "FROM gw_pairing_pending ORDER BY created_at, channel, sender_id"
    ).fetchall()
    state = PairingState(
        approved={
            (str(c), str(s)): ApprovedSender(str(c), str(s), float(at), str(label))
            for c, s, at, label in approved
        },
        pending=tuple(
            PendingRequest(str(c), str(s), str(code), float(made), float(ends), str(chat), str(lb))
            for c, s, code, made, ends, chat, lb in pending
        ),
    )
    rows = _pairing_rows(state)
    transfer.start("pairing", len(rows), path)
    if not rows:
        return
    try:
        there = read_state_file(path, _parse_pairing)
        existing = _pairing_rows(there) if there is not None else None
    except DamagedFile:
        existing = {}  # every item conflicts; the damaged file stays as it is
    write_state_file(
        "pairing", path, rows, existing, dump_pairing(state).encode(), _describe_pairing, transfer
    )
