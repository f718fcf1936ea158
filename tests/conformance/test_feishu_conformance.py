"""The conformance kit (`gateway.testing`) run against the Feishu / Lark channel, over the
fake Feishu: every scenario Feishu supports, over the long connection and over HTTP
callbacks."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.feishu_driver import FeishuWebhookDriver, FeishuWebSocketDriver

pytestmark = pytest.mark.conformance


@pytest.fixture(params=["websocket", "webhook"])
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    return FeishuWebSocketDriver() if request.param == "websocket" else FeishuWebhookDriver()
