"""Who may talk to the bot: per-channel access policies and DM pairing.

- `policy`: `ChannelAccessPolicy`, the pure `decide` over a snapshot of the pairing
  state, and the `AccessGate` a message passes before the dispatcher.
- `protocol`: the pairing state (approved senders, pending codes) and `PairingBackend`,
  where it lives.
- `store`: the file mode (`PairingStore`, `pairing.json`).
- `pg_store`: the shared mode (`PostgresPairingStore`).
- `commands`: `gateway pairing approve|list|revoke`.
"""
