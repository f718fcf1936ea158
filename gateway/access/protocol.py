"""Pairing's state and the protocol of where it lives (`PairingBackend`): approved senders,
pending codes, and the rules every backend keeps (see `PairingBackend`)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

#: No 0/O, 1/I/L: a code read aloud or copied by hand survives.
CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"

CODE_LENGTH = 8


class PairingError(Exception):
    """An operator command that cannot be done; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A stranger's request to talk to the bot, waiting for an operator's approval."""

    channel: str
    sender_id: str
    code: str
    created_at: float
    expires_at: float
    chat_id: str = ""
    label: str = ""

    def live(self, now: float) -> bool:
        return self.expires_at > now


@dataclass(frozen=True, slots=True)
class ApprovedSender:
    channel: str
    sender_id: str
    approved_at: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class PairingState:
    """A snapshot of the pairing file. Treat it as read-only; stores make new ones."""

    approved: Mapping[tuple[str, str], ApprovedSender] = field(default_factory=dict)
    pending: tuple[PendingRequest, ...] = ()

    def is_approved(self, channel: str, sender_id: str) -> bool:
        return (channel, sender_id) in self.approved

    def live_pending(self, channel: str | None, now: float) -> list[PendingRequest]:
        return [
            r for r in self.pending if r.live(now) and (channel is None or r.channel == channel)
        ]

    def pending_for(self, channel: str, sender_id: str, now: float) -> PendingRequest | None:
        for request in self.pending:
            if request.channel == channel and request.sender_id == sender_id and request.live(now):
                return request
        return None


EMPTY_STATE = PairingState()


def new_pairing_code() -> str:
    """A one-time code: 8 characters from an unambiguous alphabet (about 40 bits)."""
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def normalize_code(code: str) -> str:
    """What an operator typed, as stored: upper case, without spaces or dashes."""
    return "".join(ch for ch in code.upper() if ch not in " -_")


def pairing_reply(request: PendingRequest, now: float) -> str:
    minutes = max(1, round((request.expires_at - now) / 60))
    return (
        "Hi! This assistant only talks to people its operator has approved. "
        f"Your pairing code is {request.code} (valid for {minutes} minutes). "
        "Send it to the operator; once they approve it, just write again."
    )


@dataclass(frozen=True, slots=True)
class PairingListing:
    approved: tuple[ApprovedSender, ...]
    pending: tuple[PendingRequest, ...]


def pairing_listing(state: PairingState, channel: str | None, now: float) -> PairingListing:
    """Approved senders and live pending requests (of `channel`, or all), oldest first."""
    approved = sorted(
        (a for a in state.approved.values() if channel is None or a.channel == channel),
        key=lambda a: (a.channel, a.approved_at),
    )
    pending = sorted(state.live_pending(channel, now), key=lambda r: r.created_at)
    return PairingListing(tuple(approved), tuple(pending))


class PairingBackend(Protocol):
    """Where approvals and pending codes live: the workspace's pairing file
    (`PairingStore`) or PostgreSQL, shared by replicas (`gateway.access.pg_store`). Both
    keep the same rules: one live request per sender (an earlier one wins a race), at
    most `max_pending` live ones per channel, expired ones never count and are dropped
    on writes, a code approves only its live request. Blocking: worker threads."""

    #: A problem the operator should hear about (a damaged file set aside), or None.
    load_error: str | None

    @property
    def where(self) -> str:
        """Where the state lives, for log lines (a path, a redacted URL)."""
        ...

    def state(self) -> PairingState: ...

    def add_pending(
        self, request: PendingRequest, *, max_pending: int
    ) -> PendingRequest | None: ...

    def approve(self, channel: str, code: str) -> str | None: ...

    def revoke(self, channel: str, sender_id: str) -> bool: ...

    def is_approved(self, channel: str, sender_id: str) -> bool: ...

    def list(self, channel: str | None = None) -> PairingListing: ...
