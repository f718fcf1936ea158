"""The conformance kit (`gateway.testing`) run against the LINE channel, over the fake LINE
Platform: every scenario a platform with groups, mentions and a signed webhook that LINE
redelivers (with webhook redelivery on) supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.line_driver import LineDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return LineDriver()
