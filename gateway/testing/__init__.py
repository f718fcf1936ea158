"""The channel conformance kit: the gateway's delivery promise, checked against any channel.

A channel's author writes a `ChannelDriver` for their platform (its fake or a real
server) with the `Requirements` it meets; the kit's pytest plugin
(`gateway.testing.plugin`) and scenarios (`gateway.testing.suite`) run the real
`gateway run` against it and count from the outside. See docs/channel-sdk.md, "Test your
channel with the conformance kit".

This package imports nothing of pytest; the plugin and the suite do.
"""

from gateway.testing.driver import ChannelDriver, MessageRef, Place, Post, Requirements

__all__ = ["ChannelDriver", "MessageRef", "Place", "Post", "Requirements"]
