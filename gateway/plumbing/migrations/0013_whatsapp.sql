-- The WhatsApp channel's own state (channels/whatsapp/store.py), shared by replicas: when
-- each person last wrote (the 24-hour customer-service window), every message sent with
-- its delivery status (a status only moves forward: `status_rank`), and the replies kept
-- as undeliverable (`state` 'held'; 'templated' once sent as the configured template).
CREATE TABLE gw_whatsapp_windows (
    chat         text PRIMARY KEY,
    last_inbound double precision NOT NULL,
    message_id   text NOT NULL
);
CREATE TABLE gw_whatsapp_sent (
    wamid       text PRIMARY KEY,
    chat        text NOT NULL DEFAULT '',
    session_key text NOT NULL DEFAULT '',
    kind        text NOT NULL DEFAULT '',
    body        text NOT NULL DEFAULT '',
    reply_id    text NOT NULL DEFAULT '',
    part        integer NOT NULL DEFAULT 0,
    sent_at     double precision NOT NULL DEFAULT 0,
    status      text NOT NULL,
    status_rank integer NOT NULL,
    error_code  integer,
    error       text NOT NULL DEFAULT '',
    updated_at  double precision NOT NULL
);
CREATE INDEX gw_whatsapp_sent_updated ON gw_whatsapp_sent (updated_at);
CREATE TABLE gw_whatsapp_held (
    reply_id    text NOT NULL,
    part        integer NOT NULL,
    chat        text NOT NULL,
    session_key text NOT NULL,
    text        text NOT NULL,
    reason      text NOT NULL,
    held_at     double precision NOT NULL,
    state       text NOT NULL,
    PRIMARY KEY (reply_id, part)
);
CREATE INDEX gw_whatsapp_held_state ON gw_whatsapp_held (state, held_at);
