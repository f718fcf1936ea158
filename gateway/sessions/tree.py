"""The in-memory session tree: entries indexed by id, the leaf, labels, and context rebuild.

Pure data structure: no I/O and no locking (the owning store holds its lock around every
call). Loading is the hot path, so message lines written by this package are indexed
from a cheap prefix match and decoded only when first needed (context, branch, entries);
all other lines are decoded and validated at once. A load from the sidecar index
(`gateway.sessions.index`) does not even cut message lines out of the file's bytes
until one is needed (`ingest_index`). A lazily decoded line that turns out
damaged is logged and reported (`damaged`) and left out of branches and contexts, while
the entries after it stay connected (its id and parent were readable).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.llm import LLMMessage
from gateway.logs import logger
from gateway.sessions.context import SessionContext, branch_summary_message, custom_message
from gateway.sessions.entries import (
    BranchEntry,
    CompactionEntry,
    CustomInfoEntry,
    CustomMessageEntry,
    Entry,
    LabelEntry,
    LeafEntry,
    MessageEntry,
    ModelChangeEntry,
    SessionHeader,
    SessionInfoEntry,
    ThinkingLevelChangeEntry,
    entry_from_dict,
)
from gateway.sessions.errors import EntryFormatError, SessionError

# The exact prefix `MessageEntry.to_dict` produces (compact separators, fixed key order).
_FAST_MESSAGE = re.compile(
    r'\{"id":"([^"\\]+)","parent_id":(?:null|"([^"\\]+)"),"timestamp":[-+.0-9eE]+,'
    r'"type":"message",'
)
# Entries that leave the model's context unchanged when appended at the leaf.
_CONTEXT_NEUTRAL = (LabelEntry, SessionInfoEntry)


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One entry of `SessionTree.get_tree` with its children (file order) and label."""

    entry: Entry
    children: tuple[TreeNode, ...]
    label: str | None = None


class SessionTree:
    """Entries of one session, by id, with parent links, children, leaf and labels."""

    __slots__ = (
        "_blob",
        "_children",
        "_context",
        "_context_leaf",
        "_context_tail",
        "_entries",
        "_info",
        "_lazy",
        "_name",
        "_order",
        "_parent",
        "_raw",
        "damaged",
        "key",
        "labels",
        "leaf_id",
        "source",
    )

    def __init__(self, key: str = "", source: str = "<memory>") -> None:
        self.key = key
        self.source = source
        self._order: list[str] = []
        self._parent: dict[str, str | None] = {}
        self._entries: dict[str, Entry] = {}
        self._raw: dict[str, str] = {}  # message lines not decoded yet
        # Message lines not even cut out yet (a load from an index): where each starts
        # in `_blob`, the file's bytes.
        self._lazy: dict[str, int] = {}
        self._blob = b""
        self._children: dict[str | None, list[str]] | None = None  # built on demand
        # The context of the branch ending at `_context_leaf`: `_context` plus the
        # messages appended at the leaf since (`_context_tail`), so a turn costs O(1).
        self._context: SessionContext | None = None
        self._context_leaf: str | None = None
        self._context_tail: list[tuple[str, LLMMessage]] = []
        self._name: str | None = None
        self._info: dict[str, Any] = {}  # the latest custom_info data of each type
        self.damaged: dict[str, str] = {}  # entry id -> why its line could not be read
        self.leaf_id: str | None = None
        self.labels: dict[str, str] = {}

    # -- building -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._parent

    def ingest_lines(self, lines: Iterable[str], first_lineno: int) -> list[int]:
        """Index complete lines read from a file; return the line numbers that were bad.

        Blank lines are skipped silently; a line that is not a valid entry, a second
        header, or a duplicate id is counted as bad and skipped.
        """
        bad: list[int] = []
        match = _FAST_MESSAGE.match
        parent = self._parent
        raw = self._raw
        order = self._order
        loads = json.loads
        leaf = self.leaf_id
        lineno = first_lineno - 1
        for line in lines:
            lineno += 1
            m = match(line)
            if m is not None:
                eid = m[1]
                if eid in parent:
                    bad.append(lineno)
                    continue
                parent[eid] = m[2]
                raw[eid] = line
                order.append(eid)
                leaf = eid
                continue
            if not line or line.isspace():
                continue
            try:
                entry = entry_from_dict(loads(line))
            except (ValueError, SessionError):
                bad.append(lineno)
                continue
            if isinstance(entry, SessionHeader) or entry.id in parent:
                bad.append(lineno)
                continue
            self.leaf_id = leaf
            self._add(entry)
            leaf = self.leaf_id
        self.leaf_id = leaf
        self._children = None
        self._context = None
        return bad

    def ingest_index(
        self,
        ids: list[str],
        parents: list[str | None],
        lazy: dict[str, int],
        blob: bytes,
        decoded: list[Entry],
    ) -> None:
        """Take a whole file's entries from its index (`gateway.sessions.index`) into an
        empty tree: ``ids`` in file order with their ``parents``, the message lines
        ``lazy`` (id: offset in ``blob``) and every other entry ``decoded`` (file order).
        Raises `SessionError` when they do not fit together (nothing is kept then)."""
        if self._order:
            raise SessionError("an index is only taken by an empty tree")
        parent = dict(zip(ids, parents, strict=True))
        if len(parent) != len(ids) or len(lazy) + len(decoded) != len(ids):
            raise SessionError("the index repeats an id")
        for entry in decoded:
            if entry.id not in parent or entry.id in lazy or parent[entry.id] != entry.parent_id:
                raise SessionError(f"entry {entry.id!r} differs from the index")
        self._parent = parent
        self._order = ids
        self._lazy = lazy
        self._blob = blob
        for entry in decoded:  # the side effects of `_add` (labels, name, info)
            self._entries[entry.id] = entry
            self._apply_info(entry)
        last = self._entries.get(ids[-1]) if ids else None
        self.leaf_id = last.target_id if isinstance(last, LeafEntry) else (ids[-1] if ids else None)
        self._children = None
        self._context = None

    def index_rows(self) -> tuple[list[str], dict[str, str | None], set[str]]:
        """What an index of this tree holds: ids in file order, their parents, and the
        ids of plain message entries (decoded lazily: they change nothing at load)."""
        plain = {eid for eid, e in self._entries.items() if isinstance(e, MessageEntry)}
        plain.update(self._raw, self._lazy, self.damaged)
        return self._order, self._parent, plain

    def _undecoded(self, entry_id: str) -> bool:
        return entry_id in self._raw or entry_id in self._lazy

    def _line(self, entry_id: str) -> str:
        """The undecoded line of ``entry_id`` (`KeyError`; `UnicodeDecodeError`)."""
        line = self._raw.get(entry_id)
        if line is not None:
            return line
        blob = self._blob
        start = self._lazy[entry_id]
        end = blob.find(b"\n", start)
        return blob[start : end if end >= 0 else len(blob)].decode("utf-8")

    def _forget_line(self, entry_id: str) -> None:
        if (
            self._raw.pop(entry_id, None) is None
            and self._lazy.pop(entry_id, None) is not None
            and not self._lazy
        ):
            self._blob = b""  # every line decoded: the file's bytes can go

    def add(self, entry: Entry) -> None:
        """Apply one new entry (appended by us, or read as a complete unterminated line)."""
        if isinstance(entry, SessionHeader):
            raise SessionError("a session header cannot be added to the tree")
        if entry.id in self._parent:
            raise SessionError(f"entry id {entry.id!r} already exists in this session")
        old_leaf = self.leaf_id
        self._add(entry)
        if self._context is None:
            return
        if self._context_leaf != old_leaf or entry.parent_id != old_leaf:
            self._context = None
        elif isinstance(entry, MessageEntry):
            # The common turn: remember the message instead of rebuilding the context.
            self._context_tail.append((entry.id, entry.message))
            self._context_leaf = entry.id
        elif isinstance(entry, _CONTEXT_NEUTRAL):
            self._context_leaf = self.leaf_id
        else:
            self._context = None

    def _add(self, entry: Entry) -> None:
        eid = entry.id
        self._parent[eid] = entry.parent_id
        self._entries[eid] = entry
        self._order.append(eid)
        if self._children is not None:
            self._children.setdefault(entry.parent_id, []).append(eid)
        if isinstance(entry, LeafEntry):
            self.leaf_id = entry.target_id
            return
        self.leaf_id = eid
        self._apply_info(entry)

    def _apply_info(self, entry: Entry) -> None:
        """What a label, session-info or custom-info entry changes (loaded or added)."""
        if isinstance(entry, LabelEntry):
            if entry.label is None:
                self.labels.pop(entry.target_id, None)
            else:
                self.labels[entry.target_id] = entry.label
        elif isinstance(entry, SessionInfoEntry):
            self._name = entry.name
        elif isinstance(entry, CustomInfoEntry):
            self._info[entry.custom_type] = entry.data

    # -- reading --------------------------------------------------------------------

    @property
    def name(self) -> str | None:
        return self._name

    def custom_info(self, custom_type: str) -> Any:
        """The data of the latest `custom_info` entry of `custom_type` in the file, on
        any branch (None: there is none)."""
        return self._info.get(custom_type)

    def get_entry(self, entry_id: str) -> Entry | None:
        """The entry with this id, decoding it if needed (None if unknown or damaged)."""
        entry = self._entries.get(entry_id)
        if entry is not None:
            return entry
        if not self._undecoded(entry_id):
            return None
        try:
            try:
                line = self._line(entry_id)
            finally:
                self._forget_line(entry_id)
            entry = entry_from_dict(json.loads(line))
            if not isinstance(entry, MessageEntry):
                raise EntryFormatError("line does not hold a message entry")
            if entry.id != entry_id or entry.parent_id != self._parent[entry_id]:
                raise EntryFormatError("id or parent_id differs from the line prefix")
        except (ValueError, SessionError) as exc:
            self.damaged[entry_id] = str(exc)
            logger.bind(session_key=self.key).warning(
                "session file {}: entry {} is damaged and is left out ({})",
                self.source,
                entry_id,
                exc,
            )
            return None
        self._entries[entry_id] = entry
        return entry

    def is_usable(self, entry_id: str | None) -> bool:
        """True if ``entry_id`` names an entry that exists and is not damaged."""
        return entry_id is not None and self.get_entry(entry_id) is not None

    def entries(self) -> list[Entry]:
        """All readable entries in file order (decodes every lazily loaded line)."""
        out: list[Entry] = []
        for eid in self._order:
            entry = self.get_entry(eid)
            if entry is not None:
                out.append(entry)
        return out

    def last_entry(self) -> Entry | None:
        for eid in reversed(self._order):
            entry = self.get_entry(eid)
            if entry is not None:
                return entry
        return None

    def path_ids(self, from_id: str | None = None) -> list[str]:
        """Ids from the root to ``from_id`` (default: the leaf) following ``parent_id``.

        Stops at a parent that does not exist; a cycle (only possible in a hand-edited
        file) is cut after as many steps as there are entries.
        """
        ids: list[str] = []
        parent = self._parent
        cursor = self.leaf_id if from_id is None else from_id
        budget = len(parent)
        while cursor is not None and cursor in parent and budget >= 0:
            ids.append(cursor)
            cursor = parent[cursor]
            budget -= 1
        ids.reverse()
        return ids

    def get_branch(self, from_id: str | None = None) -> list[Entry]:
        """Entries from the root to ``from_id`` (default: the leaf), damaged ones left out."""
        out: list[Entry] = []
        for eid in self.path_ids(from_id):
            entry = self.get_entry(eid)
            if entry is not None:
                out.append(entry)
        return out

    def _children_index(self) -> dict[str | None, list[str]]:
        if self._children is None:
            index: dict[str | None, list[str]] = {}
            for eid in self._order:
                index.setdefault(self._parent[eid], []).append(eid)
            self._children = index
        return self._children

    def children(self, entry_id: str | None) -> list[Entry]:
        """Direct children of ``entry_id`` in file order (None: the roots)."""
        out: list[Entry] = []
        for eid in self._children_index().get(entry_id, ()):
            entry = self.get_entry(eid)
            if entry is not None:
                out.append(entry)
        return out

    def get_tree(self) -> list[TreeNode]:
        """The whole tree as nested nodes in file order, built without recursion.

        Roots are entries without a readable parent (the first entry, orphans of a
        damaged or missing line). Decodes every lazily loaded line.
        """
        self.entries()  # decode everything so damaged lines are known
        index = self._children_index()
        known = self._parent
        damaged = self.damaged
        roots = [
            eid
            for eid in self._order
            if eid not in damaged
            and (known[eid] is None or known[eid] not in known or known[eid] in damaged)
        ]
        preorder: list[str] = []
        stack = list(reversed(roots))
        while stack:
            eid = stack.pop()
            preorder.append(eid)
            stack.extend(c for c in reversed(index.get(eid, ())) if c not in damaged)
        nodes: dict[str, TreeNode] = {}
        for eid in reversed(preorder):  # children before their parent
            kids = tuple(nodes[c] for c in index.get(eid, ()) if c in nodes)
            nodes[eid] = TreeNode(
                entry=self._entries[eid], children=kids, label=self.labels.get(eid)
            )
        return [nodes[r] for r in roots]

    # -- context --------------------------------------------------------------------

    def build_context(self) -> SessionContext:
        """The model's context for the current branch (see `SessionContext`).

        Walk root→leaf; the latest model/thinking-level change wins; with no compaction
        every message is kept, otherwise the latest compaction's summary plus messages
        from its ``first_kept_entry_id`` up to it and every message after it.
        """
        context = self._context
        if context is not None and self._context_leaf == self.leaf_id:
            if self._context_tail:
                tail_ids, tail_messages = zip(*self._context_tail, strict=True)
                context = self._context = SessionContext(
                    messages=context.messages + tail_messages,
                    entry_ids=context.entry_ids + tail_ids,
                    summary=context.summary,
                    model=context.model,
                    thinking_level=context.thinking_level,
                )
                self._context_tail.clear()
            return context
        ids = self.path_ids()
        model: str | None = None
        thinking: str | None = None
        compaction: CompactionEntry | None = None
        compaction_at = -1
        raw = self._raw
        lazy = self._lazy
        entries = self._entries
        for i, eid in enumerate(ids):
            if eid in raw or eid in lazy:
                continue  # an undecoded message line: nothing to learn here
            entry = entries.get(eid)
            if isinstance(entry, CompactionEntry):
                compaction, compaction_at = entry, i
            elif isinstance(entry, ModelChangeEntry):
                model = entry.model
            elif isinstance(entry, ThinkingLevelChangeEntry):
                thinking = entry.thinking_level
        if compaction is None:
            selected: Iterable[str] = ids
        else:
            kept = compaction.first_kept_entry_id
            head = ids[:compaction_at]
            start = head.index(kept) if kept is not None and kept in head else len(head)
            selected = [*head[start:], *ids[compaction_at + 1 :]]
        self._decode_many([eid for eid in selected if eid in raw or eid in lazy])
        messages: list[LLMMessage] = []
        entry_ids: list[str] = []
        for eid, message in self._messages_of(selected):
            messages.append(message)
            entry_ids.append(eid)
        context = SessionContext(
            messages=tuple(messages),
            entry_ids=tuple(entry_ids),
            summary=(compaction.summary or None) if compaction is not None else None,
            model=model,
            thinking_level=thinking,
        )
        self._context = context
        self._context_leaf = self.leaf_id
        self._context_tail.clear()
        return context

    def _decode_many(self, ids: list[str]) -> None:
        """Decode many lazily loaded message lines with one ``json.loads`` (about twice
        as fast as one call per line); anything unexpected falls back to `get_entry`."""
        if len(ids) < 16:
            return
        line = self._line
        try:
            decoded = json.loads("[" + ",".join([line(eid) for eid in ids]) + "]")
        except ValueError:
            return  # a damaged line among them: decode one by one
        if not isinstance(decoded, list) or len(decoded) != len(ids):
            return
        parent = self._parent
        entries = self._entries
        for eid, data in zip(ids, decoded, strict=True):
            if (
                type(data) is not dict
                or data.get("id") != eid
                or data.get("type") != "message"
                or data.get("parent_id") != parent[eid]
            ):
                continue
            try:
                entry = MessageEntry.from_dict(data)
            except SessionError:
                continue
            entries[eid] = entry
            self._forget_line(eid)

    def _messages_of(self, ids: Iterable[str]) -> Iterator[tuple[str, LLMMessage]]:
        for eid in ids:
            entry = self.get_entry(eid) if self._undecoded(eid) else self._entries.get(eid)
            if isinstance(entry, MessageEntry):
                yield eid, entry.message
            elif isinstance(entry, BranchEntry):
                yield eid, branch_summary_message(entry)
            elif isinstance(entry, CustomMessageEntry):
                yield eid, custom_message(entry)
