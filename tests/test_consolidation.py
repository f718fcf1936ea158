"""Memory consolidation end to end: real sessions on disk, a real MemoryStore, the real
OpenAIProvider talking to the fake OpenAI server. Pure policies are tested directly."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.agent.consolidation import (
    CONSOLIDATION_TOOL,
    ConsolidationError,
    Consolidator,
    consolidation_messages,
    needs_consolidation,
    parse_consolidation,
    plan_compaction,
    retry_delay,
)
from gateway.llm import LLMMessage, LLMResponse, TokenUsage, ToolCall
from gateway.llm.openai_provider import OpenAIProvider
from gateway.memory import MemoryStore
from gateway.memory.facts import Origin
from gateway.sessions import CompactionEntry, Session, SessionContext, SessionManager
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply
from tests.llm_messages import assistant, user

KEY = "telegram:1"


def consolidation_reply(
    summary: str, facts: Sequence[tuple[str, str]] = (), *, delay: float = 0.0
) -> Reply:
    arguments = {"facts": [{"category": c, "text": t} for c, t in facts], "summary": summary}
    return Reply(tool_calls=(FakeToolCall(CONSOLIDATION_TOOL, arguments),), delay=delay)


def fill(session: Session, turns: int, tag: str = "chat") -> None:
    for i in range(turns):
        session.add_message(user(f"{tag} question {i}"))
        session.add_message(assistant(f"{tag} answer {i}"))


def compactions(session: Session) -> list[CompactionEntry]:
    return [e for e in session.entries if isinstance(e, CompactionEntry)]


def contents(ctx: SessionContext) -> list[str | None]:
    return [m.content for m in ctx.messages]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[SessionManager]:
    manager = SessionManager(tmp_path / "sessions", fsync="never")
    yield manager
    manager.close()


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[MemoryStore]:
    store = MemoryStore(tmp_path / "workspace")
    yield store
    store.close()


def make(
    sessions: SessionManager, memory: MemoryStore, provider: Any, **overrides: Any
) -> Consolidator:
    options: dict[str, Any] = {
        "model": "gpt-4o-mini",
        "memory_window": 4,
        "context_window": 100_000,
        "timeout": 5.0,
        "retry_base": 30.0,
        "retry_max": 100.0,
    }
    options.update(overrides)
    return Consolidator(sessions, memory, provider, **options)


# -- pure policies ------------------------------------------------------------------------


def ctx_of(messages: Sequence[LLMMessage], summary: str | None = None) -> SessionContext:
    return SessionContext(
        messages=tuple(messages),
        entry_ids=tuple(f"e{i}" for i in range(len(messages))),
        summary=summary,
    )


def test_trigger_by_message_count() -> None:
    eight = ctx_of([user("x")] * 8)
    assert not needs_consolidation(eight, memory_window=4, context_window=10_000)
    assert needs_consolidation(ctx_of([user("x")] * 9), memory_window=4, context_window=10_000)


def test_trigger_by_tokens_and_reported_usage() -> None:
    big = ctx_of([user("y" * 4000)] * 3)  # ~3012 tokens
    assert needs_consolidation(big, memory_window=50, context_window=4000)
    assert not needs_consolidation(big, memory_window=50, context_window=5000)
    assert needs_consolidation(big, memory_window=50, context_window=5000, token_share=0.5)
    # Small text, but the provider said the last request was large (dense tokens).
    reported = TokenUsage(prompt_tokens=3500, completion_tokens=10, total_tokens=3510)
    dense = ctx_of([user("hi"), assistant("hello", reported), user("more")])
    assert needs_consolidation(dense, memory_window=50, context_window=4000)
    assert not needs_consolidation(dense, memory_window=50, context_window=8000)


def test_retry_delay_doubles_up_to_the_cap() -> None:
    assert [retry_delay(n, 30, 3600) for n in range(5)] == [0, 30, 60, 120, 240]
    assert retry_delay(10, 30, 3600) == 3600
    assert retry_delay(10_000, 30, 3600) == 3600


def test_plan_cuts_before_the_tool_call_not_between_call_and_result() -> None:
    call = LLMMessage(
        role="assistant", tool_calls=[ToolCall(id="c1", function_name="current_time")]
    )
    result = LLMMessage(role="tool", content="now", tool_call_id="c1", name="current_time")
    messages = [user("a"), assistant("b"), user("c"), assistant("d"), user("e"), call, result]
    messages += [assistant("f"), user("g"), assistant("h")]
    plan = plan_compaction(ctx_of(messages, summary="old"), keep_last=4)
    assert plan is not None
    assert plan.first_kept_entry_id == "e5" and plan.kept == 5
    assert plan.to_summarize == tuple(messages[:5]) and plan.previous_summary == "old"
    assert plan_compaction(ctx_of(messages[:3]), keep_last=4) is None
    assert plan_compaction(ctx_of([user("only")]), keep_last=0) is None


def test_plan_bounds_the_kept_part_and_the_summarized_part() -> None:
    messages = [user(f"m{i} " + "z" * 2000) for i in range(10)]
    kept = plan_compaction(ctx_of(messages), keep_last=6, max_kept_tokens=1100)
    assert kept is not None and kept.kept == 2  # two ~504-token messages fit
    chunk = plan_compaction(ctx_of(messages), keep_last=2, max_summarize_tokens=1300)
    assert chunk is not None and len(chunk.to_summarize) == 2  # the rest waits


tool_ids = st.sampled_from(["a", "b", "c"])


@st.composite
def transcripts(draw: st.DrawFn) -> list[LLMMessage]:
    messages: list[LLMMessage] = []
    for kind in draw(st.lists(st.sampled_from(["user", "assistant", "tools"]), max_size=25)):
        if kind == "tools":
            ids = draw(st.lists(tool_ids, min_size=1, max_size=3, unique=True))
            messages.append(
                LLMMessage(
                    role="assistant",
                    tool_calls=[ToolCall(id=i, function_name="f") for i in ids],
                )
            )
            messages += [LLMMessage(role="tool", content="r", tool_call_id=i) for i in ids]
        else:
            messages.append(LLMMessage(role=kind, content="x" * draw(st.integers(0, 400))))
    return messages


@given(
    transcripts(),
    st.integers(0, 12),
    st.none() | st.integers(0, 400),
    st.none() | st.integers(0, 400),
)
def test_plan_never_splits_a_tool_call_from_its_results(
    messages: list[LLMMessage], keep: int, max_kept: int | None, max_summarized: int | None
) -> None:
    plan = plan_compaction(
        ctx_of(messages), keep, max_kept_tokens=max_kept, max_summarize_tokens=max_summarized
    )
    if plan is None:
        return
    cut = len(plan.to_summarize)
    assert 0 < cut < len(messages) and plan.kept == len(messages) - cut
    assert messages[cut].role != "tool"
    assert plan.first_kept_entry_id == f"e{cut}"


def test_parse_accepts_the_tool_call_or_strict_json() -> None:
    call = ToolCall(
        id="c",
        function_name=CONSOLIDATION_TOOL,
        arguments={"facts": [{"category": "nonsense", "text": " likes\ntea "}], "summary": "s"},
    )
    parsed = parse_consolidation(LLMMessage(role="assistant", tool_calls=[call]))
    assert parsed.facts == (("learned_fact", "likes tea"),) and parsed.summary == "s"
    body = json.dumps({"facts": [], "summary": "from content"})
    for content in (body, f"```json\n{body}\n```"):
        parsed = parse_consolidation(LLMMessage(role="assistant", content=content))
        assert parsed.summary == "from content" and parsed.facts == ()


def test_facts_point_at_the_message_they_cite_or_at_the_ranges_last_entry() -> None:
    messages = [user("hi"), assistant("hello"), user("I drink tea"), assistant("ok"), user("x")]
    plan = plan_compaction(ctx_of(messages), keep_last=1)
    assert plan is not None and plan.entry_ids == ("e0", "e1", "e2", "e3")
    request = consolidation_messages(None, plan.to_summarize)[1].content or ""
    assert "[3] User: I drink tea" in request and "[1] User: hi" in request
    facts = [
        {"category": "user_preference", "text": "Drinks tea", "message": 3},
        {"category": "learned_fact", "text": "Cited nothing"},
        {"category": "learned_fact", "text": "Cited a message not sent", "message": 9},
        {"category": "learned_fact", "text": "Cited with a bool", "message": True},
    ]
    call = ToolCall(
        id="c", function_name=CONSOLIDATION_TOOL, arguments={"facts": facts, "summary": "s"}
    )
    parsed = parse_consolidation(LLMMessage(role="assistant", tool_calls=[call]))
    assert parsed.cited == (3, None, 9, None)
    origins = [(f.text, f.origin) for f in parsed.new_facts("telegram:1", plan)]
    assert origins == [
        ("Drinks tea", Origin("telegram:1", "e2")),
        ("Cited nothing", Origin("telegram:1", "e3")),
        ("Cited a message not sent", Origin("telegram:1", "e3")),
        ("Cited with a bool", Origin("telegram:1", "e3")),
    ]


@pytest.mark.parametrize(
    "message",
    [
        LLMMessage(role="assistant", content="Sure! The user likes tea."),
        LLMMessage(role="assistant", content='["not", "an object"]'),
        LLMMessage(role="assistant", content=json.dumps({"facts": [], "summary": "  "})),
        LLMMessage(role="assistant", content=json.dumps({"facts": "tea", "summary": "s"})),
        LLMMessage(role="assistant", content=json.dumps({"facts": ["tea"], "summary": "s"})),
        LLMMessage(role="assistant", content=""),
        LLMMessage(
            role="assistant",
            tool_calls=[
                ToolCall(id="c", function_name=CONSOLIDATION_TOOL, arguments={"_raw": "{"})
            ],
        ),
    ],
)
def test_parse_rejects_unusable_answers(message: LLMMessage) -> None:
    with pytest.raises(ConsolidationError):
        parse_consolidation(message)


# -- against the fake server --------------------------------------------------------------


@pytest.mark.anyio
async def test_consolidation_stores_facts_and_compacts(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    fake_openai.add(
        consolidation_reply(
            "The user asked six questions about the weather.",
            [("user_preference", "Prefers green tea"), ("project_decision", "Uses Postgres")],
        )
    )
    consolidator = make(sessions, memory, provider)
    outcome = await consolidator.consolidate_now(KEY)

    assert outcome.status == "compacted" and outcome.ok
    assert (outcome.facts, outcome.summarized, outcome.kept) == (2, 8, 4)
    assert outcome.describe().startswith("Compacted: 8 older messages summarized, 4 kept")
    body = fake_openai.last_request.body
    assert body["tool_choice"] == {"type": "function", "function": {"name": CONSOLIDATION_TOOL}}
    schema = body["tools"][0]["function"]["parameters"]
    assert set(schema["properties"]["facts"]["items"]["properties"]["category"]["enum"]) == {
        "user_preference",
        "project_decision",
        "error_pattern",
        "system_behavior",
        "learned_fact",
    }
    request_text = fake_openai.last_request.messages[-1]["content"]
    assert "chat question 0" in request_text and "chat question 4" not in request_text

    scope = memory.for_session(KEY)
    assert "- [user_preference] Prefers green tea" in scope.read_memory()
    assert [e.content for e in scope.knowledge.search("postgres")] == ["Uses Postgres"]
    assert "six questions about the weather" in scope.read_history()

    [entry] = compactions(session)
    assert entry.first_kept_entry_id == before.entry_ids[8]
    assert entry.details is not None and entry.details["source"] == "consolidation"
    assert entry.tokens_before and entry.tokens_before > 0
    after = session.build_context()
    assert after.summary == "The user asked six questions about the weather."
    assert contents(after) == contents(before)[8:]
    assert consolidator.stats.compactions == 1 and consolidator.stats.failures == 0


@pytest.mark.anyio
async def test_the_summary_accumulates(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6, "tea")
    consolidator = make(sessions, memory, provider)
    fake_openai.add(consolidation_reply("FIRST: they talked about tea."))
    assert (await consolidator.consolidate_now(KEY)).status == "compacted"
    fill(session, 6, "coffee")
    fake_openai.add(consolidation_reply("SECOND: tea, then coffee."))
    assert (await consolidator.consolidate_now(KEY)).status == "compacted"

    second_request = fake_openai.chat_requests[-1].messages[-1]["content"]
    assert "FIRST: they talked about tea." in second_request
    assert "coffee question 0" in second_request
    assert session.build_context().summary == "SECOND: tea, then coffee."
    history = memory.for_session(KEY).read_history()
    assert "FIRST" in history and "SECOND" in history


@pytest.mark.anyio
async def test_json_content_is_accepted_when_tool_choice_is_ignored(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    fill(sessions.get_or_create(KEY), 6)
    fake_openai.add_reply(
        json.dumps(
            {"facts": [{"category": "error_pattern", "text": "CORS needs origin"}], "summary": "s"}
        )
    )
    outcome = await make(sessions, memory, provider).consolidate_now(KEY)
    assert outcome.status == "compacted" and outcome.facts == 1
    assert "[error_pattern] CORS needs origin" in memory.for_session(KEY).read_memory()


@pytest.mark.anyio
async def test_bad_output_is_a_failure_that_keeps_history(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    clock = Clock()
    consolidator = make(sessions, memory, provider, clock=clock)
    fake_openai.add_reply("Here is a nice summary for you!")
    outcome = await consolidator.consolidate_now(KEY)
    assert outcome.status == "failed" and not outcome.ok
    assert outcome.error and "JSON" in outcome.error and outcome.retry_in == 30
    assert outcome.describe().startswith("Compaction failed; nothing was lost. Retrying in 30s")
    assert consolidator.pending_keys() == {KEY: clock.now + 30}
    assert consolidator.stats.failures == 1 and KEY in (consolidator.stats.last_error or "")
    assert not compactions(session) and session.build_context() == before
    assert memory.for_session(KEY).read_memory() == ""


@pytest.mark.anyio
async def test_a_failing_model_loses_nothing_and_is_retried_with_backoff(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    clock = Clock()
    consolidator = make(sessions, memory, provider, clock=clock)
    fake_openai.fail_model("gpt-4o-mini", status=500, message="upstream exploded")

    async with anyio.create_task_group() as tg:
        await tg.start(consolidator.run)
        assert consolidator.maybe_schedule(KEY, before)
        assert await consolidator.drain(5)
        assert consolidator.stats.failures == 1
        assert "500" in (consolidator.stats.last_error or "")
        assert consolidator.pending_keys() == {KEY: clock.now + 30}
        # Scheduling again does not jump the backoff.
        consolidator.schedule(KEY)
        assert consolidator.pending_keys() == {KEY: clock.now + 30}
        attempts = len(fake_openai.chat_requests)

        clock.advance(29)
        consolidator.wake()
        assert await consolidator.drain(5)
        assert len(fake_openai.chat_requests) == attempts  # not due yet

        clock.advance(1)
        consolidator.wake()
        assert await consolidator.drain(5)
        assert consolidator.stats.failures == 2
        assert consolidator.pending_keys() == {KEY: clock.now + 60}

        clock.advance(60)
        consolidator.wake()
        assert await consolidator.drain(5)
        assert consolidator.pending_keys() == {KEY: clock.now + 100}  # 120, capped

        assert not compactions(session) and session.build_context() == before
        fake_openai.reset()
        fake_openai.add(consolidation_reply("finally", [("learned_fact", "It works")]))
        clock.advance(100)
        consolidator.wake()
        assert await consolidator.drain(5)
        await consolidator.aclose()

    assert consolidator.stats.compactions == 1 and consolidator.pending_keys() == {}
    assert session.build_context().summary == "finally"
    assert consolidator.stats.runs == 4


@pytest.mark.anyio
async def test_a_slow_model_times_out_and_loses_nothing(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    fake_openai.add(consolidation_reply("too late", delay=3))
    consolidator = make(sessions, memory, provider, timeout=0.3)
    started = time.monotonic()
    outcome = await consolidator.consolidate_now(KEY)
    assert time.monotonic() - started < 2
    assert outcome.status == "failed" and "0.3s" in (outcome.error or "")
    assert not compactions(session) and session.build_context() == before
    assert memory.for_session(KEY).read_history() == ""


@pytest.mark.anyio
async def test_messages_that_arrive_during_a_run_stay_in_context(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    fake_openai.add(consolidation_reply("summary of the start", delay=0.4))
    consolidator = make(sessions, memory, provider)
    outcomes = []

    async def consolidate() -> None:
        outcomes.append(await consolidator.consolidate_now(KEY))

    late = ["late question", "late answer", "another late question"]
    async with anyio.create_task_group() as tg:
        tg.start_soon(consolidate)
        with anyio.fail_after(5):
            await fake_openai.wait_for_requests_async(1)
        for i, text in enumerate(late):
            message = user(text) if i % 2 == 0 else assistant(text)
            await anyio.to_thread.run_sync(session.add_message, message)

    assert outcomes[0].status == "compacted"
    after = session.build_context()
    assert after.summary == "summary of the start"
    assert contents(after) == contents(before)[8:] + late
    # The late messages precede the compaction entry on the branch, after its cut.
    ids = [e.id for e in session.get_branch()]
    [entry] = compactions(session)
    assert ids.index(entry.first_kept_entry_id) < ids.index(entry.id) == len(ids) - 1


class TrackingProvider:
    """The real provider, counting calls in flight per conversation tag."""

    def __init__(self, inner: OpenAIProvider) -> None:
        self.inner = inner
        self.in_flight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()

    async def chat(self, messages: Sequence[LLMMessage], **kwargs: Any) -> LLMResponse:
        tag = "alpha" if "alpha" in (messages[-1].content or "") else "beta"
        self.in_flight[tag] += 1
        self.in_flight["all"] += 1
        for name in (tag, "all"):
            self.peak[name] = max(self.peak[name], self.in_flight[name])
        try:
            return await self.inner.chat(messages, **kwargs)
        finally:
            self.in_flight[tag] -= 1
            self.in_flight["all"] -= 1

    def stream(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.stream(*args, **kwargs)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.anyio
async def test_one_run_per_session_while_sessions_run_side_by_side(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    alpha, beta = sessions.get_or_create("slack:alpha"), sessions.get_or_create("slack:beta")
    fill(alpha, 6, "alpha")
    fill(beta, 6, "beta")
    for _ in range(3):
        fake_openai.add(consolidation_reply("summary", delay=0.3))
    tracking = TrackingProvider(provider)
    consolidator = make(sessions, memory, tracking, max_concurrent=2)
    forced = []

    async def compact_alpha_now() -> None:
        forced.append(await consolidator.consolidate_now("slack:alpha", force=True))

    async with anyio.create_task_group() as tg:
        await tg.start(consolidator.run)
        consolidator.schedule("slack:alpha")
        consolidator.schedule("slack:beta")
        with anyio.fail_after(5):
            await fake_openai.wait_for_requests_async(2)
        assert consolidator.stats.running == 2
        fill(alpha, 6, "alpha late")  # enough for another run of alpha
        consolidator.schedule("slack:alpha")  # queued behind the running one
        tg.start_soon(compact_alpha_now)  # waits for the running one too
        await anyio.sleep(0.05)
        assert "slack:alpha" in consolidator.pending_keys()
        assert await consolidator.drain(5)
        await consolidator.aclose()

    assert tracking.peak["alpha"] == 1 and tracking.peak["all"] == 2
    assert forced[0].status == "compacted"
    assert len(compactions(alpha)) == 2 and len(compactions(beta)) == 1
    assert len(fake_openai.chat_requests) == 3  # the queued re-check found nothing to do


@pytest.mark.anyio
async def test_a_tool_call_and_its_result_stay_together(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    for text in ("a", "b", "c", "d", "e"):
        session.add_message(user(text) if text in "ace" else assistant(text))
    session.add_message(
        LLMMessage(role="assistant", tool_calls=[ToolCall(id="t1", function_name="current_time")])
    )
    session.add_message(LLMMessage(role="tool", content="12:00", tool_call_id="t1"))
    for text in ("f", "g", "h"):
        session.add_message(assistant(text) if text != "g" else user(text))
    fake_openai.add(consolidation_reply("s"))
    outcome = await make(sessions, memory, provider).consolidate_now(KEY, force=True)
    assert outcome.status == "compacted" and outcome.summarized == 5
    after = session.build_context().messages
    assert after[0].tool_calls and after[1].role == "tool" and after[1].tool_call_id == "t1"


@pytest.mark.anyio
async def test_nothing_to_do_makes_no_model_call(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    consolidator = make(sessions, memory, provider)
    assert (await consolidator.consolidate_now("cli:nobody")).status == "no_session"
    session = sessions.get_or_create(KEY)
    fill(session, 2)
    assert (await consolidator.consolidate_now(KEY)).status == "not_needed"
    short = await consolidator.consolidate_now(KEY, force=True)
    assert short.status == "nothing_to_summarize" and "short" in short.describe()
    assert not consolidator.maybe_schedule(KEY, session.build_context())
    assert consolidator.pending_keys() == {}
    assert consolidator.maybe_schedule(KEY)  # no context at hand: queued for a check
    await consolidator.aclose()
    assert not consolidator.maybe_schedule(KEY)
    assert fake_openai.chat_requests == [] and consolidator.stats.skipped == 3


@pytest.mark.anyio
async def test_shutdown_abandons_a_run_without_losing_history(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    before = session.build_context()
    fake_openai.add(consolidation_reply("never used", delay=3))
    consolidator = make(sessions, memory, provider)
    async with anyio.create_task_group() as tg:
        await tg.start(consolidator.run)
        consolidator.schedule(KEY)
        with anyio.fail_after(5):
            await fake_openai.wait_for_requests_async(1)
        assert not await consolidator.drain(0.1)  # still running
        await consolidator.aclose()
    assert consolidator.stats.running == 0
    assert not compactions(session) and session.build_context() == before


@pytest.mark.anyio
async def test_a_branch_switch_or_reset_during_a_run_is_respected(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    sessions: SessionManager,
    memory: MemoryStore,
) -> None:
    session = sessions.get_or_create(KEY)
    fill(session, 6)
    early = session.build_context().entry_ids[1]
    consolidator = make(sessions, memory, provider)

    async def run_while(change: Any) -> str:
        outcome: list[str] = []

        async def consolidate() -> None:
            outcome.append((await consolidator.consolidate_now(KEY)).status)

        seen = len(fake_openai.chat_requests)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consolidate)
            with anyio.fail_after(5):
                await fake_openai.wait_for_requests_async(seen + 1)
            await anyio.to_thread.run_sync(change)
        return outcome[0]

    fake_openai.add(consolidation_reply("s1", [("learned_fact", "branch fact")], delay=0.3))
    assert await run_while(lambda: session.branch(early)) == "stale"
    assert not compactions(session) and memory.for_session(KEY).read_memory() == ""

    session.branch(session.entries[-2].id)  # back near the end of the original branch
    fill(session, 6)
    fake_openai.add(consolidation_reply("s2", [("learned_fact", "old chat fact")], delay=0.3))
    assert await run_while(lambda: sessions.reset(KEY)) == "reset"
    assert "old chat fact" in memory.for_session(KEY).read_memory()
    assert not compactions(session) and session.build_context().messages == ()


def test_the_module_imports_first_in_a_fresh_interpreter() -> None:
    """Guards the import order: `gateway.agent` (whose __init__ imports the loop) must
    not import this module at run time, or importing it first becomes circular."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import gateway.agent.consolidation"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
