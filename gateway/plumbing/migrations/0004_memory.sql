-- Long-term memory per scope (gateway.memory.pg_store), and what consolidation did.
-- Search documents: `tsv` holds the text as gateway.memory.text tokenizes it (stems,
-- stopwords, negations), parsed with the 'simple' configuration, so any language works
-- and a query matches exactly what it matches in the file mode.

-- A scope exists once something was stored in it (`MemoryBackend.exists`).
CREATE TABLE gw_memory_scopes (
    scope      text PRIMARY KEY,
    created_at double precision NOT NULL
);

-- MEMORY.md: one row per line; `day` is the `### Consolidated` heading it sits under
-- (NULL: free text before any heading), `category` a fact's category (NULL: free text).
CREATE TABLE gw_memory_facts (
    scope      text NOT NULL REFERENCES gw_memory_scopes (scope) ON DELETE CASCADE,
    id         bigserial,
    day        date,
    category   text,
    line       text NOT NULL,
    created_at double precision NOT NULL,
    tsv        tsvector NOT NULL,
    PRIMARY KEY (scope, id)
);
CREATE INDEX gw_memory_facts_tsv ON gw_memory_facts USING gin (tsv);

-- HISTORY.md: one row per line, append-only; `at` is the line's timestamp.
CREATE TABLE gw_memory_history (
    scope text NOT NULL REFERENCES gw_memory_scopes (scope) ON DELETE CASCADE,
    id    bigserial,
    at    double precision NOT NULL,
    line  text NOT NULL,
    tsv   tsvector NOT NULL,
    PRIMARY KEY (scope, id)
);
CREATE INDEX gw_memory_history_tsv ON gw_memory_history USING gin (tsv);

-- knowledge.json: one row per entry; `id` is the content hash (the dedup key).
CREATE TABLE gw_memory_knowledge (
    scope        text NOT NULL REFERENCES gw_memory_scopes (scope) ON DELETE CASCADE,
    id           text NOT NULL,
    category     text NOT NULL,
    content      text NOT NULL,
    source       text,
    tags         text[] NOT NULL DEFAULT '{}',
    created_at   double precision NOT NULL,
    accessed_at  double precision NOT NULL,
    access_count integer NOT NULL DEFAULT 0,
    tsv          tsvector NOT NULL,
    PRIMARY KEY (scope, id)
);
CREATE INDEX gw_memory_knowledge_tsv ON gw_memory_knowledge USING gin (tsv);

-- How far each session was consolidated: the compaction's first kept entry of the
-- session it was made in. Replicas update it under the session's advisory lock, so two
-- never summarize the same span.
CREATE TABLE gw_consolidations (
    session_key          text PRIMARY KEY,
    session_id           text NOT NULL,
    first_kept_entry_id  text NOT NULL,
    summarized           integer NOT NULL,
    facts                integer NOT NULL,
    consolidated_at      double precision NOT NULL,
    replica              text NOT NULL
);
