"""Where durable state lives: files in the workspace (the default) or PostgreSQL
(`[storage] url`), for several gateway replicas sharing one set of users."""
