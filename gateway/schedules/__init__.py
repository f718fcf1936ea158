"""Scheduled work: reminders and tasks set from chat, and the heartbeat jobs' last runs.

- `protocol`: a `ScheduledJob` and `JobStore`, where jobs live.
- `store`: the file mode (`FileJobStore`, `schedules.json`).
- `pg_store`: the shared mode (`PostgresJobStore`) and the heartbeat's `SharedRunState`.
- `runs`: the heartbeat jobs' last runs (`RunState`; the file mode's `HeartbeatState`).
- `schedule`: the parser of intervals, cron expressions, time zones and active hours.

The chat tools that set jobs are `gateway.agent.schedule_tools`; the runner that fires
them is `channels.schedules`, the heartbeat's is `channels.heartbeat`.
"""
