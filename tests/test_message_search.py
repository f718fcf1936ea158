"""Every past message of a memory scope is searchable, and forgetting takes it out.

Both storage modes: real session files with a MemoryStore pointed at them, and
PostgreSQL sessions with a PostgresMemoryStore (CI=true refuses to skip it)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from gateway.agent.memory_tools import blend_recall, memory_texts, memory_tools, relevant_memory
from gateway.agent.tools import ToolContext, ToolRegistry
from gateway.llm import LLMMessage, ToolCall
from gateway.memory import MemoryStore
from gateway.memory.facts import NewFact, Origin
from gateway.memory.messages import MessageHit
from gateway.memory.protocol import MemoryBackend
from gateway.sessions import SessionManager

ALICE, BOB = "telegram:1", "telegram:2"


MakeStore = Callable[[], MemoryBackend]


@pytest.fixture(params=["files", "postgres"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pools(mode: str, request: pytest.FixtureRequest) -> Callable[[], Any] | None:
    return request.getfixturevalue("pg_pools") if mode == "postgres" else None


@pytest.fixture
def sessions(tmp_path: Path, pools: Callable[[], Any] | None) -> Iterator[SessionManager]:
    if pools is None:
        manager = SessionManager(tmp_path / "sessions", fsync="never")
    else:
        from gateway.sessions.pg_store import PostgresSessions

        manager = SessionManager.shared(PostgresSessions(pools()))
    yield manager
    manager.close()


@pytest.fixture
def make_store(tmp_path: Path, pools: Callable[[], Any] | None) -> Iterator[MakeStore]:
    """Stores over the same sessions and memory (as after a restart, or another replica)."""
    made: list[MemoryBackend] = []

    def make() -> MemoryBackend:
        if pools is None:
            backend: MemoryBackend = MemoryStore(
                tmp_path / "workspace", sessions_dir=tmp_path / "sessions"
            )
        else:
            from gateway.memory.pg_store import PostgresMemoryStore

            backend = PostgresMemoryStore(pools())
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def store(make_store: MakeStore) -> MemoryBackend:
    return make_store()


def say(sessions: SessionManager, key: str, user: str, reply: str) -> str:
    """One turn; the user message's entry id."""
    session = sessions.get_or_create(key)
    entry = session.add_message(LLMMessage("user", user))
    session.add_message(LLMMessage("assistant", reply))
    session.flush()
    return entry.id


def test_a_message_is_found_with_its_session_entry_time_speaker_and_context(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "hello there", "hi, how can I help?")
    entry = say(sessions, ALICE, "my sister Ingrid moved to Tromsø last spring", "how exciting!")
    say(sessions, ALICE, "anyway, what is the weather", "I cannot look outside")
    hits = store.for_session(ALICE).search_messages("where did Ingrid move", 3)
    assert hits, "the message was not found"
    hit = hits[0]
    assert hit.entry_id == entry
    assert (hit.session_key, hit.role) == (ALICE, "user")
    assert hit.session_id == sessions.get_or_create(ALICE).session_id
    assert "Tromsø" in hit.text
    assert hit.before.startswith("assistant: hi, how can I help")
    assert hit.after == "assistant: how exciting!"
    assert hit.timestamp > 0
    assert ALICE in hit.describe() and f"entry {entry}" in hit.describe()


def test_messages_appended_after_a_search_are_found_by_the_next(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "first words", "ok")
    memory = store.for_session(ALICE)
    assert memory.search_messages("kayak") == []
    say(sessions, ALICE, "I bought a red kayak", "nice")
    assert memory.search_messages("kayak")[0].text == "I bought a red kayak"


def test_a_session_archived_after_a_search_stays_searchable(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "the piano tuner comes on Tuesday", "noted")
    memory = store.for_session(ALICE)
    assert memory.search_messages("piano tuner")[0].text == "the piano tuner comes on Tuesday"
    sessions.reset(ALICE)  # /new after the index read the session
    say(sessions, ALICE, "the piano sounds great now", "glad to hear")
    said = [h.text for h in memory.search_messages("piano", 5) if h.role == "user"]
    assert said == ["the piano sounds great now", "the piano tuner comes on Tuesday"]


def test_archived_sessions_are_searched_and_other_scopes_are_not(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "my cat is called Miso", "lovely name")
    sessions.reset(ALICE)  # /new: the old session is archived
    say(sessions, ALICE, "new topic entirely", "sure")
    say(sessions, BOB, "my cat is called Pixel", "cute")
    found = [h.text for h in store.for_session(ALICE).search_messages("cat called", 5)]
    assert found == ["my cat is called Miso", "lovely name"]  # the reply, by its context
    found = [h.text for h in store.for_session(BOB).search_messages("cat", 5)]
    assert found == ["my cat is called Pixel", "cute"]


def test_deleting_a_session_removes_its_messages(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "the vault code is 4711", "noted")
    memory = store.for_session(ALICE)
    assert memory.search_messages("vault code")
    assert sessions.delete(ALICE)
    assert memory.search_messages("vault code") == []


def test_forgetting_a_fact_removes_the_messages_saying_it_for_good(
    sessions: SessionManager, store: MemoryBackend, make_store: MakeStore
) -> None:
    entry = say(sessions, ALICE, "I am allergic to peanuts", "I will remember that")
    say(sessions, ALICE, "peanuts make me sick, I am allergic", "understood")
    say(sessions, ALICE, "I like peanuts in other people's food", "fine")
    memory = store.for_session(ALICE)
    memory.record_consolidation(
        [NewFact("user_preference", "allergic to peanuts", Origin(ALICE, entry))], ""
    )
    fact = memory.list_facts()[0]
    assert memory.forget_fact(fact.id) is not None
    left = [h.text for h in memory.search_messages("allergic peanuts", 10) if h.role == "user"]
    assert left == ["I like peanuts in other people's food"]
    store.close()
    # Reopened (a restart, another replica): the tombstones hold, the transcript is
    # unchanged.
    again = make_store()
    said = again.for_session(ALICE).search_messages("allergic", 10)
    assert [h.text for h in said if h.role == "user"] == []
    assert len(sessions.get_or_create(ALICE).messages) == 6


def test_correcting_a_fact_takes_its_old_words_out_of_message_search(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    entry = say(sessions, ALICE, "my locker code is 4711", "noted")
    memory = store.for_session(ALICE)
    memory.record_consolidation(
        [NewFact("learned_fact", "locker code is 4711", Origin(ALICE, entry))], ""
    )
    fact = memory.list_facts()[0]
    assert memory.correct_fact(fact.id, "locker code is 4712", by="test") is not None
    said = [h.text for h in memory.search_messages("locker code", 5) if h.role == "user"]
    assert said == []


def test_tool_calls_and_results_are_not_indexed(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    session = sessions.get_or_create(ALICE)
    session.add_message(LLMMessage("user", "look up zebras"))
    session.add_message(LLMMessage("tool", "zebras: striped equids", tool_call_id="t1"))
    session.flush()
    found = [h.text for h in store.for_session(ALICE).search_messages("zebras striped", 5)]
    assert found == ["look up zebras"]


def test_excluded_entries_are_skipped(sessions: SessionManager, store: MemoryBackend) -> None:
    first = say(sessions, ALICE, "the boat is blue", "ok")
    say(sessions, ALICE, "the boat is fast", "ok")
    hits = store.for_session(ALICE).search_messages("boat", 5, exclude=[first])
    assert first not in [h.entry_id for h in hits]
    assert [h.text for h in hits if h.role == "user"] == ["the boat is fast"]


def test_the_conversation_search_tool_answers_from_the_callers_scope(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    say(sessions, ALICE, "my locker number is 38", "noted")
    say(sessions, BOB, "my locker number is 12", "noted")
    tools = ToolRegistry()
    for tool in memory_tools(store):
        tools.register(tool)

    async def ask(key: str) -> str:
        call = ToolCall(id="c", function_name="conversation_search", arguments={"query": "locker"})
        return await tools.execute(call, ToolContext(session_key=key))

    answer = anyio.run(ask, ALICE)
    # (entry ids are random hex: "12" may be in one, so look for the whole words)
    assert "locker number is 38" in answer and "locker number is 12" not in answer
    assert "user" in answer and ALICE in answer


# -- automatic recall: the per-turn memory block -----------------------------------------


def test_blend_recall_ranks_layers_together_each_line_once() -> None:
    facts = ["f1", "f2", "f3"]
    history = ["h1"]
    messages = ["m1", "f2", "m2"]
    blended = blend_recall([facts, history, messages])
    # A line two layers found adds up and leads; then the firsts of every layer (ties:
    # the earlier layer), then the rest, each line once.
    assert blended == ["f2", "f1", "h1", "m1", "f3", "m2"]


def test_the_memory_block_blends_facts_history_and_messages_not_in_the_window(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    old = say(sessions, ALICE, "we adopted a greyhound named Comet", "what a lovely dog")
    recent = say(sessions, ALICE, "Comet chewed my greyhound-shaped slipper", "oh no")
    memory = store.for_session(ALICE)
    memory.record_consolidation(
        [NewFact("learned_fact", "has a greyhound")], "Talked about the new greyhound"
    )
    block = memory_texts(store, ALICE, "greyhound Comet", exclude=[recent])[0].splitlines()
    assert "[learned_fact] has a greyhound" in block
    assert any(
        line.startswith("[summary of an earlier conversation, ") and "new greyhound" in line
        for line in block
    )
    said = [line for line in block if line.startswith("[earlier message, ")]
    assert "user in telegram:1] we adopted a greyhound named Comet" in said[0]
    assert " UTC, " in said[0]
    assert not any("Comet chewed" in line for line in said)  # in the window already
    assert old not in block  # entry ids are not shown to the model


@pytest.mark.parametrize(
    ("timestamp", "shown"),
    [(0.0, "1970-01-01 00:00"), (1_700_000_059.9, "2023-11-14 22:14"), (1e10, "2286-11-20 17:46")],
)
def test_a_hit_says_when_in_utc_to_the_minute(timestamp: float, shown: str) -> None:
    hit = MessageHit("telegram:1", "s", "e", timestamp, "user", "hello", 1.0)
    assert hit.when == shown
    assert hit.describe(context=False).startswith(f"[{shown} UTC, telegram:1, user, entry e]")


def test_a_fact_is_found_through_the_message_it_came_from(
    sessions: SessionManager, store: MemoryBackend
) -> None:
    told = say(sessions, ALICE, "I got a new puppy yesterday, Max!", "congratulations")
    say(sessions, ALICE, "the weather is grim", "bring an umbrella")
    memory = store.for_session(ALICE)
    memory.record_consolidation(
        [
            NewFact("learned_fact", "Owns a dog named Max", Origin(ALICE, told)),
            NewFact("user_preference", "Likes grim weather jokes"),
        ],
        "s",
    )
    # Not one word of the fact is in the question; the message it came from has one.
    assert memory.search_memory("which puppy was adopted") == []
    assert relevant_memory(memory, "which puppy was adopted") == [
        "[learned_fact] Owns a dog named Max"
    ]
    assert relevant_memory(memory, "which puppy was adopted", category="user_preference") == []
    block = memory_texts(store, ALICE, "which puppy was adopted")[0].splitlines()
    assert "[learned_fact] Owns a dog named Max" in block
    # Words of the fact itself still find it, and another scope's messages lend nothing.
    assert relevant_memory(memory, "dog") == ["[learned_fact] Owns a dog named Max"]
    assert relevant_memory(store.for_session(BOB), "which puppy was adopted") == []


# -- dense similarity fused with BM25 ----------------------------------------------------


def test_dense_ranks_find_a_paraphrase_and_never_a_forgotten_message() -> None:
    pytest.importorskip("wordllama")
    from gateway.memory.dense import DenseIndex, StaticEmbedder
    from gateway.memory.messages import MessageIndex, StoredMessage

    texts = ["my puppy Max chewed the sofa", "the quarterly report is late", "rain again"]
    index = MessageIndex(dense=DenseIndex(StaticEmbedder()), dense_weight=1.0)
    index.add(
        "s", [StoredMessage("k", "s", f"e{i}", 1e9 + i, "user", t) for i, t in enumerate(texts)]
    )
    # No word in common with the query: only the dense ranks can find it.
    assert index.search("dog", 1)[0].text == "my puppy Max chewed the sofa"
    index.forget_entries(["e0"])
    assert "my puppy Max chewed the sofa" not in [h.text for h in index.search("dog", 3)]


def test_dense_similarity_reorders_what_the_keywords_found_equally() -> None:
    pytest.importorskip("wordllama")
    from gateway.memory.dense import DenseIndex, StaticEmbedder
    from gateway.memory.messages import MessageIndex, StoredMessage

    texts = ["bought food for my puppy", "bought food for my printer"]  # the second newer
    messages = [StoredMessage("k", "s", f"e{i}", 1e9 + i, "user", t) for i, t in enumerate(texts)]
    keyword = MessageIndex()
    keyword.add("s", messages)
    hybrid = MessageIndex(dense=DenseIndex(StaticEmbedder()), dense_weight=0.2)
    hybrid.add("s", messages)
    # The same BM25 score: keywords alone put the newer first; a fifth of the score from
    # dense similarity is enough to put the one about a dog first (a dense rank added to
    # a keyword rank, as reciprocal rank fusion does, is not).
    assert [h.text for h in keyword.search("dog food", 2)] == texts[::-1]
    assert [h.text for h in hybrid.search("dog food", 2)] == texts


def test_a_wider_sign_code_keeps_the_signs_past_256_dimensions() -> None:
    from gateway.memory.dense import DenseIndex

    class Fixed:
        """Three 384-dimension vectors that differ only past the 256th dimension."""

        def embed(self, texts: Sequence[str]) -> np.ndarray:
            rows = np.ones((len(texts), 384), np.float32)
            for row, text in enumerate(texts):
                rows[row, 256:] = -1.0 if "minus" in text else 1.0
            return rows / np.linalg.norm(rows, axis=1, keepdims=True)

    narrow, wide = DenseIndex(Fixed()), DenseIndex(Fixed(), bits=384)
    for index in (narrow, wide):
        index.add([1, 2], ["plus", "minus"])
    # 256 bits see two equal documents (newer first); 384 see the one that matches.
    assert narrow.search("plus query", 1) == [2]
    assert wide.search("plus query", 1) == [1]
    # 128 of 384 signs differ: 1 - 128 / 192.
    assert wide.similarities(wide.query_code("minus query"), [2, 1]) == [1.0, pytest.approx(1 / 3)]
    wide.remove(1)
    assert wide.search("plus query", 2) == [2]
    with pytest.raises(ValueError, match="multiple of 64"):
        DenseIndex(Fixed(), bits=100)


def test_a_turn_does_not_wait_long_for_a_scopes_first_reading() -> None:
    """The first search of a scope reads all its sessions; a caller with a bound (a
    turn's recall) gets [] while that runs in the background, then the answers."""
    import threading

    from gateway.memory.messages import MessageIndex, SessionMark, StoredMessage

    release = threading.Event()

    class SlowSource:
        """Sessions that take as long as the test says to read."""

        def sessions(self) -> dict[str, SessionMark]:
            return {"s": SessionMark("k", "s", 1)}

        def read(self, handle: str, start: int) -> tuple[list[StoredMessage], int]:
            release.wait(10)
            return [StoredMessage("k", "s", "e1", 1e9, "user", "the ferry leaves at nine")], 1

        def forgotten(self) -> set[str]:
            return set()

        def forget(self, entry_ids: object) -> None:
            pass

    index = MessageIndex(SlowSource())
    assert index.search("ferry", 3, wait=0.05) == []
    release.set()
    assert index.ready(wait=5)
    assert [h.text for h in index.search("ferry", 3, wait=0.05)] == ["the ferry leaves at nine"]
