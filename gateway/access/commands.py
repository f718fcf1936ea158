"""`gateway pairing approve|list|revoke`: the operator's answers, over any `PairingBackend`."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.access.protocol import PairingBackend, PairingError, normalize_code


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _who(sender_id: str, label: str) -> str:
    return f"{sender_id} ({label})" if label else sender_id


def cli_pairing_approve(store: PairingBackend, channel: str, code: str) -> str:
    """`gateway pairing approve CHANNEL CODE`; raises PairingError when nothing matches."""
    pending = {r.code: r for r in store.list(channel).pending}
    sender = store.approve(channel, code)
    if sender is None:
        raise PairingError(
            f"no pending request on {channel} has code {normalize_code(code)!r} (codes expire "
            f"after an hour); run `gateway pairing list {channel}` to see the live ones"
        )
    request = pending.get(normalize_code(code))
    label = request.label if request is not None else ""
    return f"Approved {_who(sender, label)} on {channel}. They can write to the assistant now."


def cli_pairing_list(store: PairingBackend, channel: str | None = None) -> str:
    """`gateway pairing list [CHANNEL]`."""
    listing = store.list(channel)
    lines: list[str] = []
    if store.load_error:
        lines += [f"warning: {store.load_error}", ""]
    where = f" on {channel}" if channel else ""
    if listing.approved:
        lines.append(f"Approved{where}:")
        lines += [
            f"  {a.channel}  {_who(a.sender_id, a.label)}  since {_when(a.approved_at)}"
            for a in listing.approved
        ]
    else:
        lines.append(f"No approved senders{where}.")
    if listing.pending:
        lines.append(f"Pending{where} (approve with `gateway pairing approve CHANNEL CODE`):")
        lines += [
            f"  {r.channel}  {_who(r.sender_id, r.label)}  code {r.code}  "
            f"expires {_when(r.expires_at)}"
            for r in listing.pending
        ]
    else:
        lines.append(f"No pending requests{where}.")
    return "\n".join(lines)


def cli_pairing_revoke(store: PairingBackend, channel: str, sender_id: str) -> str:
    """`gateway pairing revoke CHANNEL SENDER`; raises PairingError when not approved."""
    if not store.revoke(channel, sender_id):
        raise PairingError(
            f"{sender_id} is not approved on {channel}; "
            f"`gateway pairing list {channel}` shows who is"
        )
    return f"Revoked {sender_id} on {channel}. Their next message gets a new pairing code."
