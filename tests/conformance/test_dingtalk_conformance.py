"""The conformance kit (`gateway.testing`) run against the DingTalk channel, over the fake
DingTalk: every scenario DingTalk supports, in stream mode."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.dingtalk_driver import DingTalkDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return DingTalkDriver()
