"""The conformance kit's driver for Signal, over the fake signal-cli daemon (tests/fakes).

People write through FakeSignalCli, whose messages wait at "Signal's server" until a
`receive` takes them (also while no gateway runs), and the bot's posts are read back from
its record of `send` calls. The gateway reaches the fake through a TCP proxy, which
`platform_down` cuts.

Requirements, and why:
- groups and mentions: Signal groups; a message addresses the bot by mentioning its
  number (or quoting it). No threads: Signal has none.
- edits: Signal delivers a person's edit (`editMessage`), which names the first message.
- duplicate_delivery: Signal's server hands an envelope over again when signal-cli's
  acknowledgement did not reach it; `redeliver` puts the same envelope back.
- catch_up: with `--receive-mode manual`, what people write while the gateway is stopped
  waits at Signal's server (and what signal-cli handed over that the gateway did not take
  is in the channel's held list).
- lost_when_cut = 1: a kill of the gateway, or a cut network, while its `receive` call is
  open loses the one message signal-cli takes for that call (it acknowledged it to
  Signal's server and keeps no copy). docs/signal.md says the same.
- split_long_replies: a body holds 2,000 bytes; platform_outage: the proxy.
- No signed inbound (the gateway asks signal-cli; nothing comes in over HTTP), no mass
  pings (Signal has no @everyone).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.testing import ChannelDriver, MessageRef, Place, Post, Requirements
from tests.fakes.signal_server import FakeSignalCli, Group, Person
from tests.fakes.tcp_proxy import TcpProxy

ACCOUNT = "+15550001234"
PEOPLE = 10
#: What one post may hold: the channel keeps a body within 2,000 bytes of UTF-8.
MAX_BODY = 2000


class SignalDriver(ChannelDriver):
    """Signal through signal-cli's HTTP daemon (manual receive mode)."""

    name = "signal"
    requirements = Requirements(
        groups=True,
        mentions=True,
        threads=False,
        edits=True,
        duplicate_delivery=True,
        catch_up=True,
        strangers=True,
        signed_inbound=False,
        split_long_replies=True,
        mass_pings=False,
        platform_outage=True,
        lost_when_cut=1,
    )
    max_message_length = MAX_BODY

    def __init__(self) -> None:
        self._fake: FakeSignalCli | None = None
        self._proxy: TcpProxy | None = None
        self._people: dict[int, Person] = {}
        self._group: Group | None = None
        self._envelopes: dict[str, dict[str, Any]] = {}

    @property
    def fake(self) -> FakeSignalCli:
        if self._fake is None:
            raise RuntimeError("the platform is not running")
        return self._fake

    @contextmanager
    def running(self) -> Iterator[None]:
        with FakeSignalCli.in_thread(account=ACCOUNT) as fake:
            port = int(fake.url.rsplit(":", 1)[1])
            proxy = TcpProxy("127.0.0.1", port)
            proxy.restore()
            self._fake, self._proxy, self._envelopes = fake, proxy, {}
            self._people = {n: fake.person(f"Person {n}") for n in range(PEOPLE)}
            self._group = fake.group("Kit group", list(self._people.values()))
            try:
                yield
            finally:
                proxy.close()
                self._fake = self._proxy = self._group = None

    def gateway_env(self) -> dict[str, str]:
        assert self._proxy is not None
        return {
            "GATEWAY_CHANNELS__SIGNAL__ENABLED": "true",
            "GATEWAY_CHANNELS__SIGNAL__ACCOUNT": ACCOUNT,
            "GATEWAY_CHANNELS__SIGNAL__URL": f"http://127.0.0.1:{self._proxy.port}",
            "GATEWAY_CHANNELS__SIGNAL__RECEIVE_TIMEOUT": "1",
            "GATEWAY_CHANNELS__SIGNAL__DM_POLICY": "open",
            "GATEWAY_CHANNELS__SIGNAL__GROUP_POLICY": "open",
        }

    def platform_down(self) -> None:
        assert self._proxy is not None
        self._proxy.cut()

    def platform_up(self) -> None:
        assert self._proxy is not None
        self._proxy.restore()

    # -- people -------------------------------------------------------------------------

    def _person(self, n: int) -> Person:
        if n not in self._people:
            self._people[n] = self.fake.person(f"Person {n}")
        return self._people[n]

    def _ref(self, envelope: dict[str, Any]) -> MessageRef:
        data = envelope.get("dataMessage") or envelope["editMessage"]["dataMessage"]
        group = (data.get("groupInfo") or {}).get("groupId")
        sender = str(envelope["sourceUuid"])
        ref = MessageRef(
            id=f"{sender}:{envelope['timestamp']}",
            place=Place(f"group:{group}" if group else sender),
            sender=sender,
            event=f"{sender}:{envelope['timestamp']}",
        )
        self._envelopes[ref.event] = envelope
        return ref

    def dm(self, person: int, text: str) -> MessageRef:
        return self._ref(self.fake.dm(self._person(person), text))

    def group_message(
        self, person: int, text: str, *, mention: bool, thread: int | None = None
    ) -> MessageRef:
        assert self._group is not None and thread is None
        envelope = self.fake.group_message(
            self._group, self._person(person), text, mention_bot=mention
        )
        return self._ref(envelope)

    def edit(self, ref: MessageRef, text: str) -> MessageRef:
        return self._ref(self.fake.edit(self._envelopes[ref.event], text))

    def redeliver(self, ref: MessageRef) -> None:
        self.fake.again(self._envelopes[ref.event])

    # -- what the bot posted ------------------------------------------------------------

    def bot_posts(self) -> list[Post]:
        posts = []
        for sent in list(self.fake.sent):
            place = Place(f"group:{sent.group_id}" if sent.group_id else sent.recipients[0])
            reply_to = f"{sent.quote[1]}:{sent.quote[0]}" if sent.quote else None
            posts.append(
                Post(
                    place=place,
                    text=sent.text,
                    reply_to=reply_to,
                    mentions=frozenset(m[2] for m in sent.mentions),
                )
            )
        return posts

    def platform_log(self) -> Iterator[str]:
        for call in self.fake.calls:
            yield (
                f"{call.at:.3f} {call.method} {json.dumps(dict(call.params))[:160]} "
                f"{'ok' if call.ok else call.error}"
            )
        for how, envelope in list(self.fake.handed):
            yield f"handed by {how}: {envelope['sourceUuid']}:{envelope['timestamp']}"
        for envelope in list(self.fake.lost_in_transit):
            yield f"lost in transit: {envelope['sourceUuid']}:{envelope['timestamp']}"
        yield f"waiting at the server: {self.fake.waiting()}"
