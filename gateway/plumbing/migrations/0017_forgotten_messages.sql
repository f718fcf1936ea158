-- Messages forgotten from a memory scope's message search (gateway.memory.messages): the
-- transcript stays append-only, so forgetting records the entry ids that search must
-- never return again (a fork's copy of a message keeps its entry id, so it goes too).
CREATE TABLE gw_memory_forgotten_messages (
    scope      text NOT NULL,
    entry_id   text NOT NULL,
    created_at double precision NOT NULL,
    PRIMARY KEY (scope, entry_id)
);
