-- Tool results too big for the context, kept whole beside their session
-- (gateway.sessions.outputs): the conversation that made one reads it back by handle.
-- The content is the output's UTF-8 bytes as they are (bytea: text cannot hold NUL).
-- A row goes with its session's row (deleted with it; an archived session keeps it).
CREATE TABLE gw_tool_outputs (
    session_key text NOT NULL,
    handle      text NOT NULL,
    session_id  text NOT NULL REFERENCES gw_sessions (session_id) ON DELETE CASCADE,
    created_at  double precision NOT NULL,
    content     bytea NOT NULL,
    PRIMARY KEY (session_key, handle)
);
CREATE INDEX gw_tool_outputs_session ON gw_tool_outputs (session_id);
