"""The conformance kit (`gateway.testing`) run against the WeCom channel in robot mode,
over the fake robot long connection: one-to-one chats and group @-mentions, a message
pushed twice, strangers and long replies. WeCom keeps nothing for a robot that is not
connected, so the scenarios that write while the gateway is down or cut off are skipped
(the driver declares no catch-up and no outage)."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.wecom_driver import WeComRobotDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return WeComRobotDriver()
