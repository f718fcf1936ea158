"""The conformance kit's pytest plugin, and the driver it runs every scenario with:
Example Chat, in each of the channel's two modes."""

from __future__ import annotations

import pytest
from gateway.testing import ChannelDriver

from gateway_channel_example.kit_driver import ExampleDriver

pytest_plugins = ["gateway.testing.plugin"]


@pytest.fixture(params=["polling", "webhook"])
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    return ExampleDriver(mode=request.param)
