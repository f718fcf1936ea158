"""Issue 41's recall: messages found by the facts drawn from them, the time a question
names, dense codes embedded off the turn and saved (a damaged file kept, search falling
back to BM25), and everything as BM25 without the `embedding` extra."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from loguru import logger

from gateway import embedding
from gateway.agent.memory_tools import memory_texts, recall_lines, relevant_memory
from gateway.llm import LLMMessage
from gateway.memory import MemoryStore
from gateway.memory.dense import DenseIndex, sentence_dense_index
from gateway.memory.facts import NewFact, Origin
from gateway.memory.messages import (
    MESSAGE_INDEX_FILE,
    MESSAGE_VECTORS_FILE,
    FileMessageSource,
    MessageIndex,
    StoredMessage,
)
from gateway.memory.scopes import scope_dir
from gateway.memory.timewords import LATE, time_range
from gateway.sessions import SessionManager

ALICE = "telegram:1"


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[SessionManager]:
    manager = SessionManager(tmp_path / "sessions", fsync="never")
    yield manager
    manager.close()


def say(sessions: SessionManager, user: str, reply: str = "noted") -> str:
    session = sessions.get_or_create(ALICE)
    entry = session.add_message(LLMMessage("user", user))
    session.add_message(LLMMessage("assistant", reply))
    session.flush()
    return entry.id


class HashEmbedder:
    """A stand-in for the sentence model (an outside library): a unit vector per text
    from its bytes' hash, the same for the same text; it counts what it embeds."""

    model_id = "hash-test"

    def __init__(self) -> None:
        self.embedded: list[str] = []

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        self.embedded.extend(texts)
        rows = np.zeros((len(texts), 384), np.float32)
        for row, text in enumerate(texts):
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
            vector = np.random.default_rng(seed).standard_normal(384).astype(np.float32)
            rows[row] = vector / np.linalg.norm(vector)
        return rows


def file_index(tmp_path: Path, embedder: HashEmbedder) -> MessageIndex:
    """A scope's message index as the file mode builds it, with `embedder` as its model;
    embedding is run by the test (`embed_pending`), not a background thread."""
    scope = scope_dir(tmp_path / "workspace", ALICE)
    scope.mkdir(parents=True, exist_ok=True)
    source = FileMessageSource(tmp_path / "sessions", scope, lambda: [ALICE])
    index = MessageIndex(
        source, dense=DenseIndex(embedder, bits=384), saved=scope / MESSAGE_INDEX_FILE
    )
    index.embed_in_background = False
    return index


# -- fact-augmented keys ------------------------------------------------------------------


def test_a_message_is_found_by_the_words_of_a_fact_drawn_from_it(
    tmp_path: Path, sessions: SessionManager
) -> None:
    told = say(sessions, "we picked him up from the shelter on Sunday", "lovely")
    say(sessions, "the weather is grim", "bring an umbrella")
    store = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=False)
    memory = store.for_session(ALICE)
    # Indexed before the fact exists: no word of "beagle" in the conversation.
    assert memory.search_messages("beagle") == []
    memory.record_consolidation(
        [NewFact("learned_fact", "Alice adopted a beagle puppy", Origin(ALICE, told))], ""
    )
    hits = memory.search_messages("beagle")
    assert [hit.entry_id for hit in hits] == [told]
    assert hits[0].text == "we picked him up from the shelter on Sunday"  # its own words shown
    store.close()
    # A restarted scope (the saved index), and one read from the sessions again, agree.
    again = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=False)
    assert [hit.entry_id for hit in again.for_session(ALICE).search_messages("beagle")] == [told]
    again.close()
    (scope_dir(tmp_path / "workspace", ALICE) / MESSAGE_INDEX_FILE).unlink()
    fresh = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=False)
    assert [hit.entry_id for hit in fresh.for_session(ALICE).search_messages("beagle")] == [told]
    fresh.close()


def test_forgetting_the_fact_takes_its_words_out_of_the_message_key_too(
    tmp_path: Path, sessions: SessionManager
) -> None:
    told = say(sessions, "we picked him up from the shelter on Sunday")
    store = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=False)
    memory = store.for_session(ALICE)
    memory.search_messages("shelter")
    memory.record_consolidation(
        [NewFact("learned_fact", "Alice adopted a beagle puppy", Origin(ALICE, told))], ""
    )
    assert memory.search_messages("beagle")
    fact = memory.list_facts()[0]
    assert memory.forget_fact(fact.id) is not None
    assert memory.search_messages("beagle") == []
    store.close()


# -- time-aware expansion ---------------------------------------------------------------


NOW = datetime(2023, 10, 20, 15, 0, tzinfo=UTC)


def day(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    ("query", "start", "end"),
    [
        ("What movie did Joanna watch on 1 May, 2022?", "2022-05-01", "2022-05-02"),
        ("Who did Maria have dinner with on May 3, 2023?", "2023-05-03", "2023-05-04"),
        ("What did Melanie show on October 13?", "2023-10-13", "2023-10-14"),
        ("What did she paint on December 24?", "2022-12-24", "2022-12-25"),  # not yet this year
        ("What did John attend in March 2023?", "2023-03-01", "2023-04-01"),
        ("When did Melanie go camping in June?", "2023-06-01", "2023-07-01"),
        ("Where did they go in November?", "2022-11-01", "2022-12-01"),
        ("What state did Joanna visit in summer 2021?", "2021-06-01", "2021-09-01"),
        ("a pride parade during the summer", "2023-06-01", "2023-09-01"),
        ("what did we do last year", "2022-01-01", "2023-01-01"),
        ("How many times has Melanie gone to the beach in 2023?", "2023-01-01", "2024-01-01"),
        ("what happened last month", "2023-09-01", "2023-10-01"),
        ("what did I say yesterday", "2023-10-19", "2023-10-20"),
    ],
)
def test_a_named_time_becomes_a_range_ending_a_little_later(
    query: str, start: str, end: str
) -> None:
    assert time_range(query, NOW) == (day(start), day(end) + LATE.total_seconds())


@pytest.mark.parametrize(
    "query",
    ["What may I bring?", "How did the 5 of them meet?", "Who won the race?", "in 2023s"],
)
def test_a_query_without_time_words_has_no_range(query: str) -> None:
    assert time_range(query, NOW) is None


def test_relative_words_are_read_against_now() -> None:
    start, end = time_range("three weeks ago", NOW) or (0.0, 0.0)
    assert start < day("2023-09-29") < end
    assert time_range("recently", NOW) == (
        day("2023-09-20") + 15 * 3600,
        NOW.timestamp() + LATE.total_seconds(),
    )


def test_messages_in_the_named_time_rank_first() -> None:
    index = MessageIndex()
    said = [
        StoredMessage("k", "s", "march", day("2023-03-10"), "user", "we went camping by the lake"),
        StoredMessage("k", "s", "june", day("2023-06-12"), "user", "we went camping by the sea"),
        StoredMessage("k", "s", "sept", day("2023-09-02"), "user", "we went camping by a lake"),
    ]
    index.add("s", said)
    question = "When did Melanie go camping in June?"
    plain = index.search("went camping", 3, context=False)
    assert plain[0].entry_id != "june"
    during = time_range(question, NOW)
    timed = index.search("went camping", 3, context=False, during=during)
    assert timed[0].entry_id == "june"
    assert {hit.entry_id for hit in timed} == {"march", "june", "sept"}


def test_the_recall_reads_the_time_of_the_question(
    tmp_path: Path, sessions: SessionManager
) -> None:
    store = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=False)
    say(sessions, "we went camping by the lake")
    memory = store.for_session(ALICE)
    memory.search_messages("camping")
    # The session was written now: "this month" is read against the present.
    lines = recall_lines(memory, "camping this month", now=datetime.now(UTC))
    assert any("camping by the lake" in line for line in lines)
    store.close()


# -- dense codes: off the turn, saved, reloaded, damaged --------------------------------


def test_codes_are_saved_and_a_restart_embeds_nothing_again(
    tmp_path: Path, sessions: SessionManager
) -> None:
    for i in range(5):
        say(sessions, f"message number {i} about the garden")
    first = HashEmbedder()
    index = file_index(tmp_path, first)
    assert index.search("garden", 3, context=False)  # BM25 answers before any embedding
    assert index.pending == 10 and first.embedded == []  # nothing embedded on the search
    assert index.embed_pending() == 10
    index.save()
    scope = scope_dir(tmp_path / "workspace", ALICE)
    assert (scope / MESSAGE_VECTORS_FILE).exists()

    second = HashEmbedder()
    again = file_index(tmp_path, second)
    vector = first.embed(["garden"])[0]
    hits = again.search("garden", 3, context=False, query_vector=vector)
    assert len(hits) == 3
    assert again.pending == 0
    assert second.embedded == []  # neither the messages nor the query (its vector given)
    say(sessions, "one more about the garden")
    again.search("garden", 3, context=False, query_vector=vector)
    assert again.pending == 2 and again.embed_pending() == 2
    assert len(second.embedded) == 2


def test_a_damaged_vectors_file_is_reported_kept_and_search_falls_back_to_bm25(
    tmp_path: Path, sessions: SessionManager
) -> None:
    for i in range(4):
        say(sessions, f"note {i} on the roses")
    index = file_index(tmp_path, HashEmbedder())
    index.search("roses", 1)
    index.embed_pending()
    index.save()
    scope = scope_dir(tmp_path / "workspace", ALICE)
    path = scope / MESSAGE_VECTORS_FILE
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))

    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING")
    try:
        embedder = HashEmbedder()
        reopened = file_index(tmp_path, embedder)
        hits = reopened.search("note 2 roses", 4, context=False)
    finally:
        logger.remove(sink)
    assert any("damaged" in w for w in warnings)
    kept = scope / (MESSAGE_VECTORS_FILE + ".damaged")
    assert kept.read_bytes() == bytes(damaged)  # kept as it was, not overwritten
    assert not path.exists()
    assert hits[0].text == "note 2 on the roses"  # BM25 alone: nothing is embedded yet
    assert reopened.pending == 8 and embedder.embedded == []
    assert reopened.embed_pending() == 8  # embedded again, off the turn
    reopened.save()
    assert path.exists() and kept.read_bytes() == bytes(damaged)


def test_codes_of_another_index_are_not_used(tmp_path: Path, sessions: SessionManager) -> None:
    say(sessions, "a note on tulips")
    index = file_index(tmp_path, HashEmbedder())
    index.search("tulips", 1)
    index.embed_pending()
    index.save()
    scope = scope_dir(tmp_path / "workspace", ALICE)
    (scope / MESSAGE_INDEX_FILE).unlink()  # rebuilt from the sessions: other document ids
    embedder = HashEmbedder()
    rebuilt = file_index(tmp_path, embedder)
    rebuilt.search("tulips", 1)
    assert rebuilt.pending == 2 and rebuilt.embed_pending() == 2


def test_the_background_pass_embeds_what_a_search_indexed(
    tmp_path: Path, sessions: SessionManager
) -> None:
    say(sessions, "a note on lilies")
    embedder = HashEmbedder()
    index = file_index(tmp_path, embedder)
    index.embed_in_background = True
    index.search("lilies", 1, query_vector=embedder.embed(["lilies"])[0])
    thread = index._embedding
    if thread is not None:
        thread.join(10)
    assert index.pending == 0


# -- without the embedding extra ------------------------------------------------------


def test_without_the_embedding_extra_recall_is_bm25(
    tmp_path: Path, sessions: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        embedding, "embedding_unavailable", lambda: "onnxruntime missing: pip install X"
    )
    assert sentence_dense_index() is None
    told = say(sessions, "I got a new puppy yesterday, Max!", "congratulations")
    store = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=True)
    memory = store.for_session(ALICE)
    assert memory.messages is not None and memory.messages._dense is None
    memory.record_consolidation(
        [NewFact("learned_fact", "Owns a dog named Max", Origin(ALICE, told))], "s"
    )
    vector = np.ones(384, np.float32) / np.sqrt(384)  # given or not, no model is asked
    assert relevant_memory(memory, "which puppy", query_vector=vector) == [
        "[learned_fact] Owns a dog named Max"
    ]
    block = memory_texts(store, ALICE, "which puppy", query_vector=vector)[0]
    assert "Owns a dog named Max" in block
    store.close()
    assert not (scope_dir(tmp_path / "workspace", ALICE) / MESSAGE_VECTORS_FILE).exists()


@pytest.mark.skipif(
    embedding.embedding_unavailable() is not None, reason="the embedding extra is not installed"
)
def test_with_the_extra_the_store_fuses_the_sentence_model(
    tmp_path: Path, sessions: SessionManager
) -> None:
    say(sessions, "my puppy Max chewed the sofa")
    store = MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions", dense=True)
    memory = store.for_session(ALICE)
    index = memory.messages
    assert index is not None and index._dense is not None
    memory.search_messages("sofa")
    index.embed_pending()
    dog = embedding.SentenceEmbedder().embed(["dog"])[0]
    hits = memory.search_messages("dog", 1, query_vector=dog)  # no word in common
    assert hits and hits[0].text == "my puppy Max chewed the sofa"
    store.close()
    assert (scope_dir(tmp_path / "workspace", ALICE) / MESSAGE_VECTORS_FILE).exists()


def test_postgres_indexes_a_message_under_the_facts_drawn_from_it(
    pg_pools: Callable[[], Any],
) -> None:
    from gateway.memory.pg_store import PostgresMemoryStore
    from gateway.sessions.pg_store import PostgresSessions

    sessions = SessionManager.shared(PostgresSessions(pg_pools()))
    store = PostgresMemoryStore(pg_pools())
    try:
        told = say(sessions, "we picked him up from the shelter on Sunday")
        memory = store.for_session(ALICE)
        assert memory.search_messages("beagle") == []  # indexed before the fact exists
        memory.record_consolidation(
            [NewFact("learned_fact", "Alice adopted a beagle puppy", Origin(ALICE, told))], ""
        )
        assert [hit.entry_id for hit in memory.search_messages("beagle")] == [told]
        # Another replica (a new index) reads the fact with the message.
        other = PostgresMemoryStore(pg_pools())
        found = other.for_session(ALICE).search_messages("beagle")
        assert [hit.entry_id for hit in found] == [told]
        other.close()
    finally:
        store.close()
        sessions.close()


@pytest.mark.skipif(
    embedding.embedding_unavailable() is not None, reason="the embedding extra is not installed"
)
def test_a_process_exiting_while_messages_are_embedded_exits_cleanly(tmp_path: Path) -> None:
    """A short command (`gateway memory search`) starts the background pass and exits:
    the pass stops at the next text instead of being killed inside onnxruntime (which
    aborted the process once in tests/test_memory_e2e.py: "terminate called without an
    active exception"; this smoke test did not reproduce it without the fix)."""
    import subprocess
    import sys

    script = f"""
from pathlib import Path
from gateway.llm import LLMMessage
from gateway.memory import MemoryStore
from gateway.sessions import SessionManager
root = Path({str(tmp_path)!r})
sessions = SessionManager(root / "sessions", fsync="never")
session = sessions.get_or_create("cli:x")
for i in range(200):
    session.add_message(LLMMessage("user", f"message {{i}} about a long walk by the river"))
session.flush()
store = MemoryStore(root / "workspace", sessions_dir=root / "sessions", dense=True)
print(len(store.for_session("cli:x").search_messages("river", 3)))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


def test_postgres_finds_the_facts_of_many_messages_at_once(pg_pools: Callable[[], Any]) -> None:
    from gateway.memory.pg_store import PostgresMemoryStore

    store = PostgresMemoryStore(pg_pools())
    try:
        memory = store.for_session(ALICE)
        memory.append_facts(
            [
                NewFact("learned_fact", "Alice adopted a beagle", Origin(ALICE, "e7")),
                NewFact("learned_fact", "Alice likes tea", Origin(ALICE, "e70")),
                NewFact("learned_fact", "Alice has no origin"),
            ]
        )
        few = memory.facts_from_messages(["e7", "e8"])
        many = memory.facts_from_messages([f"e{i}" for i in range(7, 200)])
        assert few == {"e7": ["- [learned_fact] Alice adopted a beagle"]}
        assert many == {**few, "e70": ["- [learned_fact] Alice likes tea"]}
    finally:
        store.close()
