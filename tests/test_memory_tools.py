"""The model's memory tools against a real MemoryStore: scoped by the turn's session key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.agent.context import fit_context
from gateway.agent.memory_tools import memory_texts, memory_tools
from gateway.agent.tools import ToolContext, ToolRegistry
from gateway.llm import LLMMessage, ToolCall
from gateway.memory import MemoryStore

pytestmark = pytest.mark.anyio

ALICE, BOB = "telegram:1", "telegram:2"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MemoryStore]:
    memory = MemoryStore(tmp_path / "workspace")
    yield memory
    memory.close()


@pytest.fixture
def registry(store: MemoryStore) -> ToolRegistry:
    tools = ToolRegistry()
    for tool in memory_tools(store):
        tools.register(tool)
    return tools


async def call(registry: ToolRegistry, key: str, name: str, **arguments: Any) -> str:
    return await registry.execute(
        ToolCall(id="c", function_name=name, arguments=arguments), ToolContext(session_key=key)
    )


def test_tools_are_offered_with_schemas(registry: ToolRegistry) -> None:
    assert registry.names() == [
        "conversation_search",
        "history_search",
        "memory_correct",
        "memory_facts",
        "memory_forget",
        "memory_search",
        "remember",
    ]
    specs = {s.name: s for s in registry.specs()}
    assert specs["memory_search"].parameters["required"] == ["query"]
    assert "user_preference" in specs["remember"].description


async def test_remember_then_find_it_again(registry: ToolRegistry, store: MemoryStore) -> None:
    said = await call(
        registry, ALICE, "remember", content="Prefers answers in German", category="user_preference"
    )
    assert said.startswith("Remembered: [user_preference] Prefers answers in German (fact ")
    again = await call(
        registry,
        ALICE,
        "remember",
        content="prefers answers in german.",
        category="user_preference",
    )
    assert again == "Already remembered: [user_preference] Prefers answers in German"
    found = await call(registry, ALICE, "memory_search", query="which language for answers")
    assert "[user_preference] Prefers answers in German" in found.splitlines()
    # Written through to disk right away (a new store sees it).
    fresh = MemoryStore(store.workspace_path)
    assert len(fresh.for_session(ALICE).knowledge) >= 1
    fresh.close()


async def test_unknown_category_falls_back_like_the_knowledge_base(
    registry: ToolRegistry,
) -> None:
    said = await call(registry, ALICE, "remember", content="The VPN drops at noon", category="vpn")
    assert said.startswith("Remembered: [learned_fact] The VPN drops at noon (fact ")
    bad = await call(registry, ALICE, "memory_search", query="vpn", category="vpn")
    assert bad.startswith("error: unknown category")


async def test_memory_search_reads_consolidated_facts_once(
    registry: ToolRegistry, store: MemoryStore
) -> None:
    store.for_session(ALICE).record_consolidation(
        [("project_decision", "Database is PostgreSQL 16"), ("user_preference", "Likes tea")],
        "Talked about the database choice.",
    )
    found = await call(registry, ALICE, "memory_search", query="database postgresql")
    # In MEMORY.md and in the knowledge base, reported once.
    assert found.splitlines() == ["[project_decision] Database is PostgreSQL 16"]
    only_prefs = await call(
        registry, ALICE, "memory_search", query="", category="user_preference", max_results=3
    )
    assert only_prefs.splitlines() == ["[user_preference] Likes tea"]
    history = await call(registry, ALICE, "history_search", query="database choice")
    assert "Talked about the database choice." in history


async def test_two_conversations_never_see_each_others_memory(
    registry: ToolRegistry, store: MemoryStore
) -> None:
    await call(registry, ALICE, "remember", content="Alice's door code is 4321")
    store.for_session(ALICE).record_consolidation(
        [("learned_fact", "Alice keeps bees")], "Alice talked about her bees and door code."
    )
    for query in ("door code", "bees", "Alice"):
        assert await call(registry, BOB, "memory_search", query=query) == (
            "No stored memory matches."
        )
        assert await call(registry, BOB, "history_search", query=query) == (
            "No earlier conversation summary matches."
        )
    assert "4321" in await call(registry, ALICE, "memory_search", query="door code")
    # A model cannot name another scope: extra arguments are ignored.
    sneaky = await call(registry, BOB, "memory_search", query="bees", session_key=ALICE)
    assert sneaky == "No stored memory matches."


async def test_bad_arguments_get_clear_errors(registry: ToolRegistry) -> None:
    assert (await call(registry, ALICE, "remember", content="  ")).startswith("error:")
    too_long = await call(registry, ALICE, "remember", content="x" * 5000)
    assert too_long.startswith("error: keep it under")
    assert (await call(registry, ALICE, "history_search", query="")).startswith("error:")
    reserved = await call(registry, "_workspace", "memory_search", query="x")
    assert reserved.startswith("error: this conversation has no usable memory")


async def test_results_are_bounded(registry: ToolRegistry, store: MemoryStore) -> None:
    facts = [("learned_fact", f"server number {i} runs nginx " + "x" * 300) for i in range(40)]
    store.for_session(ALICE).record_consolidation(facts, "")
    few = await call(registry, ALICE, "memory_search", query="server nginx", max_results=3)
    assert len(few.splitlines()) == 3
    many = await call(registry, ALICE, "memory_search", query="server nginx", max_results=500)
    assert len(many) <= 4100 and "more not shown" in many


async def test_workspace_mode_is_shared_by_choice(tmp_path: Path) -> None:
    shared = MemoryStore(tmp_path / "ws", mode="workspace")
    tools = ToolRegistry()
    for tool in memory_tools(shared):
        tools.register(tool)
    await call(tools, ALICE, "remember", content="The team ships on Fridays")
    assert "Fridays" in await call(tools, BOB, "memory_search", query="ships")
    shared.close()


async def test_memory_texts_feed_the_context_builder_once_per_fact(store: MemoryStore) -> None:
    store.for_session(ALICE).record_consolidation(
        [("user_preference", "Likes tea"), ("project_decision", "Deploys on Fridays")], "s"
    )
    store.for_session(BOB).record_consolidation([("learned_fact", "Bob keeps bees")], "s")
    texts = memory_texts(store, ALICE, "when do we deploy?")
    assert "[project_decision] Deploys on Fridays" in texts[0].splitlines()
    assert "[user_preference] Likes tea" in texts[1]  # the export lists everything
    assert "bees" not in "\n".join(texts)
    plan = fit_context(
        system_prompt="s",
        history=[LLMMessage(role="user", content="when do we deploy?")],
        memory_texts=texts,
        context_window=2000,
    )
    block = plan.messages[1].content or ""
    assert plan.memory_injected and block.count("Deploys on Fridays") == 1
    assert memory_texts(store, ALICE, "  ")[0] == ""  # no query: only the export


async def test_remembered_facts_point_at_the_turns_message_and_can_be_corrected_and_forgotten(
    registry: ToolRegistry, store: MemoryStore
) -> None:
    turn = ToolContext(session_key=ALICE, sender_id="1", user_entry_id="0a1b2c3d4e5f")
    said = await registry.execute(
        ToolCall(id="c", function_name="remember", arguments={"content": "Owns a red bike"}), turn
    )
    ident = said.rsplit("(fact ", 1)[1].rstrip(")")
    listed = await call(registry, ALICE, "memory_facts")
    assert f"{ident}  [learned_fact] Owns a red bike  (from {ALICE} entry 0a1b2c3d4e5f)" in listed
    fixed = await registry.execute(
        ToolCall(
            id="c",
            function_name="memory_correct",
            arguments={"id": ident, "text": "Owns a blue bike"},
        ),
        turn,
    )
    assert fixed == f"Corrected: [learned_fact] Owns a blue bike (fact {ident})"
    (fact,) = store.for_session(ALICE).list_facts()
    assert fact.correction is not None and fact.correction.by == f"{ALICE} entry 0a1b2c3d4e5f"
    # Bob cannot see, correct or forget Alice's fact by its id.
    assert await call(registry, BOB, "memory_facts") == (
        "I have no facts remembered about this conversation."
    )
    assert (await call(registry, BOB, "memory_forget", id=ident)).startswith(
        f"error: no fact {ident} in your memory"
    )
    assert (await call(registry, BOB, "memory_correct", id=ident, text="x")).startswith("error:")
    assert await call(registry, ALICE, "memory_forget", id="bike") == (
        "error: give the fact's id (memory_facts lists them)"
    )
    gone = await call(registry, ALICE, "memory_forget", id=ident)
    assert gone == f"Forgotten: [learned_fact] Owns a blue bike (fact {ident})"
    assert await call(registry, ALICE, "memory_search", query="bike") == "No stored memory matches."
    assert (await call(registry, ALICE, "memory_forget", id=ident)).startswith("error: no fact")


async def test_a_fact_forgotten_or_corrected_through_the_tool_leaves_no_cached_answer(
    tmp_path: Path, store: MemoryStore
) -> None:
    """An answer cached for this conversation with its memory in the prompt may say the
    fact: the tools drop those answers as `/forget` does (another conversation's stay);
    a forget that fails drops nothing."""
    from gateway.cache import CacheContext, SemanticCache, SqliteCacheBackend

    cache = SemanticCache(SqliteCacheBackend(tmp_path / "cache.sqlite"))
    tools = ToolRegistry()
    for tool in memory_tools(store, cache):
        tools.register(tool)

    def ctx(session: str) -> CacheContext:
        return CacheContext(
            query="which bike do I own?",
            model="m",
            session_key=session,
            temperature=0.0,
            memory_injected=True,
        )

    try:
        turn = ToolContext(session_key=ALICE, sender_id="1", user_entry_id="0a1b2c3d4e5f")
        said = await tools.execute(
            ToolCall(id="c", function_name="remember", arguments={"content": "Owns a red bike"}),
            turn,
        )
        ident = said.rsplit("(fact ", 1)[1].rstrip(")")
        for session in (ALICE, BOB):
            await cache.store(ctx(session), "You own a red bike.")
        assert (await call(tools, ALICE, "memory_forget", id="0badc0de")).startswith("error:")
        assert await cache.lookup(ctx(ALICE)) is not None  # nothing forgotten: kept
        await call(tools, ALICE, "memory_correct", id=ident, text="Owns a blue bike")
        assert await cache.lookup(ctx(ALICE)) is None
        await cache.store(ctx(ALICE), "You own a blue bike.")
        assert (await call(tools, ALICE, "memory_forget", id=ident)).startswith("Forgotten")
        assert await cache.lookup(ctx(ALICE)) is None
        assert await cache.lookup(ctx(BOB)) is not None
    finally:
        await cache.aclose()
