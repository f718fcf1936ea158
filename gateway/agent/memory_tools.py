"""Tools that let the model search, extend, correct and forget long-term memory of its own
conversation, and the texts the chat commands /memory, /correct and /forget answer with.

Promise: every tool resolves its memory scope from the calling turn's session key
(`ToolContext.session_key`) and from nothing the model sends, so one user's
conversation never reads, corrects or forgets another's memory (unless the operator
chose the shared workspace scope): a fact id of another scope is answered as unknown.
A tool's search waits for an index still being built, so it answers from all the
memory, never from part of it. Blocking file work runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio
from loguru import logger

from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import ToolSpec
from gateway.memory.facts import Fact, NewFact, Origin, find_facts, normalize_id
from gateway.memory.format import CATEGORIES, normalize_category, parse_fact
from gateway.memory.knowledge import entry_id
from gateway.memory.messages import MessageHit
from gateway.memory.protocol import Found, MemoryBackend, MemoryScope
from gateway.memory.text import normalize_text, one_line
from gateway.memory.timewords import time_range

if TYPE_CHECKING:
    import numpy as np

    from gateway.cache import SemanticCache

DEFAULT_RESULTS = 5
MAX_RESULTS = 20
MAX_OUTPUT_CHARS = 4000
MAX_REMEMBER_CHARS = 1000
MAX_LISTED_FACTS = 50

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


def _query_spec(name: str, description: str) -> ToolSpec:
    """A search tool taking a query and at most how many results."""
    return ToolSpec(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Words to look for."},
                "max_results": {"type": "integer", "minimum": 1, "maximum": MAX_RESULTS},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    )


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
    manager: MemoryScope,
    query: str,
    *,
    category: str | None = None,
    limit: int = 8,
    wait: float | None = None,
    messages: Sequence[MessageHit] | None = None,
    query_vector: np.ndarray | None = None,
    now: datetime | None = None,
) -> Found:
    """`[category] text` lines of MEMORY.md facts and knowledge entries for `query`,
    best first, each once, and whether they come from all the facts (`wait` bounds the
    wait for a facts index being built; None waits for it). Blocking: call it from a
    worker thread.

    Facts rank by their own words fused (`blend_recall`) with the rank of the message
    each came from among the best `limit` past messages for `query` (`messages`;
    searched here when not given). A fact is a short restatement of its message; the
    message keeps its context (the message before it, its date), which keyword search
    finds more often: on LoCoMo's development half (bench/recall.py) an evidence-citing
    fact is in the top 8 for 63% of questions by the facts' words alone and for 69.5%
    fused (70% with twice as deep a search of each; not worth its 0.15 ms a turn).
    Issue 41's message keys (the facts' words, MiniLM, the time a question names) lift
    the messages to 80.8 but the facts only to 70.7: a fact hits only when one cites an
    evidence turn, which no fact does for 17% of the questions (the ceiling is 83.0),
    and only 68% of the questions have a fact-bearing evidence message in the messages'
    top 8 (bench/results/recall-i41.md). Lending facts at their message's rank, or
    counting lent facts twice, moved it by at most +0.7: not taken.

    `query_vector`: the query's unit vector from the sentence model (gateway/embedding.py),
    computed once a turn and shared with the cache; without it, a scope whose message
    index has a dense part embeds the query itself (the `memory_search` tool). `now`: the
    time relative words ("last month") are read against (`recall_time`).

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

    facts = manager.search_memory(query, max_results=limit, category=category, wait=wait)
    if messages is None:
        messages = manager.search_messages(
            query,
            max_results=limit,
            context=False,
            wait=wait,
            query_vector=query_vector,
            during=recall_time(query, now),
        )
    said = [hit.entry_id for hit in messages[:limit]]
    given = manager.facts_from_messages(said) if said else {}
    lent = [line for entry in said for line in given.get(entry, ())]
    for line in blend_recall([list(facts), lent]):
        if len(lines) >= limit:
            break
        fact = parse_fact(line)
        if fact is not None:
            if category is None or fact.category.lower() == category.lower():
                add(fact.category, fact.text)
        elif category is None:
            add(None, line.lstrip("-*+ ").strip())
    for entry in manager.knowledge.search(query, category=category, max_results=limit):
        add(entry.category, entry.content)
    return Found(lines[:limit], complete=facts.complete)


def memory_texts(
    store: MemoryBackend,
    session_key: str,
    query: str,
    *,
    limit: int = 8,
    export_chars: int = 2000,
    wait: float | None = None,
    exclude: Iterable[str] = (),
    query_vector: np.ndarray | None = None,
) -> Found:
    """What `fit_context` takes as `memory_texts` for a turn: the memory relevant to
    `query` (facts and knowledge, history summaries and past messages, blended by
    `blend_recall`), then the knowledge base's export (`fit_context` drops repeated lines
    and cuts the block to its share, in this order), and whether the search covered all
    the facts (it waits at most `wait` seconds for an index being built). Messages whose
    entry ids are in `exclude` (those already in the context) are left out. Scoped by
    `session_key`. Blocking: worker thread. A conversation without memory yet costs one
    stat: reading creates nothing. `query_vector` as for `relevant_memory`."""
    if not store.exists(session_key):
        return Found()
    manager = store.for_session(session_key)
    lines = recall_lines(
        manager, query, limit=limit, wait=wait, exclude=exclude, query_vector=query_vector
    )
    texts = ["\n".join(lines), manager.knowledge.export_for_context(export_chars)]
    return Found(texts, complete=lines.complete)


def recall_lines(
    manager: MemoryScope,
    query: str,
    *,
    limit: int = 8,
    wait: float | None = None,
    exclude: Iterable[str] = (),
    query_vector: np.ndarray | None = None,
    now: datetime | None = None,
) -> Found:
    """The memory relevant to `query`, one ranking: facts and knowledge
    (`relevant_memory`, lent facts by the same messages), history summaries and past
    messages not in `exclude`, each layer's best `limit` blended by `blend_recall`.
    Each line says what it is: a fact its `[category]`, a summary and a message where
    and when they are from. `query_vector` and `now` as for `relevant_memory`. Blocking."""
    if not query.strip():
        return Found()
    found = manager.search_messages(
        query,
        max_results=limit,
        exclude=exclude,
        context=False,
        wait=wait,
        query_vector=query_vector,
        during=recall_time(query, now),
    )
    relevant = relevant_memory(
        manager, query, limit=limit, wait=wait, messages=found, query_vector=query_vector
    )
    history = [
        _history_line(line) for line in manager.search_history(query, max_results=limit, wait=wait)
    ]
    messages = [
        f"[earlier message, {hit.when} UTC, {hit.role} in {hit.session_key}] {one_line(hit.text)}"
        for hit in found
    ]
    return Found(blend_recall([list(relevant), history, messages]), complete=relevant.complete)


def recall_time(query: str, now: datetime | None = None) -> tuple[float, float] | None:
    """The time range `query` names, read against `now` (default: the present), whose
    messages recall ranks higher (`gateway.memory.timewords`)."""
    return time_range(query, now or datetime.now(UTC))


#: Reciprocal rank fusion's constant (Cormack et al. 2009 use 60): ranks far down a list
#: still count, so one layer's fifth line can beat another's tenth.
RRF_K = 60


def blend_recall(layers: Sequence[Sequence[str]], *, k: int = RRF_K) -> list[str]:
    """Lines of several ranked lists (facts, history, messages) as one ranking, by
    reciprocal rank fusion: each line scores `1 / (k + rank)` in its list, a line in
    several lists adds up; ties go to the earlier list. Each line once, best first.

    Scores of different indexes are not comparable; ranks are, so no layer's scale
    can crowd out the others (a pure policy: `fit_context` then cuts to the share)."""
    scores: dict[str, float] = {}
    first: dict[str, tuple[int, int]] = {}
    for which, lines in enumerate(layers):
        for rank, line in enumerate(lines):
            if not line:
                continue
            scores[line] = scores.get(line, 0.0) + 1.0 / (k + rank + 1)
            first.setdefault(line, (rank, which))
    return sorted(scores, key=lambda line: (-scores[line], first[line]))


def _history_line(line: str) -> str:
    """A history line as the memory block shows it: where it is from, then when."""
    return f"[summary of an earlier conversation, {line[1:]}" if line.startswith("[") else line


# -- seeing, correcting and forgetting facts (commands and tools alike) ------------------


def facts_text(memory: MemoryScope, *, limit: int = MAX_LISTED_FACTS) -> str:
    """The scope's facts, one a line: id, category, text and where each came from."""
    facts = memory.list_facts()
    if not facts:
        return "I have no facts remembered about this conversation."
    lines = [f"Remembered facts ({len(facts)}):"]
    lines += [fact.describe() for fact in facts[-limit:]]
    if len(facts) > limit:
        lines.insert(1, f"(the newest {limit}; {len(facts) - limit} older ones not shown)")
    lines.append("/correct ID NEW TEXT fixes one; /forget ID removes one.")
    return "\n".join(lines)


def _choose(memory: MemoryScope, ref: str) -> tuple[Fact | None, str]:
    """The one fact `ref` (an id, or words) names, else what to tell the person."""
    ref = one_line(ref)
    if not ref:
        return None, "Say which fact: its id (/memory lists them) or words from it."
    found = find_facts(memory.list_facts(), ref)
    if not found:
        return None, f"no fact {ref} in your memory (/memory lists them with their ids)"
    if len(found) > 1:
        listed = "\n".join(fact.describe() for fact in found[:MAX_LISTED_FACTS])
        return None, f"{len(found)} facts match {ref!r}; say which one by its id:\n{listed}"
    return found[0], ""


def forget_text(memory: MemoryScope, ref: str) -> tuple[bool, str]:
    """Forget the fact `ref` names (an id, or words only one fact holds): (done, answer).
    Several matches are listed, none is forgotten."""
    fact, problem = _choose(memory, ref)
    if fact is None:
        return False, problem
    gone = memory.forget_fact(fact.id)
    if gone is None:  # forgotten meanwhile
        return False, f"no fact {fact.id} in your memory"
    return True, f"Forgotten: {_said(gone)} (fact {gone.id})"


def correct_text(memory: MemoryScope, ident: str, text: str, *, by: str) -> tuple[bool, str]:
    """Correct fact `ident` (an id: the new text follows it) to `text`: (done, answer)."""
    wanted = normalize_id(ident)
    text = one_line(text)
    if wanted is None or not text:
        return False, "Write /correct ID NEW TEXT; /memory shows the ids."
    if len(text) > MAX_REMEMBER_CHARS:
        return False, f"Keep it under {MAX_REMEMBER_CHARS} characters (one fact at a time)."
    fixed = memory.correct_fact(wanted, text, by=by)
    if fixed is None:
        return False, f"no fact {wanted} in your memory (/memory lists them with their ids)"
    return True, f"Corrected: {_said(fixed)} (fact {fixed.id})"


def _said(fact: Fact) -> str:
    return f"[{fact.category}] {fact.text}" if fact.category else fact.text


def _origin(context: ToolContext) -> Origin | None:
    if not context.user_entry_id:
        return None
    return Origin(context.session_key, context.user_entry_id)


def _who(context: ToolContext) -> str:
    """Who corrects through the model: the sender, else the conversation."""
    if context.inbound is not None and context.sender_id:
        who = f"{context.inbound.channel}:{context.sender_id}"
    else:
        who = context.session_key
    return f"{who} entry {context.user_entry_id}" if context.user_entry_id else who


def memory_tools(store: MemoryBackend, cache: SemanticCache | None = None) -> list[Tool]:
    """`memory_search`, `history_search`, `conversation_search`, `remember`,
    `memory_facts`, `memory_correct` and `memory_forget`, bound to `store`. A corrected
    or forgotten fact may be in an answer `cache` holds for the conversation: those
    answers go too (as with `/forget`)."""

    async def drop_cached(context: ToolContext, answer: str) -> str:
        if cache is not None and not answer.startswith("error:"):
            try:
                await cache.invalidate(session_key=context.session_key)
            except Exception as exc:  # the fact is gone from memory either way
                logger.warning("cached answers of this conversation not dropped: {}", exc)
        return answer

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

    async def conversation_search(args: dict[str, Any], context: ToolContext) -> str:
        query = _str_arg(args, "query")
        if not query:
            return "error: give a query (a few words to look for)"
        limit = _int_arg(args, "max_results", DEFAULT_RESULTS)

        def work(manager: MemoryScope) -> str:
            hits = manager.search_messages(query, max_results=limit)
            return _compact(
                [hit.describe() for hit in hits], "No earlier message of this conversation matches."
            )

        return await in_scope(context, work)

    async def remember(args: dict[str, Any], context: ToolContext) -> str:
        content = one_line(_str_arg(args, "content"))
        if not content:
            return "error: give the content to remember"
        if len(content) > MAX_REMEMBER_CHARS:
            return f"error: keep it under {MAX_REMEMBER_CHARS} characters (one fact at a time)"
        category = _str_arg(args, "category") or "learned_fact"

        def work(manager: MemoryScope) -> str:
            tag = normalize_category(category)
            if manager.knowledge.get(entry_id(tag, content)) is not None:
                entry = manager.knowledge.add(tag, content, source="remember")  # reinforced
                manager.knowledge.flush()
                return f"Already remembered: [{entry.category}] {entry.content}"
            # A fact line pointing back at this turn's message, and its knowledge entry;
            # durable when this returns (the model said so), not in a later batch.
            fact = NewFact(tag, content, _origin(context))
            manager.record_consolidation([fact], "", source="remember")
            manager.flush()
            ids = [f.id for f in manager.list_facts() if f.text == content and f.category == tag]
            shown = f" (fact {ids[-1]})" if ids else ""
            return f"Remembered: [{tag}] {content}{shown}"

        return await in_scope(context, work)

    async def memory_facts(args: dict[str, Any], context: ToolContext) -> str:
        return await in_scope(context, facts_text)

    async def memory_correct(args: dict[str, Any], context: ToolContext) -> str:
        ident, text = _str_arg(args, "id"), _str_arg(args, "text")

        def work(manager: MemoryScope) -> str:
            done, answer = correct_text(manager, ident, text, by=_who(context))
            return answer if done else f"error: {answer}"

        return await drop_cached(context, await in_scope(context, work))

    async def memory_forget(args: dict[str, Any], context: ToolContext) -> str:
        ident = _str_arg(args, "id")

        def work(manager: MemoryScope) -> str:
            if normalize_id(ident) is None:
                return "error: give the fact's id (memory_facts lists them)"
            done, answer = forget_text(manager, ident)
            return answer if done else f"error: {answer}"

        return await drop_cached(context, await in_scope(context, work))

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
            _query_spec(
                "history_search",
                "Search summaries of earlier parts of this conversation "
                "(older turns no longer in view), newest and most relevant first.",
            ),
            history_search,
        ),
        Tool(
            _query_spec(
                "conversation_search",
                "Search the exact words of every earlier message of this "
                "conversation (all its sessions, also those no longer in view): each hit "
                "with its time, session, speaker and the messages around it.",
            ),
            conversation_search,
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
        Tool(
            ToolSpec(
                name="memory_facts",
                description="List every remembered fact of this conversation with its id, "
                "category and the message it came from.",
                parameters={"type": "object", "properties": {}, "additionalProperties": False},
            ),
            memory_facts,
        ),
        Tool(
            ToolSpec(
                name="memory_correct",
                description="Correct a remembered fact that is wrong or outdated (the user "
                "said so). It keeps its id; the correction is recorded.",
                parameters={
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "description": "The fact's id (memory_facts)."},
                        "text": {"type": "string", "description": "The corrected fact."},
                    },
                    "required": ["id", "text"],
                    "additionalProperties": False,
                },
            ),
            memory_correct,
        ),
        Tool(
            ToolSpec(
                name="memory_forget",
                description="Forget a remembered fact for good when the user asks you to "
                "(removed from memory and from search).",
                parameters={
                    "type": "object",
                    "properties": {
                        "id": {"type": "string", "description": "The fact's id (memory_facts)."},
                    },
                    "required": ["id"],
                    "additionalProperties": False,
                },
            ),
            memory_forget,
        ),
    ]
