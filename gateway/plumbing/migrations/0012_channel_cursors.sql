-- Read positions a channel confirms to its platform itself (gateway.cursors_pg): Matrix's
-- /sync `since` token. Written only by the replica holding the channel's leader role, on
-- the connection that holds it, after the batch it confirms is journaled.
CREATE TABLE gw_channel_cursors (
    name       text PRIMARY KEY,
    value      text NOT NULL,
    updated_at double precision NOT NULL
);
