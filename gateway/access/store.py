"""Pairing in the workspace: approved senders and pending codes in one JSON file
(`pairing.json`), replaced atomically under a file lock, so the daemon and the operator's
`gateway pairing ...` commands can both write it; a damaged file is moved aside and
reported, never overwritten."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from gateway.access.protocol import (
    EMPTY_STATE,
    ApprovedSender,
    PairingListing,
    PairingState,
    PendingRequest,
    normalize_code,
    pairing_listing,
)
from gateway.fsutil import atomic_write_text, ensure_private_dir

FILE_VERSION = 1

#: The pairing file, in the workspace folder.
PAIRING_FILE = "pairing.json"

_T = TypeVar("_T")


def _as_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _as_time(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number")
    return float(value)


def parse_pairing(data: Any) -> tuple[PairingState, int]:
    """The state in a decoded pairing file and how many entries were unreadable.
    Raises ValueError when the file's shape is wrong as a whole."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    version = data.get("version", FILE_VERSION)
    if version != FILE_VERSION:
        raise ValueError(f"unknown version {version!r}")
    approved_raw, pending_raw = data.get("approved", []), data.get("pending", [])
    if not isinstance(approved_raw, list) or not isinstance(pending_raw, list):
        raise ValueError("'approved' and 'pending' must be lists")
    bad = 0
    approved: dict[tuple[str, str], ApprovedSender] = {}
    for item in approved_raw:
        try:
            entry = ApprovedSender(
                channel=_as_str(item.get("channel"), "channel"),
                sender_id=_as_str(item.get("sender_id"), "sender_id"),
                approved_at=_as_time(item.get("approved_at"), "approved_at"),
                label=str(item.get("label") or ""),
            )
        except (ValueError, AttributeError):
            bad += 1
            continue
        approved[(entry.channel, entry.sender_id)] = entry
    pending: list[PendingRequest] = []
    for item in pending_raw:
        try:
            pending.append(
                PendingRequest(
                    channel=_as_str(item.get("channel"), "channel"),
                    sender_id=_as_str(item.get("sender_id"), "sender_id"),
                    code=normalize_code(_as_str(item.get("code"), "code")),
                    created_at=_as_time(item.get("created_at"), "created_at"),
                    expires_at=_as_time(item.get("expires_at"), "expires_at"),
                    chat_id=str(item.get("chat_id") or ""),
                    label=str(item.get("label") or ""),
                )
            )
        except (ValueError, AttributeError):
            bad += 1
    return PairingState(approved=approved, pending=tuple(pending)), bad


def dump_pairing(state: PairingState) -> str:
    approved = sorted(state.approved.values(), key=lambda a: (a.channel, a.approved_at))
    return json.dumps(
        {
            "version": FILE_VERSION,
            "approved": [
                {
                    "channel": a.channel,
                    "sender_id": a.sender_id,
                    "approved_at": a.approved_at,
                    "label": a.label,
                }
                for a in approved
            ],
            "pending": [
                {
                    "channel": r.channel,
                    "sender_id": r.sender_id,
                    "chat_id": r.chat_id,
                    "code": r.code,
                    "created_at": r.created_at,
                    "expires_at": r.expires_at,
                    "label": r.label,
                }
                for r in state.pending
            ],
        },
        ensure_ascii=False,
        indent=1,
    )


class PairingStore:
    """Approved senders and pending codes in one JSON file, shared between processes.

    Blocking file I/O: call it from a worker thread when on the event loop (as
    `AccessGate` does). Reads are served from memory while the file is unchanged
    (same inode, size and mtime), so a change made by another process is seen on the
    next read. Every change happens under an exclusive `flock` on `<file>.lock`, on a
    fresh read of the file, and is written atomically.
    """

    def __init__(self, path: str | Path, *, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._clock = clock
        self._thread_lock = threading.Lock()
        self._cached: tuple[tuple[int, int, int], PairingState] | None = None
        #: Set when a damaged file was moved aside: say it where the operator looks.
        self.load_error: str | None = None

    @property
    def where(self) -> str:
        return str(self.path)

    # -- reading -------------------------------------------------------------------

    def state(self) -> PairingState:
        """The current state (from memory when the file has not changed)."""
        identity = self._identity()
        if identity is None:
            return EMPTY_STATE
        if self._cached is not None and self._cached[0] == identity:
            return self._cached[1]
        try:
            return self._read()
        except _Damaged:
            with self._locked():
                return self._read_or_set_aside()

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> PairingState:
        """Read and parse the file; raises `_Damaged` if it cannot be used as it is."""
        identity = self._identity()
        if identity is None:
            return EMPTY_STATE
        raw = self.path.read_bytes()
        try:
            state, bad = parse_pairing(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            raise _Damaged(str(exc), EMPTY_STATE) from None
        if bad:
            raise _Damaged(f"{bad} unreadable entries", state)
        self._cached = (identity, state)
        return state

    def _read_or_set_aside(self) -> PairingState:
        """Under the lock: the state, after moving a damaged file aside (keeping what
        could be read of it)."""
        try:
            return self._read()
        except _Damaged as damage:
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            counter = 1
            while aside.exists():
                aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{counter}")
                counter += 1
            self.path.rename(aside)
            self.load_error = (
                f"{self.path} was damaged ({damage.problem}); moved to {aside.name}. "
                "Approvals that could not be read must be given again."
            )
            logger.error("pairing file damaged: {}", self.load_error)
            if damage.salvaged.approved or damage.salvaged.pending:
                self._write(damage.salvaged)
            else:
                self._cached = None
            return damage.salvaged

    # -- writing -------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            ensure_private_dir(self.path.parent)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the flock

    def _write(self, state: PairingState) -> None:
        atomic_write_text(self.path, dump_pairing(state))
        identity = self._identity()
        self._cached = (identity, state) if identity is not None else None

    def _update(self, change: Callable[[PairingState, float], tuple[PairingState, _T]]) -> _T:
        """Apply `change` to a fresh read under the lock; write if it made a new state.
        Expired requests are dropped on every write."""
        with self._locked():
            state = self._read_or_set_aside()
            now = self._clock()
            new, result = change(state, now)
            if new is not state:
                new = replace(new, pending=tuple(r for r in new.pending if r.live(now)))
                self._write(new)
            return result

    def add_pending(self, request: PendingRequest, *, max_pending: int) -> PendingRequest | None:
        """Record `request`. Returns the request on file for that sender (an earlier
        live one wins a race), or None when the channel has `max_pending` live ones."""

        def change(state: PairingState, now: float) -> tuple[PairingState, PendingRequest | None]:
            existing = state.pending_for(request.channel, request.sender_id, now)
            if existing is not None:
                return state, existing
            if len(state.live_pending(request.channel, now)) >= max_pending:
                return state, None
            return replace(state, pending=(*state.pending, request)), request

        return self._update(change)

    def approve(self, channel: str, code: str) -> str | None:
        """Approve the sender who got `code` on `channel`; their id, or None when no
        live request has that code."""
        wanted = normalize_code(code)

        def change(state: PairingState, now: float) -> tuple[PairingState, str | None]:
            for request in state.live_pending(channel, now):
                if secrets.compare_digest(request.code, wanted):
                    approved = dict(state.approved)
                    approved[(channel, request.sender_id)] = ApprovedSender(
                        channel, request.sender_id, now, request.label
                    )
                    pending = tuple(r for r in state.pending if r is not request)
                    return PairingState(approved, pending), request.sender_id
            return state, None

        return self._update(change)

    def revoke(self, channel: str, sender_id: str) -> bool:
        """Withdraw an approval (and any pending request of that sender)."""

        def change(state: PairingState, now: float) -> tuple[PairingState, bool]:
            had = (channel, sender_id) in state.approved
            pending = tuple(
                r for r in state.pending if (r.channel, r.sender_id) != (channel, sender_id)
            )
            if not had and len(pending) == len(state.pending):
                return state, False
            approved = {k: v for k, v in state.approved.items() if k != (channel, sender_id)}
            return PairingState(approved, pending), had

        return self._update(change)

    def is_approved(self, channel: str, sender_id: str) -> bool:
        return self.state().is_approved(channel, sender_id)

    def list(self, channel: str | None = None) -> PairingListing:
        """Approved senders and live pending requests, oldest first."""
        return pairing_listing(self.state(), channel, self._clock())


class _Damaged(Exception):
    def __init__(self, problem: str, salvaged: PairingState) -> None:
        super().__init__(problem)
        self.problem = problem
        self.salvaged = salvaged
