"""Context policies as pure functions: what the LLM sees, and where a compaction cuts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.llm import LLMMessage
from gateway.sessions.entries import BranchEntry, CustomMessageEntry

BRANCH_SUMMARY_PREFIX = "[Summary of a conversation branch that was left]\n"


@dataclass(frozen=True, slots=True)
class SessionContext:
    """The model's view of the current branch.

    ``entry_ids[i]`` is the entry that produced ``messages[i]``; ``summary`` is the latest
    compaction summary on the branch (None when there is none or it is empty).
    """

    messages: tuple[LLMMessage, ...] = ()
    entry_ids: tuple[str, ...] = ()
    summary: str | None = None
    model: str | None = None
    thinking_level: str | None = None


def branch_summary_message(entry: BranchEntry) -> LLMMessage:
    """How a branch summary reaches the model: a user-role note (works with every API)."""
    return LLMMessage(role="user", content=BRANCH_SUMMARY_PREFIX + entry.summary)


def custom_message(entry: CustomMessageEntry) -> LLMMessage:
    """How an extension's custom message reaches the model: as a user-role message."""
    return LLMMessage(role="user", content=entry.content)


def choose_cut(messages: Sequence[LLMMessage], keep_last: int) -> int:
    """Index of the first message to keep so that about ``keep_last`` messages remain.

    Promise: the cut never separates an assistant message with tool calls from its tool
    results. If the naive cut lands on a tool result, it moves earlier until the kept
    part starts at the assistant message that asked for those tools; so the result may
    keep more than ``keep_last`` messages, never fewer.
    """
    if keep_last < 0:
        raise ValueError("keep_last must be >= 0")
    cut = max(0, len(messages) - keep_last)
    while 0 < cut < len(messages) and messages[cut].role == "tool":
        cut -= 1
    return cut
