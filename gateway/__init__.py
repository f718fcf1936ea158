"""Chat gateway: one daemon between chat platforms and an LLM agent."""

__version__ = "0.1.0"
