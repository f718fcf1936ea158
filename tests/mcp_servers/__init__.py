"""MCP servers written with the official SDK, run as subprocesses by the tests."""
