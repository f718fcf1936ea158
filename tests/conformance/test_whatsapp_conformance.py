"""The conformance kit (`gateway.testing`) run against the WhatsApp channel, over the fake
Cloud API: every scenario a one-to-one platform with a signed, retried webhook supports."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.whatsapp_driver import WhatsAppDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return WhatsAppDriver()
