-- Reminders and scheduled tasks set from chat (gateway.reminders_pg), shared by replicas.
-- `next_run` is the compare-and-set column: a due time is advanced by exactly one replica.
CREATE TABLE gw_schedules (
    id       text PRIMARY KEY,
    owner    text NOT NULL,
    next_run timestamptz NOT NULL,
    job      jsonb NOT NULL
);
CREATE INDEX gw_schedules_owner ON gw_schedules (owner);
CREATE INDEX gw_schedules_due ON gw_schedules (next_run);
