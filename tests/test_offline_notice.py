"""Old messages after downtime get an "I was offline" notice instead of a full turn: the
policy, the agent with real sessions and the real openai client against the fake
server, the daemon with the fake Telegram, and a real `gateway run` killed mid-turn."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.agent.offline import describe_age, is_stale, message_age
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import META_REPLAYED, META_SENT_AT, InboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram
from tests.gateway_process import GatewayProcess, telegram_env, wait_until
from tests.test_telegram_e2e import fake_tg, gateway, wait_sent  # noqa: F401

pytestmark = pytest.mark.anyio

HOUR = 3600.0


def msg(
    text: str, *, age: float = 0.0, sent_age: float | None = None, number: int = 1
) -> InboundMessage:
    now = time.time()
    metadata = {} if sent_age is None else {META_SENT_AT: now - sent_age}
    return InboundMessage(
        channel="telegram",
        chat_id="42",
        text=text,
        message_id=f"42:{number}",
        received_at=now - age,
        metadata=metadata,
    )


def test_age_is_by_the_platforms_clock_when_it_is_given() -> None:
    now = time.time()
    assert message_age(msg("x", age=10), now) == pytest.approx(10, abs=1)
    # Delivered just now, written two hours ago (sent while the gateway was down).
    assert message_age(msg("x", sent_age=2 * HOUR), now) == pytest.approx(2 * HOUR, abs=1)
    assert is_stale(msg("x", sent_age=2 * HOUR), now, HOUR)
    assert not is_stale(msg("x", sent_age=2 * HOUR), now, 0)  # 0 turns it off
    assert not is_stale(msg("x", age=60), now, HOUR)
    heartbeat = InboundMessage(channel="system", chat_id="heartbeat", text="x", received_at=0)
    assert not is_stale(heartbeat, now, HOUR)
    assert [describe_age(s) for s in (5, 61, 2 * HOUR + 5, 3 * 86400)] == [
        "moments",
        "1 minute",
        "2 hours",
        "3 days",
    ]


async def test_an_old_message_gets_the_notice_and_is_kept_without_calling_the_model(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        old = await gw.agent.handle(msg("are you there?", sent_age=3 * HOUR, number=1))
        late_command = await gw.agent.handle(msg("/new", age=2 * HOUR, number=2))
        fresh = await gw.agent.handle(msg("now?", number=3))
    finally:
        await gw.aclose()
    assert old.text.startswith("I was offline when you sent this (3 hours ago)")
    assert old.metadata["offline"] is True and not old.is_error
    assert late_command.text.startswith("I was offline") and "2 hours" in late_command.text
    assert fresh.text == "echo: now?"
    assert len(fake_openai.chat_requests) == 1  # only the fresh one reached the model
    path = settings.sessions_dir / f"{encode_key('telegram:42')}.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()][1:]
    kept = [(e["message"]["content"], (e.get("meta") or {}).get("offline")) for e in entries]
    assert kept[:2] == [("are you there?", True), (old.text, True)]
    # The model later sees the notice as what it answered, so the context stays true.
    assert fake_openai.chat_requests[0].messages[1]["content"] == "are you there?"


async def test_a_replayed_old_message_whose_answer_is_stored_gets_that_answer(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, agent__offline_after_seconds=60)
    gw = Gateway.build(settings)
    try:
        first = await gw.agent.handle(msg("hello", number=7))
        old = msg("hello", age=HOUR, number=7)
        replayed = dataclasses.replace(old, metadata={META_REPLAYED: True})
        again = await gw.agent.handle(replayed)
    finally:
        await gw.aclose()
    assert again.text == first.text == "echo: hello"
    assert len(fake_openai.chat_requests) == 1


async def test_a_message_sent_during_downtime_gets_the_notice_through_the_daemon(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,  # noqa: F811
    make_settings: Callable[..., Settings],
) -> None:
    chat = 4242
    # Waiting at Telegram since two hours ago, when the gateway was down.
    fake_tg.push_update(
        fake_tg.user_message(chat, "ping from the past", date=int(time.time() - 2 * HOUR))
    )
    async with gateway(make_settings, fake_openai, fake_tg):
        await wait_sent(fake_tg, chat, 1)
        fake_tg.push_update(fake_tg.user_message(chat, "ping from now"))
        await wait_sent(fake_tg, chat, 2)
    texts = [m["text"] for m in fake_tg.sent_messages(chat)]
    assert texts[0].startswith("I was offline when you sent this (2 hours ago)")
    assert texts[1] == "echo: ping from now"
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["ping from now"]


def test_the_replay_after_a_crash_answers_old_messages_with_the_notice(tmp_path: Path) -> None:
    limit = 3.0
    with (
        FakeOpenAI.in_thread() as llm,
        FakeTelegram.in_thread(token="778:OFFLINE-test") as telegram,
    ):
        llm.add_delay(60, "never delivered")  # the first turn is in flight at the crash
        env = telegram_env(tmp_path / "ws", llm, telegram, llm_timeout=90)
        env["GATEWAY_AGENT__OFFLINE_AFTER_SECONDS"] = str(limit)
        first = GatewayProcess(env, tmp_path)
        try:
            first.wait_ready()
            telegram.push_update(telegram.user_message(4242, "first", user_id=4242))
            llm.wait_for_requests(1, timeout=20)
            wait_until(lambda: not telegram.pending_updates)
            crashed_at = time.time()
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
        finally:
            first.stop()
        # Down for longer than the limit: "first" is old when the replay reaches it.
        wait_until(lambda: time.time() > crashed_at + limit + 1, timeout=limit + 10)
        second = GatewayProcess(env, tmp_path)
        try:
            wait_until(lambda: len(telegram.sent_messages(4242)) >= 1, timeout=30)
            telegram.push_update(telegram.user_message(4242, "second", user_id=4242))
            wait_until(lambda: len(telegram.sent_messages(4242)) >= 2, timeout=30)
            second.proc.send_signal(signal.SIGTERM)
            assert second.proc.wait(20) == 0
        finally:
            second.stop()
    texts = [m["text"] for m in telegram.sent_messages(4242)]
    assert texts[0].startswith("I was offline when you sent this")
    assert texts[1] == "echo: second"
    assert len(llm.chat_requests) == 2  # the crashed turn's request and "second"; no rerun
