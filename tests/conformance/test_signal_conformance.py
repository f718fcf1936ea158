"""The conformance kit (`gateway.testing`) run against the Signal channel, over the fake
signal-cli daemon: every scenario Signal supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.signal_driver import SignalDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return SignalDriver()
