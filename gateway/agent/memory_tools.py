"""Tools that let the model search and extend long-term memory of its own conversation.

Promise: every tool resolves its memory scope from the calling turn's session key
(`ToolContext.session_key`) and from nothing the model sends, so one user's
conversation never reads or writes another's memory (unless the operator chose the
shared workspace scope). Blocking file work runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import ToolSpec
from gateway.memory.format import CATEGORIES, parse_fact
from gateway.memory.protocol import MemoryBackend, MemoryScope
from gateway.memory.text import normalize_text, one_line

DEFAULT_RESULTS = 5
MAX_RESULTS = 20
MAX_OUTPUT_CHARS = 4000
MAX_REMEMBER_CHARS = 1000

_CATEGORY_LIST = ", ".join(CATEGORIES)


def _int_arg(args: dict[str, Any], name: str, default: int) -> int:
    value = args.get(name, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = default
    return max(1, min(MAX_RESULTS, number))


def _str_arg(args: dict[str, Any], name: str) -> str:
    value = args.get(name)
    return value.strip() if isinstance(value, str) else ""


def _compact(lines: list[str], empty: str) -> str:
    """Lines joined, at most `MAX_OUTPUT_CHARS` (whole lines), or `empty`."""
    out: list[str] = []
    used = 0
    for line in lines:
        if used + len(line) + 1 > MAX_OUTPUT_CHARS:
            out.append(f"(+{len(lines) - len(out)} more not shown)")
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out) if out else empty


def relevant_memory(
    manager: MemoryScope, query: str, *, category: str | None = None, limit: int = 8
) -> list[str]:
    """`[category] text` lines of MEMORY.md facts and knowledge entries for `query`,
    best first, each once. Blocking: call it from a worker thread.

    The agent's memory block and the `memory_search` tool both use it.
    """
    lines: list[str] = []
    seen: set[str] = set()

    def add(category_name: str | None, text: str) -> None:
        key = normalize_text(text)
        if key in seen:
            return
        seen.add(key)
        lines.append(f"[{category_name}] {text}" if category_name else text)

    for line in manager.search_memory(query, max_results=limit, category=category):
        fact = parse_fact(line)
        if fact is not None:
            add(fact.category, fact.text)
        else:
            add(None, line.lstrip("-*+ ").strip())
    for entry in manager.knowledge.search(query, category=category, max_results=limit):
        add(entry.category, entry.content)
    return lines[:limit]


def memory_texts(
    store: MemoryBackend, session_key: str, query: str, *, limit: int = 8, export_chars: int = 2000
) -> list[str]:
    """What `fit_context` takes as `memory_texts` for a turn: the memory relevant to
    `query`, then the knowledge base's export (`fit_context` drops repeated lines and
    cuts the block to its share). Scoped by `session_key`. Blocking: worker thread.
    A conversation without memory yet costs one stat: reading creates nothing."""
    if not store.exists(session_key):
        return []
    manager = store.for_session(session_key)
    relevant = relevant_memory(manager, query, limit=limit) if query.strip() else []
    return ["\n".join(relevant), manager.knowledge.export_for_context(export_chars)]


def memory_tools(store: MemoryBackend) -> list[Tool]:
    """`memory_search`, `history_search` and `remember`, bound to `store`."""

    async def in_scope(context: ToolContext, work: Callable[[MemoryScope], str]) -> str:
        def run() -> str:
            try:
                manager = store.for_session(context.session_key)
            except ValueError as exc:
                return f"error: this conversation has no usable memory ({exc})"
            return work(manager)

        return await anyio.to_thread.run_sync(run)

    async def memory_search(args: dict[str, Any], context: ToolContext) -> str:
        query = _str_arg(args, "query")
        category = _str_arg(args, "category").lower() or None
        if category is not None and category not in CATEGORIES:
            return f"error: unknown category {category!r}; use one of {_CATEGORY_LIST}"
        limit = _int_arg(args, "max_results", DEFAULT_RESULTS)

        def work(manager: MemoryScope) -> str:
            found = relevant_memory(manager, query, category=category, limit=limit)
            return _compact(found, "No stored memory matches.")

        return await in_scope(context, work)

    async def history_search(args: dict[str, Any], context: ToolContext) -> str:
        query = _str_arg(args, "query")
        if not query:
            return "error: give a query (a few words to look for)"
        limit = _int_arg(args, "max_results", DEFAULT_RESULTS)

        def work(manager: MemoryScope) -> str:
            found = manager.search_history(query, max_results=limit)
            return _compact(found, "No earlier conversation summary matches.")

        return await in_scope(context, work)

    async def remember(args: dict[str, Any], context: ToolContext) -> str:
        content = one_line(_str_arg(args, "content"))
        if not content:
            return "error: give the content to remember"
        if len(content) > MAX_REMEMBER_CHARS:
            return f"error: keep it under {MAX_REMEMBER_CHARS} characters (one fact at a time)"
        category = _str_arg(args, "category") or "learned_fact"

        def work(manager: MemoryScope) -> str:
            entry = manager.knowledge.add(category, content, source="remember")
            manager.knowledge.flush()  # the model said so: durable now, not in a batch
            if entry.access_count > 0:
                return f"Already remembered: [{entry.category}] {entry.content}"
            return f"Remembered: [{entry.category}] {entry.content}"

        return await in_scope(context, work)

    return [
        Tool(
            ToolSpec(
                name="memory_search",
                description="Search long-term memory (facts and preferences learned in "
                "earlier conversations with this user). An empty query lists the newest.",
                parameters={
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "Words to look for."},
                        "category": {"type": "string", "enum": list(CATEGORIES)},
                        "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_RESULTS},
                    },
                    "required": ["query"],
                    "additionalProperties": False,
                },
            ),
            memory_search,
        ),
        Tool(
            ToolSpec(
                name="history_search",
                description="Search summaries of earlier parts of this conversation "
                "(older turns no longer in view), newest and most relevant first.",
                parameters={
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "Words to look for."},
                        "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_RESULTS},
                    },
                    "required": ["query"],
                    "additionalProperties": False,
                },
            ),
            history_search,
        ),
        Tool(
            ToolSpec(
                name="remember",
                description="Store one durable fact about the user or their work for later "
                f"conversations. Categories: {_CATEGORY_LIST} (default learned_fact).",
                parameters={
                    "type": "object",
                    "properties": {
                        "content": {"type": "string", "description": "The fact, one sentence."},
                        "category": {"type": "string", "description": _CATEGORY_LIST},
                    },
                    "required": ["content"],
                    "additionalProperties": False,
                },
            ),
            remember,
        ),
    ]
