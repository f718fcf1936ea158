-- Token usage totals shared by replicas (gateway.usage): one row per UTC day,
-- conversation, channel, model and kind (turn | heartbeat | consolidation).
CREATE TABLE gw_usage (
    day               text NOT NULL,
    session_key       text NOT NULL,
    channel           text NOT NULL,
    model             text NOT NULL,
    kind              text NOT NULL,
    calls             bigint NOT NULL,
    prompt_tokens     bigint NOT NULL,
    completion_tokens bigint NOT NULL,
    cost              double precision NOT NULL,
    PRIMARY KEY (day, session_key, channel, model, kind)
);
CREATE INDEX gw_usage_by_session ON gw_usage (session_key, day);
