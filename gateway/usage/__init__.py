"""Token usage, its cost and budgets.

- `meter`: `UsageMeter` (prices, budgets) and `MeteredProvider`, the one seam every model
  call goes through; `usage_scope` says what a call works for.
- `protocol`: a `UsageRow` and the `UsageLedger` that totals them.
- `store`: the file mode (`SqliteUsageLedger`, `usage.sqlite`).
- `pg_store`: the shared mode (`PostgresUsageLedger`, `gw_usage`; a turn's rows ride on
  its session append).
"""
