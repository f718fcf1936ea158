"""The conformance kit (`gateway.testing`) run against the Discord channel, over the fake
Discord (its HTTP API and Gateway, behind a TCP proxy): every scenario Discord supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.discord_driver import DiscordDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return DiscordDriver()
