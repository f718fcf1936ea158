"""Going back in a session: `/undo` and re-running an edited message, both as branches.

Nothing is ever removed: both move the session's leaf with a `leaf` entry (the
tree's durable pointer), so the abandoned exchange stays in the file as a side
branch that `sessions show --tree` still lists, and a restart finds the leaf where
it was left.

An edit re-runs only the branch's latest user message: a turn further back has
answers (and maybe tool results) built on it, and rewriting it silently would
drop everything after it from the model's view. An older edit gets a short notice
(`OLD_EDIT_TEXT`) instead: the person saw a change they made go unanswered, so
they are told why rather than left to wonder (a log line alone would not reach
them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.agent.turns import META_MESSAGE_ID, META_STEERED
from gateway.messages import MERGED_IDS_KEY, META_POST_ID
from gateway.sessions.entries import Entry, MessageEntry

if TYPE_CHECKING:
    from gateway.llm.types import LLMMessage
    from gateway.sessions import Session

OLD_EDIT_TEXT = (
    "I only redo my answer when you edit your latest message. "
    "Send the changed text as a new message if you'd like an answer to it."
)
NOTHING_TO_UNDO_TEXT = "There is nothing to undo in this conversation."


def _names(meta: Mapping[str, Any] | None, post_id: str) -> bool:
    if not meta:
        return False
    merged = meta.get(MERGED_IDS_KEY)
    return post_id in (meta.get(META_POST_ID), meta.get(META_MESSAGE_ID)) or (
        isinstance(merged, list) and post_id in merged
    )


def _is_user(entry: Entry) -> bool:
    return isinstance(entry, MessageEntry) and entry.message.role == "user"


def last_user_entry(branch: Sequence[Entry]) -> MessageEntry | None:
    """The branch's latest user message (None: the branch has none)."""
    for entry in reversed(branch):
        if isinstance(entry, MessageEntry) and entry.message.role == "user":
            return entry
    return None


@dataclass(frozen=True, slots=True)
class EditPlan:
    """What an edit of the platform message `post_id` does: `rerun` (the leaf is now
    before the edited message, the turn runs again from there) or not (`OLD_EDIT_TEXT`)."""

    rerun: bool
    branched_from: str | None = None  # the entry the new branch hangs off


def plan_edit(
    branch: Sequence[Entry], entries: Sequence[Entry], leaf_id: str | None, post_id: str
) -> EditPlan:
    """Pure policy: what an edit of `post_id` does, given the session's current
    branch (root to leaf), all its entries (file order) and its leaf.

    Re-run when the branch's latest user message carries `post_id`. Also when the
    leaf already sits where that message hung (a crash between the `leaf` entry and
    the new message): the edit then goes on without moving the leaf again.
    """
    latest = last_user_entry(branch)
    if latest is not None and _names(latest.meta, post_id):
        return EditPlan(rerun=True, branched_from=latest.parent_id)
    for entry in reversed(entries):
        if _is_user(entry) and entry.parent_id == leaf_id:
            assert isinstance(entry, MessageEntry)
            if _names(entry.meta, post_id):
                return EditPlan(rerun=True, branched_from=leaf_id)
    return EditPlan(rerun=False)


def branch_for_edit(session: Session, post_id: str) -> EditPlan:
    """Move `session`'s leaf to just before its latest user message when that message
    is the platform message `post_id` (blocking: run in a worker thread)."""
    plan = plan_edit(session.get_branch(), session.entries, session.leaf_id, post_id)
    if plan.rerun and session.leaf_id != plan.branched_from:
        session.branch(plan.branched_from)
    return plan


@dataclass(frozen=True, slots=True)
class Undone:
    """What `/undo` took back: the person's message, and whether an answer to it was
    taken back too (a message that never got one, its turn failed or stopped, has none)."""

    entry: MessageEntry
    answered: bool

    @property
    def id(self) -> str:
        return self.entry.id

    @property
    def message(self) -> LLMMessage:
        return self.entry.message


def undo_last_exchange(session: Session) -> Undone | None:
    """Move the leaf back to just before the branch's latest user message (the
    message, the answer and any tool calls between leave the model's view); returns
    what was undone, or None when there is nothing to undo (blocking). Messages that
    joined that message's turn (the steer mode) go with it: the turn is one exchange."""
    branch = session.get_branch()
    latest = last_user_entry(branch)
    while latest is not None and latest.meta and latest.meta.get(META_STEERED):
        latest = last_user_entry(branch[: branch.index(latest)])
    if latest is None:
        return None
    after = branch[branch.index(latest) + 1 :]
    answered = any(
        isinstance(e, MessageEntry) and e.message.role == "assistant" and e.message.content
        for e in after
    )
    session.branch(latest.parent_id)
    return Undone(latest, answered)
