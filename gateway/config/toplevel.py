"""The keys outside any section: the workspace, how its I/O runs, the event loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from gateway.config.section import Section


class TopLevelSettings(Section):
    """The top level of gateway.toml without its sections (`Settings` adds them)."""

    # The default is a string, validated into a Path like one read from gateway.toml
    # (strict validation of defaults takes no Path object).
    workspace: Path = Field(  # type: ignore[assignment]
        "~/.gateway", description="Folder for sessions, memory and cache."
    )
    workspace_io: Literal["loop", "threads"] = Field(
        "loop",
        description="loop: a turn's small file and SQLite work runs on the event loop "
        "when it cannot wait (local disks); threads: all of it in worker threads "
        "(network file systems, where even a small write can stall).",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="The event loop of `gateway run`. auto: uvloop where it is installed "
        "(a dependency on Linux and macOS; less CPU per turn), else asyncio's own; "
        "uvloop: refuse to start without it; asyncio: always asyncio's own.",
    )

    @field_validator("event_loop")
    @classmethod
    def _uvloop_installed(cls, value: str) -> str:
        if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("'uvloop' is not installed here (pip install uvloop), or set 'auto'")
        return value

    @property
    def use_uvloop(self) -> bool:
        """Whether `gateway run` runs on uvloop (`event_loop`)."""
        if self.event_loop == "asyncio":
            return False
        return importlib.util.find_spec("uvloop") is not None

    @property
    def io_on_loop(self) -> bool:
        """`workspace_io == "loop"`: what the stores take as `io_on_loop`."""
        return self.workspace_io == "loop"

    @property
    def workspace_path(self) -> Path:
        return self.workspace.expanduser()

    @property
    def sessions_dir(self) -> Path:
        return self.workspace_path / "sessions"
