"""The whole gateway with Telegram: the real daemon (dispatcher, access gate, agent,
HTTP server) in this process, the real python-telegram-bot, the fake Bot API server
and the fake OpenAI server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest

from channels.telegram import TelegramChannel
from channels.telegram.channel import TELEGRAM_WEBHOOK_PATH
from channels.telegram.format import markdown_to_html, split_markdown
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram_server import FakeTelegram, parse_html, utf16_len
from tests.gateway_process import BotApiServer

pytestmark = pytest.mark.anyio

TOKEN = "test-api-token-123"
CHAT = 4242
GROUP = -1001234567890
SECRET = "webhook-secret_42"


@dataclass
class Running:
    daemon: Daemon
    channel: TelegramChannel
    url: str
    settings: Settings


@pytest.fixture
async def fake_tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


@asynccontextmanager
async def gateway(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    fake_tg: BotApiServer,
    **overrides: Any,
) -> AsyncIterator[Running]:
    """A daemon serving the fake bot. Uses the daemon's own Telegram channel when the
    daemon builds one from settings, else adds one (and mounts it for webhooks)."""
    options: dict[str, Any] = {
        "http__port": 0,
        "http__token": TOKEN,
        "channels__telegram__enabled": True,
        "channels__telegram__token": fake_tg.token,
        "channels__telegram__base_url": fake_tg.api_url,
        "channels__telegram__base_file_url": fake_tg.file_url,
        "channels__telegram__poll_timeout": 1,
        "channels__telegram__dm_policy": "open",
        "channels__telegram__group_policy": "open",
    }
    settings = make_settings(fake_openai, **(options | overrides))
    daemon = Daemon(Gateway.build(settings), interactive=False)
    channel = daemon.channels.get("telegram")
    if channel is None:
        channel = TelegramChannel(settings.channels.telegram, token=fake_tg.token)
        daemon.add_channel(channel)
        channel.mount(daemon.http)
    assert isinstance(channel, TelegramChannel)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        with anyio.fail_after(30):
            await channel.live.wait()
        try:
            yield Running(daemon, channel, f"http://127.0.0.1:{port}", settings)
        finally:
            daemon.stop()


async def wait_sent(fake: FakeTelegram, chat: int, count: int, seconds: float = 5) -> list[Any]:
    with anyio.fail_after(seconds):
        while len(fake.sent_messages(chat)) < count:  # noqa: ASYNC110 (polling the fake)
            await anyio.sleep(0.02)
    return fake.sent_messages(chat)


def session_file(settings: Settings, key: str) -> str:
    return (settings.sessions_dir / f"{encode_key(key)}.jsonl").read_text()


async def test_a_private_message_gets_exactly_one_reply_with_typing_before_it(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    fake_openai.add_delay(0.8, "Hello **Alice**!")
    async with gateway(make_settings, fake_openai, fake_tg) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "hi there"))
        await wait_sent(fake_tg, CHAT, 1)
        await anyio.sleep(0.3)
    [reply] = fake_tg.sent_messages(CHAT)
    assert reply["text"] == "Hello Alice!"
    assert reply["entities"] == [{"type": "bold", "offset": 6, "length": 5}]
    assert fake_openai.last_request.last_user_text == "hi there"
    actions = fake_tg.calls_to("sendChatAction")
    assert actions and all(a.params["action"] == "typing" for a in actions)
    [sent] = [c for c in fake_tg.calls_to("sendMessage") if c.ok]
    assert max(a.timestamp for a in actions) <= sent.timestamp
    assert "hi there" in session_file(gw.settings, f"telegram:{CHAT}")


async def test_a_forum_topic_message_is_answered_in_its_topic(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, fake_tg) as gw:
        fake_tg.push_update(
            fake_tg.user_message(
                GROUP,
                "@gateway_bot what now?",
                chat_type="supergroup",
                message_thread_id=7,
                is_topic_message=True,
            )
        )
        [reply] = await wait_sent(fake_tg, GROUP, 1)
    # The mention was cut out; in a group the model sees who wrote (gateway.agent.speakers).
    assert reply["text"] == 'echo: [from "Alice (@alice)"]\nwhat now?'
    assert reply["message_thread_id"] == 7 and reply["is_topic_message"] is True
    assert "what now?" in session_file(gw.settings, f"telegram:{GROUP}:topic:7")


async def test_a_redelivered_update_gets_no_second_reply_also_after_a_restart(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    update = fake_tg.user_message(CHAT, "only once")
    async with gateway(make_settings, fake_openai, fake_tg):
        fake_tg.push_update(update)
        fake_tg.push_update(update)  # the same update twice in one batch
        await wait_sent(fake_tg, CHAT, 1)
        await anyio.sleep(0.3)
    # After a restart the same message arrives again in a new update (as when the
    # offset was never confirmed): the dispatcher's dedupe remembers its message id.
    async with gateway(make_settings, fake_openai, fake_tg):
        fake_tg.push_update({"message": update["message"]})
        with anyio.fail_after(5):
            while fake_tg.pending_updates:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        await anyio.sleep(0.3)
    assert [m["text"] for m in fake_tg.sent_messages(CHAT)] == ["echo: only once"]
    assert len(fake_openai.chat_requests) == 1


async def test_a_flood_control_storm_delays_but_loses_nothing(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    fake_tg.fail_next("sendMessage", 429, retry_after=1, count=2)
    async with gateway(make_settings, fake_openai, fake_tg):
        fake_tg.push_update(fake_tg.user_message(CHAT, "first"))
        fake_tg.push_update(fake_tg.user_message(CHAT, "second"))
        await wait_sent(fake_tg, CHAT, 2, seconds=8)
        await anyio.sleep(0.2)
    assert [m["text"] for m in fake_tg.sent_messages(CHAT)] == ["echo: first", "echo: second"]
    statuses = [c.status for c in fake_tg.calls_to("sendMessage")]
    assert statuses == [429, 429, 200, 200]


def long_reply() -> str:
    """A reply of 9-12k characters: prose with markup, then a 230-line code block, past
    Telegram's 4096-character limit several times (the long-reply tests' input)."""
    prose = "\n\n".join(f"Part {i}: " + "some *careful* words " * 20 for i in range(9))
    code = "```python\n" + "\n".join(f"print('line {i}')  # <{i}>" for i in range(230)) + "\n```"
    reply = f"{prose}\n\n{code}\n\nThat is **all**."
    assert 9_000 < len(reply) < 12_000
    return reply


async def test_a_long_reply_arrives_split_and_in_order(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    reply = long_reply()
    fake_openai.add_reply(reply)
    expected = [parse_html(markdown_to_html(chunk))[0] for chunk in split_markdown(reply)]
    # Splitting is what this test is about: no code block goes out as a file.
    async with gateway(make_settings, fake_openai, fake_tg, media__code_block_file_chars=0):
        fake_tg.push_update(fake_tg.user_message(CHAT, "write a lot"))
        await wait_sent(fake_tg, CHAT, len(expected))
        await anyio.sleep(0.3)
    sent = fake_tg.sent_messages(CHAT)
    assert [m["text"] for m in sent] == expected
    assert len(sent) >= 3 and all(utf16_len(m["text"]) <= 4096 for m in sent)
    assert "print('line 0')" in sent[0]["text"] or "print('line 0')" in sent[1]["text"]
    pres = [e for m in sent for e in m.get("entities", []) if e["type"] == "pre"]
    assert len(pres) >= 2 and {e.get("language") for e in pres} == {"python"}
    assert sent[-1]["text"].endswith("That is all.")


async def test_html_telegram_refuses_falls_back_to_plain_text(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    fake_openai.add_reply("A **bold** claim")
    fake_tg.fail_next(
        "sendMessage", 400, description="Bad Request: can't parse entities: Unclosed start tag"
    )
    async with gateway(make_settings, fake_openai, fake_tg):
        fake_tg.push_update(fake_tg.user_message(CHAT, "claim something"))
        [reply] = await wait_sent(fake_tg, CHAT, 1)
    assert reply["text"] == "A **bold** claim"
    assert "parse_mode" not in fake_tg.calls_to("sendMessage")[-1].params


async def test_in_groups_only_messages_for_the_bot_are_answered(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, fake_tg):
        fake_tg.push_update(
            fake_tg.user_message(GROUP, "chatting among us", chat_type="supergroup")
        )
        fake_tg.push_update(
            fake_tg.user_message(GROUP, "@gateway_bot are you there?", chat_type="supergroup")
        )
        await wait_sent(fake_tg, GROUP, 1)
        fake_tg.push_update(
            fake_tg.user_message(GROUP, "and this?", chat_type="supergroup", reply_to_bot=True)
        )
        await wait_sent(fake_tg, GROUP, 2)
        await anyio.sleep(0.3)
    sent = fake_tg.sent_messages(GROUP)
    sender = '[from "Alice (@alice)"]'
    assert [m["text"].splitlines()[0] for m in sent] == [f"echo: {sender}", f"echo: {sender}"]
    assert [m["text"].splitlines()[-1] for m in sent] == ["are you there?", "and this?"]
    said = [(r.last_user_text or "").splitlines() for r in fake_openai.chat_requests]
    assert [lines[-1] for lines in said] == ["are you there?", "and this?"]
    assert all(lines[0] == sender for lines in said)


async def test_a_stranger_gets_a_pairing_code_and_never_reaches_the_llm(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(
        make_settings, fake_openai, fake_tg, channels__telegram__dm_policy="pairing"
    ) as gw:
        fake_tg.push_update(fake_tg.user_message(CHAT, "/start"))
        [reply] = await wait_sent(fake_tg, CHAT, 1)
        [pending] = gw.daemon.pairing.list("telegram").pending
    assert pending.code in reply["text"] and "pairing code" in reply["text"]
    assert pending.sender_id == str(CHAT)
    assert fake_openai.chat_requests == []


async def test_webhook_mode_answers_only_with_the_right_secret(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    webhook = {
        "channels__telegram__mode": "webhook",
        "channels__telegram__webhook_url": "https://bot.example.org/telegram/webhook",
        "channels__telegram__webhook_secret": SECRET,
    }
    async with gateway(make_settings, fake_openai, fake_tg, **webhook) as gw:
        assert fake_tg.webhook["secret_token"] == SECRET
        target = gw.url + TELEGRAM_WEBHOOK_PATH
        update = fake_tg.user_message(CHAT, "via webhook")
        wrong = await fake_tg.deliver_webhook(update, target, secret_token="not-it")
        missing = await fake_tg.deliver_webhook(update, target, secret_token=None)
        assert (wrong.status, missing.status) == (403, 403)
        await anyio.sleep(0.2)
        assert fake_tg.sent_messages(CHAT) == []
        right = await fake_tg.deliver_webhook(update, target)
        again = await fake_tg.deliver_webhook(update, target)  # Telegram retried it
        assert (right.status, again.status) == (200, 200)
        await wait_sent(fake_tg, CHAT, 1)
        await anyio.sleep(0.3)
    assert [m["text"] for m in fake_tg.sent_messages(CHAT)] == ["echo: via webhook"]
    assert fake_tg.calls_to("getUpdates") == []


async def test_a_webhook_update_is_journaled_before_the_200(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    """Journal before confirm: the 200 Telegram gets for a webhook update comes after
    the message is in the journal, while its turn is still with the model."""
    import json
    import sqlite3

    webhook = {
        "channels__telegram__mode": "webhook",
        "channels__telegram__webhook_url": "https://bot.example.org/telegram/webhook",
        "channels__telegram__webhook_secret": SECRET,
    }
    fake_openai.add_delay(1.0, "slow answer")
    async with gateway(make_settings, fake_openai, fake_tg, **webhook) as gw:
        target = gw.url + TELEGRAM_WEBHOOK_PATH
        delivery = await fake_tg.deliver_webhook(fake_tg.user_message(CHAT, "keep me"), target)
        assert delivery.status == 200
        with sqlite3.connect(gw.settings.workspace_path / "dedupe.sqlite") as conn:
            rows = conn.execute("SELECT message FROM inbox").fetchall()
        assert [json.loads(row[0])["text"] for row in rows] == ["keep me"]
        assert fake_tg.sent_messages(CHAT) == []
        await wait_sent(fake_tg, CHAT, 1)
        gw.channel.pause_intake()
        late = await fake_tg.deliver_webhook(fake_tg.user_message(CHAT, "too late"), target)
        assert late.status == 503
    assert [m["text"] for m in fake_tg.sent_messages(CHAT)] == ["slow answer"]


async def test_a_refused_bot_token_shows_on_readyz_in_the_channels_own_words(
    fake_openai: FakeOpenAI,
    fake_tg: FakeTelegram,
    make_settings: Callable[..., Settings],
) -> None:
    wrong_token = "123456:not-the-bots-token"  # well formed: the Bot API answers 401
    settings = make_settings(
        fake_openai,
        http__port=0,
        channels__telegram__enabled=True,
        channels__telegram__token=wrong_token,
        channels__telegram__base_url=fake_tg.api_url,
        channels__telegram__base_file_url=fake_tg.file_url,
    )
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        try:
            async with aiohttp.ClientSession() as http:
                with anyio.fail_after(5):
                    while True:
                        async with http.get(f"http://127.0.0.1:{port}/readyz") as resp:
                            status, body = resp.status, await resp.json()
                        telegram = body["components"]["telegram"]
                        if telegram["detail"] != "not reported yet":
                            break
                        await anyio.sleep(0.05)
        finally:
            daemon.stop()
    assert status == 503 and telegram["healthy"] is False
    assert telegram["detail"].startswith("TelegramSetupError: telegram: ")
    assert "refused the bot token" in telegram["detail"]
    assert "ExceptionGroup" not in telegram["detail"] and wrong_token not in str(body)
