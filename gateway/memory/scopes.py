"""Memory scopes: which folder holds whose memory.

A scope is a session key (the default: people never see each other's memory) or the
shared workspace scope `_workspace` (a single-owner assistant). Invariant: a scope's
folder is always a direct child of `<workspace>/memory/`, whatever bytes the scope
holds, and two different scopes never share a folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from gateway.messages import root_session_key
from gateway.sessions.keys import encode_key

ScopeMode = Literal["per_session", "workspace", "person"]
WORKSPACE_SCOPE = "_workspace"
MEMORY_DIRNAME = "memory"


def scope_dirname(scope: str) -> str:
    """The folder name of a scope: the session-key file-name encoding of its name.

    Raises `SessionKeyError` (a ValueError) for an empty or too long scope name.
    """
    name = encode_key(scope)
    if set(name) == {"."}:
        # "." and ".." encode to themselves (fine for session files, which get a
        # suffix) but cannot name a folder.
        name = name.replace(".", "%2E")
    return name


def scope_dir(workspace_path: Path, scope: str) -> Path:
    """`<workspace>/memory/<scope folder>`; raises if it would leave `memory/`."""
    root = workspace_path / MEMORY_DIRNAME
    path = root / scope_dirname(scope)
    if path.parent != root or path.name in ("", ".", ".."):
        raise ValueError(f"memory scope {scope!r} does not map to a folder inside {root}")
    return path


def scope_for_session(session_key: str, mode: ScopeMode) -> str:
    """The memory scope a session key reads and writes under `mode`; a subagent's
    session (`<parent>:sub:<id>`) shares the memory of the conversation it serves."""
    if mode == "workspace":
        return WORKSPACE_SCOPE
    if mode not in ("per_session", "person"):
        raise ValueError(
            f"unknown memory scope mode {mode!r}; use 'per_session', 'workspace' or 'person'"
        )
    if session_key == WORKSPACE_SCOPE:
        raise ValueError(
            f"session key {WORKSPACE_SCOPE!r} is reserved for the shared workspace memory"
        )
    return root_session_key(session_key)
