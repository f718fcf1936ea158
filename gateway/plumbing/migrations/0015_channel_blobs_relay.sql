-- State a channel keeps beside its cursor (gateway.cursors_pg): Matrix's end-to-end crypto
-- store of its device, one blob per device. Written only by the replica holding the
-- channel's leader role, on the connection that holds it, before the cursor moves on.
CREATE TABLE gw_channel_blobs (
    name       text PRIMARY KEY,
    data       bytea NOT NULL,
    updated_at double precision NOT NULL
);

-- Work for the replica holding a role, asked by the others (gateway.relay_pg): a reply to
-- an encrypted Matrix room is encrypted and sent by the replica holding the device's keys.
-- `key` makes a request idempotent; the answer stays on its row until it is swept.
CREATE TABLE gw_relay (
    role       text NOT NULL,
    key        text NOT NULL,
    request    json NOT NULL,
    state      text NOT NULL DEFAULT 'waiting' CHECK (state IN ('waiting', 'done', 'failed')),
    answer     json,
    created_at double precision NOT NULL,
    PRIMARY KEY (role, key)
);
CREATE INDEX gw_relay_waiting ON gw_relay (role, created_at) WHERE state = 'waiting';
