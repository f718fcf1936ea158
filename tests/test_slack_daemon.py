"""Slack end to end: the real Daemon in-process with the Slack channel (real bolt and
slack-sdk) against the fake Slack, and the fake OpenAI server as the model."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from loguru import logger

from channels.slack import RetryPolicy, SlackChannel
from channels.slack.channel import SLACK_EVENTS_PATH
from channels.slack.format import markdown_to_mrkdwn, split_mrkdwn
from gateway.access.commands import cli_pairing_approve
from gateway.access.store import PairingStore
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.sessions.keys import encode_key
from gateway.storage.files import pairing_path
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack_server import Ack, ApiCall, FakeSlack

pytestmark = pytest.mark.anyio

TOKEN = "test-api-token-123"
CHANNEL = "C0GENERAL01"
ALICE = "U0ALICE001"
BOB = "U0BOB00001"
QUIET = 0.3  # how long "nothing else happens" is watched for


@dataclass
class Running:
    daemon: Daemon
    channel: SlackChannel
    settings: Settings
    url: str

    @property
    def events_url(self) -> str:
        return self.url + SLACK_EVENTS_PATH


@pytest.fixture
async def fake_slack() -> AsyncIterator[FakeSlack]:
    async with FakeSlack() as server:
        yield server


@asynccontextmanager
async def slack_gateway(
    make_settings: Callable[..., Settings],
    fake_openai: FakeOpenAI,
    fake_slack: FakeSlack,
    **overrides: Any,
) -> AsyncIterator[Running]:
    options = {
        "http__port": 0,
        "http__token": TOKEN,
        "channels__slack__dm_policy": "open",
        "channels__slack__group_policy": "open",
        "channels__slack__base_url": fake_slack.api_url,
    }
    settings = make_settings(fake_openai, **(options | overrides))
    daemon = Daemon(Gateway.build(settings), interactive=False)
    channel = SlackChannel(
        settings.channels.slack,
        bot_token=fake_slack.bot_token,
        app_token=fake_slack.app_token,
        signing_secret=fake_slack.signing_secret,
        retry=RetryPolicy(backoff=0.05, reply_deadline=20),
    )
    daemon.add_channel(channel)
    # What the daemon does for every channel: only HTTP mode mounts a route.
    assert channel.mount(daemon.http) is (settings.channels.slack.mode == "http")
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        with anyio.fail_after(5):
            while not channel.live:  # noqa: ASYNC110 (the supervisor starts it soon)
                await anyio.sleep(0.01)
            if settings.channels.slack.mode == "socket":
                await fake_slack.wait_for_socket()
        try:
            yield Running(daemon, channel, settings, f"http://127.0.0.1:{port}")
        finally:
            daemon.stop()


async def posts(fake: FakeSlack, count: int) -> list[ApiCall]:
    """The successful chat.postMessage calls, once there are `count` of them."""

    def answered() -> list[ApiCall]:
        return [c for c in fake.calls_to("chat.postMessage") if c.ok]

    with anyio.fail_after(10):
        while len(answered()) < count:  # noqa: ASYNC110 (polling the fake's call log)
            await anyio.sleep(0.01)
    return answered()


async def event(fake: FakeSlack, payload: dict[str, Any]) -> tuple[dict[str, Any], Ack]:
    envelope = await fake.socket_event(payload)
    with anyio.fail_after(5):
        return envelope, await fake.wait_for_ack(envelope["envelope_id"])


def in_channel(text: str, user: str = ALICE) -> str:
    """The fake model's echo of a channel message: in channels the model sees who wrote
    (gateway.agent.speakers; the fake's users.info names a user by its lower-case id)."""
    return f'echo: [from "{user.lower()}"]\n{text}'


def place(call: ApiCall) -> tuple[str, str | None]:
    return call.params["channel"], call.params.get("thread_ts")


async def test_mention_thread_and_dm_each_get_one_reply_in_place(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    async with slack_gateway(make_settings, fake_openai, fake_slack) as gw:
        mention = fake_slack.app_mention(CHANNEL, ALICE, "hello there")
        first, _ = await event(fake_slack, mention)
        [answer] = await posts(fake_slack, 1)
        ts = mention["event"]["ts"]
        assert place(answer) == (CHANNEL, ts)  # reply_mode thread: a thread under it
        assert answer.params["text"] == in_channel("hello there")

        await event(fake_slack, fake_slack.app_mention(CHANNEL, BOB, "and you?", thread_ts=ts))
        [_, in_thread] = await posts(fake_slack, 2)
        assert place(in_thread) == (CHANNEL, ts)
        # Same session: the model saw the first exchange too.
        history = [m["content"] for m in fake_openai.last_request.messages]
        assert history[-2] == in_channel("hello there")  # the first answer
        assert history[-3].endswith("\nhello there") and history[-1].endswith("\nand you?")
        # Bob's message names him and quotes the thread's parent (Alice's mention).
        assert history[-1].startswith('[from "u0bob00001"]\n[in reply to "u0alice001": ')

        await event(fake_slack, fake_slack.dm_message(ALICE, "just us"))
        [*_, dm] = await posts(fake_slack, 3)
        assert place(dm) == ("D0ALICE001", None)
        assert dm.params["text"] == "echo: just us"

        # Slack's retry of the first mention, our own reply echoed back, a link
        # unfurl (a message_changed with the same text): all acknowledged, none answered.
        retry = await fake_slack.redeliver(first)
        with anyio.fail_after(5):
            await fake_slack.wait_for_ack(retry["envelope_id"])
        own = fake_slack.bot_message(CHANNEL, "echo: hello there", thread_ts=ts)
        await event(fake_slack, own)
        dm_event = fake_slack.dm_message(ALICE, "just us")
        await event(fake_slack, fake_slack.message_changed(dm_event, "just us"))
        await anyio.sleep(QUIET)
        assert len(fake_slack.calls_to("chat.postMessage")) == 3
        assert gw.daemon.dispatcher.stats().duplicates == 1
        assert len(fake_openai.chat_requests) == 3

    sessions = {p.name for p in gw.settings.sessions_dir.glob("*.jsonl")}
    assert f"{encode_key(f'slack:{CHANNEL}:thread:{ts}')}.jsonl" in sessions
    assert f"{encode_key('slack:D0ALICE001')}.jsonl" in sessions


async def test_channel_reply_mode_answers_in_the_channel_unless_in_a_thread(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    async with slack_gateway(
        make_settings, fake_openai, fake_slack, channels__slack__reply_mode="channel"
    ):
        await event(fake_slack, fake_slack.app_mention(CHANNEL, ALICE, "top level"))
        [top] = await posts(fake_slack, 1)
        assert place(top) == (CHANNEL, None)
        thread_ts = top.response["ts"]
        await event(
            fake_slack, fake_slack.app_mention(CHANNEL, ALICE, "in thread", thread_ts=thread_ts)
        )
        [_, threaded] = await posts(fake_slack, 2)
        assert place(threaded) == (CHANNEL, thread_ts)


async def test_ack_is_fast_while_the_model_is_slow(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    fake_openai.add_delay(2.0, "took a while")
    async with slack_gateway(make_settings, fake_openai, fake_slack):
        _, ack = await event(fake_slack, fake_slack.app_mention(CHANNEL, ALICE, "slow one"))
        assert ack.latency is not None and ack.latency < 1.0
        assert fake_slack.calls_to("chat.postMessage") == []  # acked before the answer
        [answer] = await posts(fake_slack, 1)
        assert answer.params["text"] == "took a while"


async def test_a_429_storm_delays_but_loses_nothing(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    async with slack_gateway(make_settings, fake_openai, fake_slack):
        fake_slack.fail_next("chat.postMessage", retry_after=1)
        fake_slack.fail_next("chat.postMessage", retry_after=0, count=6)
        await event(fake_slack, fake_slack.dm_message(ALICE, "one"))
        await event(fake_slack, fake_slack.dm_message(BOB, "two"))
        await event(fake_slack, fake_slack.app_mention(CHANNEL, ALICE, "three"))
        answered = await posts(fake_slack, 3)
        await anyio.sleep(QUIET)
    texts = {c.params["text"] for c in answered}
    assert texts == {"echo: one", in_channel("three"), "echo: two"}
    statuses = [c.status for c in fake_slack.calls_to("chat.postMessage")]
    assert statuses.count(429) == 7 and statuses.count(200) == 3


async def test_a_reply_slack_did_not_take_is_sent_again_and_answered_once(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    """Slack down (503) past the channel's retries: the dispatcher sends the reply again
    later, and it arrives once; it was logged and its message marked answered."""
    async with slack_gateway(make_settings, fake_openai, fake_slack) as gw:
        attempts = gw.channel.retry.attempts
        fake_slack.fail_next("chat.postMessage", "service_unavailable", status=503,
                             count=attempts + 2)  # fmt: skip
        await event(fake_slack, fake_slack.dm_message(ALICE, "still there?"))
        [answer] = await posts(fake_slack, 1)
        await anyio.sleep(QUIET)
    assert answer.params["text"] == "echo: still there?"
    statuses = [c.status for c in fake_slack.calls_to("chat.postMessage")]
    assert statuses == [503] * (attempts + 2) + [200]


async def test_a_long_reply_arrives_split_and_in_order(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    code = "```python\n" + "\n".join(f"print({i})  # step {i}" for i in range(150)) + "\n```"
    text = "\n\n".join(
        [*(f"## Part {i}\n" + f"Sentence {i} goes on. " * 60 for i in range(4)), code, "The end."]
    )
    fake_openai.add_reply(text)
    async with slack_gateway(make_settings, fake_openai, fake_slack):
        mention = fake_slack.app_mention(CHANNEL, ALICE, "write a lot")
        await event(fake_slack, mention)
        expected = split_mrkdwn(markdown_to_mrkdwn(text))
        got = await posts(fake_slack, len(expected))
        await anyio.sleep(QUIET)
    assert len(expected) >= 3
    assert [c.params["text"] for c in fake_slack.calls_to("chat.postMessage")] == expected
    assert all(place(c) == (CHANNEL, mention["event"]["ts"]) for c in got)
    assert all(len(c.params["text"]) <= 3_500 for c in got)


async def test_http_mode_checks_signatures_and_answers_once(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    async with slack_gateway(
        make_settings, fake_openai, fake_slack, channels__slack__mode="http"
    ) as gw:
        url = gw.events_url
        challenge = await fake_slack.url_verification(url, challenge="c-123")
        assert (challenge.status, challenge.json()) == (200, {"challenge": "c-123"})

        forged = await fake_slack.post_event(
            url, fake_slack.app_mention(CHANNEL, ALICE, "x"), bad_signature=True
        )
        stale = await fake_slack.post_event(
            url, fake_slack.app_mention(CHANNEL, ALICE, "x"), timestamp=0
        )
        unsigned_challenge = await fake_slack.url_verification(url, signing_secret="other")
        assert (forged.status, stale.status, unsigned_challenge.status) == (401, 401, 401)

        mention = fake_slack.app_mention(CHANNEL, ALICE, "over http")
        accepted = await fake_slack.post_event(url, mention)
        assert accepted.status == 200
        [answer] = await posts(fake_slack, 1)
        assert place(answer) == (CHANNEL, mention["event"]["ts"])
        assert answer.params["text"] == in_channel("over http")

        retried = await fake_slack.post_event(url, mention, retry_num=1)
        assert retried.status == 200
        await anyio.sleep(QUIET)
        assert len(fake_slack.calls_to("chat.postMessage")) == 1
        assert len(fake_openai.chat_requests) == 1


@pytest.mark.parametrize(
    "body",
    [
        b'{"type": "event_callback", "event": {',  # cut short
        b"\xff\xfe not even UTF-8",
        b'["a JSON list, not an object"]',
        b'"a JSON string"',
    ],
)
async def test_http_mode_answers_a_signed_malformed_body_with_400_not_a_traceback(
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
    fake_slack: FakeSlack,
    body: bytes,
) -> None:
    lines: list[str] = []
    handler = logger.add(lambda message: lines.append(str(message)), level="DEBUG")
    try:
        async with slack_gateway(
            make_settings, fake_openai, fake_slack, channels__slack__mode="http"
        ) as gw:
            refused = await fake_slack.post_event(gw.events_url, body)
            # Still serving: a good event after the bad one is answered.
            accepted = await fake_slack.post_event(
                gw.events_url, fake_slack.app_mention(CHANNEL, ALICE, "still there?")
            )
            [answer] = await posts(fake_slack, 1)
    finally:
        logger.remove(handler)
    assert refused.status == 400
    assert "JSON object" in refused.json()["error"]
    assert accepted.status == 200 and answer.params["text"] == in_channel("still there?")
    log = "".join(lines)
    assert "Traceback" not in log and " 500 " not in log


async def test_a_stranger_gets_a_pairing_code_until_approved(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    async with slack_gateway(
        make_settings, fake_openai, fake_slack, channels__slack__dm_policy="pairing"
    ) as gw:
        await event(fake_slack, fake_slack.dm_message(ALICE, "hello?"))
        [challenge] = await posts(fake_slack, 1)
        assert place(challenge) == ("D0ALICE001", None)
        code = re.search(r"pairing code is (\w+)", challenge.params["text"])
        assert code is not None and fake_openai.chat_requests == []

        store = PairingStore(pairing_path(gw.settings))
        assert "Approved U0ALICE001" in cli_pairing_approve(store, "slack", code.group(1))
        await event(fake_slack, fake_slack.dm_message(ALICE, "now?"))
        [_, answer] = await posts(fake_slack, 2)
        assert answer.params["text"] == "echo: now?"


def journaled_texts(settings: Settings) -> list[str]:
    """What the gateway's journal holds, read through another SQLite connection."""
    import json
    import sqlite3

    with sqlite3.connect(settings.workspace_path / "dedupe.sqlite") as conn:
        rows = conn.execute("SELECT message FROM inbox").fetchall()
    return [json.loads(row[0])["text"] for row in rows]


async def test_http_events_are_journaled_before_the_200_and_refused_while_draining(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], fake_slack: FakeSlack
) -> None:
    """Journal before confirm over HTTP: when Slack gets its 200 the message is in the
    journal (the turn has not even finished); once the gateway drains, events get a 503
    and stay Slack's to send again."""
    fake_openai.add_delay(1.0, "slow answer")
    async with slack_gateway(
        make_settings, fake_openai, fake_slack, channels__slack__mode="http"
    ) as gw:
        accepted = await fake_slack.post_event(
            gw.events_url, fake_slack.app_mention(CHANNEL, ALICE, "keep me")
        )
        assert accepted.status == 200
        assert journaled_texts(gw.settings) == ["keep me"]
        assert fake_slack.calls_to("chat.postMessage") == []  # still with the model
        await posts(fake_slack, 1)
        gw.channel.pause_intake()  # what the daemon does when it starts to drain
        late = await fake_slack.post_event(
            gw.events_url, fake_slack.app_mention(CHANNEL, ALICE, "too late")
        )
        assert late.status == 503
    assert [c.params["text"] for c in fake_slack.calls_to("chat.postMessage")] == ["slow answer"]
