-- The provider that answered (gateway.llm.failover) joins the key of the usage totals:
-- one row per UTC day, conversation, channel, model, kind and provider. Totals counted
-- before keep provider '' (not recorded then).
ALTER TABLE gw_usage ADD COLUMN provider text NOT NULL DEFAULT '';
ALTER TABLE gw_usage DROP CONSTRAINT gw_usage_pkey;
ALTER TABLE gw_usage ADD PRIMARY KEY (day, session_key, channel, model, kind, provider);
