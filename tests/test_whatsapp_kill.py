"""Kill test of the delivery promise over the WhatsApp webhook at its worst moment: a
message journaled and its delivery not yet answered 200 (the failpoint
`whatsapp.before_ack`). A real `gateway run` stops itself there and is SIGKILLed while
the fake Cloud API delivers messages the way Meta does (signed, retried with backoff
until a 2xx), and everything is counted from the outside, as in
tests/test_kill_delivery.py (whose counting this reuses): lost, stored twice, answered
twice, unanswered, turns run twice, and per-person order.

What is here, and what is not. The conformance kit runs WhatsApp's driver
(tests/conformance/test_whatsapp_conformance.py): kills mid-batch with messages written
while the gateway is down, a backlog, duplicate deliveries, an outage. The test that was
here beside this one (600 messages from 60 people, three kills right after a delivery's
200) is the kit's kill scenario now, which counts all it counted (lost, stored twice,
repeats per person per kill, unanswered, turns run twice, order, the exit code) and more
(order strictly, every message written answered, no stray post); `--kit-scale=19`
writes as many messages. The kit kills at moments of its own (a share of the answers
out) and cannot stop a gateway at a failpoint, so this test stays: it is the one that
puts the kill between the journal commit and the 200, three times in a row, where Meta
must deliver again a message the gateway already holds, and the next gateway must answer
it once, from the journal.

Meta's webhook keeps a delivery until it gets a 2xx, and a retried delivery overtakes
later ones, so a reply order is wrong only when a message was delivered before an
earlier-answered one could have reached the gateway. Prints
``KILL-DELIVERY whatsapp-before-ack: ...`` past pytest's capture.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes._serving import free_port
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.whatsapp_server import PHONE_NUMBER_ID, Delivery, FakeWhatsApp
from tests.gateway_process import base_env
from tests.test_kill_delivery import (
    SEED,
    TOKEN,
    Gateways,
    Message,
    Tally,
    echoed,
    plan_messages,
    pushing,
    scaled,
    session_entries,
    settle,
    slow_echo,
)

pytestmark = pytest.mark.kill

#: Meta's backoff (minutes to days) compressed, still long enough to span a restart.
META_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)
ACK_TIMEOUT = 3.0
DELIVERY_MAX = (len(META_RETRIES) + 1) * ACK_TIMEOUT + sum(META_RETRIES)


def person(message: Message) -> str:
    return f"49151{message.user:08d}"


def whatsapp_env(workspace: Path, llm: FakeOpenAI, fake: FakeWhatsApp, port: int) -> dict[str, str]:
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": str(port),  # fixed: Meta retries to the same URL
        "GATEWAY_CHANNELS__WHATSAPP__ENABLED": "true",
        "GATEWAY_CHANNELS__WHATSAPP__PHONE_NUMBER_IDS": f'["{PHONE_NUMBER_ID}"]',
        "GATEWAY_CHANNELS__WHATSAPP__ACCESS_TOKEN": fake.token,
        "GATEWAY_CHANNELS__WHATSAPP__APP_SECRET": fake.app_secret,
        "GATEWAY_CHANNELS__WHATSAPP__VERIFY_TOKEN": fake.verify_token,
        "GATEWAY_CHANNELS__WHATSAPP__API_URL": fake.url,
        "GATEWAY_CHANNELS__WHATSAPP__DM_POLICY": "open",
    }


def message_text(delivery: Delivery) -> str:
    [message] = delivery.messages
    found = TOKEN.search(str(message["text"]["body"]))
    assert found is not None
    return found.group()


def message_deliveries(fake: FakeWhatsApp) -> list[Delivery]:
    return [d for d in fake.deliveries if d.messages]


def replies(fake: FakeWhatsApp) -> list[str]:
    return [s.text for s in fake.sent if s.type == "text"]


def finish(
    fake: FakeWhatsApp,
    run: Gateways,
    sent: list[Message],
    workspace: Path,
    tmp_path: Path,
    started: float,
    scenario: str,
) -> tuple[Tally, int]:
    """Wait until every delivered message is answered (or nothing moves), stop the
    gateway, and count from the outside; also how many status deliveries got through."""

    def progress() -> tuple[bool, int, bool]:
        records = message_deliveries(fake)
        delivered = {message_text(d) for d in records if d.delivered}
        answered, _ = echoed(replies(fake))
        in_progress = any(d.in_progress for d in fake.deliveries)
        return delivered <= set(answered), len(answered), in_progress

    settle(progress)
    run.terminate()
    user, assistant = session_entries(workspace / "sessions")
    answered, other = echoed(replies(fake))
    records = message_deliveries(fake)
    not_delivered = frozenset(message_text(d) for d in records if not d.delivered)
    delivered_at = {message_text(d): d.delivered_at for d in records if d.delivered_at}
    in_order = sorted(sent, key=lambda m: delivered_at.get(m.text, float("inf")))
    arrival = {
        message_text(d): (
            min(a.sent_at for a in d.attempts if a.failure != "ClientConnectorError"),
            d.delivered_at,
        )
        for d in records
        if d.delivered_at is not None
    }
    attempts = (
        f"{message_text(d)}: "
        + ", ".join(f"{a.sent_at:.3f} {a.status} {a.failure}" for a in d.attempts)
        for d in records
    )
    tally = Tally(
        scenario=scenario,
        logs=run.save_logs(tmp_path / "logs", attempts),
        sent=in_order,
        user_entries=user,
        assistant_entries=assistant,
        reply_order=answered,
        other_replies=other,
        kills=run.kills,
        seconds=time.monotonic() - started,
        exit_code=run.exit_code,
        not_acked=not_delivered,
        arrival=arrival,
    )
    return tally, sum(1 for d in fake.deliveries if d.statuses and d.delivered)


@pytest.fixture
def run_gateways(tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Gateways]]:
    made: list[Gateways] = []

    def make(env: dict[str, str]) -> Gateways:
        made.append(Gateways(env, tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.stop()


@pytest.mark.timeout(300)
def test_a_kill_between_the_journal_and_the_200_loses_and_repeats_nothing(
    tmp_path: Path,
    run_gateways: Callable[[dict[str, str]], Gateways],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worst moment for a webhook: a message is journaled and its delivery not yet
    answered. Three gateways in a row stop themselves there (the failpoint
    `whatsapp.before_ack`) and are SIGKILLed; Meta, without its 200, delivers the message
    again to the next one, which must answer it once, from the journal, while 150
    messages from 15 people keep coming at 10 a second."""
    rng = random.Random(SEED)
    workspace = tmp_path / "ws"
    count, rate, kills = scaled(150), 10.0, 3
    sent = plan_messages(count, scaled(15), rng)
    port = free_port()
    with (
        FakeOpenAI.in_thread(responder=slow_echo(random.Random(SEED + 1))) as llm,
        FakeWhatsApp.in_thread(retry_delays=META_RETRIES, ack_timeout=ACK_TIMEOUT) as fake,
    ):
        fake.webhook_url = f"http://127.0.0.1:{port}/whatsapp/webhook"
        env = whatsapp_env(workspace, llm, fake, port)
        run = run_gateways(env | {"GATEWAY_FAILPOINTS": "whatsapp.before_ack=sigstop"})
        run.start()
        started = time.monotonic()
        futures: list[concurrent.futures.Future[Any]] = []

        def deliver(message: Message) -> None:
            futures.append(fake.deliver_soon(fake.text_message(person(message), message.text)))

        with pushing(sent, rate, deliver):
            for number in range(kills):
                assert run.current is not None
                run.current.wait_logged("failpoint whatsapp.before_ack reached", timeout=30)
                run.kill()
                if number == kills - 1:
                    run.env = env  # the last one runs to the end
                    run.start()
                else:
                    # Deliveries keep coming: it may stop at the failpoint before it
                    # logs "ready" or answers /readyz, so nothing is waited for here.
                    run.launch()
        concurrent.futures.wait(futures, timeout=DELIVERY_MAX + 10)
        tally, statuses = finish(
            fake, run, sent, workspace, tmp_path, started, "whatsapp-before-ack"
        )
    with capsys.disabled():
        print(f"\n{tally.summary()} statuses_delivered={statuses}")
    tally.check_promise()
    assert tally.kills == kills
