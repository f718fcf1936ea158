"""The fake Telegram Bot API is faithful: the real python-telegram-bot runs against it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import telegram
from aiohttp import web
from telegram import Update
from telegram.error import BadRequest, Conflict, Forbidden, InvalidToken, NetworkError, RetryAfter
from telegram.ext import Application, ApplicationBuilder, BaseHandler, ContextTypes, MessageHandler
from telegram.ext import filters as tg_filters

from tests.fakes.telegram_server import (
    WEBHOOK_SECRET_HEADER,
    EntityParseError,
    FakeTelegram,
    detect_entities,
    parse_html,
)

pytestmark = pytest.mark.anyio

CHAT = 4242
GROUP = -1001234567890


@pytest.fixture
async def fake() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(bot_username="gateway_bot") as server:
        yield server


@pytest.fixture
async def bot(fake: FakeTelegram) -> AsyncIterator[telegram.Bot]:
    async with telegram.Bot(
        fake.token, base_url=fake.api_url, base_file_url=fake.file_url
    ) as client:
        yield client


@contextlib.asynccontextmanager
async def polling_app(
    fake: FakeTelegram, *handlers: BaseHandler[Any, Any, Any]
) -> AsyncIterator[Application[Any, Any, Any, Any, Any, Any]]:
    """A real PTB Application polling the fake, the way the Telegram channel runs one."""
    app = (
        ApplicationBuilder()
        .token(fake.token)
        .base_url(fake.api_url)
        .base_file_url(fake.file_url)
        .build()
    )
    for handler in handlers:
        app.add_handler(handler)
    async with app:
        await app.start()
        assert app.updater is not None
        await app.updater.start_polling(poll_interval=0, timeout=1)
        try:
            yield app
        finally:
            await app.updater.stop()
            await app.stop()


async def test_get_me_identifies_the_bot(fake: FakeTelegram, bot: telegram.Bot) -> None:
    me = await bot.get_me()

    assert me.id == 123456789  # the token's numeric prefix, as on the real server
    assert me.is_bot and me.username == "gateway_bot"
    assert bot.base_url == f"{fake.url}/bot{fake.token}"
    assert [c.method for c in fake.calls] == ["getMe", "getMe"]  # initialize() + ours


async def test_pushed_update_reaches_a_message_handler_and_the_reply_is_recorded(
    fake: FakeTelegram,
) -> None:
    seen: list[Update] = []

    async def echo(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        assert update.message is not None and update.message.text is not None
        seen.append(update)
        await update.message.reply_text(f"echo: {update.message.text}", do_quote=True)

    async with polling_app(fake, MessageHandler(tg_filters.TEXT, echo)):
        pushed = fake.push_update(fake.user_message(CHAT, "hello there", username="bob"))
        async with asyncio.timeout(5):
            [call] = await fake.wait_for_calls_async("sendMessage")

    assert seen[0].update_id == pushed["update_id"]
    assert seen[0].effective_user is not None and seen[0].effective_user.username == "bob"
    assert seen[0].effective_chat is not None and seen[0].effective_chat.type == "private"
    assert call.content_type == "application/x-www-form-urlencoded"  # how PTB sends
    [reply] = fake.sent_messages(CHAT)
    assert reply["text"] == "echo: hello there"
    assert reply["from"]["username"] == "gateway_bot"
    assert reply["reply_to_message"]["message_id"] == pushed["message"]["message_id"]
    assert reply["message_id"] == pushed["message"]["message_id"] + 1  # ids are per chat
    assert fake.pending_updates == []  # Updater.stop() confirmed what it fetched


async def test_polling_confirms_updates_so_a_restart_gets_no_redelivery(
    fake: FakeTelegram,
) -> None:
    handled: list[int] = []
    both_handled = asyncio.Event()

    async def record(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        handled.append(update.update_id)
        if len(handled) == 2:
            both_handled.set()

    handler = MessageHandler(tg_filters.ALL, record)
    async with polling_app(fake, handler):
        fake.push_update(fake.user_message(CHAT, "one"))
        fake.push_update(fake.user_message(CHAT, "two"))
        async with asyncio.timeout(5):
            await both_handled.wait()
    polls_before = len(fake.calls_to("getUpdates"))

    async with polling_app(fake, handler):
        async with asyncio.timeout(5):
            await fake.wait_for_calls_async("getUpdates", polls_before + 1)

    assert len(handled) == 2
    restarted = fake.calls_to("getUpdates")[polls_before:]
    assert all(call.result == [] for call in restarted)


async def test_get_updates_offsets_limits_and_long_polling(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    first, second, third = (fake.push_update(fake.user_message(CHAT, t)) for t in "abc")

    batch = await bot.get_updates(limit=2, timeout=0)
    assert [u.update_id for u in batch] == [first["update_id"], second["update_id"]]
    again = await bot.get_updates(timeout=0)  # nothing confirmed yet: all three again
    assert [u.update_id for u in again] == [u["update_id"] for u in (first, second, third)]
    rest = await bot.get_updates(offset=second["update_id"] + 1, timeout=0)
    assert [u.update_id for u in rest] == [third["update_id"]]
    assert [u["update_id"] for u in fake.pending_updates] == [third["update_id"]]

    fake.redeliver(second)  # a confirmed id is never handed out again, as on Telegram
    assert await bot.get_updates(offset=third["update_id"] + 1, timeout=0) == ()

    started = time.monotonic()
    poll = asyncio.create_task(bot.get_updates(offset=third["update_id"] + 1, timeout=5))
    await asyncio.sleep(0.2)
    assert not poll.done()  # held open: long polling
    late = fake.push_update(fake.user_message(CHAT, "late"))
    [update] = await poll
    assert update.update_id == late["update_id"]
    assert time.monotonic() - started < 2

    started = time.monotonic()
    assert await bot.get_updates(offset=late["update_id"] + 1, timeout=1) == ()
    assert time.monotonic() - started >= 0.9


# -- the Bot API's delivery contract, which "never lost, never stored twice" rests on ----


async def test_an_update_stays_pending_until_a_later_offset_confirms_it(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    first, second = (fake.push_update(fake.user_message(CHAT, t)) for t in ("one", "two"))
    ids = [first["update_id"], second["update_id"]]
    for _ in range(3):  # fetched, but not confirmed: handed out again, every time
        assert [u.update_id for u in await bot.get_updates(timeout=0)] == ids
    assert await bot.get_updates(offset=ids[0], timeout=0)  # offset == id: not confirmed
    assert fake.confirmed_ids == []

    [rest] = await bot.get_updates(offset=ids[0] + 1, timeout=0)
    assert rest.update_id == ids[1]
    assert fake.confirmed_ids == [ids[0]]
    assert fake.confirmed_offset == ids[0] + 1
    # The poll log: the confirmation happened when that call arrived, before its answer.
    poll = fake.polls[-1]
    assert (poll.offset, poll.confirmed, poll.update_ids) == (ids[0] + 1, (ids[0],), (ids[1],))
    assert poll.outcome == "ok"
    assert poll.answered_at is not None and poll.received_at <= poll.answered_at


async def test_allowed_updates_filters_only_updates_created_after_it(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    """getUpdates: allowed_updates "doesn't affect updates created before the call to
    getUpdates, so unwanted updates may be received for a short period of time"."""
    first = fake.user_message(CHAT, "typo")
    before = fake.push_update(fake.edited_message(first, "fixed"))
    [early] = await bot.get_updates(timeout=0, allowed_updates=["message"])
    assert early.update_id == before["update_id"] and early.edited_message is not None

    fake.push_update(fake.edited_message(first, "fixed again"))  # not wanted: never stored
    after = fake.push_update(fake.user_message(CHAT, "hello"))
    updates = await bot.get_updates(offset=early.update_id + 1, timeout=0)
    assert [u.update_id for u in updates] == [after["update_id"]]
    assert updates[0].message is not None and updates[0].message.text == "hello"
    assert fake.pending_updates == [after]


async def test_get_updates_returns_at_most_100_updates_per_call(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    pushed = [fake.push_update(fake.user_message(CHAT, f"m{i}"))["update_id"] for i in range(250)]

    assert len(await bot.get_updates(timeout=0)) == 100  # the default limit
    assert len(await bot.get_updates(limit=7, timeout=0)) == 7
    assert len(await bot.get_updates(limit=1000, timeout=0)) == 100  # 1-100 accepted
    received: list[int] = []
    offset = 0
    while batch := await bot.get_updates(offset=offset, timeout=0):
        assert len(batch) <= 100
        received += [u.update_id for u in batch]
        offset = batch[-1].update_id + 1
    assert received == pushed  # in update_id order, each once
    assert [len(p.update_ids) for p in fake.polls[-4:]] == [100, 100, 50, 0]


async def test_a_confirmed_update_is_never_returned_again(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    first, second, third = (fake.push_update(fake.user_message(CHAT, t)) for t in "abc")
    await bot.get_updates(offset=second["update_id"] + 1, timeout=0)

    fake.redeliver(first)  # the server has forgotten it: nothing to hand out again
    fake.redeliver(third)  # pending already: still there once
    # Not even to a call without offset, or with an offset below the confirmed one.
    for offset in (None, first["update_id"]):
        [update] = await bot.get_updates(offset=offset, timeout=0)
        assert update.update_id == third["update_id"]
    with pytest.raises(ValueError, match="below the confirmed offset"):
        fake.push_update(first)

    # A negative offset keeps the last -offset updates and forgets the others.
    fourth, fifth = (fake.push_update(fake.user_message(CHAT, t)) for t in "de")
    kept = await bot.get_updates(offset=-1, timeout=0)
    assert [u.update_id for u in kept] == [fifth["update_id"]]
    assert fake.confirmed_ids == [
        first["update_id"],
        second["update_id"],
        third["update_id"],
        fourth["update_id"],
    ]
    assert [u.update_id for u in await bot.get_updates(timeout=0)] == [fifth["update_id"]]


async def test_ids_pending_updates_and_sent_messages_survive_a_restart_of_the_fake(
    tmp_path: Path,
) -> None:
    state = tmp_path / "telegram-state.json"
    async with FakeTelegram(state_path=state) as fake:
        one, two, three = (fake.push_update(fake.user_message(CHAT, t)) for t in "abc")
        async with telegram.Bot(fake.token, base_url=fake.api_url) as bot:
            await bot.get_updates(offset=one["update_id"] + 1, timeout=0)  # confirms "a"
            reply = await bot.send_message(CHAT, "echo: a")
    assert reply.message_id == one["message"]["message_id"] + 3  # after a, b and c

    async with FakeTelegram(state_path=state) as restarted:
        assert restarted.pending_updates == [two, three]
        assert [m["text"] for m in restarted.sent_messages(CHAT)] == ["echo: a"]
        later = restarted.user_message(CHAT, "d")
        assert later["update_id"] == three["update_id"] + 1
        assert later["message"]["message_id"] == reply.message_id + 1
        restarted.push_update(later)
        async with telegram.Bot(restarted.token, base_url=restarted.api_url) as bot:
            # The bot's own offset went with the process: a call without offset gets
            # everything unconfirmed, and never the confirmed update.
            updates = await bot.get_updates(timeout=0)
            assert [u.update_id for u in updates] == [u["update_id"] for u in (two, three, later)]
            await bot.edit_message_text("echo: a!", chat_id=CHAT, message_id=reply.message_id)
        assert [m["text"] for m in restarted.sent_messages(CHAT)] == ["echo: a", "echo: a!"]

    async with FakeTelegram(state_path=state) as again:  # every change was written
        assert again.pending_updates == [two, three, later]
        assert len(again.sent_messages()) == 2


def test_confirmations_can_be_awaited_and_hooked() -> None:
    with FakeTelegram.in_thread() as fake:
        pushed = [fake.push_update(fake.user_message(CHAT, t))["update_id"] for t in "ab"]
        hooked: list[tuple[tuple[int, ...], list[Any]]] = []
        # Called before the confirming call is answered: the pending updates are gone.
        fake.on_confirm = lambda ids: hooked.append((ids, fake.pending_updates))

        async def poll_twice() -> None:
            async with telegram.Bot(fake.token, base_url=fake.api_url) as bot:
                await bot.get_updates(timeout=0)
                await bot.get_updates(offset=pushed[-1] + 1, timeout=0)

        with pytest.raises(TimeoutError, match="0 of 1 updates confirmed"):
            fake.wait_for_confirmed(1, timeout=0.1)
        asyncio.run(poll_twice())
        assert fake.wait_for_confirmed(2, timeout=5) == pushed
        assert hooked == [(tuple(pushed), [])]


async def test_a_second_poller_terminates_the_first(fake: FakeTelegram, bot: telegram.Bot) -> None:
    first = asyncio.create_task(bot.get_updates(timeout=5))
    await asyncio.sleep(0.1)
    # The real server answers the older request with 409 when a newer one arrives.
    async with telegram.Bot(fake.token, base_url=fake.api_url) as other:
        assert await other.get_updates(timeout=0) == ()
    with pytest.raises(Conflict, match="terminated by other getUpdates request"):
        await first


async def test_html_is_parsed_into_entities(fake: FakeTelegram, bot: telegram.Bot) -> None:
    html = (
        '😀 <b>bold <i>both</i></b> &amp; <a href="https://example.org/?a=1&amp;b=2">link</a>\n'
        '<pre><code class="language-python">x = 1</code></pre>'
        "<tg-spoiler>hidden</tg-spoiler><blockquote expandable>quote</blockquote>"
    )
    message = await bot.send_message(CHAT, html, parse_mode="HTML")

    assert message.text == "😀 bold both & link\nx = 1hiddenquote"
    kinds = [(e.type, message.parse_entity(e)) for e in message.entities]
    assert kinds == [
        ("bold", "bold both"),
        ("italic", "both"),
        ("text_link", "link"),
        ("pre", "x = 1"),
        ("spoiler", "hidden"),
        ("expandable_blockquote", "quote"),
    ]
    assert message.entities[0].offset == 3  # UTF-16: the emoji counts twice
    assert message.entities[2].url == "https://example.org/?a=1&b=2"
    assert message.entities[3].language == "python"


async def test_bad_html_is_a_bad_request_with_telegrams_wording(bot: telegram.Bot) -> None:
    with pytest.raises(BadRequest, match='Can\'t parse entities: unsupported start tag "p"'):
        await bot.send_message(CHAT, "<p>paragraph</p>", parse_mode="HTML")
    with pytest.raises(BadRequest, match='find end tag corresponding to start tag "b"'):
        await bot.send_message(CHAT, "<b>never closed", parse_mode="HTML")
    # The same text is fine without a parse mode.
    message = await bot.send_message(CHAT, "<b>never closed")
    assert message.text == "<b>never closed"


@pytest.mark.parametrize(
    ("html", "error"),
    [
        ("<b>x", 'Can\'t find end tag corresponding to start tag "b"'),
        ("<b>x</i>", 'Unmatched end tag at byte offset 4, expected "</b>", found "</i>"'),
        ("a < b", 'Unsupported start tag "" at byte offset 2'),
        ("é<br>", 'Unsupported start tag "br" at byte offset 2'),
        ("x</b>", "Unexpected end tag at byte offset 1"),
        ("<span>x</span>", 'Tag "span" must have class "tg-spoiler" at byte offset 0'),
        ("<a href=x", "Unexpected end of name token at byte offset 8"),
        ("<b", "Unclosed start tag at byte offset 0"),
        (
            "<code x>y</code>",
            'Expected equal sign in declaration of an attribute of the tag "code"',
        ),
    ],
)
def test_parse_html_rejects_what_telegram_rejects(html: str, error: str) -> None:
    with pytest.raises(EntityParseError) as caught:
        parse_html(html)
    assert str(caught.value).startswith(error)


def test_parse_html_decodes_entities_and_counts_utf16() -> None:
    assert parse_html("&lt;b&gt; &quot;q&quot; &#33;&#x41; &unknown; 5 &gt 3") == (
        '<b> "q" !A &unknown; 5 &gt 3',
        [],
    )
    assert parse_html(
        '<span class="tg-spoiler">s</span><tg-emoji emoji-id="5368">👍</tg-emoji>'
    ) == (
        "s👍",
        [
            {"type": "spoiler", "offset": 0, "length": 1},
            {"type": "custom_emoji", "offset": 1, "length": 2, "custom_emoji_id": "5368"},
        ],
    )
    assert detect_entities("/start@gateway_bot hi @gateway_bot see https://x.org #tag") == [
        {"type": "bot_command", "offset": 0, "length": 18},
        {"type": "mention", "offset": 22, "length": 12},
        {"type": "url", "offset": 39, "length": 13},
        {"type": "hashtag", "offset": 53, "length": 4},
    ]


async def test_text_limits_are_counted_in_utf16_units(bot: telegram.Bot) -> None:
    await bot.send_message(CHAT, "😀" * 2048)  # 4096 UTF-16 code units: the limit
    with pytest.raises(BadRequest, match="Message is too long"):
        await bot.send_message(CHAT, "😀" * 2048 + "x")
    with pytest.raises(BadRequest, match="Message text is empty"):
        await bot.send_message(CHAT, "")
    with pytest.raises(BadRequest, match="Message text is empty"):
        await bot.send_message(CHAT, "<b> </b>", parse_mode="HTML")


async def test_flood_control_raises_retry_after(fake: FakeTelegram, bot: telegram.Bot) -> None:
    fake.fail_next("sendMessage", 429, retry_after=7)

    with pytest.raises(RetryAfter) as caught:
        await bot.send_message(CHAT, "too fast")
    assert caught.value.retry_after == 7
    await bot.send_message(CHAT, "later")  # one fault, consumed

    failed, sent = fake.calls_to("sendMessage")
    assert failed.status == 429
    assert failed.response == {
        "ok": False,
        "error_code": 429,
        "description": "Too Many Requests: retry after 7",
        "parameters": {"retry_after": 7},
    }
    assert sent.ok and [m["text"] for m in fake.sent_messages()] == ["later"]


async def test_scripted_errors_map_to_ptb_exceptions(fake: FakeTelegram, bot: telegram.Bot) -> None:
    fake.fail_next("sendMessage", 403)
    fake.fail_next("*", 502)
    with pytest.raises(Forbidden, match="bot was blocked by the user"):
        await bot.send_message(CHAT, "x")
    with pytest.raises(NetworkError, match="Bad Gateway"):
        await bot.send_chat_action(CHAT, "typing")
    with pytest.raises(telegram.error.EndPointNotFound):
        await bot.do_api_request("sendTelepathy")
    with pytest.raises(InvalidToken, match="rejected by the server"):
        async with telegram.Bot("123456789:WrongTokenWrongToken", base_url=fake.api_url):
            pass


async def test_forum_topic_thread_id_round_trips(fake: FakeTelegram) -> None:
    seen: list[telegram.Message] = []

    async def answer(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        assert update.message is not None
        seen.append(update.message)
        await update.message.reply_text("in the topic")  # PTB keeps the topic by itself

    async with polling_app(fake, MessageHandler(tg_filters.TEXT, answer)):
        fake.push_update(
            fake.user_message(
                GROUP,
                "@gateway_bot help",
                chat_type="supergroup",
                message_thread_id=77,
                is_topic_message=True,
            )
        )
        async with asyncio.timeout(5):
            await fake.wait_for_calls_async("sendMessage")

    [incoming] = seen
    assert incoming.is_topic_message and incoming.message_thread_id == 77
    assert incoming.message_id > 77  # the topic was created before the message
    assert incoming.chat.is_forum
    # Gotcha: in a topic every message "replies" to the topic's creation message.
    assert incoming.reply_to_message is not None
    assert incoming.reply_to_message.forum_topic_created is not None
    assert incoming.parse_entities(["mention"]) != {}
    [sent] = fake.calls_to("sendMessage")
    assert sent.params["message_thread_id"] == 77
    [reply] = fake.sent_messages(GROUP)
    assert reply["message_thread_id"] == 77 and reply["is_topic_message"] is True


async def test_reply_targets_must_exist(fake: FakeTelegram, bot: telegram.Bot) -> None:
    with pytest.raises(BadRequest, match="Message to be replied not found"):
        await bot.send_message(CHAT, "x", reply_to_message_id=999)
    orphan = await bot.send_message(
        CHAT, "x", reply_to_message_id=999, allow_sending_without_reply=True
    )
    assert orphan.reply_to_message is None

    question = fake.user_message(CHAT, "question")
    answer = await bot.send_message(
        CHAT, "answer", reply_parameters=telegram.ReplyParameters(question["message"]["message_id"])
    )
    assert answer.reply_to_message is not None
    assert answer.reply_to_message.text == "question"
    follow_up = fake.user_message(CHAT, "thanks", reply_to_bot=True)
    assert follow_up["message"]["reply_to_message"]["message_id"] == answer.message_id


async def test_edit_message_text(fake: FakeTelegram, bot: telegram.Bot) -> None:
    sent = await bot.send_message(CHAT, "draft")
    edited = await bot.edit_message_text("final", chat_id=CHAT, message_id=sent.message_id)
    assert isinstance(edited, telegram.Message)
    assert edited.text == "final" and edited.edit_date is not None

    with pytest.raises(BadRequest, match="Message is not modified"):
        await bot.edit_message_text("final", chat_id=CHAT, message_id=sent.message_id)
    with pytest.raises(BadRequest, match="Message to edit not found"):
        await bot.edit_message_text("x", chat_id=CHAT, message_id=999)
    user_update = fake.user_message(CHAT, "mine")
    with pytest.raises(BadRequest, match="Message can't be edited"):
        await bot.edit_message_text(
            "x", chat_id=CHAT, message_id=user_update["message"]["message_id"]
        )
    assert [m["text"] for m in fake.sent_messages(CHAT)] == ["draft", "final"]


async def test_chat_actions_and_commands(fake: FakeTelegram, bot: telegram.Bot) -> None:
    assert await bot.send_chat_action(CHAT, "typing")
    with pytest.raises(BadRequest, match="Wrong parameter action"):
        await bot.send_chat_action(CHAT, "dancing")

    assert await bot.set_my_commands([("new", "Start a new session"), ("help", "Help")])
    assert [c.command for c in await bot.get_my_commands()] == ["new", "help"]
    assert fake.commands() == [
        {"command": "new", "description": "Start a new session"},
        {"command": "help", "description": "Help"},
    ]
    with pytest.raises(BadRequest, match="Bot_command_invalid"):
        await bot.set_my_commands([("New-Session", "uppercase and dashes are refused")])
    assert await bot.delete_my_commands()
    assert await bot.get_my_commands() == ()


async def test_webhook_is_recorded_and_delivers_with_the_secret(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    received: list[tuple[str | None, dict[str, Any]]] = []

    async def webhook(request: web.Request) -> web.Response:
        secret = request.headers.get(WEBHOOK_SECRET_HEADER)
        received.append((secret, await request.json()))
        return web.Response(status=200 if secret == "s3cr3t" else 403)

    receiver = web.Application()
    receiver.router.add_post("/tg", webhook)
    runner = web.AppRunner(receiver, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/tg"
    try:
        fake.push_update(fake.user_message(CHAT, "stale"))
        assert await bot.set_webhook(
            url, secret_token="s3cr3t", allowed_updates=["message"], drop_pending_updates=True
        )
        assert fake.webhook["url"] == url and fake.webhook["secret_token"] == "s3cr3t"
        assert fake.webhook["drop_pending_updates"] is True
        info = await bot.get_webhook_info()
        assert info.url == url and info.pending_update_count == 0
        assert info.allowed_updates == ("message",)
        with pytest.raises(Conflict, match="webhook is active"):
            await bot.get_updates()

        update = fake.user_message(CHAT, "via webhook")
        delivery = await fake.deliver_webhook(update)
        assert delivery.status == 200
        secret, body = received[-1]
        assert secret == "s3cr3t"
        parsed = Update.de_json(body, bot)
        assert parsed.message is not None and parsed.message.text == "via webhook"

        refused = await fake.deliver_webhook(update, secret_token="forged")
        assert refused.status == 403
        info = await bot.get_webhook_info()
        assert info.last_error_message == "Wrong response from the webhook: 403 Forbidden"
        with pytest.raises(BadRequest, match="unallowed characters"):
            await bot.set_webhook(url, secret_token=fake.token)  # ':' is not allowed

        assert await bot.delete_webhook(drop_pending_updates=False)
        assert fake.webhook == {}
        assert await bot.get_updates(timeout=0) == ()
    finally:
        await runner.cleanup()
    [set_call] = [c for c in fake.calls_to("setWebhook") if c.ok]
    assert set_call.params["allowed_updates"] == ["message"]
    assert set_call.response["description"] == "Webhook was set"
    [delete_call] = fake.calls_to("deleteWebhook")
    assert delete_call.params["drop_pending_updates"] is False


async def test_photos_stickers_and_edits_parse_and_download(
    fake: FakeTelegram, bot: telegram.Bot
) -> None:
    original = fake.push_update(fake.user_message(CHAT, "typo"))
    fake.push_update(fake.edited_message(original, "fixed"))
    fake.push_update(fake.user_message(CHAT, "look at this", photo=b"\x89PNG-bytes"))
    fake.push_update(fake.user_message(CHAT, sticker="👍"))

    _, edit, photo, sticker = await bot.get_updates(timeout=0)

    assert edit.edited_message is not None and edit.edited_message.text == "fixed"
    assert edit.edited_message.message_id == original["message"]["message_id"]
    assert photo.message is not None and photo.message.caption == "look at this"
    file = await photo.message.photo[-1].get_file()
    assert file.file_path is not None and file.file_path.startswith(fake.file_url)
    assert bytes(await file.download_as_bytearray()) == b"\x89PNG-bytes"
    assert sticker.message is not None and sticker.message.sticker is not None
    assert sticker.message.sticker.emoji == "👍"


def test_in_thread_mode_serves_sync_callers() -> None:
    with FakeTelegram.in_thread(bot_username="thread_bot") as fake:
        fake.push_update(fake.user_message(CHAT, "ping"))

        async def answer() -> str:
            async with telegram.Bot(fake.token, base_url=fake.api_url) as client:
                [update] = await client.get_updates(timeout=1)
                assert update.message is not None
                await client.send_message(CHAT, f"pong to {update.message.text}")
            async with asyncio.timeout(5):  # the async wait works from this loop too
                await fake.wait_for_calls_async("sendMessage")
            return client.username

        assert asyncio.run(answer()) == "thread_bot"
        fake.wait_for_calls("sendMessage", 1, timeout=5)
        assert [m["text"] for m in fake.sent_messages(CHAT)] == ["pong to ping"]
