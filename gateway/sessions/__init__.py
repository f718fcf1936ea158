"""Conversation sessions: append-only JSONL trees per session key, with branching,
forking, compaction and a context rebuilt from the current branch.

The names are imported on first use: `gateway.sessions.keys` (which every session key
passes through) and `gateway.sessions.listing` (which `gateway sessions list` reads)
come without the entries, the stores and the manager.
"""

from typing import TYPE_CHECKING

from gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from gateway.sessions.context import SessionContext, choose_cut
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
        ParentSessionRef,
        SessionHeader,
        SessionInfoEntry,
        ThinkingLevelChangeEntry,
        entry_from_dict,
    )
    from gateway.sessions.errors import (
        EntryFormatError,
        EntryNotFoundError,
        SessionError,
        SessionExistsError,
        SessionKeyError,
        UnsupportedVersionError,
    )
    from gateway.sessions.hooks import CancelOperation, HookRegistry
    from gateway.sessions.keys import decode_key, encode_key, session_path
    from gateway.sessions.listing import ArchivedSessionInfo, SessionInfo
    from gateway.sessions.manager import (
        BeforeCompactEvent,
        BeforeForkEvent,
        CompactEvent,
        Session,
        SessionManager,
        TreeEvent,
    )
    from gateway.sessions.store import FsyncPolicy, GroupCommitter, LoadReport
    from gateway.sessions.tree import SessionTree, TreeNode

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "context": ("SessionContext", "choose_cut"),
        "entries": (
            "BranchEntry",
            "CompactionEntry",
            "CustomInfoEntry",
            "CustomMessageEntry",
            "Entry",
            "LabelEntry",
            "LeafEntry",
            "MessageEntry",
            "ModelChangeEntry",
            "ParentSessionRef",
            "SessionHeader",
            "SessionInfoEntry",
            "ThinkingLevelChangeEntry",
            "entry_from_dict",
        ),
        "errors": (
            "EntryFormatError",
            "EntryNotFoundError",
            "SessionError",
            "SessionExistsError",
            "SessionKeyError",
            "UnsupportedVersionError",
        ),
        "hooks": ("CancelOperation", "HookRegistry"),
        "keys": ("decode_key", "encode_key", "session_path"),
        "listing": ("ArchivedSessionInfo", "SessionInfo"),
        "manager": (
            "BeforeCompactEvent",
            "BeforeForkEvent",
            "CompactEvent",
            "Session",
            "SessionManager",
            "TreeEvent",
        ),
        "store": ("FsyncPolicy", "GroupCommitter", "LoadReport"),
        "tree": ("SessionTree", "TreeNode"),
    },
)

__all__ = [
    "ArchivedSessionInfo",
    "BeforeCompactEvent",
    "BeforeForkEvent",
    "BranchEntry",
    "CancelOperation",
    "CompactEvent",
    "CompactionEntry",
    "CustomInfoEntry",
    "CustomMessageEntry",
    "Entry",
    "EntryFormatError",
    "EntryNotFoundError",
    "FsyncPolicy",
    "GroupCommitter",
    "HookRegistry",
    "LabelEntry",
    "LeafEntry",
    "LoadReport",
    "MessageEntry",
    "ModelChangeEntry",
    "ParentSessionRef",
    "Session",
    "SessionContext",
    "SessionError",
    "SessionExistsError",
    "SessionHeader",
    "SessionInfo",
    "SessionInfoEntry",
    "SessionKeyError",
    "SessionManager",
    "SessionTree",
    "ThinkingLevelChangeEntry",
    "TreeEvent",
    "TreeNode",
    "UnsupportedVersionError",
    "choose_cut",
    "decode_key",
    "encode_key",
    "entry_from_dict",
    "session_path",
]
