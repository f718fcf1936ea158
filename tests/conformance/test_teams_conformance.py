"""The conformance kit (`gateway.testing`) run against the Microsoft Teams channel, over the
fake Teams: every scenario Teams supports (catch-up is not one: see the driver)."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.teams_driver import TeamsDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return TeamsDriver()
