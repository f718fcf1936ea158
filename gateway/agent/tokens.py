"""Token estimates without a tokenizer download: characters over a ratio, plus framing."""

from __future__ import annotations

import json
from collections.abc import Iterable

from gateway.llm.types import LLMMessage, ToolSpec

# ~4 characters per token for English prose under BPE tokenizers; CJK and code run denser,
# so the estimate leans high by counting non-ASCII characters as a token each.
CHARS_PER_TOKEN = 4
MESSAGE_OVERHEAD = 4


def estimate_text_tokens(text: str | None) -> int:
    if not text:
        return 0
    non_ascii = sum(1 for ch in text if ord(ch) > 127) if not text.isascii() else 0
    return (len(text) - non_ascii + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN + non_ascii


def estimate_message_tokens(message: LLMMessage) -> int:
    total = MESSAGE_OVERHEAD + estimate_text_tokens(message.content)
    for call in message.tool_calls:
        total += estimate_text_tokens(call.function_name)
        total += estimate_text_tokens(json.dumps(call.arguments, ensure_ascii=False))
    return total


def estimate_messages_tokens(messages: Iterable[LLMMessage]) -> int:
    return sum(estimate_message_tokens(m) for m in messages)


def estimate_tools_tokens(specs: Iterable[ToolSpec]) -> int:
    """The tools' definitions as a request carries them (servers count them in the
    prompt: a chat template writes them out)."""
    return sum(
        MESSAGE_OVERHEAD
        + estimate_text_tokens(spec.name)
        + estimate_text_tokens(spec.description)
        + estimate_text_tokens(json.dumps(spec.parameters, ensure_ascii=False))
        for spec in specs
    )
