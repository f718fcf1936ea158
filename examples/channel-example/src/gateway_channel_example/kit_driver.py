"""The conformance kit's driver for Example Chat (`gateway.testing.ChannelDriver`).

It runs the platform (`gateway_channel_example.platform.ExampleChat`) in a thread for each
scenario, points the gateway's example channel at it, writes people's messages on it and
reads back what the bot posted. Person ``n`` is the handle ``person<n>``, writing in
``dm-person<n>`` and in the one group, ``g-kit``. Two modes, as the channel has: long
polling, and a webhook the platform delivers to the gateway's fixed port.

Shipped in the package, not in its tests: whoever has the package installed can run the
kit against it (the gateway's repository does, for the kit's own negative controls).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from gateway.testing.process import free_port

from gateway_channel_example.platform import MAX_TEXT, SIGNATURE_HEADER, ExampleChat, sign
from gateway_channel_example.settings import Defect

__all__ = ["ExampleDriver"]

TOKEN = "kit-example-token"
BOT = "examplebot"
GROUP = "g-kit"
WEBHOOK_SECRET = "kit-example-webhook-secret"
PREFIX = "GATEWAY_CHANNELS__EXAMPLE__"


class ExampleDriver(ChannelDriver):
    """Example Chat for the kit. `mode`: the channel's; `defect`: one of the broken
    variants of `gateway_channel_example.defects` (the kit's negative controls)."""

    name = "example"
    max_message_length = MAX_TEXT

    def __init__(
        self, *, mode: Literal["polling", "webhook"] = "polling", defect: Defect | None = None
    ) -> None:
        self.mode = mode
        self.defect = defect
        self.requirements = Requirements(
            groups=True,
            mentions=True,
            threads=False,  # Example Chat has none
            edits=False,  # nor edits
            duplicate_delivery=True,  # delivery is at least once
            catch_up=True,  # an update waits until a later offset confirms it
            strangers=True,
            signed_inbound=mode == "webhook",  # polling takes nothing over HTTP
            split_long_replies=True,
            mass_pings=True,  # @everyone in a group
            platform_outage=True,
        )
        self._chat: ExampleChat | None = None
        self._port = 0

    def __repr__(self) -> str:
        return f"ExampleDriver(mode={self.mode!r}, defect={self.defect!r})"

    @property
    def chat(self) -> ExampleChat:
        if self._chat is None:
            raise RuntimeError("Example Chat is not running")
        return self._chat

    @contextmanager
    def running(self) -> Iterator[None]:
        self._port = free_port() if self.mode == "webhook" else 0
        with ExampleChat(token=TOKEN, bot=BOT).serving() as chat:
            self._chat = chat
            try:
                yield
            finally:
                self._chat = None

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self._port}/example/webhook"

    def gateway_env(self) -> dict[str, str]:
        env = {
            f"{PREFIX}ENABLED": "true",
            f"{PREFIX}TOKEN": TOKEN,
            f"{PREFIX}API_URL": self.chat.url,
            f"{PREFIX}POLL_TIMEOUT": "1",
            f"{PREFIX}DM_POLICY": "open",
            f"{PREFIX}GROUP_POLICY": "open",
        }
        if self.mode == "webhook":
            env |= {
                "GATEWAY_HTTP__PORT": str(self._port),
                f"{PREFIX}MODE": "webhook",
                f"{PREFIX}WEBHOOK_URL": self.webhook_url,
                f"{PREFIX}WEBHOOK_SECRET": WEBHOOK_SECRET,
            }
        if self.defect is not None:
            env[f"{PREFIX}DEFECT"] = self.defect
        return env

    def platform_down(self) -> None:
        self.chat.down()

    def platform_up(self) -> None:
        self.chat.up()

    # -- people -------------------------------------------------------------------------

    def dm(self, person: int, text: str) -> MessageRef:
        handle = f"person{person}"
        return self._ref(self.chat.write(handle, f"dm-{handle}", text, name=f"Person {person}"))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        if mention:
            text = f"@{BOT} {text}"
        update = self.chat.write(f"person{person}", GROUP, text, name=f"Person {person}")
        return self._ref(update)

    def redeliver(self, ref: MessageRef) -> None:
        self.chat.redeliver(ref.id)

    def forge(self, text: str) -> bool:
        """POST the webhook an update signed with the wrong secret."""
        update = {"update_id": 999_999, "message": self._forged_message(text)}
        body = json.dumps(update).encode()
        request = urllib.request.Request(
            self.webhook_url,
            data=body,
            headers={"Content-Type": "application/json", SIGNATURE_HEADER: sign("guess", body)},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                status = int(answer.status)
        except urllib.error.HTTPError as refused:
            status = refused.code
        return status in (401, 403)

    def ping_everyone_text(self) -> str:
        return "@everyone"

    def _ref(self, update: dict[str, Any]) -> MessageRef:
        message = update["message"]
        return MessageRef(
            id=message["id"],
            place=Place(message["conversation"]["id"]),
            sender=message["author"]["id"],
            event=str(update["update_id"]),
        )

    @staticmethod
    def _forged_message(text: str) -> dict[str, Any]:
        return {
            "id": "m999999",
            "conversation": {"id": "dm-forger", "kind": "dm"},
            "author": {"id": "forger", "name": "Forger"},
            "text": text,
            "mentions": [],
            "everyone": False,
            "reply_to": None,
            "sent_at": 0,
        }

    # -- what the bot posted ----------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        return [
            Post(
                place=Place(post["conversation"]["id"]),
                text=post["text"],
                reply_to=(post["reply_to"] or {}).get("id"),
                mentions=frozenset(post["mentions"]),
                pings_everyone=post["everyone"],
            )
            for post in self.chat.bot_posts()
        ]

    def platform_log(self) -> Iterator[str]:
        return iter(self.chat.log())
