"""What the model sees: pure functions that turn a session's branch into LLM messages."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.agent.tokens import estimate_message_tokens, estimate_text_tokens
from gateway.llm.types import LLMMessage

INTERRUPTED_TOOL_RESULT = "(no result: this tool call was interrupted before it finished)"


def repair_tool_pairs(messages: Sequence[LLMMessage]) -> list[LLMMessage]:
    """Return `messages` such that every tool result follows the assistant message that
    called it, and every tool call is answered by a result.

    A result whose call is not in view (cut off by the window, or orphaned by a crash)
    is dropped; a call left without a result gets a synthetic one, so a provider never
    sees an orphaned tool result or an unanswered tool call.
    """
    repaired: list[LLMMessage] = []
    pending: dict[str, str] = {}  # call id -> function name, in call order

    def answer_pending() -> None:
        for call_id, name in pending.items():
            repaired.append(
                LLMMessage(
                    role="tool", content=INTERRUPTED_TOOL_RESULT, tool_call_id=call_id, name=name
                )
            )
        pending.clear()

    for message in messages:
        if message.role == "tool":
            if message.tool_call_id in pending:
                del pending[message.tool_call_id]
                repaired.append(message)
            continue
        answer_pending()
        repaired.append(message)
        if message.role == "assistant" and message.tool_calls:
            pending = {call.id: call.function_name for call in message.tool_calls}
    answer_pending()
    return repaired


def select_window(
    history: Sequence[LLMMessage], *, max_messages: int, max_tokens: int
) -> list[LLMMessage]:
    """The most recent messages of `history` that fit both bounds, oldest first.

    The last message (the turn being answered) is always kept, whatever its size. The
    window never starts with a tool result whose call it cut off.
    """
    if not history:
        return []
    window = list(history[-max_messages:]) if max_messages > 0 else [history[-1]]
    used = sum(estimate_message_tokens(m) for m in window)
    while len(window) > 1 and used > max_tokens:
        used -= estimate_message_tokens(window.pop(0))
    return repair_tool_pairs(window)


def build_llm_messages(
    *,
    system_prompt: str,
    summary: str | None,
    history: Sequence[LLMMessage],
    max_messages: int,
    budget_tokens: int,
) -> list[LLMMessage]:
    """System prompt, then the session summary, then the recent window of `history`
    (whose last message is the new user message), fitted to `budget_tokens`."""
    head = [LLMMessage(role="system", content=system_prompt)]
    if summary:
        head.append(
            LLMMessage(
                role="system",
                content=f"Summary of the earlier conversation:\n{summary}",
            )
        )
    fixed = sum(estimate_text_tokens(m.content) + 4 for m in head)
    window = select_window(
        history, max_messages=max_messages, max_tokens=max(budget_tokens - fixed, 0)
    )
    return head + window
