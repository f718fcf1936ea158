"""The runtime: how messages become turns, in order, once.

- `dispatcher`: the `Dispatcher`, one FIFO lane per session key under a global cap on
  concurrent turns; access check, journal and outbox (`gateway.journal`), replay.
- `queue_modes`: what a message arriving during its session's turn does (followup,
  collect, steer, interrupt).
- `lanes`: what the dispatcher and the replica router know of each other (`Ticket`,
  `SubmitStatus`, the `Lanes` and `Router` protocols); both import it, never each other.
- `router`: the shared mode's `SessionRouter` (PostgreSQL): which replica runs a
  session's turns, with leases and fencing. Opened by the storage seam
  (`gateway.storage`), never chosen here.
"""
