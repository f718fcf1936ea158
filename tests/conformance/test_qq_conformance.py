"""The conformance kit (`gateway.testing`) run against the QQ channel, over the fake
OneBot v11 implementation (NapCat's forward WebSocket, behind a TCP proxy): every
scenario QQ supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.qq_driver import QQDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return QQDriver()
