"""The process's storage of the mode chosen at start, and the session store opened from
it: files in the workspace, or PostgreSQL (`storage.url`) over one set of connections.

Light to import (neither the daemon's parts, nor the LLM client, nor the session
machinery until a manager is built): a one-shot command such as `gateway sessions list`
opens its sessions from here and starts fast."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

from gateway.workspace import prepare_workspace

if TYPE_CHECKING:
    from gateway.config import PartialSettings, Settings
    from gateway.sessions.listing import SessionListing
    from gateway.sessions.manager import SessionManager
    from gateway.storage.postgres import SharedStorage

_shared_storage: dict[str, SharedStorage] = {}


def shared_storage(settings: Settings | PartialSettings) -> SharedStorage | None:
    """The process's connections to `storage.url` (opened on first use, closed at exit),
    or None in the file mode."""
    url = settings.storage.url
    if not url:
        return None
    storage = _shared_storage.get(url)
    if storage is None:
        from gateway.storage.postgres import SharedStorage

        storage = SharedStorage(
            url, pool_size=settings.storage.pool_size, migrate_mode=settings.storage.migrate
        )
        storage.open()
        _shared_storage[url] = storage
        atexit.register(storage.close)
    return storage


def shared_storage_open(url: str) -> bool:
    """Are this process's connections to `url` open already?"""
    return url in _shared_storage


def build_session_manager(
    settings: Settings | PartialSettings, *, spare_files: int = 0
) -> SessionManager:
    """The sessions of the workspace (or of PostgreSQL, `storage.url`), once the
    workspace's folders are made and writable (WorkspaceError otherwise); a long-running
    gateway passes `spare_files` (see `gateway.sessions.spares`), one-shot commands do not."""
    prepare_workspace(settings)  # also in the shared mode: per-process files (the SQLite cache)
    return _session_manager(settings, shared_storage(settings), spare_files)


def open_session_listing(settings: Settings | PartialSettings) -> SessionListing:
    """The sessions as `build_session_manager`'s manager lists them, for a command that
    only lists them: in the file mode from the folder's listing alone, without importing
    the session machinery; in the shared mode through that manager. Close it after use."""
    prepare_workspace(settings)
    shared = shared_storage(settings)
    if shared is not None:
        return _session_manager(settings, shared, 0)
    from gateway.sessions.listing import FileSessionListing

    return FileSessionListing(settings.sessions_dir)


def _session_manager(
    settings: Settings | PartialSettings, shared: SharedStorage | None, spare_files: int
) -> SessionManager:
    from gateway.sessions.manager import SessionManager

    if shared is not None:
        from gateway.sessions.pg_store import PostgresSessions

        return SessionManager.shared(
            PostgresSessions(shared.sync),
            max_cache_size=settings.sessions.max_cache_size,
            max_cache_bytes=settings.sessions.max_cache_mb * 1024 * 1024,
        )
    return SessionManager(
        settings.sessions_dir,
        max_cache_size=settings.sessions.max_cache_size,
        max_cache_bytes=settings.sessions.max_cache_mb * 1024 * 1024,
        fsync=settings.sessions.fsync,
        spare_files=spare_files,
        io_on_loop=settings.io_on_loop,
    )
