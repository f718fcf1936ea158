-- One replica at a time runs a session's turns: it holds the session's lease while it
-- works through the session's journaled messages (gw_inbound, in seq order), renews it
-- while a turn runs, and gives it up only when nothing of the session is left.
CREATE TABLE gw_session_leases (
    session_key text PRIMARY KEY,
    owner       text NOT NULL,
    expires_at  double precision NOT NULL
);
-- The sweep: sessions with journaled messages, found by session.
CREATE INDEX gw_inbound_owed_by_session ON gw_inbound (session_key, seq) WHERE state = 'journaled';

-- Heartbeat jobs run once per due time across replicas: the replica that moves a job's
-- last run from the value it read to its start time (compare-and-set) runs it.
CREATE TABLE gw_heartbeat_runs (
    job      text PRIMARY KEY,
    last_run timestamptz NOT NULL
);
