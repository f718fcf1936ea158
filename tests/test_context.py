"""Pure context policies: tool-pair repair and the recent window of fit_context."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.agent.context import INTERRUPTED_TOOL_RESULT, fit_context, repair_tool_pairs
from gateway.llm import LLMMessage
from tests.llm_messages import assert_well_paired, call, result, user


def test_orphan_result_dropped_and_unanswered_call_answered() -> None:
    msgs = [result("gone"), user("hi"), call("a", "b"), result("a"), user("next")]
    fixed = repair_tool_pairs(msgs)
    assert_well_paired(fixed)
    assert [m.role for m in fixed] == ["user", "assistant", "tool", "tool", "user"]
    assert fixed[3].tool_call_id == "b" and fixed[3].content == INTERRUPTED_TOOL_RESULT


messages_strategy = st.lists(
    st.one_of(
        st.builds(user, st.text(max_size=5)),
        st.builds(lambda ids: call(*ids), st.lists(st.sampled_from("abc"), unique=True)),
        st.builds(result, st.sampled_from("abcd")),
    ),
    max_size=30,
)


@given(messages_strategy)
def test_repair_always_yields_well_paired_history(msgs: list[LLMMessage]) -> None:
    fixed = repair_tool_pairs(msgs)
    assert_well_paired(fixed)
    # Nothing but tool results is ever dropped.
    assert [m for m in fixed if m.role != "tool"] == [m for m in msgs if m.role != "tool"]


@given(messages_strategy, st.integers(min_value=1, max_value=10), st.integers(300, 2000))
def test_context_keeps_last_message_and_pairs(
    msgs: list[LLMMessage], max_messages: int, window: int
) -> None:
    msgs = [*msgs, user("the new question")]
    plan = fit_context(
        system_prompt="sys", history=msgs, context_window=window, max_messages=max_messages
    )
    assert plan.messages[0].role == "system"
    assert plan.messages[-1] == msgs[-1]
    assert_well_paired(list(plan.messages[1:]))


def test_context_caps_the_recent_window_by_count() -> None:
    msgs = [user(f"m{i} " + "x" * 400) for i in range(10)]
    plan = fit_context(system_prompt="sys", history=msgs, context_window=10**6, max_messages=3)
    assert list(plan.messages[1:]) == msgs[-3:]
    huge = [user("y" * 100_000)]
    assert (
        list(fit_context(system_prompt="s", history=huge, context_window=300).messages[1:]) == huge
    )


def test_context_is_system_then_summary_then_window() -> None:
    plan = fit_context(
        system_prompt="sys",
        summary="earlier: we met",
        history=[user("a"), user("b")],
        max_messages=5,
        context_window=1000,
    )
    assert [m.role for m in plan.messages] == ["system", "system", "user", "user"]
    assert "earlier: we met" in (plan.messages[1].content or "")


plain_messages = st.lists(
    st.builds(
        lambda role, text: LLMMessage(role=role, content=text),
        st.sampled_from(["user", "assistant"]),
        st.text(max_size=400),
    ),
    min_size=1,
    max_size=14,
)


@given(
    plain_messages,
    st.integers(min_value=0, max_value=16),
    st.integers(200, 4000),
    st.one_of(st.none(), st.text(min_size=1, max_size=300)),
    st.lists(st.text(max_size=80), max_size=3),
    st.one_of(st.none(), st.integers(min_value=0, max_value=15)),
)
def test_one_pass_plan_for_plain_histories_equals_the_steps(
    history: list[LLMMessage],
    max_messages: int,
    window: int,
    summary: str | None,
    memory: list[str],
    turn_start: int | None,
) -> None:
    """The fast path (plain messages that all fit) plans exactly what the steps do,
    wherever the running turn starts."""
    import gateway.agent.context as context

    args = dict(
        system_prompt="You are terse.",
        history=history,
        summary=summary,
        memory_texts=memory,
        context_window=window,
        reply_reserve=100,
        max_messages=max_messages,
        turn_start=turn_start,
    )
    fast = fit_context(**args)  # type: ignore[arg-type]
    context._PLAIN_FAST_PATH = False
    try:
        steps = fit_context(**args)  # type: ignore[arg-type]
    finally:
        context._PLAIN_FAST_PATH = True
    assert fast == steps
