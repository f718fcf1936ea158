-- The runs of each conversation's scheduled jobs on a day (gateway.reminders_pg): the
-- daily run budget. One row per run that ran (noted = false) and at most one for the
-- run answered with the note that the budget is used up (noted = true); a run's fire id
-- is the same on every replica, so it is counted once.
CREATE TABLE gw_schedule_runs (
    owner   text NOT NULL,
    day     date NOT NULL,
    fire_id text NOT NULL,
    noted   boolean NOT NULL,
    PRIMARY KEY (owner, day, fire_id)
);
