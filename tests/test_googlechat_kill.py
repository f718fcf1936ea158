"""A SIGKILL between the journal and the 200 on Google Chat, which sends an event once and
never again (the conformance kit's kill scenarios need a platform that sends again, so
they do not run on it; this is the kill that matters here).

A real `gateway run` stops itself at the failpoint `googlechat.before_ack` (the message is
journaled, Google Chat not answered yet) and is SIGKILLed there. Google Chat gives up on
the request (after its 30 seconds; 3 here) and will not send it again; the next start
answers the message from the journal, once, and goes on answering what comes after."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from gateway.testing.tally import session_entries
from tests.fakes._serving import free_port
from tests.fakes.googlechat_server import (
    CHAT_CERTS_PATH,
    OIDC_CERTS_PATH,
    FakeGoogleChat,
)
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, base_env, wait_until

pytestmark = pytest.mark.kill

PREFIX = "GATEWAY_CHANNELS__GOOGLECHAT__"
FIRST = "m00001 journaled, never confirmed"
SECOND = "m00002 after the restart"


def googlechat_env(
    workspace: Path, llm: FakeOpenAI, fake: FakeGoogleChat, port: int
) -> dict[str, str]:
    """`base_env` plus the Google Chat app of `fake`, its endpoint on `port`, open to all."""
    return base_env(workspace, llm) | {
        "GATEWAY_HTTP__PORT": str(port),  # fixed: Google Chat posts to the configured URL
        f"{PREFIX}ENABLED": "true",
        f"{PREFIX}AUDIENCE": fake.audience,
        f"{PREFIX}SERVICE_ACCOUNT_KEY": json.dumps(fake.service_account_info()),
        f"{PREFIX}API_URL": fake.url,
        f"{PREFIX}CHAT_CERTS_URL": f"{fake.url}{CHAT_CERTS_PATH}",
        f"{PREFIX}GOOGLE_CERTS_URL": f"{fake.url}{OIDC_CERTS_PATH}",
        f"{PREFIX}DM_POLICY": "open",
    }


def replies(fake: FakeGoogleChat, text: str) -> list[str]:
    return [m["text"] for m in fake.app_messages() if m["text"] == f"echo: {text}"]


def test_a_kill_between_the_journal_and_the_200_loses_nothing_and_repeats_nothing(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    workspace = tmp_path / "workspace"
    port = free_port()
    with FakeGoogleChat.in_thread(response_timeout=3.0) as fake:
        fake.webhook_url = f"http://127.0.0.1:{port}/googlechat/events"
        alice = fake.add_user("Alice")["name"]
        dm = fake.dm_space(alice)["name"]
        env = googlechat_env(workspace, fake_openai_thread, fake, port)

        first = GatewayProcess(
            env | {"GATEWAY_FAILPOINTS": "googlechat.before_ack=sigstop"}, tmp_path
        )
        try:
            first.wait_readyz(first.wait_ready(120), 60)
            fake.user_message(dm, alice, FIRST)
            first.wait_logged("failpoint googlechat.before_ack reached", timeout=30)
            [delivery] = fake.wait_for_deliveries(1, timeout=20)
            assert delivery.failure == "timeout"  # Google Chat gave up; it will not resend
            first.kill()
        finally:
            first.stop()

        second = GatewayProcess(env, tmp_path)
        try:
            second.wait_readyz(second.wait_ready(120), 60)
            wait_until(lambda: replies(fake, FIRST), 60, "the replay")
            fake.user_message(dm, alice, SECOND)
            wait_until(lambda: replies(fake, SECOND), 60, "the next answer")
            time.sleep(1.5)  # a repeat would come now
            assert len(replies(fake, FIRST)) == 1
            assert len(replies(fake, SECOND)) == 1
            assert len(fake.app_messages()) == 2
            assert second.terminate() == 0
        finally:
            second.stop()
        assert len(fake.deliveries) == 2  # nothing was sent again by Google Chat
    user, assistant = session_entries(workspace)
    assert (user["m00001"], user["m00002"]) == (1, 1)  # stored once each
    assert (assistant["m00001"], assistant["m00002"]) == (1, 1)
