"""The file mode's saved message index: a restarted scope starts from it, catches up with
what the sessions gained meanwhile, and never answers from a damaged, stale or foreign
file (it is rebuilt from the sessions, which stay the truth)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from loguru import logger

from gateway.llm import LLMMessage
from gateway.memory import MemoryStore
from gateway.memory import messages as messages_module
from gateway.memory.messages import MESSAGE_INDEX_FILE, SAVE_EVERY, FileMessageSource
from gateway.memory.scopes import scope_dir
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


def open_store(tmp_path: Path) -> MemoryStore:
    return MemoryStore(tmp_path / "workspace", sessions_dir=tmp_path / "sessions")


def saved_path(tmp_path: Path) -> Path:
    return scope_dir(tmp_path / "workspace", ALICE) / MESSAGE_INDEX_FILE


def user_texts(store: MemoryStore, query: str, limit: int = 10) -> list[str]:
    hits = store.for_session(ALICE).search_messages(query, limit)
    return [hit.text for hit in hits if hit.role == "user"]


def saved_scope(tmp_path: Path, sessions: SessionManager) -> None:
    """A scope with a few sessions (one archived by /new), searched and saved."""
    say(sessions, "my sister Ingrid moved to Tromsø")
    sessions.reset(ALICE)
    say(sessions, "the piano tuner comes on Tuesday")
    store = open_store(tmp_path)
    assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]
    store.close()
    assert saved_path(tmp_path).exists()


def test_a_restarted_scope_starts_from_the_saved_index_and_catches_up(
    tmp_path: Path, sessions: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_scope(tmp_path, sessions)
    say(sessions, "the kayak is red")  # while the gateway was down
    sessions.reset(ALICE)  # and /new
    say(sessions, "the kayak has a leak")
    reads: list[tuple[str, int]] = []
    real_read = FileMessageSource.read

    def counting_read(self: FileMessageSource, handle: str, start: int) -> object:
        reads.append((handle, start))
        return real_read(self, handle, start)

    monkeypatch.setattr(FileMessageSource, "read", counting_read)
    store = open_store(tmp_path)
    assert user_texts(store, "kayak") == ["the kayak has a leak", "the kayak is red"]
    assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]  # once
    assert user_texts(store, "piano") == ["the piano tuner comes on Tuesday"]
    # Only the session that grew (from where the saved index ended) and the new one
    # were read, not the archived session the saved index held whole.
    assert len(reads) == 2 and sorted(start > 0 for _, start in reads) == [False, True]
    store.close()


def test_a_session_deleted_while_down_is_gone_after_the_restart(
    tmp_path: Path, sessions: SessionManager
) -> None:
    saved_scope(tmp_path, sessions)
    assert sessions.delete(ALICE)  # the current session (the piano tuner's)
    say(sessions, "a brand new session about tulips")  # its file under the same name
    store = open_store(tmp_path)
    assert user_texts(store, "piano") == []
    assert user_texts(store, "tulips") == ["a brand new session about tulips"]
    assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_saved_index_is_reported_kept_and_rebuilt(
    tmp_path: Path, sessions: SessionManager, damage: str
) -> None:
    saved_scope(tmp_path, sessions)
    path = saved_path(tmp_path)
    data = path.read_bytes()
    if damage == "flip":  # inside the payload: only the checksum can tell
        at = len(data) - 40
        data = data[:at] + bytes([data[at] ^ 0x55]) + data[at + 1 :]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = b""
    path.write_bytes(data)
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING")
    try:
        store = open_store(tmp_path)
        assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]
        assert user_texts(store, "piano") == ["the piano tuner comes on Tuesday"]
    finally:
        logger.remove(sink)
    assert any("message index rebuilt" in w and "damaged" in w for w in warnings)
    assert path.with_name(path.name + ".damaged").read_bytes() == data
    store.close()


def test_a_saved_index_of_another_document_format_is_rebuilt_not_trusted(
    tmp_path: Path, sessions: SessionManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_scope(tmp_path, sessions)
    # A version that indexes messages another way reads this file: not its documents.
    monkeypatch.setattr(messages_module, "DOCUMENTS", "another")
    store = open_store(tmp_path)
    assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]
    path = saved_path(tmp_path)
    assert not path.with_name(path.name + ".damaged").exists()  # stale, not damaged
    store.close()  # saved again, in this format
    monkeypatch.setattr(messages_module, "DOCUMENTS", messages_module._documents_mark())
    store = open_store(tmp_path)
    assert user_texts(store, "piano") == ["the piano tuner comes on Tuesday"]
    store.close()


def test_a_forgotten_message_leaves_the_saved_file_too(
    tmp_path: Path, sessions: SessionManager
) -> None:
    secret = say(sessions, "my pin is zebracorn")
    say(sessions, "something else entirely")
    store = open_store(tmp_path)
    memory = store.for_session(ALICE)
    assert user_texts(store, "zebracorn") == ["my pin is zebracorn"]
    store.close()
    assert b"zebracorn" in saved_path(tmp_path).read_bytes()
    store = open_store(tmp_path)
    memory = store.for_session(ALICE)
    assert memory.messages is not None
    assert memory.messages.forget_entries([secret]) == 1
    assert b"zebracorn" not in saved_path(tmp_path).read_bytes()
    assert user_texts(store, "zebracorn") == []
    store.close()
    assert user_texts(open_store(tmp_path), "zebracorn") == []


def test_tombstones_written_while_the_index_was_not_saved_are_applied_at_load(
    tmp_path: Path, sessions: SessionManager
) -> None:
    """Another process (an operator's `gateway memory forget`, an older version) records
    a tombstone without rewriting the saved index: the next start takes it out."""
    secret = say(sessions, "the alarm code is 8812 plover")
    saved_scope(tmp_path, sessions)
    source = FileMessageSource(
        tmp_path / "sessions", scope_dir(tmp_path / "workspace", ALICE), lambda: [ALICE]
    )
    source.forget([secret])
    store = open_store(tmp_path)
    assert user_texts(store, "plover") == []
    assert user_texts(store, "Ingrid") == ["my sister Ingrid moved to Tromsø"]
    store.close()


def test_a_large_first_reading_is_saved_at_once_and_answers_the_same_after_a_restart(
    tmp_path: Path, sessions: SessionManager
) -> None:
    """The first reading of a scope past `SAVE_EVERY` messages is saved as soon as it
    is done (a crash after it does not cost a restart the whole reading again), and
    the loaded index ranks exactly as the one built in memory."""
    words = ["amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "heath"]
    session = sessions.get_or_create(ALICE)
    for i in range(SAVE_EVERY // 2 + 10):
        first, second = words[i % 8], words[(i * 3 + 1) % 8]
        session.add_message(LLMMessage("user", f"note {i} about {first} and {second}"))
        session.add_message(LLMMessage("assistant", f"reply {i} on {second}"))
        if i % 500 == 499:
            sessions.reset(ALICE)
            session = sessions.get_or_create(ALICE)
    session.flush()
    store = open_store(tmp_path)
    queries = ["amber birch", "cobalt", "fjord heath garnet", "note 1234", "reply ember"]
    built = [
        [
            (h.entry_id, h.score, h.before, h.after)
            for h in store.for_session(ALICE).search_messages(q, 8)
        ]
        for q in queries
    ]
    assert saved_path(tmp_path).exists()  # saved without a close
    store.close()
    store = open_store(tmp_path)
    loaded = [
        [
            (h.entry_id, h.score, h.before, h.after)
            for h in store.for_session(ALICE).search_messages(q, 8)
        ]
        for q in queries
    ]
    assert loaded == built
    store.close()
