"""Both chat platforms in one daemon, wired from settings as an operator enables them:
the real python-telegram-bot and slack-bolt against the fake Bot API and the fake Slack,
the fake OpenAI server as the model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_server import FakeSlack
from tests.fakes.telegram_server import FakeTelegram

pytestmark = pytest.mark.anyio

KNOWN_USER = 111
STRANGER = 999
FORUM = -1001234
CHANNEL = "C0GENERAL01"
ALICE = "U0ALICE001"


@pytest.fixture
async def fake_telegram() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token="123456:TEST-token") as server:
        yield server


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as server:
        yield server


async def until(predicate: Callable[[], Any], what: str) -> None:
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (polling a fake's call log)
            await anyio.sleep(0.02)


async def test_telegram_and_slack_in_one_daemon(
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
    fake_telegram: FakeTelegram,
    fake_slack: FakeSlack,
) -> None:
    settings = make_settings(
        fake_openai,
        http__port=0,
        http__token="api-token-123",
        channels__telegram__enabled=True,
        channels__telegram__token=fake_telegram.token,
        channels__telegram__base_url=fake_telegram.api_url,
        channels__telegram__base_file_url=fake_telegram.file_url,
        channels__telegram__poll_timeout=1,
        channels__telegram__allow_from=f'["{KNOWN_USER}", "{FORUM}"]',
        channels__slack__enabled=True,
        channels__slack__bot_token=fake_slack.bot_token,
        channels__slack__app_token=fake_slack.app_token,
        channels__slack__base_url=fake_slack.api_url,
        channels__slack__dm_policy="open",
        channels__slack__group_policy="open",
    )
    daemon = Daemon(Gateway.build(settings), interactive=False)
    assert set(daemon.channels) == {"telegram", "slack"}
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        await fake_slack.wait_for_socket()

        # Telegram: a private message from an allowed user.
        hello = fake_telegram.user_message(KNOWN_USER, "hello from telegram", user_id=KNOWN_USER)
        fake_telegram.push_update(hello)
        await until(lambda: fake_telegram.sent_messages(KNOWN_USER), "telegram reply")
        [reply] = fake_telegram.sent_messages(KNOWN_USER)
        assert reply["text"] == "echo: hello from telegram"

        # Telegram: a forum-topic message that mentions the bot; the reply stays in the topic.
        topic = fake_telegram.user_message(
            FORUM,
            "@gateway_bot what's up in this topic?",
            user_id=KNOWN_USER,
            chat_type="supergroup",
            chat_title="Team",
            message_thread_id=7,
            is_topic_message=True,
        )
        fake_telegram.push_update(topic)
        await until(lambda: fake_telegram.sent_messages(FORUM), "topic reply")
        [in_topic] = fake_telegram.sent_messages(FORUM)
        assert in_topic.get("message_thread_id") == 7

        # Slack: a mention, a reply in its thread, and a DM.
        mention = fake_slack.app_mention(CHANNEL, ALICE, "hello from slack")
        first = await fake_slack.socket_event(mention)
        ts = mention["event"]["ts"]
        await fake_slack.socket_event(
            fake_slack.app_mention(CHANNEL, ALICE, "and in the thread", thread_ts=ts)
        )
        await fake_slack.socket_event(fake_slack.dm_message(ALICE, "a private word"))
        await until(lambda: len(fake_slack.posted_messages()) >= 3, "slack replies")
        places = [
            (p.params["channel"], p.params.get("thread_ts"))
            for p in fake_slack.calls_to("chat.postMessage")
            if p.ok
        ]
        # Sessions run concurrently, so the DM may be answered first; the thread's two
        # replies are in order, in the thread.
        assert [p for p in places if p[0] == CHANNEL] == [(CHANNEL, ts), (CHANNEL, ts)]
        assert len([p for p in places if p[0].startswith("D") and p[1] is None]) == 1

        # Redeliveries get nothing; a stranger gets a pairing code and no model call.
        fake_telegram.redeliver(hello)
        await fake_slack.redeliver(first)
        calls_before = len(fake_openai.chat_requests)
        fake_telegram.push_update(
            fake_telegram.user_message(STRANGER, "hi?", user_id=STRANGER, username="eve")
        )
        await until(lambda: fake_telegram.sent_messages(STRANGER), "pairing code")
        [code] = fake_telegram.sent_messages(STRANGER)
        assert "pairing code" in code["text"]
        await anyio.sleep(0.5)
        assert len(fake_openai.chat_requests) == calls_before == 5
        assert len(fake_telegram.sent_messages(KNOWN_USER)) == 1
        assert len([p for p in fake_slack.calls_to("chat.postMessage") if p.ok]) == 3
        daemon.stop()
