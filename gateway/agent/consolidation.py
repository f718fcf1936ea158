"""Memory consolidation: the older part of a session becomes durable facts in memory and
an accumulated summary in a `compaction` entry, in the background, one run per session.

Promises (each tested):

- history is never lost: a failed, slow or cancelled consolidation writes no
  compaction entry, so the session's context stays whole; the session file itself is
  never rewritten (a compaction only adds an entry);
- the summary accumulates: the previous summary is part of the request and the new one
  replaces it covering both;
- a compaction never separates a tool call from its results (`choose_cut`), and never
  hides messages that arrived while it ran: its cut comes from the snapshot taken at
  the start, and later messages sit after ``first_kept_entry_id`` on the branch;
- at most one consolidation runs per session at a time; a failure is logged with the
  session key, retried with exponential backoff, and never raised into the caller;
- with replicas sharing sessions and memory (`ConsolidationGuard`), at most one runs
  per session across all of them, and a span already consolidated by one is never
  summarized again by another: its facts are stored once.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from anyio.abc import TaskStatus
from loguru import logger

from gateway.agent.context import estimate_branch_tokens, trim_middle
from gateway.agent.tokens import estimate_messages_tokens, estimate_text_tokens
from gateway.agent.windows import ContextWindows
from gateway.llm.types import ContextOverflow, LLMError, LLMMessage, LLMProvider, ToolSpec
from gateway.memory.facts import NewFact, Origin
from gateway.memory.format import CATEGORIES, normalize_category
from gateway.memory.protocol import ConsolidationGuard, ConsolidationLease, MemoryBackend
from gateway.memory.text import one_line
from gateway.sessions import EntryNotFoundError, Session, SessionContext, SessionManager
from gateway.sessions.context import choose_cut
from gateway.usage.meter import usage_scope

CONSOLIDATION_TOOL = "save_consolidation"
MAX_FACTS = 100
MAX_FACT_CHARS = 1000
SUMMARY_WORDS = 400

# -- when, and what ----------------------------------------------------------------------


def needs_consolidation(
    ctx: SessionContext, *, memory_window: int, context_window: int, token_share: float = 0.75
) -> bool:
    """True when the branch since the last compaction holds more than twice
    `memory_window` messages, or its tokens (`estimate_branch_tokens`: the provider's
    last reported count where known) pass `token_share` of `context_window`."""
    if len(ctx.messages) > 2 * memory_window:
        return True
    return estimate_branch_tokens(ctx.messages) > token_share * context_window


@dataclass(frozen=True, slots=True)
class CompactionPlan:
    """What one consolidation summarizes (`to_summarize`: the context's messages
    before the cut, made by the session entries `entry_ids`) and where the compaction
    keeps the context from."""

    to_summarize: tuple[LLMMessage, ...]
    first_kept_entry_id: str
    kept: int
    previous_summary: str | None
    tokens_before: int
    entry_ids: tuple[str, ...] = ()

    def entry_of(self, number: int | None) -> str:
        """The entry of message `number` (1-based, as the request numbers them); the
        last summarized one when the model cited none or one that is not there."""
        if number is not None and 1 <= number <= len(self.entry_ids):
            return self.entry_ids[number - 1]
        return self.entry_ids[-1] if self.entry_ids else self.first_kept_entry_id


def plan_compaction(
    ctx: SessionContext,
    keep_last: int,
    *,
    max_kept_tokens: int | None = None,
    max_summarize_tokens: int | None = None,
) -> CompactionPlan | None:
    """Cut the context so about `keep_last` messages stay (never splitting a tool call
    from its results, see `choose_cut`); None when nothing would be summarized.

    `max_kept_tokens` moves the cut later while the kept part is larger than that
    (big tool results). `max_summarize_tokens` moves it earlier while the part to
    summarize does not fit one request (as `transcript_lines` renders it); the rest is
    left for the next run. At least one message is always kept, so
    ``first_kept_entry_id`` always names an entry of the snapshot's branch.
    """
    messages = ctx.messages
    if len(messages) < 2:
        return None
    cut = choose_cut(messages, max(1, keep_last))
    if max_kept_tokens is not None:
        kept_tokens = estimate_messages_tokens(messages[cut:])
        while kept_tokens > max_kept_tokens:
            nxt = _next_boundary(messages, cut)
            if nxt >= len(messages):
                break
            kept_tokens -= estimate_messages_tokens(messages[cut:nxt])
            cut = nxt
    if max_summarize_tokens is not None:
        costs = [estimate_text_tokens(line) for line in transcript_lines(messages[:cut])]
        used = sum(costs)
        while used > max_summarize_tokens:
            earlier = _previous_boundary(messages, cut)
            if earlier <= 0:
                break
            used -= sum(costs[earlier:cut])
            cut = earlier
    if cut <= 0:
        return None
    return CompactionPlan(
        to_summarize=tuple(messages[:cut]),
        first_kept_entry_id=ctx.entry_ids[cut],
        kept=len(messages) - cut,
        previous_summary=ctx.summary,
        tokens_before=estimate_branch_tokens(messages),
        entry_ids=tuple(ctx.entry_ids[:cut]),
    )


def _next_boundary(messages: Sequence[LLMMessage], cut: int) -> int:
    nxt = cut + 1
    while nxt < len(messages) and messages[nxt].role == "tool":
        nxt += 1
    return nxt


def _previous_boundary(messages: Sequence[LLMMessage], cut: int) -> int:
    earlier = cut - 1
    while earlier > 0 and messages[earlier].role == "tool":
        earlier -= 1
    return earlier


# -- asking the model --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConsolidationResult:
    """Facts as ``(category, text)`` (categories normalized), the new cumulative
    summary (for the compaction entry), and what only the new messages were about (for
    HISTORY.md, so its lines do not repeat each other; the summary when not given).
    `cited[i]` is the number of the message fact i came from, when the model said."""

    facts: tuple[tuple[str, str], ...]
    summary: str
    recent: str | None = None
    cited: tuple[int | None, ...] = ()

    def new_facts(self, session_key: str, plan: CompactionPlan) -> list[NewFact]:
        """The facts with their origins: the entry of the message each cites."""
        cited = self.cited + (None,) * (len(self.facts) - len(self.cited))
        return [
            NewFact(category, text, Origin(session_key, plan.entry_of(number)))
            for (category, text), number in zip(self.facts, cited, strict=False)
        ]

    @property
    def history_line(self) -> str:
        return self.recent or self.summary


class ConsolidationError(Exception):
    """The model's consolidation answer was missing, late or unusable."""


def consolidation_tool() -> ToolSpec:
    """The tool the model is forced to call with its answer."""
    return ToolSpec(
        name=CONSOLIDATION_TOOL,
        description="Save durable facts and the updated conversation summary.",
        parameters={
            "type": "object",
            "properties": {
                "facts": {
                    "type": "array",
                    "description": "Durable facts worth remembering; empty if none.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "category": {"type": "string", "enum": list(CATEGORIES)},
                            "text": {"type": "string"},
                            "message": {
                                "type": "integer",
                                "description": "The [number] of the message it came from.",
                            },
                        },
                        "required": ["category", "text"],
                        "additionalProperties": False,
                    },
                },
                "summary": {
                    "type": "string",
                    "description": "The whole conversation so far: previous summary "
                    "plus the new messages.",
                },
                "recent": {
                    "type": "string",
                    "description": "One or two sentences on what only the new messages "
                    "were about, for the history log.",
                },
            },
            "required": ["facts", "summary"],
            "additionalProperties": False,
        },
    )


_SYSTEM_PROMPT = f"""\
You keep the long-term memory of a chat assistant. You get the summary of a \
conversation so far and the messages that followed it. Call {CONSOLIDATION_TOOL} once:
- facts: durable facts worth remembering in later conversations, each one short \
self-contained sentence with a category: user_preference, project_decision, \
error_pattern, system_behavior or learned_fact, and the [number] of the message it \
came from. No small talk, greetings, one-off \
details or tool chatter. An empty list when nothing qualifies.
- summary: ONE summary of the whole conversation so far. It replaces the previous \
summary, so carry over everything from it that still matters (people, decisions, open \
tasks, promises), then add the new messages. At most {SUMMARY_WORDS} words.
- recent: one or two sentences on what only the new messages were about."""

_JSON_FALLBACK = (
    "If you cannot call tools, answer with only this JSON object and nothing else: "
    '{"facts": [{"category": "...", "text": "...", "message": 1}], "summary": "...", '
    '"recent": "..."}'
)


def transcript_lines(
    messages: Sequence[LLMMessage], *, max_message_tokens: int = 600, max_tool_tokens: int = 200
) -> list[str]:
    """One line block per message, `[n] Role: text` (n from 1, so a fact can cite its
    message), long texts cut in the middle."""
    lines: list[str] = []
    for number, message in enumerate(messages, start=1):
        text = message.content or ""
        if message.role == "tool":
            label = f"Tool result ({message.name or 'tool'})"
            text = trim_middle(text, max_tool_tokens)
        else:
            label = {"user": "User", "assistant": "Assistant", "system": "System"}[message.role]
            text = trim_middle(text, max_message_tokens)
        if message.tool_calls:
            calls = ", ".join(
                f"{call.function_name}({json.dumps(call.arguments, ensure_ascii=False)[:200]})"
                for call in message.tool_calls
            )
            text = f"{text} [called {calls}]".strip()
        lines.append(f"[{number}] {label}: {text}")
    return lines


def consolidation_messages(
    previous_summary: str | None, messages: Sequence[LLMMessage]
) -> list[LLMMessage]:
    """The request: instructions, then the previous summary and the new messages."""
    transcript = "\n".join(transcript_lines(messages))
    user = (
        f"Previous summary:\n{previous_summary or '(none yet)'}\n\n"
        f"New messages, oldest first:\n{transcript}\n\n"
        f"Call {CONSOLIDATION_TOOL} now. {_JSON_FALLBACK}"
    )
    return [
        LLMMessage(role="system", content=_SYSTEM_PROMPT),
        LLMMessage(role="user", content=user),
    ]


_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_consolidation(message: LLMMessage) -> ConsolidationResult:
    """The result from a `save_consolidation` call, else from a JSON object that is the
    whole content (a ```json fence allowed). Raises `ConsolidationError` saying what
    was wrong."""
    for call in message.tool_calls:
        if call.function_name != CONSOLIDATION_TOOL:
            continue
        if set(call.arguments) == {"_raw"}:
            raise ConsolidationError(f"{CONSOLIDATION_TOOL} arguments are not a JSON object")
        return _validated(call.arguments)
    content = (message.content or "").strip()
    if not content:
        called = ", ".join(c.function_name for c in message.tool_calls) or "nothing"
        raise ConsolidationError(
            f"the model answered without {CONSOLIDATION_TOOL} or JSON (called {called})"
        )
    fenced = _FENCE_RE.match(content)
    if fenced:
        content = fenced.group(1)
    try:
        data = json.loads(content)
    except ValueError:
        raise ConsolidationError(
            f"the model answered neither with {CONSOLIDATION_TOOL} nor with a JSON object: "
            f"{content[:120]!r}"
        ) from None
    if not isinstance(data, dict):
        raise ConsolidationError("the model's JSON answer is not an object")
    return _validated(data)


def _validated(data: Mapping[str, Any]) -> ConsolidationResult:
    summary = data.get("summary")
    if not isinstance(summary, str) or not summary.strip():
        # An empty summary would replace the previous one with nothing.
        raise ConsolidationError("the consolidation answer has no summary")
    raw_facts = data.get("facts", [])
    if not isinstance(raw_facts, list):
        raise ConsolidationError("the consolidation answer's facts are not a list")
    facts: list[tuple[str, str]] = []
    cited: list[int | None] = []
    for item in raw_facts[:MAX_FACTS]:
        if not isinstance(item, dict):
            raise ConsolidationError("a consolidation fact is not an object")
        category, text = item.get("category"), item.get("text")
        if not isinstance(text, str) or not isinstance(category, str | None):
            raise ConsolidationError("a consolidation fact has no text or a bad category")
        text = one_line(text)[:MAX_FACT_CHARS]
        if text:
            facts.append((normalize_category(category or ""), text))
            number = item.get("message")
            # A wrong citation costs only precision: the fact then points at the range.
            usable = isinstance(number, int) and not isinstance(number, bool)
            cited.append(number if usable else None)
    recent = data.get("recent")
    recent_line = one_line(recent) if isinstance(recent, str) else ""
    return ConsolidationResult(tuple(facts), summary.strip(), recent_line or None, tuple(cited))


async def summarize(
    provider: LLMProvider,
    model: str,
    previous_summary: str | None,
    messages: Sequence[LLMMessage],
    timeout: float,  # noqa: ASYNC109  (part of the call contract; a timeout is a failure)
) -> ConsolidationResult:
    """Ask `model` for facts and an accumulated summary with a forced tool call.

    Raises `ConsolidationError` for a late or unusable answer and `LLMError` when the
    model could not be reached.
    """
    request = consolidation_messages(previous_summary, messages)
    try:
        with anyio.fail_after(timeout):
            response = await provider.chat(
                request,
                model=model,
                tools=[consolidation_tool()],
                tool_choice={"type": "function", "function": {"name": CONSOLIDATION_TOOL}},
            )
    except TimeoutError:
        raise ConsolidationError(f"the model gave no answer within {timeout:g}s") from None
    return parse_consolidation(response.message)


# -- the background service --------------------------------------------------------------


def retry_delay(failures: int, base: float, maximum: float) -> float:
    """Seconds before retry number `failures` (1 = first retry): `base` doubling each
    time, at most `maximum`."""
    if failures <= 0:
        return 0.0
    return min(maximum, base * 2.0 ** min(failures - 1, 64))


OutcomeStatus = Literal[
    "compacted",
    "not_needed",
    "nothing_to_summarize",
    "no_session",
    "stale",
    "busy",
    "reset",
    "cancelled",
    "failed",
]


@dataclass(frozen=True, slots=True)
class ConsolidationOutcome:
    """What one consolidation did. `stale`: the branch moved meanwhile, nothing was
    written; `reset`: the session was reset meanwhile, facts were stored but the old
    session got no compaction; `cancelled`: a ``session_before_compact`` hook vetoed
    the compaction (facts were stored); `failed`: nothing changed, a retry is due in
    `retry_in`; `busy`: another replica consolidates (or did consolidate) this span,
    nothing was written here. `more`: the backlog needs another run (already queued)."""

    session_key: str
    status: OutcomeStatus
    facts: int = 0
    summarized: int = 0
    kept: int = 0
    error: str | None = None
    retry_in: float | None = None
    more: bool = False

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def describe(self) -> str:
        """One line for a person (``/compact``, ``gateway memory compact``)."""
        if self.status == "compacted":
            return (
                f"Compacted: {self.summarized} older messages summarized, {self.kept} kept, "
                f"{self.facts} facts saved to memory."
            )
        if self.status == "failed":
            retry = f" Retrying in {self.retry_in:.0f}s." if self.retry_in else ""
            return f"Compaction failed; nothing was lost.{retry} ({self.error})"
        return _DESCRIPTIONS[self.status]


_DESCRIPTIONS: dict[str, str] = {
    "not_needed": "No compaction needed yet.",
    "nothing_to_summarize": "Nothing to compact: the conversation is short.",
    "no_session": "There is no conversation to compact.",
    "stale": "The conversation moved to another branch meanwhile; nothing was compacted.",
    "busy": "Another gateway replica compacted or is compacting this conversation; "
    "nothing was done here.",
    "reset": "The conversation was reset meanwhile; its facts were saved to memory.",
    "cancelled": "An extension cancelled the compaction; facts were saved to memory.",
}


@dataclass(frozen=True, slots=True)
class ConsolidatorStats:
    """Counters for metrics: runs started, compactions written, failures, runs that
    found nothing to do, keys queued, runs in progress (service and on demand), and
    the last error (``key: detail``)."""

    runs: int
    compactions: int
    failures: int
    skipped: int
    pending: int
    running: int
    last_error: str | None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    session: Session
    session_id: str
    plan: CompactionPlan
    lease: ConsolidationLease | None = None


class Consolidator:
    """Runs consolidations: queued by the agent after a reply (`maybe_schedule`),
    on demand (`consolidate_now`, for ``/compact`` and ``gateway memory compact``), and
    as retries. `run` is the service; start it in the daemon's task group.

    All methods are meant for one event loop (the daemon's); the blocking work (session
    and memory files) runs in worker threads.
    """

    def __init__(
        self,
        sessions: SessionManager,
        memory: MemoryBackend,
        provider: LLMProvider,
        *,
        model: str,
        consolidation_model: str | None = None,
        memory_window: int,
        context_window: int,
        token_share: float = 0.75,
        timeout: float = 120.0,
        retry_base: float = 30.0,
        retry_max: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        max_concurrent: int = 2,
        guard: ConsolidationGuard | None = None,
        windows: ContextWindows | None = None,
    ) -> None:
        """`context_window` is the size used until `windows` (the agent's) knows the
        model's own (`gateway.agent.windows`)."""
        if memory_window < 1:
            raise ValueError("memory_window must be at least 1")
        if not 0 < token_share <= 1:
            raise ValueError("token_share must be in (0, 1]")
        if timeout <= 0 or retry_base <= 0 or retry_max < retry_base:
            raise ValueError("need timeout > 0 and 0 < retry_base <= retry_max")
        self.sessions = sessions
        self.memory = memory
        self.provider = provider
        self.model = consolidation_model or model
        self.memory_window = memory_window
        self._configured_window = context_window
        self.windows = windows
        self.token_share = token_share
        self.timeout = timeout
        self.retry_base = retry_base
        self.retry_max = retry_max
        self.clock = clock
        self.max_concurrent = max(1, max_concurrent)
        self.guard = guard
        self._pending: dict[str, float] = {}  # key -> when it is due (clock time)
        self._failures: dict[str, int] = {}  # key -> consecutive failures
        self._running: set[str] = set()  # keys with a service job in progress
        self._locks: dict[str, anyio.Lock] = {}
        self._lock_users: dict[str, int] = {}
        self._limiter: anyio.CapacityLimiter | None = None
        self._wake: anyio.Event | None = None
        self._changed: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None
        self._serving = False
        self._closed = False
        self._runs = self._compactions = self._failed = self._skipped = 0
        self._in_progress = 0
        self._last_error: str | None = None

    # -- policy --------------------------------------------------------------------

    @property
    def context_window(self) -> int:
        """The consolidation model's context window as the agent uses it: what its
        server said where known (a summary request must fit a small local window too)."""
        if self.windows is None:
            return self._configured_window
        return self.windows.known(self.model).tokens

    def should_consolidate(self, ctx: SessionContext) -> bool:
        return needs_consolidation(
            ctx,
            memory_window=self.memory_window,
            context_window=self.context_window,
            token_share=self.token_share,
        )

    def plan(self, ctx: SessionContext) -> CompactionPlan | None:
        """This consolidator's cut: keep `memory_window` messages, and at most half
        the trigger's tokens so the next turn does not trigger again at once."""
        return plan_compaction(
            ctx,
            self.memory_window,
            max_kept_tokens=int(self.token_share * self.context_window / 2),
            max_summarize_tokens=self.context_window // 2,
        )

    # -- queueing --------------------------------------------------------------------

    def maybe_schedule(self, session_key: str, context: SessionContext | None = None) -> bool:
        """Queue `session_key` if its context needs consolidation; True if queued.

        Cheap (no I/O): pass the context the turn already has. Without one the key is
        queued and the run checks the trigger in a worker thread.
        """
        if self._closed:
            return False
        if context is not None and not self.should_consolidate(context):
            return False
        self.schedule(session_key)
        return True

    def schedule(self, session_key: str) -> None:
        """Queue a consolidation check of `session_key` (a pending retry keeps its
        backoff: scheduling does not hammer a failing model)."""
        if self._closed:
            return
        now = self.clock()
        self._pending[session_key] = max(now, self._pending.get(session_key, now))
        self._wake_up()

    def wake(self) -> None:
        """Look at the queue now (after an injected clock moved; the service otherwise
        wakes by itself when the next retry is due)."""
        self._wake_up()

    @property
    def stats(self) -> ConsolidatorStats:
        return ConsolidatorStats(
            runs=self._runs,
            compactions=self._compactions,
            failures=self._failed,
            skipped=self._skipped,
            pending=len(self._pending),
            running=self._in_progress,
            last_error=self._last_error,
        )

    def pending_keys(self) -> dict[str, float]:
        """Queued keys and when each is due (clock time)."""
        return dict(self._pending)

    # -- the service -----------------------------------------------------------------

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Process queued keys until `aclose` (or cancellation): due keys start at once,
        different sessions concurrently up to `max_concurrent`, one job per session."""
        if self._serving:
            raise RuntimeError("the consolidator is already running")
        self._serving = True
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                task_status.started()
                while not self._closed:
                    wake = self._wake = anyio.Event()  # fresh before looking at the queue
                    for key in self._take_due():
                        tg.start_soon(self._job, key)
                    with anyio.move_on_after(self._next_delay()):
                        await wake.wait()
                tg.cancel_scope.cancel()
        finally:
            self._serving = False
            self._scope = None

    async def drain(self, timeout: float) -> bool:  # noqa: ASYNC109  (returns False, no raise)
        """Finish running jobs and the keys already due (running them here when the
        service is not running); True if done within `timeout` seconds. Retries due
        later stay queued."""
        with anyio.move_on_after(timeout):
            while True:
                if not self._serving:
                    for key in self._take_due():
                        await self._job(key)
                if not self._running and not self._due_keys():
                    return True
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()
        return False

    async def aclose(self) -> None:
        """Stop the service: queued keys are dropped, running jobs are cancelled (their
        history stays whole; a commit already under way completes)."""
        self._closed = True
        if self._pending:
            logger.info("consolidation: abandoning {} queued sessions", len(self._pending))
        self._pending.clear()
        if self._scope is not None:
            self._scope.cancel()
        self._wake_up()

    async def consolidate_now(
        self, session_key: str, force: bool = False, *, retry: bool = True
    ) -> ConsolidationOutcome:
        """Consolidate `session_key` now (after any run of it in progress); `force`
        ignores the trigger. Never raises for model or storage problems: see the
        outcome's `status` and `error`. `retry=False` is for a caller that reports a
        failure itself and will not be there for a retry (`gateway memory compact`):
        none is scheduled or promised."""
        return await self._consolidate(session_key, force, retry=retry)

    # -- internals -----------------------------------------------------------------

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _notify(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    def _due_keys(self) -> list[str]:
        now = self.clock()
        due = [k for k, at in self._pending.items() if at <= now and k not in self._running]
        return sorted(due, key=lambda k: self._pending[k])

    def _take_due(self) -> list[str]:
        keys = self._due_keys()
        for key in keys:
            del self._pending[key]
            self._running.add(key)
        return keys

    def _next_delay(self) -> float:
        waiting = [at for k, at in self._pending.items() if k not in self._running]
        if not waiting:
            return math.inf
        return max(0.0, min(waiting) - self.clock())

    async def _job(self, key: str) -> None:
        try:
            await self._consolidate(key, force=False)
        finally:
            self._running.discard(key)
            self._wake_up()
            self._notify()

    async def _consolidate(
        self, key: str, force: bool, *, retry: bool = True
    ) -> ConsolidationOutcome:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrent)
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = anyio.Lock()
        self._lock_users[key] = self._lock_users.get(key, 0) + 1
        try:
            with logger.contextualize(session=key):
                async with lock, self._limiter:
                    return await self._consolidate_locked(key, force, retry)
        finally:
            self._lock_users[key] -= 1
            if not self._lock_users[key]:
                del self._lock_users[key], self._locks[key]

    async def _consolidate_locked(self, key: str, force: bool, retry: bool) -> ConsolidationOutcome:
        self._runs += 1
        self._in_progress += 1
        try:
            return await self._attempt(key, force, retry)
        finally:
            self._in_progress -= 1

    async def _attempt(self, key: str, force: bool, retry: bool) -> ConsolidationOutcome:
        if self.guard is None:
            return await self._attempt_held(key, force, retry, None)
        try:
            lease = await anyio.to_thread.run_sync(self.guard.acquire, key)
        except Exception as exc:
            return self._record_failure(key, exc, retry)
        if lease is None:
            # Another replica runs it; it schedules any further run itself.
            self._skipped += 1
            return ConsolidationOutcome(key, "busy")
        try:
            return await self._attempt_held(key, force, retry, lease)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lease.release)

    async def _attempt_held(
        self, key: str, force: bool, retry: bool, lease: ConsolidationLease | None
    ) -> ConsolidationOutcome:
        started = time.monotonic()
        try:
            with anyio.fail_after(self.timeout):
                if self.windows is not None:
                    await self.windows.ensure(self.model)  # the plan's sizes depend on it
                snapshot = await anyio.to_thread.run_sync(self._snapshot, key, force, lease)
                if isinstance(snapshot, ConsolidationOutcome):
                    self._skipped += 1
                    self._failures.pop(key, None)
                    return snapshot
                plan = snapshot.plan
                # Counted as upkeep of this conversation, apart from its turns.
                with usage_scope(key, "consolidation"):
                    result = await summarize(
                        self.provider,
                        self.model,
                        plan.previous_summary,
                        plan.to_summarize,
                        self.timeout,
                    )
            # The commit is short local I/O; once begun it completes, so a cancellation
            # cannot leave facts recorded without their compaction.
            with anyio.CancelScope(shield=True):
                outcome = await anyio.to_thread.run_sync(self._commit, key, snapshot, result)
        except Exception as exc:
            if isinstance(exc, ContextOverflow) and exc.context_tokens and self.windows:
                # The retry's plan is cut to the size the server named.
                self.windows.learn(self.model, exc.context_tokens, exc.server, exc.provider)
            return self._record_failure(key, exc, retry)
        self._failures.pop(key, None)
        if outcome.status == "compacted":
            self._compactions += 1
        logger.info(
            "consolidation {} in {:.1f}s: {} messages summarized, {} kept, {} facts",
            outcome.status,
            time.monotonic() - started,
            outcome.summarized,
            outcome.kept,
            outcome.facts,
        )
        if outcome.more:
            self.schedule(key)  # a long backlog goes in several runs
        return outcome

    def _snapshot(
        self, key: str, force: bool, lease: ConsolidationLease | None = None
    ) -> _Snapshot | ConsolidationOutcome:
        # Under the lease, `get` reads what other replicas appended (their compactions).
        session = self.sessions.get(key)
        if session is None:
            return ConsolidationOutcome(key, "no_session")
        ctx = session.build_context()
        if not force and not self.should_consolidate(ctx):
            return ConsolidationOutcome(key, "not_needed")
        plan = self.plan(ctx)
        if plan is None:
            return ConsolidationOutcome(key, "nothing_to_summarize")
        return _Snapshot(session, session.session_id, plan, lease)

    def _commit(
        self, key: str, snapshot: _Snapshot, result: ConsolidationResult
    ) -> ConsolidationOutcome:
        session, plan = snapshot.session, snapshot.plan
        facts, summarized = len(result.facts), len(plan.to_summarize)
        reset = session.session_id != snapshot.session_id
        branch = [e.id for e in session.get_branch()]
        if not reset and plan.first_kept_entry_id not in branch:
            # The user moved to another branch meanwhile; a compaction at the new leaf
            # would hide that branch's messages. Try again on the next trigger.
            return ConsolidationOutcome(key, "stale")
        if snapshot.lease is not None and _already_consolidated(
            snapshot.lease.consolidated(), snapshot.session_id, plan.first_kept_entry_id, branch
        ):
            return ConsolidationOutcome(key, "busy")
        # Facts first: a crash before the compaction can only repeat them next time.
        self.memory.for_session(key).record_consolidation(
            result.new_facts(key, plan), result.history_line
        )
        if reset:  # /new meanwhile: the old conversation's facts still count
            return ConsolidationOutcome(key, "reset", facts, summarized)
        try:
            entry = session.compact(
                result.summary,
                plan.first_kept_entry_id,
                tokens_before=plan.tokens_before,
                details={
                    "source": "consolidation",
                    "model": self.model,
                    "summarized_messages": len(plan.to_summarize),
                    "facts": len(result.facts),
                },
            )
        except EntryNotFoundError:  # reset between the check and the append
            return ConsolidationOutcome(key, "reset", facts, summarized)
        if entry is None:
            return ConsolidationOutcome(key, "cancelled", facts, summarized)
        if snapshot.lease is not None:
            snapshot.lease.record(
                snapshot.session_id, plan.first_kept_entry_id, summarized=summarized, facts=facts
            )
        after = session.build_context()
        more = self.should_consolidate(after) and self.plan(after) is not None
        return ConsolidationOutcome(
            key, "compacted", facts, summarized, kept=len(after.messages), more=more
        )

    def _record_failure(self, key: str, exc: Exception, retry: bool) -> ConsolidationOutcome:
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        delay = retry_delay(failures, self.retry_base, self.retry_max)
        if isinstance(exc, TimeoutError):
            detail = f"no result within {self.timeout:g}s"
        elif isinstance(exc, LLMError | ConsolidationError):
            detail = str(exc)
        else:
            detail = f"{type(exc).__name__}: {exc}"
            logger.opt(exception=exc).error("consolidation hit an unexpected error")
        self._failed += 1
        self._last_error = f"{key}: {detail}"
        if not retry:
            # The caller reports it (one line); a log line too would say it twice.
            logger.debug("consolidation failed; history kept, not retried: {}", detail)
            return ConsolidationOutcome(key, "failed", error=detail)
        if not self._closed:
            self._pending[key] = self.clock() + delay
            self._wake_up()
        logger.warning(
            "consolidation failed (attempt {}); history kept, retry in {:.0f}s: {}",
            failures,
            delay,
            detail,
        )
        return ConsolidationOutcome(key, "failed", error=detail, retry_in=delay)


def _already_consolidated(
    done: tuple[str, str] | None, session_id: str, first_kept: str, branch: list[str]
) -> bool:
    """True when the recorded consolidation `done` of this session already covers the
    span up to `first_kept` (its first kept entry is that one or a later one)."""
    if done is None or done[0] != session_id or done[1] not in branch:
        return False
    return branch.index(done[1]) >= branch.index(first_kept) if first_kept in branch else False
