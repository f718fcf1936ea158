"""Conversation sessions: append-only JSONL trees per session key, with branching,
forking, compaction and a context rebuilt from the current branch."""

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
from gateway.sessions.hooks import (
    BeforeCompactEvent,
    BeforeForkEvent,
    CancelOperation,
    CompactEvent,
    HookRegistry,
    TreeEvent,
)
from gateway.sessions.keys import decode_key, encode_key, session_path
from gateway.sessions.manager import ArchivedSessionInfo, Session, SessionInfo, SessionManager
from gateway.sessions.store import FsyncPolicy, GroupCommitter, LoadReport
from gateway.sessions.tree import SessionTree, TreeNode

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
