"""The real Telegram channel (python-telegram-bot inside the real daemon) against
telegram-test-api, a Bot API emulator we did not write (tests/emulators/): a direct
message, a group mention, a long reply split under the limit, and no second answer to
a repeated update. Where the emulator departs from the Bot API, and how the harness
copes, is listed in docs/telegram-emulator.md.

Marked `telegram_emulator`; skipped without node or the installed emulator, except under
CI=true, where that fails."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from gateway.config import Settings
from tests.emulators.telegram_emulator import (
    BOT_USERNAME,
    TOKEN,
    EmulatorBridge,
    TelegramEmulator,
    require_emulator,
)
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, telegram_env
from tests.test_telegram_e2e import gateway, long_reply, session_file

pytestmark = [pytest.mark.anyio, pytest.mark.telegram_emulator]

CHAT = 4242
GROUP = -1001234567890
GROUP_MEMBER = 1001
# "Text of the message to be sent, 1-4096 characters after entities parsing"
# (https://core.telegram.org/bots/api#sendmessage), counted in UTF-16 code units.
BOT_API_TEXT_LIMIT = 4096
TOKEN_TAIL = TOKEN.split(":", 1)[1]  # the secret part: never in a log line


@pytest.fixture
def emulator() -> Iterator[TelegramEmulator]:
    with TelegramEmulator(require_emulator()) as running:
        yield running


@pytest.fixture
async def bridge(emulator: TelegramEmulator) -> AsyncIterator[EmulatorBridge]:
    async with EmulatorBridge(emulator) as server:
        yield server


def mention(text: str) -> list[dict[str, Any]]:
    """The mention entity Telegram's server adds to a text that starts with the bot's
    @username (the emulator adds none)."""
    assert text.startswith(f"@{BOT_USERNAME}")
    return [{"type": "mention", "offset": 0, "length": len(BOT_USERNAME) + 1}]


class _VisibleText(HTMLParser):
    """The text a Telegram user sees of an HTML message (the standard library's parser,
    not ours: the emulator does not parse entities)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []

    def handle_data(self, data: str) -> None:
        self.parts.append(data)


def visible_text(message: dict[str, Any]) -> str:
    if message.get("parse_mode") != "HTML":
        return str(message["text"])
    parser = _VisibleText()
    parser.feed(message["text"])
    parser.close()
    return unescape("".join(parser.parts))


def utf16_units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


async def test_a_direct_message_gets_one_answer_and_is_confirmed_by_offset(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, bridge) as gw:
        await emulator.send_user_message(CHAT, "hi there")
        [first] = await emulator.wait_bot_messages(CHAT, 1)
        with anyio.fail_after(30):
            await bridge.wait_confirmed(2)  # the emulator's first update_id is 1
        await emulator.send_user_message(CHAT, "and again")
        sent = await emulator.wait_bot_messages(CHAT, 2)
    assert first["text"] == "echo: hi there" and first["parse_mode"] == "HTML"
    assert [m["text"] for m in sent] == ["echo: hi there", "echo: and again"]
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["hi there", "and again"]
    assert "hi there" in session_file(gw.settings, f"telegram:{CHAT}")
    # Each update was handed out once: confirmed by the next call's offset, never again.
    served = [u["update_id"] for u in bridge.served()]
    assert len(served) == 2 and len(set(served)) == 2


async def test_in_a_group_only_a_mention_of_the_bot_is_answered_quoting_it(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    asked = f"@{BOT_USERNAME} are you there?"
    async with gateway(make_settings, fake_openai, bridge) as gw:
        await emulator.send_user_message(
            GROUP, "chatting among us", chat_type="supergroup", user_id=GROUP_MEMBER
        )
        await emulator.send_user_message(
            GROUP, asked, chat_type="supergroup", user_id=GROUP_MEMBER, entities=mention(asked)
        )
        [reply] = await emulator.wait_bot_messages(GROUP, 1)
        then = f"@{BOT_USERNAME}, and now?"
        await emulator.send_user_message(
            GROUP, then, chat_type="supergroup", user_id=GROUP_MEMBER, entities=mention(then)
        )
        sent = await emulator.wait_bot_messages(GROUP, 2)
    # In a group the model sees who wrote (gateway.agent.speakers).
    said = ['[from "Alice (@alice)"]\nare you there?', '[from "Alice (@alice)"]\nand now?']
    assert [m["text"] for m in sent] == [f"echo: {text}" for text in said]
    assert [r.last_user_text for r in fake_openai.chat_requests] == said
    [asked_record] = [r for r in await emulator.history() if r["message"].get("text") == asked]
    quoted = json.loads(reply["reply_parameters"])
    assert quoted["message_id"] == asked_record["messageId"]
    assert "are you there?" in session_file(gw.settings, f"telegram:{GROUP}")


async def test_a_long_reply_arrives_split_under_the_limit_in_order(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    reply = long_reply()
    fake_openai.add_reply(reply)
    # Splitting is what this test is about: no code block goes out as a file.
    async with gateway(make_settings, fake_openai, bridge, media__code_block_file_chars=0):
        await emulator.send_user_message(CHAT, "write a lot")
        await emulator.send_user_message(CHAT, "thanks")  # answered after every piece
        sent = await emulator.wait_bot_messages(CHAT, ending="echo: thanks")
    pieces = [visible_text(m) for m in sent[:-1]]
    assert len(pieces) >= 3
    assert all(0 < utf16_units(p) <= BOT_API_TEXT_LIMIT for p in pieces)
    joined = "\n".join(pieces)
    order = [joined.index(f"Part {i}: ") for i in range(9)]
    order += [joined.index(f"print('line {i}')  # <{i}>") for i in range(230)]
    assert order == sorted(order)
    assert pieces[-1].endswith("That is all.") and "**" not in joined


async def test_a_repeated_update_gets_no_second_answer(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, bridge):
        await emulator.send_user_message(CHAT, "only once")
        await emulator.wait_bot_messages(CHAT, 1)
        with anyio.fail_after(30):
            await bridge.wait_confirmed(2)
        [update] = bridge.served(1)
        bridge.replay(update)  # the same update_id and message again
        await emulator.send_user_message(CHAT, "next")  # handled after the replay
        sent = await emulator.wait_bot_messages(CHAT, 2)
    assert len(bridge.served(1)) == 2
    assert [m["text"] for m in sent] == ["echo: only once", "echo: next"]
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["only once", "next"]


async def test_a_repeated_update_after_a_restart_gets_no_second_answer(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
) -> None:
    async with gateway(make_settings, fake_openai, bridge):
        await emulator.send_user_message(CHAT, "only once")
        await emulator.wait_bot_messages(CHAT, 1)
    [update] = bridge.served(1)
    # The new process is handed the update again, as Telegram does when the old one died
    # before its next getUpdates confirmed it; only the journal can tell it was answered.
    bridge.replay(update)
    async with gateway(make_settings, fake_openai, bridge) as gw:
        await emulator.send_user_message(CHAT, "next")
        sent = await emulator.wait_bot_messages(CHAT, 2)
    assert len(bridge.served(1)) == 2
    assert [m["text"] for m in sent] == ["echo: only once", "echo: next"]
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["only once", "next"]
    assert session_file(gw.settings, f"telegram:{CHAT}").count('"only once"') == 1


async def test_gateway_run_answers_once_and_again_nothing_twice_after_a_restart(
    emulator: TelegramEmulator,
    bridge: EmulatorBridge,
    fake_openai: FakeOpenAI,
    tmp_path: Path,
) -> None:
    """The same through `gateway run` processes: SIGTERM drains and stops the first; the
    second is handed the first's update again and answers only what is new."""
    env = telegram_env(tmp_path / "ws", fake_openai, bridge)
    logs: list[str] = []
    for text in ("only once", "next"):
        process = GatewayProcess(env, tmp_path)
        try:
            await anyio.to_thread.run_sync(process.wait_for_line, "is live (long polling)")
            await emulator.send_user_message(CHAT, text)
            await emulator.wait_bot_messages(CHAT, ending=f"echo: {text}")
            assert await anyio.to_thread.run_sync(process.terminate) == 0
        finally:
            process.stop()
            logs += process.log
        if text == "only once":
            bridge.replay(bridge.served(1)[0])
    assert len(bridge.served(1)) == 2, "the second process was never handed the old update"
    sent = await emulator.bot_messages(CHAT)
    assert [m["text"] for m in sent] == ["echo: only once", "echo: next"]
    assert [r.last_user_text for r in fake_openai.chat_requests] == ["only once", "next"]
    assert not [line for line in logs if "Traceback" in line or TOKEN_TAIL in line]


async def test_the_emulator_still_departs_from_the_bot_api_where_the_harness_corrects_it(
    emulator: TelegramEmulator,
) -> None:
    """The departures the bridge and the tests work around (docs/telegram-emulator.md,
    rows 1, 2, 9, 12 and 14), asked of the emulator directly: when a new version fixes
    one, this fails and the workaround can go."""
    api = f"{emulator.url}/bot{TOKEN}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{api}/getMe") as response:
            me = (await response.json())["result"]
        assert "is_bot" not in me  # row 12: the Bot API always sends it

        text = f"@{BOT_USERNAME} /start"
        await emulator.send_user_message(CHAT, text)
        async with http.post(f"{api}/getUpdates", data={"timeout": "5"}) as response:
            [update] = (await response.json())["result"]
        assert "entities" not in update["message"]  # row 9: no mention, no bot_command
        # Row 2: a long poll of 600 s with nothing pending is answered at once; row 1:
        # the update is gone, though no offset confirmed it.
        with anyio.fail_after(60):
            async with http.post(f"{api}/getUpdates", data={"offset": "0", "timeout": "600"}) as r:
                again = (await r.json())["result"]
        assert again == []

        async with http.post(f"{api}/sendMessage", data={"chat_id": str(CHAT), "text": "x"}) as r:
            sent = (await r.json())["result"]
        assert sent["date"] > 10**12  # row 14: milliseconds, not Unix seconds


@pytest.mark.parametrize("ci", ["true", None])
def test_a_missing_emulator_fails_under_ci_and_skips_elsewhere(
    ci: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setattr(
        "tests.emulators.telegram_emulator.EMULATOR_PACKAGE", tmp_path / "not-installed"
    )
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    expected = pytest.fail.Exception if ci == "true" else pytest.skip.Exception
    with pytest.raises(expected, match=r"scripts/install-emulators\.sh"):
        require_emulator()
