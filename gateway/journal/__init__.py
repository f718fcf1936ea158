"""What came in from the platforms, and where we are in each stream: the delivery promise.

- `protocol`: the inbound journal and outbox (`DedupeStore`): dedupe by platform message
  id, journal before confirm, reply recorded before it is sent; `dedupe_key`.
- `store`: its file mode (`FileDedupeStore`, one SQLite file) and `MemoryDedupeStore`.
- `pg_store`: its shared mode (`PostgresDedupeStore`, `gw_inbound`), with the session
  leases and their fencing epochs.
- `cursors`: a platform stream's read position and state blobs (`CursorStore`) and who
  keeps them (`Lead`): in the workspace (`FileCursorStore`, `run_with`).
- `pg_cursors`: the same in PostgreSQL, written only by the replica holding the
  stream's leader role (`run_as_leader`, `lead_as`).
- `pg_relay`: replies sent through the replica that holds a connection (Matrix E2EE).
"""
