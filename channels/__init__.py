"""Channel adapters: one module per platform, each a thin layer over gateway.messages."""
