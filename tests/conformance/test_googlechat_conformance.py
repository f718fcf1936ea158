"""The conformance kit (`gateway.testing`) run against the Google Chat channel, over the fake
Google Chat: every scenario Google Chat supports (tests/conformance/googlechat_driver.py
says which do not apply, and why)."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.googlechat_driver import GoogleChatDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return GoogleChatDriver()
