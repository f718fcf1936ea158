"""Entry types: JSON round trip, the fixed key order, and clear parse errors."""

from __future__ import annotations

import json

import pytest

from gateway.llm import LLMMessage, TokenUsage, ToolCall
from gateway.sessions import (
    BranchEntry,
    CompactionEntry,
    CustomInfoEntry,
    CustomMessageEntry,
    Entry,
    EntryFormatError,
    LabelEntry,
    LeafEntry,
    MessageEntry,
    ModelChangeEntry,
    ParentSessionRef,
    SessionHeader,
    SessionInfoEntry,
    ThinkingLevelChangeEntry,
    UnsupportedVersionError,
    entry_from_dict,
)
from gateway.sessions.entries import ENTRY_TYPES, new_entry_id

BASE = {"id": "e1", "parent_id": "e0", "timestamp": 1700000000.25}

ALL: list[Entry] = [
    SessionHeader(
        id="s" * 32,
        parent_id=None,
        timestamp=1.0,
        key="telegram:1",
        parent_session=ParentSessionRef(key="k", session_id="p" * 32, entry_id="abc"),
        previous_session="q" * 32,
    ),
    SessionHeader(id="s" * 32, parent_id=None, timestamp=1.0, key="cli:default"),
    MessageEntry(**BASE, message=LLMMessage(role="user", content="hi")),
    MessageEntry(
        **BASE,
        message=LLMMessage(
            role="assistant",
            content=None,
            tool_calls=(ToolCall(id="c1", function_name="ls", arguments={"path": "."}),),
            usage=TokenUsage(1, 2, 3),
            model="m",
        ),
        meta={"cached": True},
    ),
    MessageEntry(
        **BASE, message=LLMMessage(role="tool", content="ok", tool_call_id="c1", name="ls")
    ),
    CompactionEntry(**BASE, summary="s", first_kept_entry_id="e0"),
    CompactionEntry(
        **BASE, summary="s", first_kept_entry_id=None, tokens_before=123, details={"a": [1]}
    ),
    BranchEntry(**BASE, from_id="e0", summary="left"),
    LeafEntry(**BASE, target_id="e0"),
    LeafEntry(**BASE, target_id=None),
    LabelEntry(**BASE, target_id="e0", label="checkpoint"),
    LabelEntry(**BASE, target_id="e0", label=None),
    ModelChangeEntry(**BASE, model="gpt-x"),
    ThinkingLevelChangeEntry(**BASE, thinking_level="high"),
    SessionInfoEntry(**BASE, name="Trip planning"),
    CustomInfoEntry(**BASE, custom_type="ext", data={"k": [1, "two", None]}),
    CustomMessageEntry(**BASE, custom_type="ext", content="note", display=False),
]


@pytest.mark.parametrize("entry", ALL, ids=lambda e: e.type)
def test_round_trip_through_json(entry: Entry) -> None:
    line = json.dumps(entry.to_dict(), ensure_ascii=False, separators=(",", ":"))
    assert entry_from_dict(json.loads(line)) == entry
    assert list(entry.to_dict())[:4] == ["id", "parent_id", "timestamp", "type"]


def test_every_type_is_covered() -> None:
    assert {e.type for e in ALL} == set(ENTRY_TYPES)
    assert len(ENTRY_TYPES) == 11


def test_entries_are_frozen() -> None:
    entry = ALL[2]
    with pytest.raises(AttributeError):
        entry.id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([], "JSON object"),
        ({**BASE, "type": "nope"}, "unknown entry type 'nope'"),
        ({**BASE}, "unknown entry type None"),
        ({"parent_id": None, "timestamp": 1, "type": "leaf", "target_id": "x"}, "'id'"),
        ({"id": "a", "timestamp": 1, "type": "leaf", "target_id": "x"}, "'parent_id'"),
        ({"id": "a", "parent_id": None, "type": "leaf", "target_id": "x"}, "'timestamp'"),
        ({**BASE, "timestamp": True, "type": "leaf", "target_id": "x"}, "'timestamp'"),
        ({**BASE, "type": "leaf"}, "missing field 'target_id'"),
        ({**BASE, "type": "message"}, "missing field 'message'"),
        ({**BASE, "type": "message", "message": {"role": "boss"}}, "unknown role"),
        ({**BASE, "type": "message", "message": {"role": "user"}, "meta": 3}, "'meta'"),
        ({**BASE, "type": "compaction", "summary": "s"}, "'first_kept_entry_id'"),
        ({**BASE, "type": "compaction", "summary": 1, "first_kept_entry_id": None}, "'summary'"),
        ({**BASE, "type": "label", "target_id": "x"}, "'label'"),
        ({**BASE, "type": "custom_message", "custom_type": "t", "content": "c"}, "'display'"),
        ({**BASE, "type": "custom_info", "custom_type": "t"}, "'data'"),
        ({**BASE, "type": "session_header", "key": "k", "version": 1}, "parent_id"),
        ({**BASE, "parent_id": None, "type": "session_header", "version": 1}, "'key'"),
    ],
)
def test_invalid_entries_say_what_is_wrong(data: object, match: str) -> None:
    with pytest.raises(EntryFormatError, match=match):
        entry_from_dict(data)


def test_newer_format_version_is_refused_not_misread() -> None:
    data = {**BASE, "parent_id": None, "type": "session_header", "key": "k", "version": 2}
    with pytest.raises(UnsupportedVersionError, match="upgrade"):
        entry_from_dict(data)


def test_unknown_extra_fields_are_ignored() -> None:
    data = {**BASE, "type": "model_change", "model": "m", "added_later": 1}
    assert entry_from_dict(data) == ModelChangeEntry(**BASE, model="m")


def test_entry_ids_are_short_hex() -> None:
    ids = {new_entry_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 12 and int(i, 16) >= 0 for i in ids)
