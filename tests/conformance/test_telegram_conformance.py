"""The conformance kit (`gateway.testing`) run against the Telegram channel, over the fake
Bot API: every scenario Telegram supports, in long polling and in webhook mode."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.telegram_driver import TelegramDriver, TelegramWebhookDriver

pytestmark = pytest.mark.conformance


@pytest.fixture(params=["polling", "webhook"])
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    return TelegramDriver() if request.param == "polling" else TelegramWebhookDriver()
