"""The cache policy and key as pure functions: who may share an answer, and under what key."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.cache import (
    SHARED_SCOPE,
    CacheContext,
    CacheMode,
    CacheSettings,
    cache_key,
    cache_policy,
    digest_messages,
    normalize_query,
    session_scope,
    strip_nocache,
)
from gateway.llm.types import LLMMessage, TokenUsage, ToolCall, ToolSpec

SETTINGS = CacheSettings()


def fullwidth(text: str) -> str:
    """The same ASCII letters as full-width forms (U+FF21...), which NFKC folds back."""
    return "".join(chr(ord(c) + 0xFEE0) for c in text)


def ctx(query: str = "What is DNS?", **kw: object) -> CacheContext:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("session_key", "telegram:1")
    return CacheContext(query=query, model="m", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("context", "mode", "reason"),
    [
        (ctx(), CacheMode.SHARED, "standalone"),
        (ctx(streaming=True), CacheMode.BYPASS, "streaming"),
        (ctx(nocache=True), CacheMode.BYPASS, "/nocache"),
        (ctx(temperature=0.3), CacheMode.SHARED, "standalone"),
        (ctx(temperature=0.31), CacheMode.BYPASS, "temperature"),
        (ctx(temperature=None), CacheMode.BYPASS, "temperature"),
        (ctx(tool_calls_made=True), CacheMode.BYPASS, "tool calls"),
        (ctx(tool_calls_made=True, memory_injected=True), CacheMode.BYPASS, "tool calls"),
        (ctx("   ?  "), CacheMode.BYPASS, "empty"),
        (ctx(context_digest="abc"), CacheMode.SCOPED, "session"),
        (ctx(memory_injected=True), CacheMode.SCOPED, "session"),
        (ctx(user_specific=True), CacheMode.SCOPED, "session"),
        (ctx(memory_injected=True, session_key=""), CacheMode.BYPASS, "session key"),
        (ctx(session_key=""), CacheMode.SHARED, "standalone"),
    ],
)
def test_cache_policy(context: CacheContext, mode: CacheMode, reason: str) -> None:
    decision = cache_policy(context, SETTINGS)
    assert decision.mode is mode
    assert reason in decision.reason
    expected_scope = {
        CacheMode.SHARED: SHARED_SCOPE,
        CacheMode.SCOPED: session_scope(context.session_key),
        CacheMode.BYPASS: "",
    }[mode]
    assert decision.scope == expected_scope


def test_disabled_cache_bypasses_everything() -> None:
    decision = cache_policy(ctx(), CacheSettings(enabled=False))
    assert decision.mode is CacheMode.BYPASS and not decision.cacheable


def test_temperature_bound_is_a_setting() -> None:
    assert cache_policy(ctx(temperature=0.7), CacheSettings(max_temperature=1.0)).cacheable
    assert not cache_policy(ctx(temperature=0.1), CacheSettings(max_temperature=0.0)).cacheable


@pytest.mark.parametrize(
    "bad",
    [
        {"ttl_seconds": 0},
        {"max_entries": 0},
        {"max_temperature": -1},
        {"near_duplicate_threshold": 0},
        {"max_response_bytes": 0},
    ],
)
def test_settings_are_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CacheSettings(**bad)  # type: ignore[arg-type]


# -- normalization and /nocache -------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("  What IS   Python? ", "what is python"),
        (fullwidth("Python"), "python"),  # NFKC folds full-width letters
        ("STRASSE", "strasse"),
        ("Straße", "strasse"),  # casefold, not lower
        ("ﬁle\u00a0name", "file name"),  # ligature, no-break space
        ("what is 5!", "what is 5!"),
        ("why??", "why"),
        ("", ""),
    ],
)
def test_normalize_query(raw: str, normalized: str) -> None:
    assert normalize_query(raw) == normalized


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/nocache what is DNS?", ("what is DNS?", True)),
        ("  /NoCache\n what is DNS?", ("what is DNS?", True)),
        ("/nocache", ("", True)),
        ("/nocache@gateway_bot why?", ("why?", True)),
        ("/nocachex what", ("/nocachex what", False)),
        ("what is /nocache", ("what is /nocache", False)),
        ("plain", ("plain", False)),
    ],
)
def test_strip_nocache(text: str, expected: tuple[str, bool]) -> None:
    assert strip_nocache(text) == expected


# -- keys -----------------------------------------------------------------------------


def key(context: CacheContext) -> str:
    return cache_key(context, cache_policy(context, SETTINGS))


def test_shared_key_ignores_who_asks_and_scoped_key_does_not() -> None:
    shared = ctx("What is DNS?")
    assert key(shared) == key(replace(shared, session_key="slack:C1", sender_id="bob"))
    assert key(shared) == key(replace(shared, query="  what is dns??"))

    personal = ctx("What's my name?", memory_injected=True)
    variants = [
        replace(personal, session_key="telegram:2"),
        replace(personal, sender_id="bob"),
        replace(personal, context_digest="d1"),
        replace(personal, user_specific=True),
        replace(personal, memory_injected=False, user_specific=True),
        replace(personal, memory_injected=False),  # a shared key: also different
    ]
    keys = {key(personal), *(key(v) for v in variants)}
    assert len(keys) == len(variants) + 1


def test_key_covers_model_prompt_and_tools() -> None:
    tool = ToolSpec("search", "Search", {"type": "object"})
    base = ctx(tools=(tool,), system_prompt="S")
    others = [
        replace(base, model="m2"),
        replace(base, system_prompt="S2"),
        replace(base, tools=()),
        replace(base, tools=(ToolSpec("search", "Search", {"type": "array"}),)),
        replace(base, tools=(ToolSpec("search", "Find", {"type": "object"}),)),
        replace(base, tools=(tool, ToolSpec("fetch", "Fetch", {}))),
    ]
    assert len({key(base), *(key(o) for o in others)}) == len(others) + 1
    assert len(key(base)) == 64 and int(key(base), 16) >= 0


def test_a_session_key_that_looks_like_the_shared_scope_is_still_scoped() -> None:
    personal = ctx("What's my name?", session_key="shared", memory_injected=True)
    decision = cache_policy(personal, SETTINGS)
    assert decision.scope != SHARED_SCOPE
    assert key(personal) != key(replace(personal, memory_injected=False))


def test_bypassed_context_has_no_key() -> None:
    context = ctx(streaming=True)
    with pytest.raises(ValueError):
        cache_key(context, cache_policy(context, SETTINGS))


def test_digest_messages_covers_what_the_model_sees_only() -> None:
    assert digest_messages([]) is None
    a = [LLMMessage("user", "hi"), LLMMessage("assistant", "hello", model="x")]
    b = [LLMMessage("user", "hi"), LLMMessage("assistant", "hello", usage=TokenUsage(1, 2, 3))]
    assert digest_messages(a) == digest_messages(b)
    assert digest_messages(a) != digest_messages([LLMMessage("user", "hi")])
    assert digest_messages(a) != digest_messages(
        [LLMMessage("user", "hi"), LLMMessage("assistant", "hello!")]
    )
    call = LLMMessage("assistant", None, tool_calls=(ToolCall("1", "f", {"x": 1}),))
    other = LLMMessage("assistant", None, tool_calls=(ToolCall("1", "f", {"x": 2}),))
    assert digest_messages([call]) != digest_messages([other])


# -- the invariant, over arbitrary contexts -------------------------------------------

contexts = st.builds(
    CacheContext,
    query=st.text(min_size=0, max_size=30),
    model=st.sampled_from(["m1", "m2"]),
    temperature=st.one_of(st.none(), st.floats(0, 2)),
    session_key=st.sampled_from(["", "telegram:1", "slack:C1", "shared"]),
    system_prompt=st.sampled_from(["", "S"]),
    context_digest=st.one_of(st.none(), st.sampled_from(["d1", "d2"])),
    memory_injected=st.booleans(),
    user_specific=st.booleans(),
    tool_calls_made=st.booleans(),
    streaming=st.booleans(),
    nocache=st.booleans(),
    sender_id=st.sampled_from(["", "alice", "bob"]),
)


@given(contexts)
def test_only_standalone_questions_are_ever_shared(context: CacheContext) -> None:
    """An answer is never served to a session it would be wrong or private for."""
    decision = cache_policy(context, SETTINGS)
    dependent = context.context_digest is not None or context.memory_injected
    dependent = dependent or context.user_specific
    if decision.mode is CacheMode.SHARED:
        assert not dependent and not context.tool_calls_made
        assert decision.scope == SHARED_SCOPE
    if dependent and decision.cacheable:
        assert decision.mode is CacheMode.SCOPED
        assert decision.scope == session_scope(context.session_key) != SHARED_SCOPE
        # Any other session, sender or context gets a different key.
        for other in (
            replace(context, session_key=context.session_key + "x"),
            replace(context, sender_id=context.sender_id + "x"),
            replace(context, context_digest=(context.context_digest or "") + "x"),
        ):
            other_decision = cache_policy(other, SETTINGS)
            assert cache_key(other, other_decision) != cache_key(context, decision)
