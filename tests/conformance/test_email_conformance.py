"""The conformance kit (`gateway.testing`) run against the email channel, over a real
Dovecot and a real SMTP server: every scenario email supports (tests/conformance/
email_driver.py says what it declares and why), and what only mail has: a reply the SMTP
server cannot take for longer than the channel's own retries."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gateway.testing import ChannelDriver
from gateway.testing.kit import Kit
from gateway.testing.suite import *  # noqa: F403
from gateway.testing.suite import introduce
from gateway.testing.tally import Tally
from tests.conformance.email_driver import EmailDriver
from tests.dovecot_server import Dovecot, running_dovecot
from tests.email_gateway import BOT, BOT_PASSWORD

pytestmark = pytest.mark.conformance


@pytest.fixture(scope="session")
def kit_dovecot() -> Iterator[Dovecot]:
    """One Dovecot for every scenario (each empties the bot's mailbox first)."""
    with running_dovecot({BOT: BOT_PASSWORD}) as dovecot:
        yield dovecot


@pytest.fixture(params=["threads", "correspondents"])
def channel_driver(request: pytest.FixtureRequest, kit_dovecot: Dovecot) -> ChannelDriver:
    """The channel's `threads` setting: a conversation per mail thread (the default), or
    per correspondent."""
    return EmailDriver(kit_dovecot, threads=request.param == "threads")


def channel_retry_seconds() -> float:
    """How long the email channel itself retries a reply that did not go out (its
    `Pacing`: the waits between its attempts)."""
    from channels.email import Pacing

    pacing = Pacing()
    waits = [
        min(pacing.retry_backoff * 2**n, pacing.retry_backoff_max)
        for n in range(pacing.send_attempts - 1)
    ]
    return sum(waits)


@pytest.mark.parametrize("channel_driver", ["threads"], indirect=True)
def test_a_reply_the_smtp_server_cannot_take_for_longer_than_the_channel_tries_arrives_once(
    kit: Kit,
) -> None:
    """The SMTP server is unreachable for longer than the channel retries a reply (then
    answers the first attempt with a 451 "try again later") while replies are due and
    mail comes in over IMAP: once it is back each message is answered once, in order,
    and the mail the 451 turned away went out again as the same mail (its Message-ID).
    (Before: the channel gave up after its own retries, the dispatcher marked the
    messages answered, and their replies were lost.)"""
    driver = kit.driver
    assert isinstance(driver, EmailDriver)
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(0)])
    driver.smtp_down()
    try:
        for person in (1, 0, 1):
            kit.dm(person)
        time.sleep(channel_retry_seconds() + 5)
        driver.smtp.refuse_next = ["451 4.3.0 try again later"]
    finally:
        driver.smtp_up()
    kit.settle()

    def resent_as_the_same_mail(tally: Tally) -> list[str]:
        refused = [item.message["Message-ID"] for item in driver.smtp.refused]
        sent = {mail["Message-ID"] for mail in driver.mails_sent()}
        if not refused:
            return ["no reply met the 451"]
        return [] if set(refused) <= sent else [f"{refused} never went out as such: {sent}"]

    kit.check(run, extra=resent_as_the_same_mail)


@pytest.mark.parametrize("channel_driver", ["threads"], indirect=True)
def test_a_reply_still_unsent_at_a_stop_goes_out_once_after_the_next_start(kit: Kit) -> None:
    """The SMTP server is unreachable while a reply is due, past the channel's own
    retries, and the gateway is stopped (SIGTERM): it exits cleanly with the message
    still journaled, and the next start, the server back, sends that reply once, without
    asking the model again."""
    driver = kit.driver
    assert isinstance(driver, EmailDriver)
    run = kit.gateways()
    run.start()
    introduce(kit, [kit.dm(0)])
    driver.smtp_down()
    try:
        waiting = kit.dm(1)
        time.sleep(channel_retry_seconds() + 3)
        assert run.terminate() == 0
    finally:
        driver.smtp_up()
    run.start()
    kit.settle()

    def asked_once(tally: Tally) -> list[str]:
        asked = [r for r in kit.model.requests if waiting.token in r.last_user_text]
        return [] if len(asked) == 1 else [f"the model was asked {len(asked)} times"]

    kit.check(run, extra=asked_once)
