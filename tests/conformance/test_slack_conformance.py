"""The conformance kit (`gateway.testing`) run against the Slack channel, over the fake
Slack: every scenario Slack supports, over the Events API (HTTP) and over Socket Mode."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.slack_driver import SlackHttpDriver, SlackSocketModeDriver

pytestmark = pytest.mark.conformance


@pytest.fixture(params=["http", "socket"])
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    return SlackHttpDriver() if request.param == "http" else SlackSocketModeDriver()
