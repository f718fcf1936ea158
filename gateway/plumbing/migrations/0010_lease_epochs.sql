-- Fencing tokens (gateway.storage.fence). A session's lease carries an epoch that grows
-- at every change of owner; every write a turn makes names the epoch its turn started
-- under, and gw_fence refuses it (SQLSTATE GWF01) once the lease holds another epoch. A
-- replica paused past its lease (GC, VM migration, CPU quota, SIGSTOP) can then neither
-- store nor send anything when it wakes up. A released lease keeps its row (expires_at
-- 0) and its epoch, so a holder that takes it back unchallenged keeps its writes valid.
CREATE SEQUENCE gw_lease_epochs;
ALTER TABLE gw_session_leases
    ADD COLUMN epoch bigint NOT NULL DEFAULT nextval('gw_lease_epochs');

CREATE FUNCTION gw_fence(p_key text, p_epoch bigint) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF p_epoch IS NULL THEN
        RETURN true;  -- not a turn's write (the file mode's import, an operator's command)
    END IF;
    -- FOR SHARE: a change of owner (an UPDATE of this row) waits for the end of the
    -- transaction of a write that passed here, and a write waits for a change of owner
    -- in progress and then sees its new epoch: the two never interleave.
    PERFORM 1 FROM gw_session_leases
    WHERE session_key = p_key AND epoch = p_epoch FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the lease of % has moved on from epoch %', p_key, p_epoch
            USING ERRCODE = 'GWF01';
    END IF;
    RETURN true;
END
$$;

-- gw_append_entry (0006) behind the fence of the turn that appends.
CREATE FUNCTION gw_append_entry(
    p_key text, p_session_id text, p_seq bigint, p_entry_id text, p_parent_id text,
    p_type text, p_body json, p_size bigint, p_at double precision,
    p_fence_key text, p_epoch bigint
) RETURNS bigint LANGUAGE plpgsql AS $$
BEGIN
    PERFORM gw_fence(p_fence_key, p_epoch);
    RETURN gw_append_entry(
        p_key, p_session_id, p_seq, p_entry_id, p_parent_id, p_type, p_body, p_size, p_at
    );
END
$$;
