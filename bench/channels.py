"""Benchmark of every chat channel end to end: messages per second from the platform
into the journal, and from the platform to the reply, for Telegram, Slack, Discord,
Matrix, WhatsApp, email and every other channel of `PLATFORMS` in one run.

    .venv/bin/python bench/channels.py             # a table
    .venv/bin/python bench/channels.py --quick     # a short run (a smoke test)
    .venv/bin/python bench/channels.py --channels discord,telegram --json

Each channel runs the real `gateway run` (a subprocess, file mode) against the
platform its tests use: the fakes of tests/fakes (Telegram's Bot API polled, Slack's
Events API over HTTP, Discord's Gateway and HTTP API, WhatsApp's webhook, and the
others' fakes, each named in its `Platform` class below), Synapse for
Matrix (`scripts/install-synapse.sh`, or the venv `GATEWAY_TEST_SYNAPSE_VENV` names) and
Dovecot with a local SMTP server for email (`scripts/install-dovecot.sh`); a channel
whose server is not installed is skipped with the reason. The model is the fake OpenAI
server, answering at once (an echo).

Per channel, after everyone wrote once and was answered (not measured):
- `handed/s`: how fast the benchmark handed the burst to the platform (where that is a
  request per message, to Synapse or Dovecot, in parallel): a ceiling of `intake/s`.
- `intake/s`: `--messages` messages from `--users` people handed to the platform at
  once; messages per second from the first handed over until the last is in the
  journal (rows of the workspace's dedupe.sqlite, read from outside the process).
- `e2e/s`: the same burst, until the last reply reached the platform.
- `p50`/`p99`: handed over -> reply at the platform, for `--paced` messages sent at
  `--rate` a second, or at half the channel's `e2e/s` when that is lower (`paced/s`), so
  that no queue builds up and the latency is the path's own. The reply's
  time is the platform's record of it where it keeps one (the fakes' clocks, Synapse's
  `origin_server_ts`), else when the benchmark saw it (polled every 10 ms).

The fakes keep the platforms' own limits: Discord's (5 messages per 5 s per channel,
50 requests per second in all) and WhatsApp's (80 messages a second) bound their
`e2e/s`; Telegram's and Slack's fakes have none.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, without installing

from tests.fakes._serving import free_port  # noqa: E402
from tests.fakes.openai_server import FakeOpenAI  # noqa: E402
from tests.gateway_process import GatewayProcess, telegram_env  # noqa: E402
from tests.test_kill_delivery import (  # noqa: E402
    TOKEN,
    Message,
    plan_messages,
    pushing,
    slack_env,
)

CHANNELS = (
    "telegram",
    "slack",
    "discord",
    "matrix",
    "whatsapp",
    "signal",
    "email",
    "mattermost",
    "teams",
    "googlechat",
    "irc",
    "line",
    "web",
    "feishu",
    "qq",
    "dingtalk",
    "wecom",
)


class Platform(Protocol):
    """One channel's platform as the benchmark drives it."""

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]: ...

    def ready(self) -> None:
        """Called once the gateway is up (e.g. wait until it joined the rooms)."""

    def send(self, message: Message) -> None:
        """Hand `message` to the platform, as its sender would."""

    def replies(self) -> list[tuple[float | None, str]]:
        """(when the platform got it, time.time(), or None if it keeps no time; text) of
        every reply so far."""


def answered_tokens(replies: list[tuple[float | None, str]]) -> dict[str, float | None]:
    """The first reply's time per message token (``u017 m0042``) the replies echo."""
    first: dict[str, float | None] = {}
    for at, text in replies:
        if "echo: " in text:
            for token in TOKEN.findall(text):
                first.setdefault(token, at)
    return first


# -- the platforms -----------------------------------------------------------------------


class Telegram:
    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.telegram_server import FakeTelegram

        self.fake = stack.enter_context(FakeTelegram.in_thread(token="777:BENCH-channels"))

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        return telegram_env(workspace, llm, self.fake)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        chat = 7000 + message.user
        self.fake.push_update(self.fake.user_message(chat, message.text, user_id=chat))

    def replies(self) -> list[tuple[float | None, str]]:
        return [
            (c.timestamp, str(c.params.get("text", "")))
            for c in self.fake.calls_to("sendMessage")
            if c.ok
        ]


class Slack:
    """Slack's Events API over HTTP (each event POSTed, signed, retried until a 2xx)."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.slack_server import FakeSlack

        self.fake = stack.enter_context(FakeSlack.in_thread())
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/slack/events"
        self.deliveries: list[concurrent.futures.Future[Any]] = []

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        return slack_env(workspace, llm, self.fake, self.port)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        payload = self.fake.dm_message(f"U0B{message.user:03d}", message.text)
        self.deliveries.append(self.fake.deliver_event_soon(self.url, payload))

    def replies(self) -> list[tuple[float | None, str]]:
        return [
            (c.timestamp, str(c.params.get("text", "")))
            for c in self.fake.calls_to("chat.postMessage")
            if c.ok
        ]


class Discord:
    """Everyone in a DM with the bot; the Gateway brings the messages in."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.discord_server import FakeDiscord

        self.fake = stack.enter_context(FakeDiscord.in_thread())
        self.people = [self.fake.add_user(f"u{n:03d}") for n in range(users)]
        self.dms = [self.fake.dm_channel(person) for person in self.people]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import discord_env

        return discord_env(workspace, llm, self.fake)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        self.fake.user_message(self.dms[message.user], self.people[message.user], message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return [
            (datetime.datetime.fromisoformat(m["timestamp"]).timestamp(), str(m["content"]))
            for m in self.fake.bot_messages()
        ]


class Mattermost:
    """Everyone in a direct message with the bot; the WebSocket brings the posts in."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.mattermost_server import FakeMattermost

        self.fake = stack.enter_context(FakeMattermost.in_thread())
        self.people = [str(self.fake.add_user(f"bench{n}")["id"]) for n in range(users)]
        self.dms = [str(self.fake.dm_channel(p, self.fake.bot_id)["id"]) for p in self.people]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__MATTERMOST__ENABLED": "true",
            "GATEWAY_CHANNELS__MATTERMOST__URL": self.fake.url,
            "GATEWAY_CHANNELS__MATTERMOST__TOKEN": self.fake.bot_token,
            "GATEWAY_CHANNELS__MATTERMOST__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        user = message.user % len(self.people)
        self.fake.user_message(self.dms[user], self.people[user], message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return [(p["create_at"] / 1000, str(p["message"])) for p in self.fake.bot_posts()]


class Teams:
    """Everyone in a personal chat with the bot; Teams POSTs each activity, signed (one
    conversation's activities one at a time, as the fake delivers them)."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.teams_server import FakeTeams

        self.fake = stack.enter_context(FakeTeams.in_thread())
        self.port = free_port()
        self.fake.bot_url = f"http://127.0.0.1:{self.port}/api/messages"
        self.people = [self.fake.add_person(f"bench {n}") for n in range(users)]
        self.chats = [self.fake.personal_chat(person) for person in self.people]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.fakes.teams_server import APP_ID, APP_PASSWORD
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": str(self.port),
            "GATEWAY_CHANNELS__TEAMS__ENABLED": "true",
            "GATEWAY_CHANNELS__TEAMS__APP_ID": APP_ID,
            "GATEWAY_CHANNELS__TEAMS__APP_PASSWORD": APP_PASSWORD,
            "GATEWAY_CHANNELS__TEAMS__OPENID_METADATA_URL": self.fake.openid_metadata_url,
            "GATEWAY_CHANNELS__TEAMS__TOKEN_URL": self.fake.token_url,
            "GATEWAY_CHANNELS__TEAMS__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        user = message.user % len(self.people)
        activity = self.fake.message(self.people[user], self.chats[user], message.text)
        self.fake.deliver_soon(activity)

    def replies(self) -> list[tuple[float | None, str]]:
        return [(post.at, post.text) for post in self.fake.posts()]


class GoogleChat:
    """A Chat app on an HTTP endpoint: each message's event POSTed once, signed, in order
    per space; replies through the Chat API with the service account's token."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.googlechat_server import FakeGoogleChat

        self.fake = stack.enter_context(FakeGoogleChat.in_thread())
        self.port = free_port()
        self.fake.webhook_url = f"http://127.0.0.1:{self.port}/googlechat/events"
        self.people = [str(self.fake.add_user(f"Bench {n}")["name"]) for n in range(users)]
        self.dms = [str(self.fake.dm_space(p)["name"]) for p in self.people]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.test_googlechat_kill import googlechat_env

        return googlechat_env(workspace, llm, self.fake, self.port)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        user = message.user % len(self.people)
        self.fake.user_message(self.dms[user], self.people[user], message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return self.fake.app_texts()


class WhatsApp:
    """Meta's webhook: each message POSTed, signed, retried until a 2xx."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.whatsapp_server import FakeWhatsApp

        self.fake = stack.enter_context(FakeWhatsApp.in_thread())
        self.port = free_port()
        self.fake.webhook_url = f"http://127.0.0.1:{self.port}/whatsapp/webhook"

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.test_whatsapp_kill import whatsapp_env

        return whatsapp_env(workspace, llm, self.fake, self.port)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        self.fake.deliver_soon(self.fake.text_message(f"49151{message.user:08d}", message.text))

    def replies(self) -> list[tuple[float | None, str]]:
        return [(s.at, s.text) for s in self.fake.sent if s.type == "text"]


class Signal:
    """signal-cli's HTTP daemon (manual receive mode): each person writes a DM, which waits
    at Signal's server until the gateway's next `receive` takes it."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.signal_server import FakeSignalCli

        self.fake = stack.enter_context(FakeSignalCli.in_thread())
        self.people = [self.fake.person(f"Person {n}") for n in range(users)]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__SIGNAL__ENABLED": "true",
            "GATEWAY_CHANNELS__SIGNAL__ACCOUNT": self.fake.account,
            "GATEWAY_CHANNELS__SIGNAL__URL": self.fake.url,
            "GATEWAY_CHANNELS__SIGNAL__RECEIVE_TIMEOUT": "1",
            "GATEWAY_CHANNELS__SIGNAL__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        self.fake.dm(self.people[message.user], message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return [(s.at, s.text) for s in list(self.fake.sent)]


class Matrix:
    """A real Synapse; one DM room per person with the bot."""

    senders = 8  # each message is a request to Synapse: send the burst in parallel

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.synapse_server import start_synapse

        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-synapse-")))
        self.synapse = start_synapse(folder)
        stack.callback(self.synapse.stop)
        self.bot = self.synapse.register()
        self.people = [self.synapse.register() for _ in range(users)]
        self.rooms: Any = None

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.test_matrix_kill import matrix_env

        return matrix_env(workspace, llm, self.synapse, self.bot)

    def ready(self) -> None:
        from tests.test_matrix_kill import Rooms

        self.rooms = Rooms(self.synapse, self.bot, self.people)
        self.rooms.wait_joined()

    def send(self, message: Message) -> None:
        self.rooms.send(message)

    def replies(self) -> list[tuple[float | None, str]]:
        found: list[tuple[float | None, str]] = []
        for person, room in zip(self.people, self.rooms.rooms, strict=True):
            for event in self.synapse.messages(person, room):
                if event["sender"] == self.bot.user_id:
                    body = str(event["content"].get("body", ""))
                    found.append((event["origin_server_ts"] / 1000, body))
        return found


class Email:
    """Dovecot's mailbox (IMAP IDLE) in, a local SMTP server out."""

    senders = 4  # each mail is an IMAP APPEND: append the burst in parallel

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.dovecot_server import running_dovecot
        from tests.email_gateway import BOT, BOT_PASSWORD
        from tests.smtp_server import running_smtp

        accounts = {BOT: BOT_PASSWORD}
        self.dovecot = stack.enter_context(running_dovecot(accounts))
        self.smtp = stack.enter_context(running_smtp(accounts, dovecot=self.dovecot))

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.email_gateway import email_env

        return email_env(workspace, llm, self.dovecot, self.smtp)

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        from tests.test_email_kill import push_mail

        push_mail(self.dovecot, message)

    def replies(self) -> list[tuple[float | None, str]]:
        return [(None, text) for text in self.smtp.texts()]


class Irc:
    """A real ngIRCd; everyone writes to the bot privately, the bot connects over TLS."""

    bot = "benchbot"
    #: ngIRCd relays the bot's lines a few a second: a bigger run only takes longer.
    max_messages, max_paced = 120, 40

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.ngircd_server import running_ngircd

        self.server = stack.enter_context(running_ngircd())
        self.people = [self.server.person(f"bench{n}") for n in range(users)]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__IRC__ENABLED": "true",
            "GATEWAY_CHANNELS__IRC__HOST": "127.0.0.1",
            "GATEWAY_CHANNELS__IRC__PORT": str(self.server.tls_port),
            "GATEWAY_CHANNELS__IRC__TLS_CA_FILE": str(self.server.ca_file),
            "GATEWAY_CHANNELS__IRC__NICK": self.bot,
            # ngIRCd takes 3 lines a second from a client with more waiting: the bot's
            # own pace keeps its queue here, where a PONG can go first.
            "GATEWAY_CHANNELS__IRC__BURST_LINES": "5",
            "GATEWAY_CHANNELS__IRC__LINE_INTERVAL_SECONDS": "0.34",
            "GATEWAY_CHANNELS__IRC__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        self.people[message.user].say(self.bot, message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return [
            (at, text)
            for person in self.people
            for at, sender, _, text in person.received()
            if sender == self.bot
        ]


class Line:
    """LINE's webhook: each message POSTed, signed, redelivered until a 2xx; the replies
    go with each message's reply token (the fake's quota is unlimited)."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.line_server import FakeLine

        self.fake = stack.enter_context(FakeLine.in_thread(retry_delays=(0.5,) * 60))
        self.port = free_port()
        self.fake.webhook_url = f"http://127.0.0.1:{self.port}/line/webhook"
        self.people = [self.fake.add_user(f"bench{n}") for n in range(users)]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": str(self.port),  # fixed: LINE delivers to the console's URL
            "GATEWAY_CHANNELS__LINE__ENABLED": "true",
            "GATEWAY_CHANNELS__LINE__CHANNEL_ACCESS_TOKEN": self.fake.token,
            "GATEWAY_CHANNELS__LINE__CHANNEL_SECRET": self.fake.channel_secret,
            "GATEWAY_CHANNELS__LINE__API_URL": self.fake.url,
            "GATEWAY_CHANNELS__LINE__DATA_API_URL": self.fake.url,
            "GATEWAY_CHANNELS__LINE__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        user = self.people[message.user % len(self.people)]
        self.fake.deliver_soon(self.fake.text_message(user, message.text))

    def replies(self) -> list[tuple[float | None, str]]:
        return [(s.at, s.text) for s in self.fake.sent]


class WebChat:
    """A page per person: each posts its messages in order (again until a 200) and reads
    its visitor's log as a stream. Everyone comes from 127.0.0.1, faster than people write:
    the rate limits are off."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.webchat_client import Browsers

        self.users = users
        self.port = free_port()
        self.browsers = Browsers()
        stack.callback(self.browsers.close)
        self.pages: list[Any] = []

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": str(self.port),
            "GATEWAY_CHANNELS__WEB__ENABLED": "true",
            "GATEWAY_CHANNELS__WEB__DM_POLICY": "open",
            "GATEWAY_CHANNELS__WEB__VISITOR_MESSAGES_PER_MINUTE": "0",
            "GATEWAY_CHANNELS__WEB__ADDRESS_MESSAGES_PER_MINUTE": "0",
            "GATEWAY_CHANNELS__WEB__ADDRESS_NEW_VISITORS_PER_HOUR": "0",
        }

    def ready(self) -> None:
        url = f"http://127.0.0.1:{self.port}"
        self.pages = [self.browsers.open(url, name=f"u{n:03d}") for n in range(self.users)]

    def send(self, message: Message) -> None:
        page = self.pages[message.user % len(self.pages)]
        self.browsers.soon(lambda: page.queue(message.text))

    def replies(self) -> list[tuple[float | None, str]]:
        async def snapshot() -> list[tuple[float | None, str]]:
            return [(float(e["at"]), str(e["text"])) for p in self.pages for e in p.replies()]

        return self.browsers.call(snapshot)


class Feishu:
    """Everyone in a direct chat with the bot; events pushed on the long connection, each
    pushed again until it is answered (Feishu's rules)."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.feishu_server import FakeFeishu

        self.fake = stack.enter_context(FakeFeishu.in_thread())
        self.people = [self.fake.add_person(f"bench{n}") for n in range(users)]
        self.chats = [self.fake.p2p_chat(p) for p in self.people]
        self.deliveries: list[concurrent.futures.Future[Any]] = []

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        prefix = "GATEWAY_CHANNELS__FEISHU__"
        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            f"{prefix}ENABLED": "true",
            f"{prefix}APP_ID": self.fake.app_id,
            f"{prefix}APP_SECRET": self.fake.app_secret,
            f"{prefix}API_URL": self.fake.url,
            f"{prefix}DM_POLICY": "open",
        }

    def ready(self) -> None:
        self.fake.wait_for_connections(1, 30)

    def send(self, message: Message) -> None:
        user = message.user % len(self.people)
        event = self.fake.user_message(self.chats[user], self.people[user], message.text)
        self.deliveries.append(self.fake.deliver_soon(event))

    def replies(self) -> list[tuple[float | None, str]]:
        return [(m.create_time, self.fake.rendered(m)) for m in self.fake.bot_messages()]


class QQ:
    """Everyone a friend of the bot's QQ account, in private chats; the fake OneBot
    implementation's forward WebSocket brings the messages in."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.onebot_server import FakeOneBot

        self.fake = stack.enter_context(FakeOneBot.in_thread())
        for n in range(users):
            self.fake.add_friend(20000 + n, f"bench{n}")

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.fakes.onebot_server import DEFAULT_TOKEN
        from tests.gateway_process import base_env

        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_CHANNELS__QQ__ENABLED": "true",
            "GATEWAY_CHANNELS__QQ__URL": self.fake.url.replace("http://", "ws://"),
            "GATEWAY_CHANNELS__QQ__ACCESS_TOKEN": DEFAULT_TOKEN,
            "GATEWAY_CHANNELS__QQ__DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        self.fake.user_message(20000 + message.user, message.text)

    def replies(self) -> list[tuple[float | None, str]]:
        return [
            (r.made_at, "".join(str(s["data"].get("text", "")) for s in r.segments))
            for r in self.fake.bot_messages()
        ]


class DingTalk:
    """Everyone in a one-to-one chat with the robot; callbacks pushed on the stream
    connection, each pushed again until it is acked (DingTalk's rules); replies through
    each message's session webhook."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.dingtalk_server import FakeDingTalk

        self.fake = stack.enter_context(FakeDingTalk.in_thread())
        self.people = [self.fake.add_person(f"bench{n}") for n in range(users)]
        self.chats = [self.fake.dm(p) for p in self.people]
        self.deliveries: list[concurrent.futures.Future[Any]] = []

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        prefix = "GATEWAY_CHANNELS__DINGTALK__"
        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": "0",
            f"{prefix}ENABLED": "true",
            f"{prefix}CLIENT_ID": self.fake.client_id,
            f"{prefix}CLIENT_SECRET": self.fake.client_secret,
            f"{prefix}API_URL": self.fake.url,
            f"{prefix}DM_POLICY": "open",
        }

    def ready(self) -> None:
        self.fake.wait_for_connections(1, 30)

    def send(self, message: Message) -> None:
        user = message.user % len(self.people)
        data = self.fake.user_message(self.chats[user], self.people[user], message.text)
        assert data is not None
        self.deliveries.append(self.fake.deliver_soon(data))

    def replies(self) -> list[tuple[float | None, str]]:
        return [(m.at, m.text) for m in self.fake.bot_messages()]


class WeCom:
    """Members writing to a WeCom self-built app: each message an encrypted, signed
    callback, sent again until a 200 (the fake's three retries stretched); the replies
    through message/send, within WeCom's 30 messages a minute to one member."""

    def __init__(self, stack: contextlib.ExitStack, users: int) -> None:
        from tests.fakes.wecom_server import FakeWeCom

        self.fake = stack.enter_context(FakeWeCom.in_thread(retry_delays=(0.5,) * 60))
        self.port = free_port()
        self.fake.callback_url = f"http://127.0.0.1:{self.port}/wecom/callback"
        self.people = [self.fake.add_user(f"bench{n}") for n in range(users)]

    def env(self, workspace: Path, llm: FakeOpenAI) -> dict[str, str]:
        from tests.gateway_process import base_env

        fake, prefix = self.fake, "GATEWAY_CHANNELS__WECOM__"
        return base_env(workspace, llm) | {
            "GATEWAY_HTTP__PORT": str(self.port),  # fixed: WeCom calls the console's URL
            f"{prefix}ENABLED": "true",
            f"{prefix}CORP_ID": fake.corp_id,
            f"{prefix}AGENT_ID": str(fake.agent_id),
            f"{prefix}SECRET": fake.secret,
            f"{prefix}TOKEN": fake.callback_token,
            f"{prefix}ENCODING_AES_KEY": fake.encoding_aes_key,
            f"{prefix}API_URL": fake.url,
            f"{prefix}DM_POLICY": "open",
        }

    def ready(self) -> None:
        pass

    def send(self, message: Message) -> None:
        user = self.people[message.user % len(self.people)]
        self.fake.deliver_soon(self.fake.text_message(user, message.text))

    def replies(self) -> list[tuple[float | None, str]]:
        return [(s.at, s.text) for s in self.fake.sent]


PLATFORMS: dict[str, Callable[[contextlib.ExitStack, int], Platform]] = {
    "telegram": Telegram,
    "slack": Slack,
    "discord": Discord,
    "matrix": Matrix,
    "whatsapp": WhatsApp,
    "signal": Signal,
    "email": Email,
    "mattermost": Mattermost,
    "teams": Teams,
    "googlechat": GoogleChat,
    "irc": Irc,
    "line": Line,
    "web": WebChat,
    "feishu": Feishu,
    "qq": QQ,
    "dingtalk": DingTalk,
    "wecom": WeCom,
}


def unavailable(name: str) -> str | None:
    """Why channel `name` cannot run here (its server is not installed), or None."""
    if name == "matrix":
        from tests.synapse_server import INSTALL_HINT, SYNAPSE_VENV

        if not (SYNAPSE_VENV / "bin" / "python").exists():
            return f"Synapse is not installed in {SYNAPSE_VENV} ({INSTALL_HINT})"
    if name == "email":
        from tests.dovecot_server import INSTALL, dovecot_missing

        missing = dovecot_missing()
        if missing is not None:
            return f"{missing} ({INSTALL})"
    return None


# -- measuring ---------------------------------------------------------------------------


@dataclass
class Row:
    channel: str
    messages: int = 0
    handed_per_s: float | None = None
    intake_per_s: float | None = None
    e2e_per_s: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    paced_per_s: float | None = None
    note: str = ""


class Watch:
    """The replies as they come: each message token's first reply time, the platform's
    when it keeps one, else when this saw it (polled every 10 ms in a thread)."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.first: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replies", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            seen = time.time()
            for token, at in answered_tokens(self.platform.replies()).items():
                self.first.setdefault(token, at if at is not None else seen)

    def wait_for(self, messages: list[Message], timeout: float) -> float:
        """The time (time.time()) the last of `messages` was answered."""
        deadline = time.monotonic() + timeout
        wanted = [m.text for m in messages]
        while time.monotonic() < deadline:
            first = self.first
            if all(text in first for text in wanted):
                return max(first[text] for text in wanted)
            time.sleep(0.02)
        missing = sum(1 for text in wanted if text not in self.first)
        raise TimeoutError(f"{missing} of {len(wanted)} messages unanswered after {timeout:g}s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def journaled(database: Path) -> int:
    """Messages in the journal: taken in and not answered yet, or answered."""
    if not database.exists():
        return 0
    with contextlib.closing(sqlite3.connect(database, timeout=5)) as conn:
        try:
            row = conn.execute(
                "SELECT (SELECT count(*) FROM inbox) + (SELECT count(*) FROM answered)"
            ).fetchone()
        except sqlite3.OperationalError:
            return 0  # not created yet
    return int(row[0])


def wait_journaled(database: Path, count: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if journaled(database) >= count:
            return time.time()
        time.sleep(0.01)
    raise TimeoutError(f"{journaled(database)} of {count} journaled after {timeout:g}s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextlib.contextmanager
def gateway_for(platform: Platform, workspace: Path, llm: FakeOpenAI) -> Iterator[GatewayProcess]:
    process = GatewayProcess(platform.env(workspace, llm), workspace.parent)
    try:
        process.wait_readyz(process.wait_ready(120), 60)
        yield process
    finally:
        with contextlib.suppress(Exception):
            process.terminate(30)
        process.stop()


def bench_channel(name: str, args: argparse.Namespace) -> Row:
    reason = unavailable(name)
    if reason is not None:
        return Row(name, note=f"skipped: {reason}")
    users, count = args.users, args.messages
    with (
        tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as folder,
        contextlib.ExitStack() as stack,
    ):
        workspace = Path(folder) / "ws"
        llm = stack.enter_context(FakeOpenAI.in_thread())
        platform = PLATFORMS[name](stack, users)
        gateway = stack.enter_context(gateway_for(platform, workspace, llm))
        platform.ready()
        watch = Watch(platform)
        stack.callback(watch.close)
        try:
            # Everyone writes once first: DMs and rooms exist, every session is warm.
            intro = [Message(n, n) for n in range(users)]
            for message in intro:
                platform.send(message)
            watch.wait_for(intro, args.timeout)
            database = workspace / "dedupe.sqlite"
            before = journaled(database)

            rng = random.Random(7)
            burst = [Message(m.user, users + m.number) for m in plan_messages(count, users, rng)]
            started = time.time()
            senders = getattr(platform, "senders", 1)
            with concurrent.futures.ThreadPoolExecutor(senders) as pool:
                list(pool.map(platform.send, burst))
            handed_over = time.time()
            in_journal = wait_journaled(database, before + count, args.timeout)
            answered = watch.wait_for(burst, args.timeout)
            e2e = count / max(answered - started, 1e-6)
            rate = min(args.rate, e2e / 2)

            first = users + count
            paced = [
                Message(m.user, first + m.number) for m in plan_messages(args.paced, users, rng)
            ]
            handed: dict[str, float] = {}

            def send_paced(message: Message) -> None:
                handed[message.text] = time.time()
                platform.send(message)

            with pushing(paced, rate, send_paced):
                pass
            watch.wait_for(paced, args.timeout)
        except TimeoutError as exc:
            tail = "".join(gateway.log[-15:])
            return Row(name, note=f"failed: {exc}; the gateway's last lines:\n{tail}")
        latencies = [max(0.0, watch.first[m.text] - handed[m.text]) * 1000 for m in paced]
    return Row(
        name,
        messages=count,
        handed_per_s=count / max(handed_over - started, 1e-6),
        intake_per_s=count / max(in_journal - started, 1e-6),
        e2e_per_s=e2e,
        p50_ms=statistics.median(latencies),
        p99_ms=percentile(latencies, 0.99),
        paced_per_s=rate,
    )


def show(rows: list[Row], args: argparse.Namespace) -> None:
    print(
        f"channels: burst of {args.messages} messages from {args.users} people; latency over"
        f" {args.paced} messages at up to {args.rate:g}/s (paced/s); the model answers at once"
    )
    print(
        f"{'channel':<10} {'handed/s':>9} {'intake/s':>9} {'e2e/s':>8} {'paced/s':>8} {'p50 ms':>8}"
        f" {'p99 ms':>8}  note"
    )

    def cell(value: float | None, width: int) -> str:
        return f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"

    for row in rows:
        print(
            f"{row.channel:<10} {cell(row.handed_per_s, 9)} {cell(row.intake_per_s, 9)}"
            f" {cell(row.e2e_per_s, 8)}"
            f" {cell(row.paced_per_s, 8)} {cell(row.p50_ms, 8)} {cell(row.p99_ms, 8)}"
            f"  {row.note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channels", default=",".join(CHANNELS), help="comma-separated")
    parser.add_argument("--messages", type=int, default=400, help="burst size")
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--paced", type=int, default=200, help="messages for the latency")
    parser.add_argument("--rate", type=float, default=10.0, help="paced messages a second")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.users, args.paced = 60, 10, 30
    names = [n.strip() for n in args.channels.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLATFORMS]
    if unknown:
        parser.error(f"unknown channel(s) {', '.join(unknown)}; choose from {', '.join(CHANNELS)}")
    rows = [bench_channel(name, args) for name in names]
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        show(rows, args)


if __name__ == "__main__":
    main()
