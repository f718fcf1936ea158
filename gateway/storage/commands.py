"""`gateway db status|migrate` and `gateway storage import|export`: the shared mode's
schema and contents, as an operator (or a Kubernetes migration Job) handles them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from gateway.config import Settings
from gateway.plumbing.postgres import StorageError, connect, migrate, schema_status
from gateway.redaction import redact_url


def _url(settings: Settings) -> str:
    if not settings.storage.url:
        raise StorageError(
            "storage.url is not set: this gateway keeps everything in workspace files "
            "(set [storage] url or GATEWAY_STORAGE__URL to use PostgreSQL)"
        )
    return settings.storage.url


def db_status(settings: Settings, *, as_json: bool = False) -> int:
    """Print applied and pending migrations; exit 0 when the schema is current, 3 when
    migrations are pending (what a readiness script or a Job wants to know)."""
    url = _url(settings)
    with connect(url) as conn:
        status = schema_status(conn)
    if as_json:
        print(
            json.dumps(
                {
                    "url": redact_url(url),
                    "current": status.current,
                    "applied": [{"version": v, "name": n} for v, n, _ in status.applied],
                    "pending": [{"version": m.version, "name": m.name} for m in status.pending],
                    "unknown": list(status.unknown),
                }
            )
        )
    else:
        print(f"database: {redact_url(url)}")
        for version, name, at in status.applied:
            when = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
            print(f"  applied  {version:04d}_{name}  ({when})")
        for mig in status.pending:
            print(f"  pending  {mig.version:04d}_{mig.name}")
        for version in status.unknown:
            print(f"  unknown  {version:04d} (from a newer gateway)")
        if status.pending:
            print(f"{len(status.pending)} pending: run `gateway db migrate`")
        else:
            print(f"schema is current (version {status.current})")
    if status.unknown:
        return 4
    return 3 if status.pending else 0


def db_migrate(settings: Settings) -> int:
    url = _url(settings)
    with connect(url) as conn:
        applied = migrate(conn)
        current = schema_status(conn).current
    for mig in applied:
        print(f"applied {mig.version:04d}_{mig.name}")
    print(f"schema is current (version {current})" + ("" if applied else "; nothing to do"))
    return 0


def storage_transfer(settings: Settings, direction: str, folder: Path) -> int:
    """`gateway storage import|export DIR`: progress on stderr, the summary on stdout;
    exit 0 when everything is in place, 1 when something was damaged or conflicting."""
    from gateway.storage.transfer import transfer_workspace

    url = _url(settings)
    mode: Literal["import", "export"] = "import" if direction == "import" else "export"
    with connect(url) as conn:
        transfer = transfer_workspace(conn, url, mode, folder.expanduser())
    print(transfer.summary())
    return 0 if transfer.clean else 1
