"""Channel adapters: one package per platform (its adapter and its formatter side by side),
each a thin layer over gateway.messages; the terminal and the heartbeat are one module each."""
