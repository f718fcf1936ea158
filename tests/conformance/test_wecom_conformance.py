"""The conformance kit (`gateway.testing`) run against the WeCom channel, over the fake
WeCom: every scenario a platform of one-to-one chats with an encrypted, signed callback
that WeCom retries supports, and one of WeCom's own: a kill at the worst moment of its
callback."""

from __future__ import annotations

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.kit import Kit
from gateway.testing.suite import *  # noqa: F403
from gateway.testing.suite import introduce
from tests.conformance.wecom_driver import WeComDriver

pytestmark = pytest.mark.conformance


@pytest.fixture
def channel_driver() -> ChannelDriver:
    return WeComDriver()


def test_kill_between_the_journal_and_the_200_answers_once(kit: Kit) -> None:
    """While the gateway is stopped three people write four DMs each; the next gateway
    stops itself once the first of them is journaled and before its callback is answered
    (failpoint `wecom.before_ack`), and is SIGKILLed there. WeCom, without its 200,
    sends that callback again with the same MsgId: after the next start each message is
    answered once, in order, and stored once."""
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(person) for person in range(3)])
    run.terminate()
    writers = [p for p in range(3) for _ in range(kit.sized(4))]
    kit.rng.shuffle(writers)
    for person in writers:
        kit.dm(person)
    run.kill_at("wecom.before_ack")
    run.start()
    kit.settle()
    kit.check(run)
