"""What a session already holds of a turn, found by the platform message id it answers.

The user's session entry carries the id of the platform message it came from
(`meta["message_id"]`, and `meta["merged_message_ids"]` for a merged turn; a message
that joined a running turn has `meta["steered"]` too). After a crash the dispatcher
replays journaled messages; `find_turn` tells the agent loop whether such a message is
in the session already, so the replay never stores it twice and never asks the model
again for a reply the session holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.messages import MERGED_IDS_KEY, META_EDIT_OF, META_POST_ID, InboundMessage
from gateway.sessions.entries import Entry, MessageEntry

META_MESSAGE_ID = "message_id"
#: Meta of a user entry that joined the running turn of an earlier message (the steer
#: mode): it belongs to that turn, whose final reply answers it too.
META_STEERED = "steered"


@dataclass(frozen=True, slots=True)
class EarlierTurn:
    """A turn that began before a crash: its final reply (None: it never finished) and
    that reply's entry id, whether the message is still in the branch's latest turn
    (only then can the turn go on), and the id of the user entry the turn began with
    (the message's own, or for a message that joined a turn, that turn's first).
    Messages that joined a turn (`META_STEERED`) are part of it: they neither end it
    nor start another."""

    reply: str | None
    is_latest: bool
    reply_entry: str | None = None
    turn_entry: str | None = None


def user_entry_meta(inbound: InboundMessage) -> dict[str, Any] | None:
    """The `meta` of the user's session entry: the platform ids it answers, if any."""
    if not inbound.message_id:
        return None
    meta: dict[str, Any] = {META_MESSAGE_ID: inbound.message_id}
    merged = inbound.metadata.get(MERGED_IDS_KEY)
    if merged:
        meta[MERGED_IDS_KEY] = list(merged)
    # An edit's entry answers to the message it changes, so a second edit finds it.
    post_id = inbound.metadata.get(META_EDIT_OF) or inbound.metadata.get(META_POST_ID)
    if post_id and post_id != inbound.message_id:
        meta[META_POST_ID] = str(post_id)
    return meta


def _carries(meta: Mapping[str, Any] | None, message_id: str) -> bool:
    if not meta:
        return False
    merged = meta.get(MERGED_IDS_KEY)
    return meta.get(META_MESSAGE_ID) == message_id or (
        isinstance(merged, list) and message_id in merged
    )


def find_turn(branch: Sequence[Entry], message_id: str) -> EarlierTurn | None:
    """The turn of the user entry carrying `message_id` on `branch` (root to leaf), or
    None when the session does not hold that message."""
    for index in range(len(branch) - 1, -1, -1):
        entry = branch[index]
        if not (
            isinstance(entry, MessageEntry)
            and entry.message.role == "user"
            and _carries(entry.meta, message_id)
        ):
            continue
        first = _turn_entry(branch, index)
        for later in branch[index + 1 :]:
            if not isinstance(later, MessageEntry):
                continue
            message = later.message
            if message.role == "user":
                if later.meta and later.meta.get(META_STEERED):
                    continue  # joined this turn: the turn goes on past it
                return EarlierTurn(reply=None, is_latest=False, turn_entry=first)
            if message.role == "assistant" and not message.tool_calls:
                reply = message.content or ""
                return EarlierTurn(
                    reply=reply, is_latest=True, reply_entry=later.id, turn_entry=first
                )
        return EarlierTurn(reply=None, is_latest=True, turn_entry=first)
    return None


def _turn_entry(branch: Sequence[Entry], index: int) -> str:
    """The id of the user entry that began the turn of `branch[index]` (a user entry):
    itself, or for one that joined a turn, the nearest earlier user entry that did not."""
    for earlier in range(index, -1, -1):
        entry = branch[earlier]
        if (
            isinstance(entry, MessageEntry)
            and entry.message.role == "user"
            and not (entry.meta and entry.meta.get(META_STEERED))
        ):
            return entry.id
    return branch[index].id
