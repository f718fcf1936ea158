-- Sessions as trees: one row per session (its header) and one row per entry, append-only.
-- An entry's body is the exact JSON line of the JSONL format (type json keeps it verbatim,
-- so an export gives back the same bytes).
CREATE TABLE gw_sessions (
    session_id  text PRIMARY KEY,
    key         text NOT NULL,
    header      json NOT NULL,
    created_at  double precision NOT NULL,
    updated_at  double precision NOT NULL,
    last_seq    bigint NOT NULL DEFAULT 0,
    bytes       bigint NOT NULL DEFAULT 0,
    archived_at double precision
);
-- One current session per key; archived ones (`/new`) keep their rows.
CREATE UNIQUE INDEX gw_sessions_current ON gw_sessions (key) WHERE archived_at IS NULL;
CREATE INDEX gw_sessions_activity ON gw_sessions (updated_at DESC) WHERE archived_at IS NULL;
CREATE INDEX gw_sessions_archived ON gw_sessions (key, archived_at) WHERE archived_at IS NOT NULL;

CREATE TABLE gw_session_entries (
    session_id text NOT NULL REFERENCES gw_sessions (session_id) ON DELETE CASCADE,
    seq        bigint NOT NULL,
    entry_id   text NOT NULL,
    parent_id  text,
    type       text NOT NULL,
    body       json NOT NULL,
    PRIMARY KEY (session_id, seq),
    -- the branch walk: parent ids resolve by entry id
    UNIQUE (session_id, entry_id)
);
