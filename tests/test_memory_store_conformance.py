"""One suite for both memory backends (`gateway.memory.protocol`): workspace files and
PostgreSQL keep the same facts, history, knowledge and search promises."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from gateway.memory import MemoryStore
from gateway.memory.facts import Correction, NewFact, Origin, fact_id
from gateway.memory.protocol import MemoryBackend
from gateway.memory.scopes import ScopeMode

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


class Clock:
    """A settable clock both backends read for timestamps and days."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


MakeBackend = Callable[..., MemoryBackend]


@pytest.fixture(params=["files", "postgres"])
def make_backend(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> Iterator[MakeBackend]:
    """A factory of backends over one store (files: one workspace; postgres: one schema):
    two backends made by it see the same memory, as two replicas (or processes) do."""
    made: list[MemoryBackend] = []
    if request.param == "files":

        def make(mode: ScopeMode = "per_session") -> MemoryBackend:
            backend = MemoryStore(tmp_path / "ws", mode=mode, clock=clock)
            made.append(backend)
            return backend

    else:
        from gateway.memory.pg_store import PostgresMemoryStore

        pools = request.getfixturevalue("pg_pools")

        def make(mode: ScopeMode = "per_session") -> MemoryBackend:
            backend = PostgresMemoryStore(pools(), mode=mode, clock=clock)
            made.append(backend)
            return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def backend(make_backend: MakeBackend) -> MemoryBackend:
    return make_backend()


def same(line: str) -> str:
    """A stored line as compared across backends: PostgreSQL keeps NUL as U+FFFD."""
    return line.replace("\x00", "\ufffd")


# -- facts -------------------------------------------------------------------------------


def test_facts_are_bullets_under_one_heading_per_day(backend: MemoryBackend) -> None:
    memory = backend.for_session("telegram:1")
    assert memory.read_memory() == ""
    assert memory.append_facts([("user_preference", "Likes jazz"), ("weird", "Has a cat")]) == 2
    assert memory.append_facts([("project_decision", "  ")]) == 0
    memory.append_facts([("learned_fact", "Lives in\nLyon")])  # same day: no new heading
    memory.append_facts([("error_pattern", "Forgets keys")], day=date(2025, 3, 2))
    assert memory.read_memory() == (
        "### Consolidated 2025-03-01\n"
        "- [user_preference] Likes jazz\n"
        "- [learned_fact] Has a cat\n"
        "- [learned_fact] Lives in Lyon\n"
        "\n"
        "### Consolidated 2025-03-02\n"
        "- [error_pattern] Forgets keys\n"
    )


def test_fact_search_ranks_filters_by_category_and_lists_the_newest(
    backend: MemoryBackend,
) -> None:
    memory = backend.for_session("telegram:1")
    memory.append_facts(
        [
            ("project_decision", "We deploy the gateway with Docker"),
            ("user_preference", "Prefers Rust for the gateway and deploys by hand"),
            ("learned_fact", "The cat is called Rust"),
            ("learned_fact", "Nothing in common"),
        ]
    )
    hits = memory.search_memory("rust deploying", max_results=5)
    # Both words (stemmed: deploying ~ deploys) beat one of them; no match is not a hit.
    assert hits[0] == "- [user_preference] Prefers Rust for the gateway and deploys by hand"
    assert set(hits[1:]) == {
        "- [project_decision] We deploy the gateway with Docker",
        "- [learned_fact] The cat is called Rust",
    }
    assert memory.search_memory("rust", category="learned_fact") == [
        "- [learned_fact] The cat is called Rust"
    ]
    assert memory.search_memory("rust", category="User_Preference ") == [
        "- [user_preference] Prefers Rust for the gateway and deploys by hand"
    ]
    assert len(memory.search_memory("rust", max_results=1)) == 1
    assert memory.search_memory("the of and") == [
        "- [learned_fact] Nothing in common",
        "- [learned_fact] The cat is called Rust",
        "- [user_preference] Prefers Rust for the gateway and deploys by hand",
        "- [project_decision] We deploy the gateway with Docker",
    ]
    assert memory.search_memory("zebra") == []


def test_negations_are_words_not_stopwords(backend: MemoryBackend) -> None:
    memory = backend.for_session("cli:direct")
    memory.append_facts(
        [("user_preference", "Likes tea"), ("user_preference", "Doesn't like coffee")]
    )
    assert memory.search_memory("not")[0] == "- [user_preference] Doesn't like coffee"


# -- history -----------------------------------------------------------------------------


def test_history_lines_are_timestamped_and_append_only(
    backend: MemoryBackend, clock: Clock
) -> None:
    memory = backend.for_session("telegram:1")
    assert memory.append_history("   ") == ""
    first = memory.append_history("Talked about\nthe trip to Rome")
    assert first == "[2025-03-01 12:00:00] Talked about the trip to Rome"
    clock.now = T0 + timedelta(hours=5)
    memory.append_history("Planned the budget")
    assert memory.search_history("rome") == [first]
    # A query without words lists the newest lines.
    assert memory.search_history("?!") == [
        "[2025-03-01 17:00:00] Planned the budget",
        first,
    ]


def test_history_recency_decay_can_outrank_relevance(backend: MemoryBackend, clock: Clock) -> None:
    memory = backend.for_session("telegram:1")
    clock.now = T0 - timedelta(days=365)
    old = memory.append_history("rust rust release planning for the rust gateway")
    clock.now = T0
    new = memory.append_history("a short rust note among many other words about unrelated things")
    assert memory.search_history("rust", decay_rate=0.0, now=T0) == [old, new]
    assert memory.search_history("rust", decay_rate=1.0, now=T0) == [new, old]
    # Equal relevance: newer first, with or without decay.
    clock.now = T0 + timedelta(hours=1)
    twin_a = memory.append_history("kayak trip")
    clock.now = T0 + timedelta(hours=2)
    twin_b = memory.append_history("kayak trip")
    assert memory.search_history("kayak", decay_rate=0.0) == [twin_b, twin_a]


# -- knowledge ---------------------------------------------------------------------------


def test_knowledge_dedupes_by_content_and_merges(backend: MemoryBackend, clock: Clock) -> None:
    kb = backend.for_session("telegram:1").knowledge
    first = kb.add("user_preference", "Likes  dark mode.", tags=["ui"])
    assert first.access_count == 0 and first.source is None and first.tags == ("ui",)
    clock.now = T0 + timedelta(minutes=5)
    again = kb.add("USER_PREFERENCE", "likes dark mode", source="remember", tags=["ui", "theme"])
    assert again.id == first.id and again.content == "Likes dark mode."
    assert again.access_count == 1 and again.source == "remember"
    assert again.tags == ("ui", "theme") and again.created_at == first.created_at
    assert again.accessed_at == (T0 + timedelta(minutes=5)).timestamp()
    other = kb.add("learned_fact", "Likes dark mode")  # another category: another entry
    assert other.id != first.id
    kb.flush()
    assert len(kb) == 2 and kb.get(first.id) == again
    assert {e.id for e in kb} == {first.id, other.id}
    with pytest.raises(ValueError):
        kb.add("learned_fact", " \n ")


def test_knowledge_search_filters_ranks_and_counts_an_access(
    backend: MemoryBackend, clock: Clock
) -> None:
    kb = backend.for_session("telegram:1").knowledge
    kb.add("project_decision", "The gateway uses PostgreSQL for replicas")
    kb.add("user_preference", "Prefers PostgreSQL over MySQL", tags=["databases"])
    kb.add("learned_fact", "Has two cats")
    kb.flush()
    hits = kb.search("postgresql databases")
    assert [e.content for e in hits] == [
        "Prefers PostgreSQL over MySQL",
        "The gateway uses PostgreSQL for replicas",
    ]
    assert all(e.access_count == 1 for e in hits)
    assert [e.content for e in kb.search("postgresql", category="project_decision")] == [
        "The gateway uses PostgreSQL for replicas"
    ]
    assert [e.content for e in kb.search("cats", category=None)] == ["Has two cats"]
    assert kb.search("zebra") == []
    # An empty query lists by popularity: most accessed first.
    assert [e.content for e in kb.search("", max_results=1)] == [
        "The gateway uses PostgreSQL for replicas"
    ]
    assert [e.content for e in kb.by_category("user_preference")] == [
        "Prefers PostgreSQL over MySQL"
    ]
    assert kb.export_for_context(2000).splitlines() == [
        "[user_preference] Prefers PostgreSQL over MySQL",
        "[project_decision] The gateway uses PostgreSQL for replicas",
        "[learned_fact] Has two cats",
    ]
    assert kb.export_for_context(60) == "[user_preference] Prefers PostgreSQL over MySQL"


# -- consolidation, scopes ----------------------------------------------------------------


def test_record_consolidation_writes_facts_knowledge_and_one_history_line(
    backend: MemoryBackend,
) -> None:
    memory = backend.for_session("slack:C1")
    memory.record_consolidation(
        [("user_preference", "Likes short answers"), ("bogus", "Works at ACME"), ("x", " ")],
        "Discussed answer style",
    )
    assert memory.search_memory("acme") == ["- [learned_fact] Works at ACME"]
    assert sorted(e.content for e in memory.knowledge) == ["Likes short answers", "Works at ACME"]
    assert {e.source for e in memory.knowledge} == {"consolidation"}
    assert memory.search_history("answer style") == ["[2025-03-01 12:00:00] Discussed answer style"]


def test_one_scope_never_sees_another(make_backend: MakeBackend) -> None:
    backend = make_backend()
    assert not backend.exists("telegram:1")
    alice, bob = backend.for_session("telegram:1"), backend.for_session("telegram_1")
    alice.append_facts([("user_preference", "Alice likes jazz")])
    alice.append_history("Alice talked about jazz")
    alice.knowledge.add("learned_fact", "Alice plays jazz piano")
    alice.knowledge.flush()
    assert backend.exists("telegram:1")
    assert bob.search_memory("jazz") == [] and bob.search_history("jazz") == []
    assert bob.knowledge.search("jazz") == [] and len(bob.knowledge) == 0
    assert bob.search_memory("") == [] and bob.read_memory() == ""
    assert bob.knowledge.export_for_context() == ""
    # Another backend over the same storage (another process, another replica).
    twin = make_backend()
    assert twin.for_session("telegram:1").search_memory("jazz") == [
        "- [user_preference] Alice likes jazz"
    ]
    assert (
        twin.for_session("telegram:1").knowledge.search("piano")[0].content
        == "Alice plays jazz piano"
    )
    shared = make_backend(mode="workspace")
    shared.for_session("slack:C9").append_facts([("learned_fact", "Team lunch on Fridays")])
    assert shared.for_session("telegram:7").search_memory("lunch") == [
        "- [learned_fact] Team lunch on Fridays"
    ]
    assert backend.for_session("telegram:1").search_memory("lunch") == []


@pytest.mark.parametrize("scope", ["", "x" * 300])
def test_unusable_scope_names_are_refused(backend: MemoryBackend, scope: str) -> None:
    with pytest.raises(ValueError):
        backend.for_scope(scope).append_history("never stored")


# -- hostile and huge text ---------------------------------------------------------------

HOSTILE = [
    "nul\x00byte inside",
    'quote\'s "double" `tick` \\back\\slash',
    "tsquery ops a & b | !c <-> d:* (e)",
    "'); DROP TABLE gw_memory_facts; --",
    "日本語のテキスト 東京 emoji 🦀 crab",
    "tab\there\rcarriage",
    "%s %(name)s {0} $1",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_is_stored_and_found(backend: MemoryBackend, text: str) -> None:
    memory = backend.for_session("telegram:1")
    memory.append_facts([("learned_fact", text)])
    line = memory.append_history(text)
    entry = memory.knowledge.add("learned_fact", text)
    memory.knowledge.flush()
    assert same(memory.search_memory(text)[0]) == same(f"- [learned_fact] {' '.join(text.split())}")
    assert same(memory.search_history(text)[0]) == same(line)
    assert same(memory.knowledge.search(text)[0].content) == same(entry.content)
    # The same text as a query of its own never breaks a search.
    assert memory.search_memory(text, category="learned_fact")
    assert memory.read_memory().count("\n") == 2


def test_nul_bytes_dedupe_like_the_text_around_them(backend: MemoryBackend) -> None:
    kb = backend.for_session("telegram:1").knowledge
    first = kb.add("learned_fact", "a\x00b")
    again = kb.add("learned_fact", "a\x00b")
    assert again.id == first.id and again.access_count == 1


def test_huge_entries_are_kept_whole_and_searchable(backend: MemoryBackend) -> None:
    memory = backend.for_session("telegram:1")
    words = " ".join(f"w{i}" for i in range(300_000))  # ~2.3 MB
    huge = f"needle {words} lastword"
    line = memory.append_history(huge)
    assert len(line) > 2_000_000
    # The file mode indexes megabytes in the background: a search waits for it.
    assert memory.search_history("needle") == [line]
    memory.append_facts([("learned_fact", huge)])
    assert memory.search_memory("needle")[0].endswith("lastword")
    entry = memory.knowledge.add("learned_fact", huge)
    memory.knowledge.flush()
    assert memory.knowledge.search("needle")[0].id == entry.id


# -- fact ids, origins, corrections, forgetting ------------------------------------------


def test_facts_have_stable_ids_and_point_back_to_their_session_entry(
    make_backend: MakeBackend,
) -> None:
    memory = make_backend().for_session("telegram:1")
    told = Origin("telegram:1", "0a1b2c3d4e5f")
    memory.record_consolidation(
        [NewFact("user_preference", "Drinks green tea", told), ("learned_fact", "Has a cat")],
        "talked about tea",
    )
    facts = memory.list_facts()
    assert [(f.category, f.text, f.origin) for f in facts] == [
        ("user_preference", "Drinks green tea", told),
        ("learned_fact", "Has a cat", None),  # the writer did not say where from
    ]
    tea, cat = facts
    assert tea.id != cat.id and all(len(f.id) == 8 for f in facts)
    # Readable as Markdown: the id and origin ride in a comment; search never sees it.
    assert memory.read_memory() == (
        "### Consolidated 2025-03-01\n"
        f"- [user_preference] Drinks green tea <!-- fact {tea.id} from telegram:1 "
        "entry 0a1b2c3d4e5f -->\n"
        "- [learned_fact] Has a cat\n"
    )
    assert memory.search_memory("tea") == ["- [user_preference] Drinks green tea"]
    assert memory.search_memory("0a1b2c3d4e5f") == []  # an entry id is not a word of it
    # Another process (replica) sees the same ids.
    assert make_backend().for_session("telegram:1").list_facts() == facts


def test_facts_are_found_by_the_message_they_came_from(
    make_backend: MakeBackend, clock: Clock
) -> None:
    memory = make_backend().for_session("telegram:1")
    puppy, odd = Origin("telegram:1", "e1"), Origin("telegram:1", "e_%1")
    memory.record_consolidation(
        [
            NewFact("learned_fact", "Owns a dog named Max", puppy),
            NewFact("user_preference", "Walks Max at dawn", puppy),
            NewFact("learned_fact", "Likes LIKE patterns", odd),
            ("learned_fact", "Has a cat"),
        ],
        "s",
    )
    lent = {
        "e1": ["- [learned_fact] Owns a dog named Max", "- [user_preference] Walks Max at dawn"],
        "e_%1": ["- [learned_fact] Likes LIKE patterns"],
    }
    # Lines as fact search gives them; a message that gave no fact is left out, and an
    # entry id is matched whole ("e" is no prefix match, "_" and "%" are no wildcards).
    assert memory.facts_from_messages(["e1", "e_%1", "e2", "e", "e_1"]) == lent
    assert memory.facts_from_messages([]) == {}
    # Appended, corrected and forgotten facts show, change and go, in any process.
    clock.now = T0 + timedelta(days=1)
    memory.append_facts([NewFact("learned_fact", "Max is a beagle", puppy)])
    dog = next(f for f in memory.list_facts() if f.text == "Owns a dog named Max")
    memory.correct_fact(dog.id, "Owns a beagle named Max", by="telegram:1")
    walks = next(f for f in memory.list_facts() if f.text == "Walks Max at dawn")
    memory.forget_fact(walks.id)
    for view in (memory, make_backend().for_session("telegram:1")):
        assert view.facts_from_messages(["e1"]) == {
            "e1": ["- [learned_fact] Owns a beagle named Max", "- [learned_fact] Max is a beagle"]
        }
    assert make_backend().for_session("telegram:2").facts_from_messages(["e1"]) == {}


def test_lines_without_ids_get_ids_derived_from_their_day_and_text(backend: MemoryBackend) -> None:
    memory = backend.for_session("telegram:1")
    memory.append_facts([("learned_fact", "Lives in Lyon")], day=date(2024, 1, 2))
    (fact,) = memory.list_facts()
    assert fact.id == fact_id(date(2024, 1, 2), "learned_fact", "Lives in Lyon")
    assert (fact.day, fact.origin, fact.correction) == (date(2024, 1, 2), None, None)
    assert backend.for_session("telegram:1").list_facts() == [fact]


def test_a_correction_keeps_the_id_and_says_who_corrected_it(
    make_backend: MakeBackend, clock: Clock
) -> None:
    memory = make_backend().for_session("telegram:1")
    told = Origin("telegram:1", "e1")
    memory.record_consolidation([NewFact("user_preference", "Drinks green tea", told)], "s")
    (tea,) = memory.list_facts()
    clock.now = T0 + timedelta(hours=2)
    fixed = memory.correct_fact(tea.id, "Drinks black tea, no sugar", by="telegram:1")
    assert fixed is not None
    assert (fixed.id, fixed.text, fixed.origin) == (tea.id, "Drinks black tea, no sugar", told)
    assert fixed.correction == Correction("2025-03-01T14:00:00Z", "telegram:1")
    again = make_backend().for_session("telegram:1")
    assert again.list_facts() == [fixed]
    # The knowledge entry says the new text, and searches find it instead of the old.
    assert [e.content for e in again.knowledge] == ["Drinks black tea, no sugar"]
    assert again.search_memory("green") == []
    assert again.search_memory("black") == ["- [user_preference] Drinks black tea, no sugar"]
    assert "green" not in again.knowledge.export_for_context()
    assert again.correct_fact("ffffffff", "anything", by="x") is None
    with pytest.raises(ValueError, match="needs some text"):
        again.correct_fact(tea.id, "   ", by="x")
    assert again.list_facts() == [fixed]


def test_forgetting_removes_the_fact_its_knowledge_and_its_search_hits(
    make_backend: MakeBackend,
) -> None:
    memory = make_backend().for_session("telegram:1")
    memory.record_consolidation(
        [("user_preference", "Drinks green tea"), ("learned_fact", "Has a cat named Miso")], "s"
    )
    memory.knowledge.add("learned_fact", "has a cat named miso.", source="remember")
    assert memory.search_memory("miso")
    cat = next(f for f in memory.list_facts() if "Miso" in f.text)
    gone = memory.forget_fact(cat.id)
    assert gone is not None and gone.text == "Has a cat named Miso"
    for view in (memory, make_backend().for_session("telegram:1")):
        assert [f.text for f in view.list_facts()] == ["Drinks green tea"]
        assert "Miso" not in view.read_memory()
        assert view.search_memory("miso") == []
        assert view.knowledge.search("miso") == []
        assert [e.content for e in view.knowledge] == ["Drinks green tea"]
        assert "Miso" not in view.knowledge.export_for_context()


def test_forgetting_a_fact_that_does_not_exist_changes_nothing(backend: MemoryBackend) -> None:
    memory = backend.for_session("telegram:1")
    memory.record_consolidation([("user_preference", "Drinks green tea")], "s")
    before = (memory.read_memory(), memory.list_facts(), list(memory.knowledge))
    assert memory.forget_fact("deadbeef") is None
    assert memory.forget_fact("") is None
    assert (memory.read_memory(), memory.list_facts(), list(memory.knowledge)) == before


def test_one_scope_cannot_correct_or_forget_another_scopes_fact(backend: MemoryBackend) -> None:
    alice = backend.for_session("telegram:1")
    bob = backend.for_session("telegram:2")
    alice.record_consolidation([("learned_fact", "Alice's PIN hint is her cat")], "s")
    (secret,) = alice.list_facts()
    assert bob.list_facts() == []
    assert bob.forget_fact(secret.id) is None
    assert bob.correct_fact(secret.id, "nothing", by="telegram:2") is None
    assert backend.for_session("telegram:1").list_facts() == [secret]


def test_a_knowledge_entry_no_line_says_is_a_fact_too(backend: MemoryBackend) -> None:
    memory = backend.for_session("telegram:1")
    entry = memory.knowledge.add("user_preference", "Answers in French", source="remember")
    (fact,) = memory.list_facts()
    assert (fact.id, fact.kind, fact.text) == (entry.id[:8], "knowledge", "Answers in French")
    fixed = memory.correct_fact(fact.id, "Answers in German", by="operator")
    assert fixed is not None and fixed.id == fact.id
    (now,) = memory.list_facts()  # a line from now on, with the same id
    assert (now.id, now.kind, now.text) == (fact.id, "memory", "Answers in German")
    assert [e.content for e in memory.knowledge] == ["Answers in German"]
    assert memory.forget_fact(fact.id) is not None
    assert memory.list_facts() == [] and len(memory.knowledge) == 0
    other = memory.knowledge.add("learned_fact", "Only knowledge", source="remember")
    assert memory.forget_fact(other.id[:8]) is not None
    assert len(memory.knowledge) == 0
