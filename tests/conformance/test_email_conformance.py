"""The conformance kit (`gateway.testing`) run against the email channel, over a real
Dovecot and a real SMTP server: every scenario email supports (tests/conformance/
email_driver.py says what it declares and why)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.suite import *  # noqa: F403
from tests.conformance.email_driver import EmailDriver
from tests.dovecot_server import Dovecot, running_dovecot
from tests.email_gateway import BOT, BOT_PASSWORD

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="session")
def kit_dovecot() -> Iterator[Dovecot]:
    """One Dovecot for every scenario (each empties the bot's mailbox first)."""
    with running_dovecot({BOT: BOT_PASSWORD}) as dovecot:
        yield dovecot


@pytest.fixture
def channel_driver(kit_dovecot: Dovecot) -> ChannelDriver:
    return EmailDriver(kit_dovecot)
