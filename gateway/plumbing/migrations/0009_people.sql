-- One memory per person (gateway.people): sender ids an operator linked as one person,
-- and the sender each direct conversation belongs to.
CREATE TABLE gw_people (
    sender_id text PRIMARY KEY,
    person    text NOT NULL
);
CREATE INDEX gw_people_by_person ON gw_people (person);

CREATE TABLE gw_people_dms (
    session_key text PRIMARY KEY,
    sender_id   text NOT NULL
);
