"""The token-budgeted context builder: promises as properties, pruning strategies by
example, and a long scripted conversation through a real session."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.agent.consolidation import needs_consolidation, plan_compaction
from gateway.agent.context import (
    MEMORY_PREFIX,
    ContextBuilder,
    ContextPlan,
    PruningPolicy,
    UsageHint,
    estimate_branch_tokens,
    fit_context,
    score_importance,
    trim_middle,
)
from gateway.agent.tokens import estimate_messages_tokens, estimate_text_tokens
from gateway.agent.tools import ToolContext, build_registry
from gateway.llm import LLMMessage, TokenUsage, ToolCall
from gateway.memory.text import tokenize
from gateway.sessions import SessionManager
from tests.llm_messages import assert_well_paired, assistant, call, result, user

# -- properties ---------------------------------------------------------------------------

VOCABULARY = ("alpha", "beta", "gamma", "deploy", "database", "error", "python", "rust")
words = st.sampled_from((*VOCABULARY, "tea", "coffee", "log", "trace", "the", "a"))
texts = st.lists(words, min_size=0, max_size=60).map(" ".join) | st.text(max_size=300)
history_items = st.one_of(
    st.builds(user, texts),
    st.builds(assistant, texts),
    st.builds(lambda ids: call(*ids), st.lists(st.sampled_from("abc"), unique=True, max_size=3)),
    st.builds(result, st.sampled_from("abcd"), texts),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(history_items, max_size=40),
    last=texts,
    window=st.integers(min_value=20, max_value=3000),
    reserve=st.integers(min_value=0, max_value=100),
    max_messages=st.integers(min_value=0, max_value=25),
    memory=st.lists(texts, max_size=3),
    summary=st.none() | texts,
    ratio=st.floats(min_value=0.5, max_value=3.0),
)
def test_fit_context_keeps_its_promises(
    history: list[LLMMessage],
    last: str,
    window: int,
    reserve: int,
    max_messages: int,
    memory: list[str],
    summary: str | None,
    ratio: float,
) -> None:
    history = [*history, user(last)]
    usage = UsageHint(prompt_tokens=int(1000 * ratio), estimated_tokens=1000)
    plan = fit_context(
        system_prompt="You are helpful.",
        history=history,
        summary=summary,
        memory_texts=memory,
        context_window=window,
        reply_reserve=reserve,
        max_messages=max_messages,
        usage=usage,
    )
    budget = max(0, window - reserve)
    limit = int(budget / usage.ratio)
    assert plan.raw_tokens == estimate_messages_tokens(plan.messages)
    kept = [i for i in plan.kept_indices if i is not None]
    # Within budget, unless only protected messages remain (then memory is gone too).
    if plan.over_budget:
        assert all(i >= plan.protected_from for i in kept)
        assert not plan.memory_injected
    else:
        assert plan.raw_tokens <= limit
        assert plan.estimated_tokens <= budget + 1  # rounding of the scaled estimate
    # The new user message is always there, last and untouched.
    assert plan.messages[-1] is history[-1]
    # Tool pairs are well formed; kept messages keep their order.
    assert_well_paired(plan.history_messages)
    assert kept == sorted(kept) and len(set(kept)) == len(kept)
    # Every history message is either kept or reported as pruned, never both.
    pruned = [p.index for p in plan.pruned]
    assert sorted(kept + pruned) == list(range(len(history)))
    # Protected messages (that were not orphans) are all kept.
    orphans = {p.index for p in plan.pruned if p.reason == "orphan"}
    for i in range(max(plan.protected_from, 0), len(history)):
        assert i in kept or i in orphans


@given(st.lists(st.lists(words, max_size=20), max_size=15), st.lists(words, max_size=5))
def test_importance_is_bounded(units: list[list[str]], query: list[str]) -> None:
    scores = score_importance(
        [tokenize(" ".join(u)) for u in units], " ".join(query), PruningPolicy()
    )
    assert len(scores) == len(units)
    assert all(0.0 <= s <= 1.0 + 1e-9 for s in scores)


# -- strategies by example ----------------------------------------------------------------


def filler(i: int, size: int = 400) -> str:
    return f"note {i}: " + " ".join(f"w{i}x{j}" for j in range(size // 6))


def test_small_history_is_sent_whole_with_head_in_order() -> None:
    history = [user("hi"), assistant("hello"), user("what now")]
    plan = fit_context(
        system_prompt="sys",
        history=history,
        summary="we met before",
        memory_texts=["[user_preference] likes tea"],
        context_window=4000,
        reply_reserve=100,
    )
    roles = [m.role for m in plan.messages]
    assert roles == ["system", "system", "system", "user", "assistant", "user"]
    assert "we met before" in (plan.messages[1].content or "")
    assert (plan.messages[2].content or "").startswith(MEMORY_PREFIX)
    assert plan.memory_injected and plan.summary_included and not plan.pruned
    assert plan.kept_indices == (0, 1, 2)


def test_oldest_unimportant_messages_go_first() -> None:
    history = [user(filler(i)) if i % 2 == 0 else assistant(filler(i)) for i in range(12)]
    history.append(user("and the weather tomorrow?"))
    plan = fit_context(system_prompt="sys", history=history, context_window=700, reply_reserve=0)
    reasons = {p.index: p.reason for p in plan.pruned}
    assert reasons and min(reasons) == 0
    assert set(reasons.values()) <= {"oldest", "least_important", "last_resort", "leading"}
    assert "oldest" in reasons.values()
    kept = [i for i in plan.kept_indices if i is not None]
    assert kept == list(range(kept[0], 13))  # a contiguous recent tail
    assert history[kept[0]].role == "user"  # an answer whose question went goes too
    assert plan.raw_tokens <= 700


def test_an_old_relevant_message_outlives_recent_chatter() -> None:
    history = [user("my deployment target is the kubernetes cluster named orion")]
    history.append(assistant("noted: orion"))
    for i in range(8):
        history.append(user(filler(i, 240)))
        history.append(assistant(filler(100 + i, 240)))
    history.append(user("which kubernetes cluster do I deploy to, orion?"))
    plan = fit_context(system_prompt="sys", history=history, context_window=600)
    kept = [i for i in plan.kept_indices if i is not None]
    assert 0 in kept, plan.pruned
    assert any(p.reason in ("oldest", "least_important") for p in plan.pruned)


def test_near_duplicates_of_important_text_are_dropped_oldest_first() -> None:
    # Pasted three times and asked about: every copy is relevant and reused, so the
    # importance strategies keep them; the near-duplicate strategy drops old copies.
    trace = "KeyError in loader " + " ".join(f"frame{j} module{j}" for j in range(40))
    history = [
        user(trace),
        assistant("ok"),
        user(trace + " again"),
        assistant("hm"),
        user(trace + " once more"),
        assistant("see"),
        user("why KeyError in loader frame1 module1 frame2 module2 frame3 module3?"),
    ]
    full = estimate_messages_tokens(history)
    plan = fit_context(system_prompt="s", history=history, context_window=full - 60)
    reasons = {p.index: p.reason for p in plan.pruned}
    assert reasons[0] == "near_duplicate", reasons
    assert 2 in plan.kept_indices and 4 in plan.kept_indices  # the newer copies stay
    assert plan.raw_tokens <= full - 60


def test_the_previous_exchange_is_protected_when_it_fits() -> None:
    history = [user(filler(i)) for i in range(6)]
    history += [user("question one"), assistant("answer one " + "y" * 300), user("follow-up")]
    plan = fit_context(system_prompt="s", history=history, context_window=200)
    assert plan.protected_from == 6
    assert plan.kept_indices[-3:] == (6, 7, 8)
    tight = fit_context(system_prompt="s", history=history, context_window=40)
    assert tight.protected_from == 8 and tight.kept_indices[-1] == 8
    assert 7 not in tight.kept_indices and tight.raw_tokens <= 40


def test_huge_tool_results_are_trimmed_keeping_both_ends() -> None:
    big = "HEAD-MARK " + "x" * 40_000 + " TAIL-MARK"
    history = [user("run it"), call("c1"), result("c1", big), assistant("done"), user("ok?")]
    plan = fit_context(system_prompt="s", history=history, context_window=4000)
    tool = next(m for m in plan.messages if m.role == "tool")
    assert tool.content is not None
    assert tool.content.startswith("HEAD-MARK") and tool.content.endswith("TAIL-MARK")
    assert "characters cut" in tool.content
    assert [t.target for t in plan.trimmed] == ["tool_result"]
    assert plan.trimmed[0].index == 2 and plan.trimmed[0].tokens_after <= 800
    assert plan.raw_tokens <= 4000


def test_a_pruned_tool_call_takes_its_results_along() -> None:
    history = [user(filler(1)), call("a", "b"), result("a", filler(2)), result("b", filler(3))]
    history += [assistant(filler(4)), user("next"), assistant("fine"), user("last one")]
    plan = fit_context(system_prompt="s", history=history, context_window=150)
    assert_well_paired(plan.history_messages)
    dropped = {p.index for p in plan.pruned}
    assert {1, 2, 3} <= dropped or not ({1, 2, 3} & dropped)


def test_memory_block_is_cut_to_its_share_and_dropped_last() -> None:
    lines = [f"[learned_fact] fact number {i} about something" for i in range(200)]
    plan = fit_context(
        system_prompt="s",
        history=[user("hello")],
        memory_texts=["\n".join(lines)],
        context_window=1000,
    )
    memory = next(m for m in plan.messages if (m.content or "").startswith(MEMORY_PREFIX))
    assert estimate_text_tokens(memory.content) <= 0.2 * 1000 + 2
    assert "fact number 0 " in (memory.content or "")  # caller's order: first lines win
    assert plan.memory_injected and plan.trimmed[0].target == "memory"
    huge_question = user("q " * 1500)
    starved = fit_context(
        system_prompt="s",
        history=[huge_question],
        memory_texts=["\n".join(lines)],
        context_window=900,
    )
    # The question fits only without memory: the memory block goes, the question stays.
    assert not starved.over_budget and not starved.memory_injected
    assert starved.trimmed[-1].target == "memory" and starved.trimmed[-1].tokens_after == 0
    assert starved.messages[-1] is huge_question
    too_big = fit_context(system_prompt="s", history=[user("q " * 4000)], context_window=900)
    assert too_big.over_budget and too_big.kept_indices == (0,)


def test_window_cap_counts_messages_but_never_cuts_a_tool_pair() -> None:
    """The cap counts messages. A tool call at its edge is not kept without its results,
    nor with them: the window starts at a user message, so the call's turn goes."""
    history = [user("a"), call("x", "y"), result("x"), result("y"), assistant("b"), user("c")]
    plan = fit_context(system_prompt="s", history=history, context_window=5000, max_messages=6)
    assert plan.kept_indices == tuple(range(6)) and not plan.pruned
    plan = fit_context(system_prompt="s", history=history, context_window=5000, max_messages=5)
    assert plan.kept_indices == (5,)
    assert {p.index: p.reason for p in plan.pruned} == {i: "window" for i in range(5)}


# -- the request's history starts at a user message ----------------------------------------


def opening(plan: ContextPlan) -> str:
    """The role of the first message after the system part."""
    return next(m.role for m in plan.messages if m.role != "system")


def test_a_pruned_user_message_takes_its_turns_tool_calls_along() -> None:
    """Issue 37, item 7: a tight window dropped an old turn's user message and kept its
    tool call and result, so the request went system prompt, then an assistant tool call,
    which Mistral's and Gemma's chat templates refuse."""
    history = [user(filler(0, 1200)), call("a"), result("a", "sunny"), assistant("It is sunny.")]
    history += [user("and tomorrow?")]
    full = estimate_messages_tokens(history)
    plan = fit_context(system_prompt="s", history=history, context_window=full - 100)
    assert opening(plan) == "user"
    assert plan.kept_indices == (4,)
    reasons = {p.index: p.reason for p in plan.pruned}
    assert reasons[1] == reasons[2] == reasons[3] == "leading"
    assert_well_paired(plan.history_messages)


def test_the_window_moves_on_to_a_user_message() -> None:
    """A count cut that lands on a tool call leaves out the rest of that old turn."""
    history = [user("a"), call("x"), result("x"), assistant("b"), user("c")]
    plan = fit_context(system_prompt="s", history=history, context_window=5000, max_messages=3)
    assert plan.kept_indices == (4,) and opening(plan) == "user"
    assert {p.index: p.reason for p in plan.pruned} == {i: "window" for i in range(4)}


@pytest.mark.parametrize("fast", [True, False])
def test_a_history_a_compaction_kept_from_an_answer_starts_at_the_next_question(
    fast: bool,
) -> None:
    """A compaction may cut before an assistant message (`choose_cut`): with its summary
    first, the request still goes on with a user message."""
    import gateway.agent.context as context

    history = [assistant("the answer it kept"), user("thanks; next?"), assistant("sure")]
    history.append(user("go on"))
    context._PLAIN_FAST_PATH = fast
    try:
        plan = fit_context(
            system_prompt="s", summary="we talked", history=history, context_window=5000
        )
    finally:
        context._PLAIN_FAST_PATH = True
    assert [m.role for m in plan.messages] == ["system", "system", "user", "assistant", "user"]
    assert plan.kept_indices == (1, 2, 3)
    assert {p.index: p.reason for p in plan.pruned} == {0: "window"}
    tools = [call("t"), result("t"), *history[1:]]  # kept from a tool call: the same
    plan = fit_context(system_prompt="s", summary="we talked", history=tools, context_window=5000)
    assert opening(plan) == "user" and plan.kept_indices == (2, 3, 4)


def test_a_steered_turn_that_begins_with_a_tool_call_is_sent_as_it_is() -> None:
    """Protection wins: a running turn said to start at a tool call keeps it, and what
    came before it without a user message of its own goes."""
    history = [assistant("old"), call("o"), result("o"), call("t"), result("t"), user("joined")]
    plan = fit_context(system_prompt="s", history=history, context_window=5000, turn_start=3)
    assert plan.kept_indices == (3, 4, 5)


def running_turn(joined: int, rounds: int) -> list[LLMMessage]:
    """A running turn: its user message, `rounds` tool rounds, `joined` messages that
    joined it (the steer mode), each after a round."""
    turn = [user("the running turn's question")]
    for r in range(rounds):
        turn += [call(f"r{r}"), result(f"r{r}", "x" * (30 * r))]
        if r < joined:
            turn.append(user(f"joined {r}"))
    turn += [user(f"joined {r}") for r in range(rounds, joined)]
    return turn


sized_texts = st.integers(min_value=0, max_value=2000).map(lambda n: "lorem ipsum " * (n // 12))
history_sizes = st.one_of(texts, sized_texts)
turn_items = st.one_of(
    st.builds(user, history_sizes),
    st.builds(assistant, history_sizes),
    st.builds(lambda ids: call(*ids), st.lists(st.sampled_from("abc"), unique=True, max_size=3)),
    st.builds(result, st.sampled_from("abcd"), history_sizes),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(turn_items, max_size=40),
    joined=st.integers(min_value=0, max_value=4),
    rounds=st.integers(min_value=0, max_value=3),
    window=st.integers(min_value=20, max_value=8000),
    max_messages=st.integers(min_value=0, max_value=25),
    summary=st.none() | texts,
    memory=st.lists(texts, max_size=2),
    steered=st.booleans(),
)
def test_the_request_opens_with_a_user_message_and_keeps_its_pairs(
    history: list[LLMMessage],
    joined: int,
    rounds: int,
    window: int,
    max_messages: int,
    summary: str | None,
    memory: list[str],
    steered: bool,
) -> None:
    """Whatever the window, the budget, a compaction's cut (a history opening with an
    answer, a tool call or an orphaned result) or the running turn: after the system
    part the request starts with a user message, every tool call is followed by all its
    results and no result is orphaned, the running turn is whole and nothing moves."""
    turn = running_turn(joined, rounds)
    full = [*history, *turn]
    start = len(history)
    plan = fit_context(
        system_prompt="s",
        history=full,
        summary=summary,
        memory_texts=memory,
        context_window=window,
        reply_reserve=10,
        max_messages=max_messages,
        turn_start=start if steered else None,
    )
    roles = [m.role for m in plan.messages]
    head = roles.index("user") if "user" in roles else len(roles)
    assert set(roles[:head]) == {"system"}, roles
    assert "system" not in roles[head:]
    assert plan.history_messages and plan.history_messages[0].role == "user", roles
    assert_well_paired(plan.history_messages)
    kept = [i for i in plan.kept_indices if i is not None]
    assert kept == sorted(kept) and len(set(kept)) == len(kept)
    for index, message in zip(plan.kept_indices, plan.history_messages, strict=True):
        if index is not None:  # a kept message is the history's (a tool result maybe cut)
            original = full[index]
            assert (message.role, message.tool_call_id) == (original.role, original.tool_call_id)
            assert message.tool_calls == original.tool_calls
    if steered or not joined:  # the running turn, from its own message on, is sent whole
        assert plan.kept_indices[-len(turn) :] == tuple(range(start, len(full)))
    assert plan.kept_indices[-1] == len(full) - 1


def steered_turn(joined: int) -> list[LLMMessage]:
    """A turn of the steer mode: its user message, a tool round, then `joined` messages
    that joined it (stored after the round's results)."""
    return [user("look it up"), call("t"), result("t"), *(user(f"and {i}") for i in range(joined))]


def test_the_window_never_cuts_into_a_turn_that_messages_joined() -> None:
    """Nine messages joined a turn: with a window of 11 messages the turn's own message
    was cut, so the model never saw it and the turn's one reply did not answer it."""
    before = [user("earlier"), assistant("earlier answer")]
    history = [*before, *steered_turn(9)]
    plan = fit_context(
        system_prompt="s", history=history, context_window=10**6, max_messages=11, turn_start=2
    )
    assert list(plan.history_messages) == history[2:]
    assert plan.protected_from == 2
    assert {p.index: p.reason for p in plan.pruned} == {0: "window", 1: "window"}
    # The budget cannot prune the turn either: the older exchange goes, the turn stays.
    tight = fit_context(
        system_prompt="s",
        history=[user(filler(0)), assistant(filler(1)), *steered_turn(9)],
        context_window=120,
        turn_start=2,
    )
    assert tight.kept_indices == tuple(range(2, 14))


def test_the_builder_considers_the_whole_running_turn() -> None:
    """The builder looks at a tail of the branch only (twice its window, and some); a
    turn longer than that is still sent whole."""
    builder = ContextBuilder(context_window=10**6, reply_reserve=0, max_messages=2)
    turn = steered_turn(20)
    history = [user("earlier"), assistant("earlier answer"), *turn]
    plan = builder.build(system_prompt="s", history=history, turn_start=2)
    assert list(plan.history_messages) == turn


@given(
    history=st.lists(history_items, max_size=20),
    joined=st.integers(min_value=1, max_value=12),
    window=st.integers(min_value=20, max_value=3000),
    max_messages=st.integers(min_value=0, max_value=12),
)
def test_a_running_turn_is_kept_whole(
    history: list[LLMMessage], joined: int, window: int, max_messages: int
) -> None:
    turn = steered_turn(joined)
    plan = fit_context(
        system_prompt="s",
        history=[*history, *turn],
        context_window=window,
        max_messages=max_messages,
        turn_start=len(history),
    )
    assert list(plan.history_messages[-len(turn) :]) == turn
    assert plan.protected_from <= len(history)


def test_orphans_are_reported_and_unanswered_calls_answered() -> None:
    history = [result("gone"), user("hi"), call("a"), user("next")]
    plan = fit_context(system_prompt="s", history=history, context_window=5000)
    assert_well_paired(plan.history_messages)
    assert {p.index: p.reason for p in plan.pruned} == {0: "orphan"}
    assert plan.kept_indices == (1, 2, None, 3)


def test_usage_hint_makes_the_budget_tighter() -> None:
    history = [user(filler(i)) for i in range(10)] + [user("now")]
    loose = fit_context(system_prompt="s", history=history, context_window=800)
    hint = UsageHint(prompt_tokens=2000, estimated_tokens=1000)
    tight = fit_context(system_prompt="s", history=history, context_window=800, usage=hint)
    assert hint.ratio == 2.0 and UsageHint(500, 1000).ratio == 1.0
    assert tight.raw_tokens <= 400 < loose.raw_tokens
    assert tight.estimated_tokens == 2 * tight.raw_tokens


def test_builder_learns_the_ratio_per_session() -> None:
    builder = ContextBuilder(context_window=800, reply_reserve=0, max_messages=0)
    history = [user(filler(i)) for i in range(10)] + [user("now")]
    first = builder.build(system_prompt="s", history=history, session_key="k")
    builder.observe("k", first.messages, TokenUsage(prompt_tokens=first.raw_tokens * 3))
    assert builder.hint_for("k") is not None and builder.hint_for("other") is None
    second = builder.build(system_prompt="s", history=history, session_key="k")
    other = builder.build(system_prompt="s", history=history, session_key="other")
    assert second.raw_tokens < other.raw_tokens == first.raw_tokens
    builder.observe("k", first.messages, None)  # nothing reported: nothing learned
    with pytest.raises(ValueError):
        ContextBuilder(context_window=0, reply_reserve=0, max_messages=0)


def test_the_reserves_take_at_most_a_quarter_of_the_window_each() -> None:
    # [llm] context_window = 1024 with the default 1,024-token reply reserve used to
    # stop Gateway.build with a ValueError; a small server's window leaves room too.
    builder = ContextBuilder(context_window=1024, reply_reserve=1024, max_messages=0)
    history = [user("hello")]
    assert builder.build(system_prompt="s", history=history).budget_tokens == 768
    assert builder.build(system_prompt="s", history=history, fixed_tokens=600).budget_tokens == 512
    large = builder.build(system_prompt="s", history=history, context_window=32768)
    assert large.budget_tokens == 32768 - 1024


def test_branch_tokens_prefer_the_reported_usage() -> None:
    plain = [user("hi"), assistant("hello"), user("again")]
    assert estimate_branch_tokens(plain) == estimate_messages_tokens(plain)
    reported = TokenUsage(prompt_tokens=5000, completion_tokens=20, total_tokens=5020)
    anchored = [user("hi"), assistant("hello", reported), user("again")]
    assert estimate_branch_tokens(anchored) == 5020 + estimate_messages_tokens([user("again")])
    tiny = TokenUsage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    low = [user("x" * 4000), assistant("ok", tiny), user("more")]
    assert estimate_branch_tokens(low) == estimate_messages_tokens(low)  # never below ours


def test_trim_middle_fits_and_keeps_ends() -> None:
    text = "start " + "é" * 5000 + " end"
    cut = trim_middle(text, 300)
    assert estimate_text_tokens(cut) <= 300
    assert cut.startswith("start") and cut.endswith("end")
    assert trim_middle("short", 10) == "short"


# -- a long scripted conversation through a real session ------------------------------------


@pytest.mark.anyio
async def test_three_hundred_turns_stay_within_the_context_window(tmp_path: Path) -> None:
    """Every request of a long, mixed conversation (short and long messages, tool calls
    through the registry's current_time tool, compactions when the trigger says so)
    fits the configured window with the reply reserve left free."""
    context_window, reserve, memory_window = 6000, 800, 10
    sessions = SessionManager(tmp_path / "sessions", fsync="never")
    session = sessions.get_or_create("cli:long")
    registry = build_registry(["current_time"])
    builder = ContextBuilder(
        context_window=context_window, reply_reserve=reserve, max_messages=2 * memory_window + 1
    )
    rng = random.Random(7)
    memory_lines = [f"[learned_fact] remembered thing {i}" for i in range(300)]
    requests = compactions = 0
    reasons: set[str] = set()
    opened: Counter[str] = Counter()  # the role each request's history starts with

    def send() -> None:
        nonlocal requests
        ctx = session.build_context()
        plan = builder.build(
            system_prompt="You are a test assistant.",
            history=ctx.messages,
            summary=ctx.summary,
            memory_texts=["\n".join(memory_lines)],
            session_key=session.key,
        )
        requests += 1
        reasons.update(p.reason for p in plan.pruned)
        reasons.update(t.target for t in plan.trimmed)
        assert not plan.over_budget
        assert plan.estimated_tokens + reserve <= context_window
        last_user = next(m for m in reversed(ctx.messages) if m.role == "user")
        assert any(m is last_user for m in plan.messages)
        assert_well_paired(plan.history_messages)
        opened[plan.history_messages[0].role] += 1
        builder.observe(session.key, plan.messages, TokenUsage(prompt_tokens=plan.raw_tokens))

    for turn in range(300):
        size = rng.choice([20, 80, 400, 3000, 9000])
        session.add_message(user(f"turn {turn} " + "lorem ipsum " * (size // 12)))
        send()
        if turn % 7 == 3:
            call_id = f"call_{turn}"
            request = ToolCall(id=call_id, function_name="current_time", arguments={})
            session.add_message(LLMMessage(role="assistant", tool_calls=[request]))
            output = await registry.execute(request, ToolContext(session_key=session.key))
            if turn % 21 == 3:
                output += " " + "z" * 30_000  # an oversized tool result
            session.add_message(
                LLMMessage(role="tool", content=output, tool_call_id=call_id, name="current_time")
            )
            send()
        reply = "answer " * rng.choice([3, 30, 300])
        session.add_message(assistant(reply, TokenUsage(prompt_tokens=100, completion_tokens=5)))
        ctx = session.build_context()
        if needs_consolidation(
            ctx, memory_window=memory_window, context_window=context_window
        ) and (cut := plan_compaction(ctx, memory_window)):
            await anyio.to_thread.run_sync(
                session.compact, f"summary up to turn {turn}", cut.first_kept_entry_id
            )
            compactions += 1

    assert requests > 300 and compactions > 10
    assert opened == {"user": requests}
    assert {"tool_result", "memory", "window"} <= reasons
    assert reasons & {"oldest", "least_important"}
    assert session.message_count <= 2 * memory_window + 4
    sessions.close()
