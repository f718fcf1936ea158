"""The conformance kit's drivers for Slack, over the fake Slack (tests/fakes/slack_server.py):
the Events API over HTTP (`SlackHttpDriver`) and Socket Mode (`SlackSocketModeDriver`),
the channel's two modes.

What the drivers play is Slack's behaviour for the app docs/slack.md sets up:

- The app subscribes to `app_mention` and `message.im`, as the page's manifest says. A DM
  is delivered as a `message` event, a mention in the group as an `app_mention`. A group
  message without a mention is put in the channel (conversations.replies finds it) and
  delivered to nobody: Slack sends it to no such app.
- A top-level mention opens a thread of its own (`reply_mode = "thread"`, the default),
  so its place is that thread, the one its answer is posted in. The kit's threads are
  threads under a message someone else posted in the group, each its own conversation.
- An edit: in a DM a `message_changed`; of a mention, Slack's `app_mention` again, with
  `edited` and a fresh event_id.
- Slack's delivery rules: an event is acknowledged by a 2xx within 3 s (HTTP) or an ack
  on the socket within 3 s; else it is sent again, nearly immediately, then 10 s later
  and 30 s after that (Slack's 1 and 5 minutes, shortened: the window covers a gateway
  that is killed once and started twice on a busy machine; `delivering` tells the kit
  a retry is still due, so it waits for it), then dropped. So what is written while the
  gateway is down reaches it when it is back within about 40 s, as a real gateway back
  within about 6 minutes gets it; past that Slack drops the event, and the kit would
  count it lost. Socket Mode: an event finding no connection open counts as a failed
  attempt.
- Slack does not promise the order of events, yet a person writing at a human pace sees
  theirs in order; the kit writes milliseconds apart, so each conversation's events are
  delivered one at a time, in order (tests/conformance/lanes.py), conversations in
  parallel.
- The network: the gateway reaches the Web API (and its socket) through a TCP proxy and,
  over HTTP, Slack reaches `/slack/events` through another; `platform_down` cuts both.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.conformance.lanes import Lanes
from tests.fakes._serving import free_port
from tests.fakes.slack_server import MAX_TEXT_LENGTH, SLACK_ACK_TIMEOUT, FakeSlack, Payload
from tests.fakes.tcp_proxy import TcpProxy

GROUP = "C0KITROOM01"
THREAD_STARTER = "U0KITSTART"  # posts the messages the kit's threads hang under
#: Slack's retries of an unacknowledged event (nearly immediately, after 1 minute, after
#: 5 more), shortened (see the module docstring).
SLACK_RETRIES = (0.0, 10.0, 30.0)

_MENTION = re.compile(r"<@([UW][A-Z0-9]+)(?:\|[^>]*)?>")
_BROADCAST = re.compile(r"<!(?:channel|here|everyone)(?:\|[^>]*)?>")
_PLAIN_BROADCAST = re.compile(r"(?<![\w&])@(?:channel|here|everyone)\b")


def person_id(person: int) -> str:
    """Person n's Slack user id (their DM with the bot is ``D`` and the rest of it)."""
    return f"U0KIT{person:04d}"


def readable(text: str) -> str:
    """A message's text as Slack shows it: its three escapes decoded."""
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


class SlackDriver(ChannelDriver):
    """What both modes share: the fake, the people, the bot's posts."""

    name = "slack"
    max_message_length = MAX_TEXT_LENGTH  # chat.postMessage's limit (msg_too_long)

    def __init__(self) -> None:
        self._fake: FakeSlack | None = None
        self._proxy: TcpProxy | None = None
        self._lanes: Lanes | None = None
        self._events: dict[str, Payload] = {}  # by event_id: what `redeliver` sends again
        self._roots: dict[int, str] = {}  # the kit's thread n: its parent message's ts

    @property
    def fake(self) -> FakeSlack:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeSlack.in_thread() as fake:
            proxy = TcpProxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1]))
            proxy.restore()
            fake.socket_port = proxy.port  # the socket goes through the proxy too
            lanes = Lanes(self._deliver, name=f"kit-slack-{type(self).__name__}")
            lanes.start()
            self._fake, self._proxy, self._lanes = fake, proxy, lanes
            self._events, self._roots = {}, {}
            try:
                with self._serving():
                    yield
            finally:
                lanes.stop()
                proxy.close()
                self._fake = self._proxy = self._lanes = None

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """What a mode adds around the running platform."""
        yield

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        return {
            "GATEWAY_CHANNELS__SLACK__ENABLED": "true",
            "GATEWAY_CHANNELS__SLACK__BOT_TOKEN": self.fake.bot_token,
            "GATEWAY_CHANNELS__SLACK__BASE_URL": f"http://127.0.0.1:{self._proxy.port}/api/",
            "GATEWAY_CHANNELS__SLACK__DM_POLICY": "open",
            "GATEWAY_CHANNELS__SLACK__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    async def _deliver(self, item: tuple[Payload, bool]) -> None:
        """Deliver one event by Slack's rules (`item`: the payload, and whether it is
        Slack sending it again)."""
        raise NotImplementedError

    def _hand_over(self, payload: Payload, place: Place, *, again: bool = False) -> None:
        assert self._lanes is not None
        self._lanes.put(str(place), (payload, again))

    def _ref(self, payload: Payload) -> MessageRef:
        event = payload["event"]
        message = event.get("message") if event.get("subtype") == "message_changed" else event
        channel, ts = str(event["channel"]), str(message["ts"])
        thread = message.get("thread_ts")
        if channel.startswith("D"):
            place = Place(channel, thread)
        elif event["type"] == "app_mention":
            place = Place(channel, thread or ts)  # a top-level mention opens its thread
        else:
            place = Place(channel, thread)
        ref = MessageRef(f"{channel}:{ts}", place, str(message["user"]), str(payload["event_id"]))
        self._events[ref.event] = payload
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        payload = self.fake.dm_message(person_id(person), text)
        ref = self._ref(payload)
        self._hand_over(payload, ref.place)
        return ref

    def _root(self, thread: int) -> str:
        if thread not in self._roots:
            started = self.fake.channel_message(GROUP, THREAD_STARTER, f"thread {thread} here")
            self._roots[thread] = str(started["event"]["ts"])
        return self._roots[thread]

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        user = person_id(person)
        thread_ts = None if thread is None else self._root(thread)
        if not mention:  # in the channel; no event for an app without message.channels
            return self._ref(self.fake.channel_message(GROUP, user, text, thread_ts=thread_ts))
        payload = self.fake.app_mention(GROUP, user, text, thread_ts=thread_ts)
        ref = self._ref(payload)
        self._hand_over(payload, ref.place)
        return ref

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        original = self._events[ref.event]
        if original["event"]["type"] == "app_mention":
            payload = self.fake.edited_mention(original, text)
        else:
            payload = self.fake.message_changed(original, text)
        edited = MessageRef(ref.id, ref.place, ref.sender, str(payload["event_id"]))
        self._events[edited.event] = payload
        self._hand_over(payload, ref.place)
        return edited

    def redeliver(self, ref: MessageRef) -> None:
        self._hand_over(self._events[ref.event], ref.place, again=True)

    def ping_everyone_text(self) -> str:
        return "<!channel> <!here> <!everyone>"

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        latest: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {}
        for call in self.fake.calls:  # an update shows the message again: the last wins
            if call.method in ("chat.postMessage", "chat.update") and call.ok:
                message = call.response["message"]
                latest[(str(call.response["channel"]), str(message["ts"]))] = (message, call)
        posts = []
        for (channel, _), (message, call) in latest.items():
            raw = str(message.get("text") or "")
            thread = message.get("thread_ts")
            links_names = str(call.params.get("link_names")) in ("1", "true", "True") or (
                call.params.get("parse") == "full"
            )
            pings = bool(_BROADCAST.search(raw)) or (
                links_names and bool(_PLAIN_BROADCAST.search(raw))
            )
            posts.append(
                Post(
                    place=Place(channel, thread),
                    text=readable(raw),
                    reply_to=f"{channel}:{thread}" if thread else None,
                    mentions=frozenset(_MENTION.findall(raw)),
                    pings_everyone=pings,
                )
            )
        return posts

    def delivering(self) -> bool:
        """The platform still retries an event the gateway has not acknowledged."""
        lanes = self._lanes
        return lanes is not None and lanes.busy

    def platform_log(self) -> Iterator[str]:
        for call in self.fake.calls:
            if call.method in ("chat.postMessage", "chat.update"):
                text = str(call.params.get("text"))[:100]
                yield (
                    f"{call.timestamp:.3f} {call.method} {call.params.get('channel')} "
                    f"thread={call.params.get('thread_ts')} {call.status} "
                    f"{call.error or ''} {text!r}"
                )
        if self._lanes is not None:
            yield from (f"driver failure: {line}" for line in self._lanes.failures)


class SlackHttpDriver(SlackDriver):
    """Slack's Events API over HTTP: each event POSTed, signed, to the gateway's
    /slack/events, through a proxy `platform_down` cuts; `forge` signs one with a wrong
    secret."""

    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,  # a retry of an event Slack saw no ack for
        catch_up=True,  # within Slack's retries (see the module docstring)
        strangers=True,
        signed_inbound=True,  # X-Slack-Signature with the signing secret
        split_long_replies=True,
        mass_pings=True,  # <!channel>, <!here>, <!everyone>
        platform_outage=True,
    )

    def __init__(self) -> None:
        super().__init__()
        self._port = 0
        self._inbound: TcpProxy | None = None

    @contextmanager
    def _serving(self) -> Iterator[None]:
        self._port = free_port()  # fixed: Slack retries to the URL the app set
        inbound = TcpProxy("127.0.0.1", self._port)
        inbound.restore()
        self._inbound = inbound
        try:
            yield
        finally:
            inbound.close()
            self._inbound = None

    @property
    def events_url(self) -> str:
        """Where Slack posts: the gateway's /slack/events, through the inbound proxy."""
        assert self._inbound is not None
        return f"http://127.0.0.1:{self._inbound.port}/slack/events"

    def gateway_env(self) -> dict[str, str]:
        return super().gateway_env() | {
            "GATEWAY_HTTP__PORT": str(self._port),
            "GATEWAY_CHANNELS__SLACK__MODE": "http",
            "GATEWAY_CHANNELS__SLACK__SIGNING_SECRET": self.fake.signing_secret,
        }

    def platform_down(self) -> None:
        assert self._inbound is not None
        self._inbound.cut()
        super().platform_down()

    def platform_up(self) -> None:
        super().platform_up()
        assert self._inbound is not None
        self._inbound.restore()

    async def _deliver(self, item: tuple[Payload, bool]) -> None:
        payload, _ = item
        await self.fake.deliver_event(
            self.events_url, payload, retry_delays=SLACK_RETRIES, ack_timeout=SLACK_ACK_TIMEOUT
        )

    def forge(self, text: str) -> bool:
        payload = self.fake.dm_message(person_id(999), text)
        answer = asyncio.run(
            self.fake.post_event(f"http://127.0.0.1:{self._port}/slack/events", payload,
                                 bad_signature=True)
        )  # fmt: skip
        return answer.status in (401, 403)

    def platform_log(self) -> Iterator[str]:
        for delivery in self.fake.event_deliveries:
            attempts = ", ".join(
                f"#{a.retry_num} {a.sent_at:.3f} {a.status} {a.failure or 'acked'}"
                for a in delivery.attempts
            )
            text = str(delivery.payload["event"].get("text"))[:60]
            yield f"event {delivery.event_id} {text!r}: {attempts}"
        yield from super().platform_log()


class SlackSocketModeDriver(SlackDriver):
    """Slack over Socket Mode: each event sent in an envelope on the gateway's socket
    (through the proxy), and sent again, by Slack's schedule, until it is acknowledged."""

    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=True,
        edits=True,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=False,  # the socket is the app's own (its token): nothing to forge
        split_long_replies=True,
        mass_pings=True,
        platform_outage=True,
    )

    def __init__(self) -> None:
        super().__init__()
        self.attempts: list[str] = []

    @contextmanager
    def _serving(self) -> Iterator[None]:
        self.attempts = []
        yield

    def gateway_env(self) -> dict[str, str]:
        return super().gateway_env() | {
            "GATEWAY_CHANNELS__SLACK__MODE": "socket",
            "GATEWAY_CHANNELS__SLACK__APP_TOKEN": self.fake.app_token,
        }

    async def _deliver(self, item: tuple[Payload, bool]) -> None:
        payload, again = item
        fake = self.fake
        for attempt in range(len(SLACK_RETRIES) + 1):
            if attempt:
                await asyncio.sleep(SLACK_RETRIES[attempt - 1])
            retry = attempt + int(again)
            try:
                envelope = await fake.socket_event(
                    payload,
                    retry_num=retry,
                    retry_reason="timeout" if retry else None,
                    connect_timeout=0.2,
                )
            except (RuntimeError, OSError) as exc:  # no connection open, or it broke
                self._note(payload, attempt, f"not sent: {exc}")
                continue
            try:
                async with asyncio.timeout(SLACK_ACK_TIMEOUT):
                    await fake.wait_for_ack(envelope["envelope_id"])
            except TimeoutError:
                self._note(payload, attempt, "no ack within 3 s")
                continue
            self._note(payload, attempt, "acked")
            return
        self._note(payload, len(SLACK_RETRIES), "given up")

    def _note(self, payload: Payload, attempt: int, outcome: str) -> None:
        with contextlib.suppress(Exception):
            text = str(payload["event"].get("text"))[:60]
            self.attempts.append(
                f"{time.time():.3f} event {payload['event_id']} {text!r} #{attempt}: {outcome}"
            )

    def platform_log(self) -> Iterator[str]:
        yield from list(self.attempts)
        yield from super().platform_log()
