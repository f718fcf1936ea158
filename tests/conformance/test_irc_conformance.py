"""The conformance kit (`gateway.testing`) run against the IRC channel, over a private
ngIRCd (tests/ngircd_server.py): every scenario IRC supports (tests/conformance/irc_driver.py
says which, and why the others cannot hold on IRC)."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.irc_driver import IrcDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return IrcDriver()
