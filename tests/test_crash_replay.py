"""A crash never loses a message a platform has handed over: the real daemon in a
subprocess, Telegram through the fake Bot API (which never redelivers confirmed
updates), SIGKILL mid-turn, restart, and every message is answered, in order, ahead of
what arrived while the gateway was down."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until

CHAT = 4242


def test_messages_queued_at_a_crash_are_answered_after_restart(tmp_path: Path) -> None:
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(token="777:CRASH-test") as telegram,
    ):
        llm.add_delay(60, "never delivered")  # the first turn is in flight at the crash
        env = telegram_env(tmp_path / "ws", llm, telegram, llm_timeout=90)
        first = GatewayProcess(env, tmp_path)
        try:
            first.wait_ready()
            telegram.push_update(telegram.user_message(CHAT, "first", user_id=CHAT))
            telegram.push_update(telegram.user_message(CHAT, "second", user_id=CHAT))
            llm.wait_for_requests(1, timeout=20)  # "first" is with the model
            # Telegram has confirmed both updates: it will never send them again.
            wait_until(lambda: not telegram.pending_updates)
            time.sleep(0.5)  # "second" waits in its lane behind "first"
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
        finally:
            first.stop()
        assert telegram.sent_messages(CHAT) == []

        # Written while the gateway was down: it must come after the replayed ones.
        telegram.push_update(telegram.user_message(CHAT, "third", user_id=CHAT))
        second = GatewayProcess(env, tmp_path)
        try:
            wait_until(lambda: len(telegram.sent_messages(CHAT)) >= 3, timeout=30)
            time.sleep(0.5)
            second.proc.send_signal(signal.SIGTERM)
            assert second.proc.wait(20) == 0
        finally:
            second.stop()
    texts = [m["text"] for m in telegram.sent_messages(CHAT)]
    assert texts == ["echo: first", "echo: second", "echo: third"]
