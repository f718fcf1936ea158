"""The conformance kit (`gateway.testing`) run against the web chat, with an HTTP client
playing each person's browser: every scenario the web chat supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.webchat_driver import WebChatDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return WebChatDriver()
