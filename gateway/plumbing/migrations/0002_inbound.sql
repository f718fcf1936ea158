-- The inbound journal and dedupe shared by replicas (gateway.dedupe's protocol).
-- `seen`: one row per platform message id ever taken in (the unique key is the dedupe
-- across replicas and restarts); `state` says where it is: claimed (no journal yet),
-- journaled (answer owed), done (answered; kept until expires_at as a duplicate marker).
CREATE TABLE gw_inbound (
    dedupe_key  text PRIMARY KEY,
    seq         bigserial NOT NULL UNIQUE,
    state       text NOT NULL CHECK (state IN ('claimed', 'journaled', 'done')),
    session_key text,
    received_at double precision,
    message     json,
    reply       json,
    reply_id    text,
    claimed_by  text NOT NULL,
    claimed_at  double precision NOT NULL,
    expires_at  double precision
);
CREATE INDEX gw_inbound_owed ON gw_inbound (received_at, seq) WHERE state = 'journaled';
CREATE INDEX gw_inbound_expiry ON gw_inbound (expires_at) WHERE state = 'done';

-- Replicas alive: each gateway beats here every few seconds; a journaled message whose
-- owner stopped beating is taken over by another replica.
CREATE TABLE gw_replicas (
    replica_id text PRIMARY KEY,
    started_at double precision NOT NULL,
    seen_at    double precision NOT NULL
);
