-- A session append in one round trip: the caller built the entry (its parent_id) from
-- the tree it holds at (session_id, last_seq); under the session row's lock the entry is
-- stored only if that is still the current row and its last entry, else NULL is returned
-- and nothing is written (the caller reads what changed and builds the entry again).
CREATE FUNCTION gw_append_entry(
    p_key text, p_session_id text, p_seq bigint, p_entry_id text, p_parent_id text,
    p_type text, p_body json, p_size bigint, p_at double precision
) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE
    cur_id text;
    cur_seq bigint;
BEGIN
    SELECT session_id, last_seq INTO cur_id, cur_seq FROM gw_sessions
    WHERE key = p_key AND archived_at IS NULL FOR UPDATE;
    IF cur_id IS DISTINCT FROM p_session_id OR cur_seq <> p_seq THEN
        RETURN NULL;
    END IF;
    INSERT INTO gw_session_entries (session_id, seq, entry_id, parent_id, type, body)
    VALUES (cur_id, cur_seq + 1, p_entry_id, p_parent_id, p_type, p_body);
    UPDATE gw_sessions SET last_seq = cur_seq + 1, bytes = bytes + p_size, updated_at = p_at
    WHERE session_id = cur_id;
    RETURN cur_seq + 1;
END
$$;
