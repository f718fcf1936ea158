"""The conformance kit (`gateway.testing`) run against the LINE channel, over the fake LINE
Platform: every scenario a platform with groups, mentions and a signed webhook that LINE
redelivers (with webhook redelivery on) supports, and one of LINE's own: a kill at the
worst moment of its webhook."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.kit import Kit
from gateway.testing.suite import *  # noqa: F403
from gateway.testing.suite import introduce
from tests.conformance.line_driver import LineDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return LineDriver()


def test_kill_between_the_journal_and_the_200_answers_once(kit: Kit) -> None:
    """While the gateway is stopped three people write four DMs each; the next gateway
    stops itself once the first of them is journaled and before its webhook request is
    answered (failpoint `line.before_ack`), and is SIGKILLed there. LINE, without its
    200, delivers that request again: after the next start each message is answered
    once, in order, and stored once."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(person) for person in range(3)])
    run.terminate()
    writers = [p for p in range(3) for _ in range(kit.sized(4))]
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    run.kill_at("line.before_ack")
    run.start()
    kit.settle()
    kit.check(run)
