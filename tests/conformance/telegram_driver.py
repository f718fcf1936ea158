"""The conformance kit's driver for Telegram, over the fake Bot API (tests/fakes).

People write through FakeTelegram, which keeps Telegram's delivery rules (an update
waits until a later getUpdates offset confirms it, also while no gateway runs), and the
bot's posts are read back from its record. The gateway reaches the fake through a TCP
proxy, which `platform_down` cuts.

Two modes, as the channel has: long polling, and a webhook (`TelegramWebhookDriver`),
where the driver plays Telegram's side of it: each update is POSTed to the gateway with
the secret token, in order, and kept and sent again until the gateway answers 200 (a
gateway that is down or refuses gets it later, as Telegram retries).
"""

from __future__ import annotations

import asyncio
import copy
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes._serving import free_port
from tests.fakes.tcp_proxy import TcpProxy
from tests.fakes.telegram_server import MAX_MESSAGE_LENGTH, WEBHOOK_SECRET_HEADER, FakeTelegram

TOKEN = "4242:KIT-conformance-telegram"
BOT_USERNAME = "kit_gateway_bot"
FIRST_PERSON = 5000  # person n is Telegram user FIRST_PERSON + n, in private chat of that id
GROUP = -1001000000777  # a forum supergroup: its topics are the threads
FIRST_TOPIC = 700  # thread n is forum topic FIRST_TOPIC + n
WEBHOOK_SECRET = "kit-webhook-secret"


class TelegramDriver(ChannelDriver):
    """Telegram over long polling."""

    name = "telegram"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=False,  # long polling takes nothing over HTTP
        split_long_replies=True,
        mass_pings=False,  # Telegram has no @everyone
        platform_outage=True,
    )
    max_message_length = MAX_MESSAGE_LENGTH

    def __init__(self) -> None:
        self._fake: FakeTelegram | None = None
        self._proxy: TcpProxy | None = None
        self._updates: dict[str, dict[str, Any]] = {}

    @property
    def fake(self) -> FakeTelegram:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeTelegram.in_thread(token=TOKEN, bot_username=BOT_USERNAME) as fake:
            port = int(fake.url.rsplit(":", 1)[1])
            proxy = TcpProxy("127.0.0.1", port)
            proxy.restore()
            self._fake, self._proxy, self._updates = fake, proxy, {}
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = None

    @property
    def _api_root(self) -> str:
        assert self._proxy is not None
        return f"http://127.0.0.1:{self._proxy.port}"

    def gateway_env(self) -> dict[str, str]:
        return {
            "GATEWAY_CHANNELS__TELEGRAM__ENABLED": "true",
            "GATEWAY_CHANNELS__TELEGRAM__TOKEN": TOKEN,
            "GATEWAY_CHANNELS__TELEGRAM__BASE_URL": f"{self._api_root}/bot",
            "GATEWAY_CHANNELS__TELEGRAM__BASE_FILE_URL": f"{self._api_root}/file/bot",
            "GATEWAY_CHANNELS__TELEGRAM__POLL_TIMEOUT": "1",
            "GATEWAY_CHANNELS__TELEGRAM__DM_POLICY": "open",
            "GATEWAY_CHANNELS__TELEGRAM__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _hand_over(self, update: dict[str, Any]) -> None:
        """Give the gateway an update (long polling: it waits at Telegram)."""
        self.fake.push_update(update)

    def _ref(self, update: dict[str, Any]) -> MessageRef:
        message = update.get("message") or update["edited_message"]
        chat = int(message["chat"]["id"])
        thread = message.get("message_thread_id") if message.get("is_topic_message") else None
        ref = MessageRef(
            id=f"{chat}:{message['message_id']}",
            place=Place(str(chat), None if thread is None else str(thread)),
            sender=str(message["from"]["id"]),
            event=str(update["update_id"]),
        )
        self._updates[ref.event] = update
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        user = FIRST_PERSON + person
        update = self.fake.user_message(
            user, text, user_id=user, username=f"person{person}", first_name=f"Person {person}"
        )
        self._hand_over(update)
        return self._ref(update)

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        update = self.fake.user_message(
            GROUP,
            f"@{BOT_USERNAME} {text}" if mention else text,
            user_id=FIRST_PERSON + person,
            username=f"person{person}",
            first_name=f"Person {person}",
            chat_type="supergroup",
            chat_title="Kit group",
            message_thread_id=None if thread is None else FIRST_TOPIC + thread,
            is_topic_message=thread is not None,
        )
        self._hand_over(update)
        return self._ref(update)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        original = self._updates[ref.event]
        mention = f"@{BOT_USERNAME} "
        if str((original.get("message") or original["edited_message"]).get("text")).startswith(
            mention
        ):
            text = mention + text  # the author keeps the mention
        update = self.fake.edited_message(original, text)
        self._hand_over(update)
        return self._ref(update)

    def redeliver(self, ref: MessageRef) -> None:
        # The same message in an update of its own: only the journal's dedupe by
        # message id can tell (the channel remembers update ids it has seen).
        update = {k: v for k, v in self._updates[ref.event].items() if k != "update_id"}
        self._hand_over(self.fake.with_update_id(copy.deepcopy(update)))

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        latest: dict[tuple[int, int], dict[str, Any]] = {}
        for message in self.fake.sent_messages():  # an edit appears again: the last wins
            latest[(int(message["chat"]["id"]), int(message["message_id"]))] = message
        posts = []
        for (chat, _), message in latest.items():
            thread = message.get("message_thread_id") if message.get("is_topic_message") else None
            replied = message.get("reply_to_message")
            reply_to = None
            if isinstance(replied, dict) and "forum_topic_created" not in replied:
                reply_to = f"{chat}:{replied['message_id']}"
            text = str(message.get("text", ""))
            mentions = set()
            for entity in message.get("entities") or ():
                if entity.get("type") == "text_mention":
                    mentions.add(str(entity["user"]["id"]))
                elif entity.get("type") == "mention":
                    start, end = entity["offset"], entity["offset"] + entity["length"]
                    person = re.fullmatch(r"@person(\d+)", _utf16_slice(text, start, end))
                    if person is not None:
                        mentions.add(str(FIRST_PERSON + int(person.group(1))))
            posts.append(
                Post(
                    place=Place(str(chat), None if thread is None else str(thread)),
                    text=text,
                    reply_to=reply_to,
                    mentions=frozenset(mentions),
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for poll in self.fake.polls:
            yield (
                f"getUpdates at {poll.received_at:.3f} offset={poll.offset} "
                f"confirmed={list(poll.confirmed)} returned={list(poll.update_ids)} "
                f"{poll.outcome}"
            )
        for message in self.fake.sent_messages():
            yield f"sent to {message['chat']['id']}: {str(message.get('text'))[:100]!r}"


def _utf16_slice(text: str, start: int, end: int) -> str:
    encoded = text.encode("utf-16-le")
    return encoded[start * 2 : end * 2].decode("utf-16-le", errors="replace")


class TelegramWebhookDriver(TelegramDriver):
    """Telegram with a webhook: the driver POSTs each update to the gateway's
    /telegram/webhook with the secret token the gateway set, one at a time and in order,
    and sends it again (every 0.3 s) until the gateway answers 200; `forge` POSTs one
    with a wrong secret."""

    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=True,
        split_long_replies=True,
        mass_pings=False,
        platform_outage=True,
    )

    def __init__(self) -> None:
        super().__init__()
        self._port = 0
        self._queue: list[dict[str, Any]] = []
        self._wake = threading.Condition()
        self._stop = False
        self._cut = False  # the network is cut: Telegram cannot reach the gateway either
        self.deliveries: list[str] = []

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Telegram posts to the URL the bot set
        self._queue, self._stop, self._cut, self.deliveries = [], False, False, []
        with super().running():
            thread = threading.Thread(target=self._deliver, name="kit-webhook", daemon=True)
            thread.start()
            try:
                yield
            finally:
                with self._wake:
                    self._stop = True
                    self._wake.notify_all()
                thread.join(10)

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self._port}/telegram/webhook"

    def gateway_env(self) -> dict[str, str]:
        return super().gateway_env() | {
            "GATEWAY_HTTP__PORT": str(self._port),
            "GATEWAY_CHANNELS__TELEGRAM__MODE": "webhook",
            "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_URL": self.webhook_url,
            "GATEWAY_CHANNELS__TELEGRAM__WEBHOOK_SECRET": WEBHOOK_SECRET,
        }

    def platform_down(self) -> None:
        self._cut = True
        super().platform_down()

    def platform_up(self) -> None:
        super().platform_up()
        self._cut = False

    def _hand_over(self, update: dict[str, Any]) -> None:
        with self._wake:
            self._queue.append(update)
            self._wake.notify_all()

    def _deliver(self) -> None:
        asyncio.run(self._deliver_all())

    async def _deliver_all(self) -> None:
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                with self._wake:
                    while not self._queue and not self._stop:
                        self._wake.wait(0.5)
                    if self._stop:
                        return
                    update = self._queue[0]
                if await self._post(session, update, self.fake.webhook.get("secret_token")):
                    with self._wake:
                        self._queue.pop(0)
                else:
                    await asyncio.sleep(0.3)

    async def _post(
        self, session: aiohttp.ClientSession, update: dict[str, Any], secret: object
    ) -> bool:
        """One delivery attempt; True when the gateway answered 200."""
        if not self.fake.webhook.get("url") or self._cut:
            return False  # no gateway has set its webhook yet, or it cannot be reached
        headers = {WEBHOOK_SECRET_HEADER: str(secret)} if secret else {}
        try:
            async with session.post(self.webhook_url, json=update, headers=headers) as answer:
                status = answer.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, note = 0, type(exc).__name__
        else:
            note = ""
        self.deliveries.append(f"{time.time():.3f} update {update['update_id']}: {status} {note}")
        return status == 200

    def forge(self, text: str) -> bool:
        update = self.fake.user_message(
            FIRST_PERSON + 999, text, username="forger", first_name="Forger"
        )

        async def post() -> int:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    self.webhook_url,
                    json=update,
                    headers={WEBHOOK_SECRET_HEADER: "not-the-secret"},
                ) as answer,
            ):
                return answer.status

        return asyncio.run(post()) in (401, 403)

    def platform_log(self) -> Iterator[str]:
        yield from list(self.deliveries)
        yield from super().platform_log()
