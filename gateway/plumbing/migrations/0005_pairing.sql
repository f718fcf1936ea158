-- DM pairing shared by replicas (gateway.access_pg): approvals and live codes.
CREATE TABLE gw_pairing_approved (
    channel     text NOT NULL,
    sender_id   text NOT NULL,
    approved_at double precision NOT NULL,
    label       text NOT NULL DEFAULT '',
    PRIMARY KEY (channel, sender_id)
);

-- One request per sender; an expired one is replaced by the sender's next request.
CREATE TABLE gw_pairing_pending (
    channel    text NOT NULL,
    sender_id  text NOT NULL,
    code       text NOT NULL,
    chat_id    text NOT NULL DEFAULT '',
    label      text NOT NULL DEFAULT '',
    created_at double precision NOT NULL,
    expires_at double precision NOT NULL,
    PRIMARY KEY (channel, sender_id)
);
CREATE INDEX gw_pairing_pending_live ON gw_pairing_pending (channel, expires_at);
