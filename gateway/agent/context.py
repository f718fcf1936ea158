"""What the model sees: pure functions that turn a session's branch into LLM messages
fitted to a token budget, and the `ContextBuilder` the agent loop calls once per turn.

The fitting policy (`fit_context`) keeps these promises, each tested:

- the estimated tokens of the result stay within ``context_window - reply_reserve``
  unless nothing but the protected messages is left;
- the protected messages are never pruned: the running turn (everything from its user
  message on, the messages that joined it included; by default from the last user
  message), and the previous user/assistant exchange when it fits;
- kept messages keep their order, and tool calls stay paired with their results (a
  pruned tool call takes its results with it; see `repair_tool_pairs`);
- the kept history starts at a user message, right after the system part (prompt,
  summary, memory block): the chat templates of many local models (Mistral's, Gemma's)
  refuse a conversation that opens with the assistant or a tool result. What followed
  a user message that the window, a compaction or the budget left out goes with it,
  unless it is protected (a running turn that starts elsewhere is sent as it is);
- old tool results leave first: before any message is dropped, the tool results
  outside the protected messages become, oldest first, a one-line stub that names the
  stored output's handle to read it again (`gateway.agent.tool_outputs.stub_for`);
- pruning is explained: every dropped or trimmed message is reported with its reason.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from gateway.agent.tokens import (
    CHARS_PER_TOKEN,
    estimate_message_tokens,
    estimate_messages_tokens,
    estimate_text_tokens,
)
from gateway.agent.tool_outputs import stub_for
from gateway.llm.types import LLMMessage, TokenUsage
from gateway.memory.text import tokenize

INTERRUPTED_TOOL_RESULT = "(no result: this tool call was interrupted before it finished)"
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"
MEMORY_PREFIX = (
    "Long-term memory that may be relevant (it can be outdated; what the user says in "
    "this conversation wins):\n"
)

PruneReason = Literal[
    "window", "oldest", "least_important", "near_duplicate", "last_resort", "orphan", "leading"
]
TrimTarget = Literal["tool_result", "tool_stub", "memory", "summary"]


# -- tool pairs and the plain recent window ------------------------------------------------


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


# -- token accounting with the provider's reported usage -----------------------------------


def last_reported_usage(messages: Sequence[LLMMessage]) -> tuple[int, TokenUsage] | None:
    """Index and usage of the latest assistant message that carries a reported usage
    with a prompt count, or None."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if message.role == "assistant" and message.usage and message.usage.prompt_tokens > 0:
            return index, message.usage
    return None


def estimate_branch_tokens(
    messages: Sequence[LLMMessage], count: Callable[[LLMMessage], int] = estimate_message_tokens
) -> int:
    """Tokens of a branch, anchored on what the provider reported where it can be.

    The latest assistant message with a usage tells how many tokens the request that
    produced it really had (``prompt_tokens``) and what the answer cost
    (``completion_tokens``); messages after it are estimated. The anchor is the larger
    of the reported count and our own estimate of the messages up to it: the report
    corrects the estimate for dense text (code, CJK), while our estimate still counts
    messages the request that was reported on left out (a pruned window). Without any
    usage this is `estimate_messages_tokens`.
    """
    found = last_reported_usage(messages)
    if found is None:
        return sum(map(count, messages))
    index, usage = found
    completion = usage.completion_tokens or count(messages[index])
    reported = usage.prompt_tokens + completion
    estimated = sum(map(count, messages[: index + 1]))
    return max(reported, estimated) + sum(map(count, messages[index + 1 :]))


@dataclass(frozen=True, slots=True)
class UsageHint:
    """The provider's count for an earlier request next to our estimate of the same
    request; their ratio scales later estimates so they lean toward the real count."""

    prompt_tokens: int
    estimated_tokens: int

    MAX_RATIO: ClassVar[float] = 4.0

    @property
    def ratio(self) -> float:
        """Reported over estimated, within [1, MAX_RATIO]. Never below 1: an estimate
        that ran high only costs a little room, one that ran low overflows the model."""
        if self.prompt_tokens <= 0 or self.estimated_tokens <= 0:
            return 1.0
        return min(self.MAX_RATIO, max(1.0, self.prompt_tokens / self.estimated_tokens))


# -- text trimming ------------------------------------------------------------------------


def trim_middle(text: str, max_tokens: int) -> str:
    """`text` cut to about `max_tokens` by keeping its head and its tail around a
    ``[... N characters cut ...]`` marker (both ends of a log or a file tend to
    matter). Returned unchanged when it already fits."""
    if estimate_text_tokens(text) <= max_tokens:
        return text
    low, high = 0, min(len(text) // 2, max(0, max_tokens) * CHARS_PER_TOKEN)
    best = _cut_middle(text, 0)
    while low <= high:  # the longest halves whose result still fits
        keep = (low + high) // 2
        candidate = _cut_middle(text, keep)
        if estimate_text_tokens(candidate) <= max_tokens:
            best, low = candidate, keep + 1
        else:
            high = keep - 1
    return best


def _cut_middle(text: str, keep: int) -> str:
    cut = len(text) - 2 * keep
    return f"{text[:keep]}\n[... {cut} characters cut ...]\n{text[len(text) - keep :]}"


def trim_lines(lines: Sequence[str], max_tokens: int) -> tuple[list[str], bool]:
    """Whole lines, in order, while they fit `max_tokens` (a line that does not fit is
    skipped, so a shorter later one may still get in); True if something was left out."""
    kept: list[str] = []
    used = 0
    for line in lines:
        cost = estimate_text_tokens(line) + 1
        if used + cost > max_tokens:
            continue
        kept.append(line)
        used += cost
    return kept, len(kept) < len(lines)


# -- the fitting policy -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PruningPolicy:
    """The knobs of `fit_context`. Shares are fractions of the token budget.

    Importance of a message group is ``frequency_weight * frequency + recency_weight *
    recency + relevance_weight * relevance``, each in [0, 1]:

    - frequency: how much the rest of the conversation keeps coming back to it, the
      IDF-weighted share of its words that later messages (and the new query) reuse,
      a word counting fully once two later messages use it. Messages carry no access
      log, so reuse by later turns stands in for "accessed often";
    - recency: ``0.5 ** (age / recency_half_life)``, age in message groups;
    - relevance: BM25 of the group against the query, over the window's groups,
      divided by the best score (or by ``relevance_floor`` if the best is weaker, so a
      poor best match is not promoted to 1).

    ``horizon``: groups older than ``horizon`` budgets' worth of newer messages are not
    considered at all (reported as "window"); this bounds the work per turn when a
    long backlog was not consolidated yet.
    """

    memory_share: float = 0.2
    summary_share: float = 0.25
    tool_result_share: float = 0.2
    frequency_weight: float = 0.3
    recency_weight: float = 0.3
    relevance_weight: float = 0.4
    recency_half_life: float = 6.0
    relevance_floor: float = 2.0
    important: float = 0.4
    near_duplicate: float = 0.8
    duplicate_lookahead: int = 64
    horizon: float = 4.0


@dataclass(frozen=True, slots=True)
class PrunedMessage:
    """One history message left out of the request: its index in the history given to
    `fit_context`, role, estimated tokens, why, and the importance of its group (None
    where it was not needed)."""

    index: int
    role: str
    tokens: int
    reason: PruneReason
    importance: float | None = None


@dataclass(frozen=True, slots=True)
class TrimmedItem:
    """A part kept but shortened: a tool result cut in the middle ("tool_result") or
    replaced by its stub ("tool_stub"), with its history index; the memory block or the
    summary."""

    target: TrimTarget
    tokens_before: int
    tokens_after: int
    index: int | None = None


@dataclass(frozen=True, slots=True)
class ContextPlan:
    """The request to send and how it was made.

    `messages`: head (system prompt, summary, memory block) then the kept history.
    `kept_indices`: history index of each kept history message, ascending (None for a
    synthetic tool result answering an interrupted call). `estimated_tokens` is scaled
    by the usage hint; `raw_tokens` is the plain estimate. `over_budget` is True only
    when nothing but protected messages was left and they still did not fit.
    """

    messages: tuple[LLMMessage, ...]
    kept_indices: tuple[int | None, ...]
    estimated_tokens: int
    raw_tokens: int
    budget_tokens: int
    branch_tokens: int
    memory_injected: bool
    summary_included: bool
    protected_from: int
    over_budget: bool
    pruned: tuple[PrunedMessage, ...] = ()
    trimmed: tuple[TrimmedItem, ...] = ()

    @property
    def history_messages(self) -> tuple[LLMMessage, ...]:
        """The kept history part of `messages` (the head left out)."""
        return self.messages[len(self.messages) - len(self.kept_indices) :]


#: Tests switch the one-pass plan for plain histories off to compare it with the steps.
_PLAIN_FAST_PATH = True


class _Counter:
    """Token estimates for one `fit_context` call, each message counted once. Messages
    are immutable; the memo keeps each one it saw alive, so an id is never reused."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[int, tuple[LLMMessage, int]] = {}

    def __call__(self, message: LLMMessage) -> int:
        hit = self._seen.get(id(message))
        if hit is None:
            hit = self._seen[id(message)] = (message, estimate_message_tokens(message))
        return hit[1]


@dataclass(slots=True)
class _Unit:
    """A group pruned as one: one message, or a tool call with its results."""

    messages: list[LLMMessage]
    indices: list[int | None]
    tokens: int = 0
    terms: list[str] = dataclasses.field(default_factory=list)
    importance: float = 0.0


def _split_units(messages: Sequence[LLMMessage], indices: Sequence[int | None]) -> list[_Unit]:
    units: list[_Unit] = []
    for message, index in zip(messages, indices, strict=True):
        if message.role == "tool" and units and units[-1].messages[0].tool_calls:
            unit = units[-1]
        else:
            unit = _Unit([], [])
            units.append(unit)
        unit.messages.append(message)
        unit.indices.append(index)
    return units


def _shape_unit(unit: _Unit, tool_cap: int, trimmed: list[TrimmedItem], count: _Counter) -> None:
    """Cut the unit's oversized tool results, then count its tokens."""
    for position, message in enumerate(unit.messages):
        if message.role == "tool" and message.content:
            before = estimate_text_tokens(message.content)
            if before > tool_cap:
                content = trim_middle(message.content, tool_cap)
                unit.messages[position] = dataclasses.replace(message, content=content)
                after = estimate_text_tokens(content)
                trimmed.append(TrimmedItem("tool_result", before, after, unit.indices[position]))
    unit.tokens = sum(map(count, unit.messages))


def _stub_tool_results(
    units: Sequence[_Unit], used: int, limit: int, trimmed: list[TrimmedItem], count: _Counter
) -> int:
    """Replace tool results of `units`, oldest first, by their one-line stub until `used`
    fits `limit` (or none is left); the tokens used then."""
    for unit in units:
        if not unit.messages[0].tool_calls:
            continue
        for position, message in enumerate(unit.messages):
            if used <= limit:
                return used
            if message.role != "tool" or not message.content:
                continue
            stub = stub_for(message)
            if len(stub) >= len(message.content):
                continue
            stubbed = dataclasses.replace(message, content=stub)
            change = count(stubbed) - count(message)
            unit.messages[position] = stubbed
            unit.tokens += change
            used += change
            before = estimate_text_tokens(message.content)
            after = estimate_text_tokens(stub)
            trimmed.append(TrimmedItem("tool_stub", before, after, unit.indices[position]))
    return used


def _opens_turn(unit: _Unit) -> bool:
    """Whether the request's history may start with `unit`: a user message."""
    return unit.messages[0].role == "user"


def _unit_text(message: LLMMessage) -> str:
    parts = [message.content or ""]
    parts.extend(call.function_name for call in message.tool_calls)
    return " ".join(parts)


def _history_indices(
    history: Sequence[LLMMessage], repaired: Sequence[LLMMessage]
) -> list[int | None]:
    """The history index of each repaired message (None for a synthetic one)."""
    positions: dict[int, deque[int]] = defaultdict(deque)
    for index, message in enumerate(history):
        positions[id(message)].append(index)
    out: list[int | None] = []
    for message in repaired:
        queue = positions.get(id(message))
        out.append(queue.popleft() if queue else None)
    return out


def score_importance(
    units_terms: Sequence[Sequence[str]], query: str, policy: PruningPolicy
) -> list[float]:
    """Importance in [0, 1] of each group (oldest first) for `query`; see `PruningPolicy`."""
    n = len(units_terms)
    if n == 0:
        return []
    query_terms = tokenize(query)
    sets = [set(terms) for terms in units_terms]
    df: Counter[str] = Counter()
    for term_set in sets:
        df.update(term_set)
    postings: dict[str, list[int]] = defaultdict(list)
    for i, term_set in enumerate(sets):
        for term in term_set:
            postings[term].append(i)

    def idf(term: str) -> float:
        return math.log(1.0 + (n - df[term] + 0.5) / (df[term] + 0.5))

    query_set = set(query_terms)
    lengths = [len(terms) for terms in units_terms]
    avg_len = (sum(lengths) / n) or 1.0
    k1, b = 1.2, 0.75
    relevance_raw: list[float] = []
    for i, terms in enumerate(units_terms):
        tf = Counter(t for t in terms if t in query_set)
        score = 0.0
        for term, count in tf.items():
            norm = count + k1 * (1 - b + b * lengths[i] / avg_len)
            score += idf(term) * count * (k1 + 1) / norm
        relevance_raw.append(score)
    scale = max(max(relevance_raw), policy.relevance_floor)

    scores: list[float] = []
    for i, term_set in enumerate(sets):
        total = reused = 0.0
        for term in term_set:
            weight = idf(term)
            later = len(postings[term]) - bisect.bisect_right(postings[term], i)
            later += 1 if term in query_set else 0
            total += weight
            reused += weight * min(1.0, later / 2)
        frequency = reused / total if total else 0.0
        recency = 0.5 ** ((n - 1 - i) / policy.recency_half_life)
        relevance = min(1.0, relevance_raw[i] / scale)
        scores.append(
            policy.frequency_weight * frequency
            + policy.recency_weight * recency
            + policy.relevance_weight * relevance
        )
    return scores


def _jaccard(a: set[str], b: set[str]) -> float:
    union = len(a | b)
    return len(a & b) / union if union else 0.0


def fit_context(
    *,
    system_prompt: str,
    history: Sequence[LLMMessage],
    summary: str | None = None,
    memory_texts: Sequence[str] = (),
    query: str | None = None,
    context_window: int,
    reply_reserve: int = 0,
    max_messages: int = 0,
    usage: UsageHint | None = None,
    policy: PruningPolicy | None = None,
    turn_start: int | None = None,
) -> ContextPlan:
    """Fit system prompt, summary, memory and the recent history into
    ``context_window - reply_reserve`` tokens (see the module docstring's promises).

    `history` is the session context's messages, whose last is the new user message;
    `memory_texts` are blocks of memory lines, most relevant first (e.g. search hits
    for the new message, then the knowledge base's export); `query` defaults to the
    last user message; `max_messages` caps the history messages considered (0: no
    cap; a tool call is never cut from its results, and the running turn is kept whole,
    so more may stay).
    `turn_start` is the index in `history` of the running turn's user message, when
    messages joined that turn after it (the steer mode): the turn is protected from
    there on, so its one reply can answer every message of it. None: the turn starts at
    the last user message.

    Steps, each recorded in the plan:

    1. shape: the memory block is cut to ``memory_share`` of the budget (whole lines,
       in the caller's order), the summary to ``summary_share``; a tool result (in
       the window) above ``tool_result_share`` is cut in the middle, head and tail kept.
    2. window: history before the last `max_messages` messages, or older than
       ``policy.horizon`` budgets of newer messages, is left out, and so is what comes
       before the first user message after that cut (a history kept by a compaction
       may start with the assistant), unless it is protected.
    3. While over budget, tool results that are not protected become their one-line
       stub (`stub_for`: the stored output's handle, to read it again), oldest first.
       Then, while still over budget, message groups that are not protected are dropped by
       strategies in this order, each starting only if the previous one could not
       reach the budget:

       - oldest: unimportant groups in the older half of the window, oldest first;
       - least_important: any unimportant group, least important first;
       - near_duplicate: a group whose words nearly repeat a newer kept group's,
         oldest first. It comes after importance because repetition scores as
         frequent use, so repeated text survives the first two;
       - last_resort: what is left, least important first.

       "Unimportant" means importance below ``policy.important``. When the first kept
       user message goes, the groups after it up to the next kept user message go with
       it ("leading"), unless they are protected.
    4. Still over budget with only protected messages: the memory block goes.
    """
    policy = policy or PruningPolicy()
    tokens_of = _Counter()
    budget = max(0, context_window - reply_reserve)
    ratio = usage.ratio if usage is not None else 1.0
    limit = int(budget / ratio)  # budget in raw-estimate tokens
    trimmed: list[TrimmedItem] = []
    pruned: list[PrunedMessage] = []

    # 1. repair and shape the head --------------------------------------------------
    plain = _PLAIN_FAST_PATH and not any(m.role == "tool" or m.tool_calls for m in history)
    if plain:  # no tool call or result: nothing to repair
        repaired: list[LLMMessage] = list(history)
        indices: list[int | None] = list(range(len(history)))
    else:
        repaired = repair_tool_pairs(history)
        indices = _history_indices(history, repaired)
    seen = {i for i in indices if i is not None}
    for position, original in enumerate(history):
        if position not in seen:
            tokens = tokens_of(original)
            pruned.append(PrunedMessage(position, original.role, tokens, "orphan"))
    head = [LLMMessage(role="system", content=system_prompt)]
    summary_included = bool(summary and summary.strip())
    if summary and summary_included:
        cap = max(1, int(limit * policy.summary_share))
        text = trim_middle(summary, cap)
        if text != summary:
            trimmed.append(
                TrimmedItem("summary", estimate_text_tokens(summary), estimate_text_tokens(text))
            )
        head.append(LLMMessage(role="system", content=SUMMARY_PREFIX + text))
    memory_message: LLMMessage | None = None
    memory_lines = _distinct_lines(memory_texts)
    if memory_lines:
        cap = max(0, int(limit * policy.memory_share) - estimate_text_tokens(MEMORY_PREFIX))
        lines, cut = trim_lines(memory_lines, cap)
        if cut:
            before = estimate_text_tokens("\n".join(memory_lines))
            trimmed.append(TrimmedItem("memory", before, estimate_text_tokens("\n".join(lines))))
        if lines:
            memory_message = LLMMessage(role="system", content=MEMORY_PREFIX + "\n".join(lines))
            head.append(memory_message)
    head_tokens = sum(map(tokens_of, head))

    users = [i for i, m in enumerate(history) if m.role == "user"]
    if turn_start is None or not 0 <= turn_start < len(history):
        turn_start = users[-1] if users else len(history) - 1
    if plain and history and (max_messages <= 0 or len(history) <= max_messages):
        # The common turn: plain messages, all inside the window and the budget. The
        # steps below would keep everything and protect from the previous user
        # message; this is their plan without building units (a test holds them equal).
        history_tokens = sum(map(tokens_of, history))
        raw = head_tokens + history_tokens
        if raw <= limit and history_tokens <= policy.horizon * limit:
            earlier = [i for i in users if i < turn_start]
            protected = earlier[-1] if earlier else turn_start
            lead = min(users[0], turn_start) if users else turn_start  # where the window starts
            raw -= sum(map(tokens_of, history[:lead]))
            return ContextPlan(
                messages=(*head, *history[lead:]),
                kept_indices=tuple(range(lead, len(history))),
                estimated_tokens=math.ceil(raw * ratio),
                raw_tokens=raw,
                budget_tokens=budget,
                branch_tokens=estimate_branch_tokens(history, tokens_of),
                memory_injected=memory_message is not None,
                summary_included=summary_included,
                protected_from=protected,
                over_budget=False,
                pruned=tuple(
                    PrunedMessage(i, m.role, tokens_of(m), "window")
                    for i, m in enumerate(history[:lead])
                ),
                trimmed=tuple(trimmed),
            )

    # 2. window and protection ------------------------------------------------------
    units = _split_units(repaired, indices)
    # Units from the first that holds a message of the running turn on are never pruned
    # (with no such unit, the last).
    protected_at = next(
        (
            i
            for i, unit in enumerate(units)
            if any(index is not None and index >= turn_start for index in unit.indices)
        ),
        max(0, len(units) - 1),
    )
    start = 0
    if max_messages > 0:
        start = len(units)
        count = 0
        while start > 0 and count < max_messages:
            start -= 1
            count += len(units[start].messages)
    # Groups so far back that `horizon` budgets of newer text come after them could
    # only be kept by the last strategies; leaving them out keeps the cost bounded.
    reach, seen_tokens = len(units), 0
    while reach > start and seen_tokens <= policy.horizon * limit:
        reach -= 1
        seen_tokens += sum(map(tokens_of, units[reach].messages))
    start = min(max(start, reach), protected_at)
    while start < protected_at and not _opens_turn(units[start]):
        start += 1  # the window starts at a user message
    for unit in units[:start]:
        _record(pruned, unit, "window", count=tokens_of)
    window = units[start:]
    protected_at -= start
    tool_cap = max(1, int(limit * policy.tool_result_share))
    for unit in window:
        _shape_unit(unit, tool_cap, trimmed, tokens_of)
    previous_user = next(
        (i for i in range(protected_at - 1, -1, -1) if window[i].messages[0].role == "user"),
        None,
    )
    if previous_user is not None:
        needed = head_tokens + sum(u.tokens for u in window[previous_user:])
        if needed <= limit:
            protected_at = previous_user

    # 3. pruning --------------------------------------------------------------------
    kept = [True] * len(window)
    used = head_tokens + sum(u.tokens for u in window)
    if used > limit:  # old tool results go before any message does
        used = _stub_tool_results(window[:protected_at], used, limit, trimmed, tokens_of)
    if used > limit:  # scoring is only needed (and only paid for) when something must go
        query_text = query if query is not None else _last_user_text(repaired)
        for unit in window:
            unit.terms = tokenize(" ".join(_unit_text(m) for m in unit.messages))
        scores = score_importance([u.terms for u in window], query_text, policy)
        for unit, score in zip(window, scores, strict=True):
            unit.importance = score

    front = 0  # the first kept group; the window starts at a user message (step 2)

    def discard(i: int, reason: PruneReason) -> None:
        nonlocal used
        kept[i] = False
        used -= window[i].tokens
        _record(pruned, window[i], reason, window[i].importance, tokens_of)

    def drop(order: Sequence[int], reason: PruneReason) -> None:
        nonlocal front
        for i in order:
            if used <= limit:
                return
            if kept[i]:
                discard(i, reason)
                # The groups that followed a dropped user message, up to the next kept
                # one, would open the request: they go too (their tokens count here,
                # so fewer other groups have to).
                while front < protected_at and not (kept[front] and _opens_turn(window[front])):
                    if kept[front]:
                        discard(front, "leading")
                    front += 1

    if used > limit:  # the common case fits: nothing to order or drop
        prunable = range(protected_at)
        unimportant = [i for i in prunable if window[i].importance < policy.important]
        drop([i for i in unimportant if i < protected_at / 2], "oldest")
        drop(sorted(unimportant, key=lambda i: (window[i].importance, i)), "least_important")
        if used > limit:
            drop(_near_duplicates(window, kept, protected_at, policy), "near_duplicate")
        drop(sorted(prunable, key=lambda i: (window[i].importance, i)), "last_resort")

    # 4. the memory block goes before the protected messages would -----------------
    if used > limit and memory_message is not None:
        head.remove(memory_message)
        used -= tokens_of(memory_message)
        before = estimate_text_tokens(memory_message.content)
        trimmed.append(TrimmedItem("memory", before, 0))
        memory_message = None

    body: list[LLMMessage] = []
    body_indices: list[int | None] = []
    for unit, keep in zip(window, kept, strict=True):
        if keep:
            body.extend(unit.messages)
            body_indices.extend(unit.indices)
    messages = (*head, *body)
    raw = sum(map(tokens_of, messages))
    pruned.sort(key=lambda p: p.index)
    return ContextPlan(
        messages=messages,
        kept_indices=tuple(body_indices),
        estimated_tokens=math.ceil(raw * ratio),
        raw_tokens=raw,
        budget_tokens=budget,
        branch_tokens=estimate_branch_tokens(history, tokens_of),
        memory_injected=memory_message is not None,
        summary_included=summary_included,
        protected_from=_first_index(window[protected_at:]),
        over_budget=raw > limit,
        pruned=tuple(pruned),
        trimmed=tuple(trimmed),
    )


def _distinct_lines(texts: Sequence[str]) -> list[str]:
    """Non-blank lines of `texts` in order, each once: a fact found by search and listed
    again by the knowledge export (with or without a leading bullet) is sent once."""
    lines: list[str] = []
    seen: set[str] = set()
    for text in texts:
        for line in text.splitlines():
            stripped = line.strip()
            key = " ".join(stripped.lstrip("-*+ ").casefold().split())
            if key and key not in seen:
                seen.add(key)
                lines.append(stripped)
    return lines


def _record(
    pruned: list[PrunedMessage],
    unit: _Unit,
    reason: PruneReason,
    importance: float | None = None,
    count: Callable[[LLMMessage], int] = estimate_message_tokens,
) -> None:
    for message, index in zip(unit.messages, unit.indices, strict=True):
        if index is not None:
            tokens = count(message)
            pruned.append(PrunedMessage(index, message.role, tokens, reason, importance))


def _first_index(units: Sequence[_Unit]) -> int:
    for unit in units:
        for index in unit.indices:
            if index is not None:
                return index
    return -1


def _last_user_text(messages: Sequence[LLMMessage]) -> str:
    for message in reversed(messages):
        if message.role == "user":
            return message.content or ""
    return ""


def _near_duplicates(
    window: Sequence[_Unit], kept: Sequence[bool], protected_at: int, policy: PruningPolicy
) -> list[int]:
    """Unprotected kept groups whose word set nearly equals a newer kept group's
    (Jaccard >= `policy.near_duplicate`, at least three distinct words), oldest first."""
    sets = [set(u.terms) for u in window]
    found: list[int] = []
    for i in range(protected_at):
        if not kept[i] or len(sets[i]) < 3:
            continue
        horizon = min(len(window), i + 1 + policy.duplicate_lookahead)
        for j in range(i + 1, horizon):
            if kept[j] and _jaccard(sets[i], sets[j]) >= policy.near_duplicate:
                found.append(i)
                break
    return found


# -- what the loop calls ------------------------------------------------------------------


#: Extra messages considered beyond the window so a tool call at its edge keeps its results.
TOOL_GROUP_SLACK = 8


def reserve_cap(context_window: int) -> int:
    """The most of `context_window` set aside for the reply, and for the tools'
    definitions, each: a quarter. Tools past it crowd the window (see the loop's
    `_without_tools`)."""
    return context_window // 4


def reply_reserve_for(context_window: int, reserve: int, fixed_tokens: int = 0) -> int:
    """The tokens of `context_window` kept free of messages: `reserve` for the reply and
    `fixed_tokens` for what every request carries besides them (the tools' definitions),
    each at most `reserve_cap` of the window. A reserve sized for a large window would
    leave a small one, such as llama.cpp's 4,096 or Ollama's 2,048, little room for the
    prompt; and a server whose chat template leaves the tools out does not count them at
    all."""
    quarter = reserve_cap(context_window)
    return max(0, min(reserve, quarter)) + max(0, min(fixed_tokens, quarter))


class ContextBuilder:
    """Builds each turn's request with `fit_context`, and learns from the provider's
    reported prompt tokens how far the estimates run low, per session.

    The loop calls `build` once per turn (with the window the model is used with, see
    `gateway.agent.windows`) and `observe` after each completion.
    """

    def __init__(
        self,
        *,
        context_window: int,
        reply_reserve: int,
        max_messages: int,
        policy: PruningPolicy | None = None,
        max_tracked: int = 1024,
    ) -> None:
        if context_window < 1 or reply_reserve < 0:
            raise ValueError("need context_window >= 1 and reply_reserve >= 0")
        self.context_window = context_window
        self.reply_reserve = reply_reserve
        self.max_messages = max_messages
        self.policy = policy or PruningPolicy()
        self._max_tracked = max(1, max_tracked)
        self._hints: OrderedDict[str, UsageHint] = OrderedDict()

    def build(
        self,
        *,
        system_prompt: str,
        history: Sequence[LLMMessage],
        summary: str | None = None,
        memory_texts: Sequence[str] = (),
        query: str | None = None,
        session_key: str | None = None,
        usage: UsageHint | None = None,
        context_window: int | None = None,
        fixed_tokens: int = 0,
        turn_start: int | None = None,
    ) -> ContextPlan:
        """The plan for one request; `usage` defaults to what `observe` last learned
        for `session_key`, `context_window` to the builder's. `fixed_tokens` are sent
        with every request besides the messages (the tools' definitions): room is kept
        for them as for the reply (`reply_reserve_for`).

        Only the tail of `history` that the window could hold is considered (twice
        `max_messages`, plus room for a tool call's results), so a turn costs the same
        whatever the branch's length; plan positions count from that tail.
        """
        if usage is None and session_key is not None:
            usage = self._hints.get(session_key)
        if self.max_messages:
            cut = max(0, len(history) - (2 * self.max_messages + TOOL_GROUP_SLACK))
            if turn_start is not None:
                cut = min(cut, turn_start)  # the running turn is considered whole
                turn_start -= cut
            history = history[cut:]
        window = context_window or self.context_window
        return fit_context(
            system_prompt=system_prompt,
            history=history,
            summary=summary,
            memory_texts=memory_texts,
            query=query,
            context_window=window,
            reply_reserve=reply_reserve_for(window, self.reply_reserve, fixed_tokens),
            max_messages=self.max_messages,
            usage=usage,
            policy=self.policy,
            turn_start=turn_start,
        )

    def observe(
        self,
        session_key: str,
        sent: Sequence[LLMMessage],
        usage: TokenUsage | None,
        fixed_tokens: int = 0,
    ) -> UsageHint | None:
        """Remember the provider's prompt count for the messages just sent (less the
        `fixed_tokens` estimated for what went with them, which `build` keeps apart)."""
        if usage is None or usage.prompt_tokens <= 0:
            return None
        hint = UsageHint(usage.prompt_tokens - fixed_tokens, estimate_messages_tokens(sent))
        self._hints[session_key] = hint
        self._hints.move_to_end(session_key)
        while len(self._hints) > self._max_tracked:
            self._hints.popitem(last=False)
        return hint

    def hint_for(self, session_key: str) -> UsageHint | None:
        return self._hints.get(session_key)
