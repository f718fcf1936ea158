"""The session tree: branches, labels, compaction and the context rebuilt from them."""

from __future__ import annotations

import tempfile
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.llm import LLMMessage, ToolCall
from gateway.sessions import (
    BranchEntry,
    CompactionEntry,
    CustomMessageEntry,
    Entry,
    EntryNotFoundError,
    LeafEntry,
    MessageEntry,
    ModelChangeEntry,
    Session,
    SessionContext,
    SessionManager,
    ThinkingLevelChangeEntry,
    choose_cut,
)
from gateway.sessions.context import BRANCH_SUMMARY_PREFIX


def user(text: str) -> LLMMessage:
    return LLMMessage(role="user", content=text)


def bot(text: str) -> LLMMessage:
    return LLMMessage(role="assistant", content=text)


def calls(*ids: str) -> LLMMessage:
    return LLMMessage(
        role="assistant", tool_calls=tuple(ToolCall(id=i, function_name="f") for i in ids)
    )


def result(call_id: str) -> LLMMessage:
    return LLMMessage(role="tool", content="r", tool_call_id=call_id, name="f")


def texts(session: Session) -> list[str | None]:
    return [m.content for m in session.messages]


@pytest.fixture
def manager(tmp_path: Path) -> SessionManager:
    return SessionManager(tmp_path / "sessions", fsync="never")


def reopen(manager: SessionManager, key: str) -> Session:
    assert manager.sessions_dir is not None
    fresh = SessionManager(manager.sessions_dir, fsync="never").get(key)
    assert fresh is not None
    return fresh


# -- context rebuild ----------------------------------------------------------------


def test_context_without_compaction_is_every_message(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    ids = [s.add_message(user("a")).id, s.add_message(bot("b")).id]
    s.append_custom_info("ext", {"x": 1})  # metadata: not for the model
    ids.append(s.append_custom_message("ext", "note").id)
    ctx = s.build_context()
    assert [m.content for m in ctx.messages] == ["a", "b", "note"]
    assert list(ctx.entry_ids) == ids
    assert ctx.summary is None and ctx.model is None and ctx.thinking_level is None
    assert s.context() == ctx


def test_latest_model_and_thinking_level_win(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    s.append_model_change("m1")
    s.append_thinking_level_change("low")
    s.add_message(user("a"))
    s.append_model_change("m2")
    ctx = s.build_context()
    assert (ctx.model, ctx.thinking_level) == ("m2", "low")
    assert reopen(manager, "k").build_context() == ctx


def test_compaction_keeps_tail_and_everything_after(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    ids = [s.add_message(user(str(i))).id for i in range(5)]
    entry = s.compact("summary of 0-2", ids[3], tokens_before=500, details={"n": 3})
    assert isinstance(entry, CompactionEntry)
    s.add_message(user("5"))
    assert texts(s) == ["3", "4", "5"]
    assert s.summary == "summary of 0-2"
    # A later compaction wins, and may reach back into the previous kept tail.
    s.compact("second", ids[4])
    assert texts(s) == ["4", "5"] and s.summary == "second"
    s.compact("keep nothing", None)
    s.add_message(user("6"))
    assert texts(s) == ["6"]
    # Summaries replace nothing on disk.
    assert [e.message.content for e in s.entries if isinstance(e, MessageEntry)] == [
        *map(str, range(7))
    ]
    assert reopen(manager, "k").build_context() == s.build_context()


def test_branch_moves_leaf_and_survives_restart(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    s.add_message(bot("b1"))
    leaf = s.branch(a.id)
    assert isinstance(leaf, LeafEntry) and s.leaf_id == a.id
    b2 = s.add_message(bot("b2"))
    assert b2.parent_id == a.id
    assert texts(s) == ["a", "b2"]
    assert [e.id for e in s.get_branch()] == [a.id, b2.id]
    assert [c.id for c in s.children(a.id) if isinstance(c, MessageEntry)] != []
    again = reopen(manager, "k")
    assert again.leaf_id == b2.id and texts(again) == ["a", "b2"]
    # The abandoned branch is still there.
    assert [m.message.content for m in again.entries if isinstance(m, MessageEntry)] == [
        "a",
        "b1",
        "b2",
    ]


def test_branch_right_after_navigation_persists_the_leaf(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    s.add_message(bot("b"))
    s.branch(a.id)
    assert reopen(manager, "k").leaf_id == a.id
    s.branch(None)
    assert s.messages == [] and reopen(manager, "k").leaf_id is None
    first = s.add_message(user("new start"))
    assert first.parent_id is None


def test_branch_with_summary_shows_summary_to_model(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    s.add_message(bot("long detour"))
    entry = s.branch_with_summary(a.id, "tried X, failed")
    assert isinstance(entry, BranchEntry) and entry.parent_id == a.id
    assert s.leaf_id == entry.id
    s.add_message(user("c"))
    ctx = s.build_context()
    assert [m.content for m in ctx.messages] == [
        "a",
        BRANCH_SUMMARY_PREFIX + "tried X, failed",
        "c",
    ]
    assert ctx.entry_ids[1] == entry.id


def test_unknown_entry_ids_are_refused(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    s.add_message(user("a"))
    for call in (
        lambda: s.branch("nope"),
        lambda: s.branch_with_summary("nope", "x"),
        lambda: s.label("nope", "x"),
        lambda: s.compact("x", "nope"),
        lambda: s.get_branch("nope"),
    ):
        with pytest.raises(EntryNotFoundError, match="nope"):
            call()
    assert len(s.entries) == 1  # nothing was appended


def test_labels_and_name(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    s.label(a.id, "start")
    s.set_name("Trip")
    assert s.labels == {a.id: "start"} and s.name == "Trip"
    again = reopen(manager, "k")
    assert again.labels == {a.id: "start"} and again.name == "Trip"
    s.label(a.id, None)
    assert s.labels == {}
    assert reopen(manager, "k").labels == {}
    assert texts(s) == ["a"]  # labels and names are not messages


def test_get_tree_nests_children_without_recursion_limits(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    b = s.add_message(bot("b"))
    s.branch(a.id)
    c = s.add_message(bot("c"))
    s.label(c.id, "alt")
    (root,) = s.get_tree()
    assert root.entry.id == a.id
    kids = [n.entry.id for n in root.children]
    assert b.id in kids and c.id in kids
    alt = next(n for n in root.children if n.entry.id == c.id)
    assert alt.label == "alt"

    long = manager.get_or_create("long")
    for i in range(3000):
        long.add_message(user(str(i)))
    (node,) = reopen(manager, "long").get_tree()
    depth = 1
    while node.children:
        (node,) = node.children
        depth += 1
    assert depth == 3000


# -- choose_cut / prune_to_window ---------------------------------------------------


def test_choose_cut_basic() -> None:
    msgs = [user("1"), bot("2"), user("3"), bot("4")]
    assert choose_cut(msgs, 2) == 2
    assert choose_cut(msgs, 10) == 0
    assert choose_cut(msgs, 0) == 4
    assert choose_cut([], 3) == 0
    with pytest.raises(ValueError):
        choose_cut(msgs, -1)


def test_choose_cut_never_splits_tool_calls() -> None:
    msgs = [user("q"), calls("c1", "c2"), result("c1"), result("c2"), bot("done")]
    # Keeping 2 would start at result("c2"): move back to the assistant's call.
    assert choose_cut(msgs, 2) == 1
    assert choose_cut(msgs, 3) == 1
    assert choose_cut(msgs, 1) == 4


@given(
    st.lists(st.sampled_from(["user", "assistant", "calls", "tool"]), max_size=30),
    st.integers(min_value=0, max_value=35),
)
def test_choose_cut_property(kinds: list[str], keep: int) -> None:
    msgs = []
    for kind in kinds:
        if kind == "calls":
            msgs.append(calls("c"))
        elif kind == "tool":
            msgs.append(result("c"))
        else:
            msgs.append(LLMMessage(role=kind, content="x"))  # type: ignore[arg-type]
    cut = choose_cut(msgs, keep)
    assert 0 <= cut <= len(msgs)
    assert len(msgs) - cut >= min(keep, len(msgs))  # never keeps fewer
    if 0 < cut < len(msgs):
        assert msgs[cut].role != "tool"


def test_prune_to_window_compacts_without_deleting(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    s.add_message(user("q1"))
    s.add_message(bot("a1"))
    s.add_message(user("q2"))
    s.add_message(calls("c1"))
    s.add_message(result("c1"))
    s.add_message(bot("a2"))
    s.summary = "earlier"
    assert s.summary == "earlier" and s.message_count == 6
    size_before = s.path.stat().st_size  # type: ignore[union-attr]
    pruned = s.prune_to_window(2)  # would start at the tool result: cut moves back
    assert pruned == 3
    assert [m.role for m in s.messages] == ["assistant", "tool", "assistant"]
    assert s.messages[0].tool_calls
    assert s.summary == "earlier"  # carried forward
    assert s.path.stat().st_size > size_before  # type: ignore[union-attr]
    assert sum(isinstance(e, MessageEntry) for e in s.entries) == 6
    assert s.prune_to_window(10) == 0


def test_seed_window_helpers(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    for i in range(5):
        s.add_message(user(str(i)))
    assert [m.content for m in s.get_recent(2)] == ["3", "4"]
    assert [m.content for m in s.get_old_messages(2)] == ["0", "1", "2"]
    assert s.get_recent(0) == [] and len(s.get_old_messages(0)) == 5
    assert s.get_old_messages(9) == [] and len(s.get_recent(9)) == 5
    assert s.updated_at >= s.created_at


def test_context_cache_follows_appends_and_navigation(manager: SessionManager) -> None:
    s = manager.get_or_create("k")
    a = s.add_message(user("a"))
    assert texts(s) == ["a"]
    s.add_message(bot("b"))
    s.label(a.id, "x")
    s.add_message(user("c"))
    assert texts(s) == ["a", "b", "c"]
    s.branch(a.id)
    assert texts(s) == ["a"]
    s.append_model_change("m")
    s.add_message(bot("d"))
    assert texts(s) == ["a", "d"] and s.build_context().model == "m"


# -- property: random operation sequences -------------------------------------------

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "user",
                "assistant",
                "branch",
                "branch_root",
                "label",
                "unlabel",
                "compact",
                "model",
                "thinking",
                "branch_summary",
                "name",
                "custom",
            ]
        ),
        st.integers(min_value=0, max_value=10_000),
    ),
    min_size=1,
    max_size=40,
)


def reference_context(branch: list[Entry]) -> SessionContext:
    """A direct transcription of the spec, to check the optimised tree against."""
    model = thinking = None
    compaction_at = -1
    for i, e in enumerate(branch):
        if isinstance(e, ModelChangeEntry):
            model = e.model
        elif isinstance(e, ThinkingLevelChangeEntry):
            thinking = e.thinking_level
        elif isinstance(e, CompactionEntry):
            compaction_at = i
    summary = None
    chosen = branch
    if compaction_at >= 0:
        comp = branch[compaction_at]
        assert isinstance(comp, CompactionEntry)
        summary = comp.summary or None
        head = [e.id for e in branch[:compaction_at]]
        start = (
            head.index(comp.first_kept_entry_id)
            if comp.first_kept_entry_id in head
            else compaction_at
        )
        chosen = branch[start:compaction_at] + branch[compaction_at + 1 :]
    msgs, ids = [], []
    for e in chosen:
        if isinstance(e, MessageEntry):
            msgs.append(e.message)
        elif isinstance(e, BranchEntry):
            msgs.append(user(BRANCH_SUMMARY_PREFIX + e.summary))
        elif isinstance(e, CustomMessageEntry):
            msgs.append(user(e.content))
        else:
            continue
        ids.append(e.id)
    return SessionContext(tuple(msgs), tuple(ids), summary, model, thinking)


def apply(s: Session, op: str, n: int) -> None:
    ids = [e.id for e in s.entries]
    pick = ids[n % len(ids)] if ids else None
    if op in ("user", "assistant"):
        s.add_message(LLMMessage(role=op, content=f"{op} {n}"))  # type: ignore[arg-type]
    elif op == "branch" and pick:
        s.branch(pick)
    elif op == "branch_root":
        s.branch(None)
    elif op == "label" and pick:
        s.label(pick, f"L{n}")
    elif op == "unlabel" and pick:
        s.label(pick, None)
    elif op == "compact":
        ctx_ids = s.build_context().entry_ids
        s.compact(f"S{n}", ctx_ids[n % len(ctx_ids)] if ctx_ids else None)
    elif op == "model":
        s.append_model_change(f"m{n}")
    elif op == "thinking":
        s.append_thinking_level_change(f"t{n}")
    elif op == "branch_summary" and pick:
        s.branch_with_summary(pick, f"B{n}")
    elif op == "name":
        s.set_name(f"N{n}")
    elif op == "custom":
        s.append_custom_message("ext", f"C{n}", display=n % 2 == 0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_tree_invariants_under_random_operations(ops: list[tuple[str, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        manager = SessionManager(Path(tmp), fsync="never")
        s = manager.get_or_create("prop:key")
        before = b""
        for op, n in ops:
            apply(s, op, n)
            data = s.path.read_bytes() if s.path and s.path.exists() else b""
            assert data.startswith(before), "earlier bytes of the file changed"
            before = data

        entries = s.entries
        by_id = {e.id: e for e in entries}
        assert len(by_id) == len(entries)
        for e in entries:  # every parent exists
            assert e.parent_id is None or e.parent_id in by_id
        branch = s.get_branch()
        if branch:  # a root-to-leaf chain by parent_id
            assert branch[0].parent_id is None
            assert branch[-1].id == s.leaf_id
            for parent, child in pairwise(branch):
                assert child.parent_id == parent.id
        else:
            assert s.leaf_id is None
        assert s.build_context() == reference_context(branch)

        again = SessionManager(Path(tmp), fsync="never").get("prop:key")
        if s.path is None or not s.path.exists():
            assert again is None
            return
        assert again is not None
        assert again.entries == entries
        assert again.leaf_id == s.leaf_id
        assert again.build_context() == s.build_context()
        assert again.labels == s.labels and again.name == s.name
        assert again.load_report.clean


def test_lines_indexed_in_bulk_keep_the_first_of_a_repeated_id() -> None:
    """A repeated id is a bad line wherever it repeats (within a run of message lines or
    after another entry); the first line with the id is the entry, the leaf the last good
    line, exactly as when every line was indexed one by one."""
    from gateway.sessions.store import encode_line
    from gateway.sessions.tree import SessionTree

    def message(eid: str, parent: str | None, text: str) -> str:
        entry = MessageEntry(id=eid, parent_id=parent, timestamp=1.0, message=user(text))
        return encode_line(entry).rstrip("\n")

    model = encode_line(ModelChangeEntry(id="m1", parent_id="b", timestamp=1.0, model="x"))
    lines = [
        message("a", None, "one"),
        message("b", "a", "two"),
        message("a", "b", "again"),  # line 4: repeats a within the run
        model.rstrip("\n"),
        "",
        message("c", "m1", "three"),
        message("b", "c", "twice"),  # line 8: repeats b after the model change
        message("d", "c", "four"),
    ]
    tree = SessionTree("k")
    assert tree.ingest_lines(lines, 2) == [4, 8]
    assert tree.leaf_id == "d"
    assert [e.id for e in tree.get_branch()] == ["a", "b", "m1", "c", "d"]
    first = tree.get_entry("a")
    assert isinstance(first, MessageEntry) and first.message.content == "one"
    assert [m.content for m in tree.build_context().messages] == ["one", "two", "three", "four"]
    assert tree.build_context().model == "x"
