"""The conformance kit (`gateway.testing`) run against the Mattermost channel, over the fake
server: every scenario Mattermost supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.mattermost_driver import MattermostDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return MattermostDriver()
