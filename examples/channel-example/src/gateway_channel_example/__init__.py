"""An example channel package for the chat gateway: Example Chat, an imaginary platform
(`platform`), its channel (`spec`, `settings`, `channel`) and the conformance kit's
driver for it (`kit_driver`). docs/channel-sdk.md walks through it file by file."""
