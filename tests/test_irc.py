"""The IRC channel (channels/irc/): translation and keys, then the channel against a real
ngIRCd (tests/ngircd_server.py: TLS, nicks, reconnects, pacing, delivery failures,
draining) and SASL PLAIN against the fake server of tests/fakes/irc_server.py (ngIRCd has
none). A recorder stands in for the dispatcher; tests/conformance runs the whole gateway."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from channels.irc.channel import (
    AWAY_TEXT,
    EVERYTHING,
    IrcChannel,
    IrcSetupError,
    Pacing,
    Skip,
    addressing,
    translate,
)
from channels.irc.channel import _MemoryCursors as MemoryCursors
from channels.irc.settings import IrcSettings
from channels.irc.spec import SPEC, access, checks
from channels.irc.wire import ISupport, Line
from gateway.channel import DeliveryFailed
from gateway.config import ConfigError
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_SENDER_NAME,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from tests.fakes.irc_server import FakeIrc
from tests.fakes.tcp_proxy import TcpProxy
from tests.ngircd_server import IrcPerson, Ngircd, running_ngircd

pytestmark = pytest.mark.anyio

BOT = "gwbot"
FAST = Pacing(
    reconnect_first=0.2,
    stable_after=5.0,
    send_wait=2.0,
    resubmit_pause=0.1,
    regain_nick=0.5,
    join_timeout=5.0,
    rejoin_after=0.2,
)


def settings_for(server: Ngircd, **overrides: Any) -> IrcSettings:
    values: dict[str, Any] = {
        "enabled": True,
        "host": "127.0.0.1",
        "port": server.tls_port,
        "tls": True,
        "tls_ca_file": server.ca_file,
        "network": "test",
        "nick": BOT,
        "channels": ["#Team"],
        "burst_lines": 5,
        "line_interval_seconds": 0.2,
        "reconnect_max_seconds": 1.0,
    }
    return IrcSettings(**(values | overrides))


# --------------------------------------------------------------------------- translation


def privmsg(source: str, target: str, text: str, **tags: str) -> Line:
    return Line("PRIVMSG", (target, text), source, dict(tags))


SUPPORT = ISupport()


def take(line: Line, me: str = BOT) -> InboundMessage | Skip:
    return translate(line, me=me, isupport=SUPPORT, network="net", message_id="net:c:1", now=5.0)


def test_a_private_message_is_a_dm_keyed_by_the_folded_nick() -> None:
    message = take(privmsg("Alice[1]!~a@host", BOT, "hello"))
    assert isinstance(message, InboundMessage)
    assert message.session_key == "irc:net:alice{1}"  # rfc1459: [ is {
    assert message.sender_id == "alice{1}" and message.text == "hello"
    assert message.metadata[META_IS_GROUP] is False
    assert message.metadata[META_SENDER_NAME] == "Alice[1]"
    assert message.message_id == "net:c:1"


def test_a_channel_message_is_keyed_by_the_folded_channel_and_gated_by_the_nick() -> None:
    message = take(privmsg("bob!~b@host", "#Team", "GWBot: what time is it?"))
    assert isinstance(message, InboundMessage)
    assert message.session_key == "irc:net:#team"
    assert message.text == "what time is it?"
    assert message.metadata[META_IS_GROUP] is True and message.metadata[META_MENTIONED] is True
    chatter = take(privmsg("bob!~b@host", "#team", "lunch?"))
    assert isinstance(chatter, InboundMessage) and chatter.metadata[META_MENTIONED] is False


@pytest.mark.parametrize(
    ("text", "mentioned", "left"),
    [
        ("gwbot: hi", True, "hi"),
        ("gwbot, hi", True, "hi"),
        ("  GWBOT:hi", True, "hi"),
        ("ask gwbot about it", True, "ask gwbot about it"),
        ("(gwbot) help", True, "(gwbot) help"),
        ("gwbot:", True, "gwbot:"),
        ("gwbots are fun", False, "gwbots are fun"),
        ("xgwbot: no", False, "xgwbot: no"),
        ("gwbot_ is another", False, "gwbot_ is another"),
        ("bob: gwbot is here", True, "bob: gwbot is here"),
    ],
)
def test_addressing_by_nick(text: str, mentioned: bool, left: str) -> None:
    assert addressing(text, BOT, SUPPORT) == (mentioned, left)


def test_a_local_channel_and_a_message_to_a_channels_operators_are_channel_messages() -> None:
    local = take(privmsg("a!~a@h", "&Local", "gwbot: hi"))
    ops = take(privmsg("a!~a@h", "@#Team", "gwbot: hi"))
    assert isinstance(local, InboundMessage) and local.session_key == "irc:net:&local"
    assert isinstance(ops, InboundMessage) and ops.session_key == "irc:net:#team"


def test_what_is_not_a_message_for_the_bot() -> None:
    assert isinstance(take(privmsg("gwbot!~g@h", "#team", "gwbot: me")), Skip)
    assert isinstance(take(privmsg("irc.server", "#team", "notice")), Skip)
    assert isinstance(take(privmsg("a!~a@h", BOT, "\x01VERSION\x01")), Skip)
    assert isinstance(take(privmsg("a!~a@h", BOT, "\x02\x02")), Skip)
    action = take(privmsg("a!~a@h", BOT, "\x01ACTION waves\x01"))
    assert isinstance(action, InboundMessage) and action.text == "* a waves"


def test_bang_commands_are_the_gateways_commands_and_tags_are_used() -> None:
    message = take(privmsg("a!~a@h", "#t", "gwbot: !new", msgid="XYZ", time="2024-01-01T00:00:00Z"))
    assert isinstance(message, InboundMessage)
    assert message.text == "/new" and message.message_id == "XYZ"
    assert message.metadata["sent_at"] == 1704067200.0
    other = take(privmsg("a!~a@h", BOT, "!seen bob"))
    assert isinstance(other, InboundMessage) and other.text == "!seen bob"


def test_allow_from_entries_are_the_channels_ids() -> None:
    section = IrcSettings(
        enabled=True, host="irc.example", network="net", allow_from=["#Team", "Alice", "*"]
    )
    policy = access(section)
    assert {"net:#team", "alice", "*"} <= policy.allow_from
    assert SPEC.offers.groups and not SPEC.offers.catch_up
    assert SPEC.leader_roles == ("irc connection",)


def test_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="nick"):
        IrcSettings(nick="9bad nick")
    with pytest.raises(ValueError, match="channel name"):
        IrcSettings(channels=["team"])
    with pytest.raises(ValueError, match="session keys"):
        IrcSettings(network="a:b")
    with pytest.raises(ConfigError, match="GATEWAY_CHANNELS__IRC__HOST"):
        IrcChannel(IrcSettings(enabled=True))
    with pytest.raises(ConfigError, match="SASL_PASSWORD"):
        IrcChannel(IrcSettings(enabled=True, host="h", sasl_username="bot"))
    assert IrcSettings(host="Irc.Example").resolved_network() == "irc.example"
    assert IrcSettings(tls=False).resolved_port() == 6667


# --------------------------------------------------------------------------- against ngIRCd


@pytest.fixture(scope="module")
def ngircd() -> Iterator[Ngircd]:
    with running_ngircd() as server:
        yield server


@dataclass
class Taken:
    taken: bool = True

    async def reply(self) -> OutboundMessage | None:
        return None


@dataclass
class Recorder:
    """The dispatcher's part: records what is submitted, answers "echo: ...", and says
    "not taken" for the first `refuse` submits."""

    channel: IrcChannel | None = None
    messages: list[InboundMessage] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    refuse: int = 0
    slow: float = 0.0
    answer: bool = True

    async def __call__(self, message: InboundMessage) -> Taken:
        self.events.append(f"start {message.text}")
        if self.slow:
            await anyio.sleep(self.slow)
        self.events.append(f"end {message.text}")
        if self.refuse:
            self.refuse -= 1
            return Taken(False)
        self.messages.append(message)
        if self.answer and self.channel is not None:
            await self.channel.send(reply_for(message, f"echo: {message.text}"))
        return Taken(True)


@asynccontextmanager
async def running(channel: IrcChannel, recorder: Recorder | None = None) -> AsyncIterator[Recorder]:
    recorder = recorder or Recorder()
    recorder.channel = channel
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(20):
            await tg.start(channel.run, recorder)
        try:
            yield recorder
        finally:
            tg.cancel_scope.cancel()


async def wait_for(person: IrcPerson, text: str, within: float = 15.0) -> str:
    return await anyio.to_thread.run_sync(
        lambda: person.wait_for(text, timeout=within, what=repr(text))
    )


async def eventually(check: Any, within: float = 15.0) -> None:
    """Poll `check` (state of a channel that has no event for it) until it holds."""
    with anyio.fail_after(within):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def test_over_tls_a_dm_and_a_channel_mention_are_answered_in_place(ngircd: Ngircd) -> None:
    channel = IrcChannel(settings_for(ngircd), pacing=FAST)
    alice = ngircd.person("alice1", channels=("#team",))
    async with running(channel) as recorder:
        assert channel.live.is_set()
        alice.say(BOT, "hello over TLS")
        await wait_for(alice, "PRIVMSG alice1 :echo: hello over TLS")
        alice.say("#team", f"{BOT.upper()}: in the channel")
        await wait_for(alice, "PRIVMSG #team :alice1: echo: in the channel")
        alice.say("#team", "chatter")
        await eventually(lambda: len(recorder.messages) == 3)
    keys = [m.session_key for m in recorder.messages]
    assert keys == ["irc:test:alice1", "irc:test:#team", "irc:test:#team"]
    assert [m.metadata.get(META_MENTIONED) for m in recorder.messages] == [None, True, False]
    alice.close()


async def test_a_taken_nick_gives_way_and_is_asked_back(ngircd: Ngircd) -> None:
    squatter = ngircd.person("gwnick")
    channel = IrcChannel(settings_for(ngircd, nick="gwnick", channels=[]), pacing=FAST)
    async with running(channel):
        me = channel._me
        assert me is not None and me.nick == "gwnick_"
        squatter.close()
        await eventually(lambda: me.nick == "gwnick", within=10)


async def test_lines_are_submitted_one_at_a_time_and_again_until_taken(ngircd: Ngircd) -> None:
    channel = IrcChannel(settings_for(ngircd, channels=[]), pacing=FAST)
    bob = ngircd.person("bob1")
    recorder = Recorder(refuse=2, slow=0.3, answer=False)
    async with running(channel, recorder):
        for n in range(3):
            bob.say(BOT, f"m{n}")
        await eventually(lambda: len(recorder.messages) == 3)
    # The first line was offered three times (twice refused) before the second was read.
    assert recorder.events == [
        "start m0", "end m0", "start m0", "end m0", "start m0", "end m0",
        "start m1", "end m1", "start m2", "end m2",
    ]  # fmt: skip
    assert [m.text for m in recorder.messages] == ["m0", "m1", "m2"]
    bob.close()


async def test_a_reply_is_paced_by_the_bucket(ngircd: Ngircd) -> None:
    channel = IrcChannel(
        settings_for(ngircd, channels=[], burst_lines=3, line_interval_seconds=0.5), pacing=FAST
    )
    carol = ngircd.person("carol1")
    async with running(channel):
        channel_reply = OutboundMessage(
            "irc", "test:carol1", "\n".join(f"line {n}" for n in range(7)), "irc:test:carol1"
        )
        began = time.monotonic()
        await channel.send(channel_reply)
        took = time.monotonic() - began
        await wait_for(carol, "line 6")
    assert took >= 4 * 0.5 - 0.1  # three at once, then four more half a second apart
    got = [text for _, sender, _, text in carol.received() if sender == BOT]
    assert got == [f"line {n}" for n in range(7)]
    carol.close()


async def test_a_reply_cut_off_fails_and_goes_on_where_it_stopped(ngircd: Ngircd) -> None:
    proxy = TcpProxy("127.0.0.1", ngircd.tls_port)
    proxy.restore()
    dave = ngircd.person("dave1")
    channel = IrcChannel(
        settings_for(
            ngircd, port=proxy.port, channels=[], burst_lines=1, line_interval_seconds=0.4
        ),
        pacing=FAST,
    )
    reply = OutboundMessage(
        "irc", "test:dave1", "\n".join(f"part {n}" for n in range(8)), "irc:test:dave1", "id-1"
    )
    try:
        async with running(channel):
            async with anyio.create_task_group() as tg:

                async def cut_after_two() -> None:
                    await wait_for(dave, "part 1")
                    proxy.cut()

                tg.start_soon(cut_after_two)
                with pytest.raises(DeliveryFailed) as failed:
                    await channel.send(reply)
            sent = failed.value.sent
            assert 2 <= sent < 8
            proxy.restore()
            await channel.send(reply)  # reconnected meanwhile: the rest goes out
            await wait_for(dave, "part 7")
    finally:
        proxy.close()
    got = [text for _, sender, _, text in dave.received() if sender == BOT]
    assert len(got) == len(set(got)), f"a line came twice: {got}"
    assert got == sorted(got) and got[-1] == "part 7" and {"part 0", "part 1"} <= set(got)
    assert channel.connections == 2
    dave.close()


async def test_no_connection_for_a_while_is_a_delivery_failure(ngircd: Ngircd) -> None:
    channel = IrcChannel(settings_for(ngircd), pacing=FAST)
    with pytest.raises(DeliveryFailed, match="not connected"):
        await channel.send(OutboundMessage("irc", "test:x", "hi", "irc:test:x"))
    with pytest.raises(ValueError, match="network"):
        await channel.send(OutboundMessage("irc", "other:x", "hi", "irc:other:x"))


async def test_draining_marks_the_bot_away_and_still_takes_what_is_written(ngircd: Ngircd) -> None:
    """IRC hands no line over twice: a drain must not leave one unread (the dispatcher
    journals it for the next start; here the recorder takes it)."""
    channel = IrcChannel(settings_for(ngircd, channels=[]), pacing=FAST)
    erin = ngircd.person("erin1")
    async with running(channel) as recorder:
        erin.say(BOT, "before")
        await wait_for(erin, "echo: before")
        channel.pause_intake()
        await anyio.sleep(0.5)
        erin.say(BOT, "during")
        away = await wait_for(erin, " 301 erin1 ")  # RPL_AWAY: the server tells the sender
        assert AWAY_TEXT in away
        await anyio.sleep(0.5)
    assert [m.text for m in recorder.messages] == ["before", "during"]
    assert IrcChannel.redelivers is False
    erin.close()


# --------------------------------------------------------------------------- reconnects


async def test_a_server_restart_is_met_with_reconnects_and_the_channels_rejoined() -> None:
    with running_ngircd() as server:
        channel = IrcChannel(settings_for(server), pacing=FAST)
        async with running(channel):
            server.restart(down_for=1.5)  # connections refused meanwhile: backoff
            frank = server.person("frank1", channels=("#team",))
            await eventually(lambda: channel.connections == 2 and channel._link is not None)
            await anyio.sleep(1.0)  # the JOIN
            frank.say("#team", f"{BOT}: back?")
            await wait_for(frank, "frank1: echo: back?")


# --------------------------------------------------------------------------- SASL


def fake_settings(fake: FakeIrc, **overrides: Any) -> IrcSettings:
    values: dict[str, Any] = {
        "enabled": True,
        "host": "127.0.0.1",
        "port": fake.port,
        "tls": False,
        "nick": BOT,
        "sasl_username": "gwaccount",
        "sasl_password": "right",
    }
    return IrcSettings(**(values | overrides))


async def test_sasl_plain_logs_in_before_registering_and_never_asks_nickserv() -> None:
    with FakeIrc.running({"gwaccount": "right"}) as fake:
        channel = IrcChannel(fake_settings(fake), pacing=FAST)
        async with running(channel, Recorder(answer=False)) as recorder:
            me = channel._me
            assert me is not None and "sasl" in me.caps and me.isupport.network == "FakeNet"
            fake.tell(BOT, f"@msgid=m-1 :zoe!~z@host PRIVMSG {BOT} :tagged")
            await eventually(lambda: recorder.messages)
        assert recorder.messages[0].message_id == "m-1"
        assert fake.clients[0].account == "gwaccount"
        sent = [Line.parse(line) for line in fake.received]
        assert [line.command for line in sent][:5] == ["CAP", "NICK", "USER", "CAP", "AUTHENTICATE"]
        assert not any("nickserv" in " ".join(line.params).lower() for line in sent)


async def test_a_refused_sasl_login_stops_the_channel_saying_what_to_fix() -> None:
    with FakeIrc.running({"gwaccount": "right"}) as fake:
        channel = IrcChannel(fake_settings(fake, sasl_password="wrong"), pacing=FAST)
        with pytest.raises(IrcSetupError, match="SASL login as 'gwaccount' failed"):
            with anyio.fail_after(10):
                await channel.run(Recorder())


async def test_sasl_on_a_server_without_it_is_refused(ngircd: Ngircd) -> None:
    channel = IrcChannel(
        settings_for(ngircd, sasl_username="acct", sasl_password="pw"), pacing=FAST
    )
    with pytest.raises(IrcSetupError, match="offers no SASL"):
        with anyio.fail_after(10):
            await channel.run(Recorder())


# --------------------------------------------------------------------------- doctor, replicas


async def test_doctor_registers_and_quits(ngircd: Ngircd) -> None:
    findings = await checks(settings_for(ngircd))
    assert findings[0].status == "ok" and f"{BOT} on test" in findings[0].what
    refused = await checks(settings_for(ngircd, port=1, tls=False))
    assert refused[0].status == "fail" and "cannot register" in refused[0].what
    untrusted = await checks(settings_for(ngircd, tls_ca_file=None))
    assert untrusted[0].status == "fail" and "TLS" in untrusted[0].what


class LocalRelay:
    """The relay of the shared mode, between two channels in one process."""

    def __init__(self) -> None:
        self.holder: IrcChannel | None = None
        self.done: dict[str, dict[str, Any]] = {}

    async def listen(self) -> None:
        await anyio.sleep_forever()

    async def serve(self, handle: Any) -> None:
        self.handle = handle
        await anyio.sleep_forever()

    async def call(self, key: str, request: dict[str, Any], *, deadline: float) -> Any:
        if key not in self.done:
            self.done[key] = await self.handle(request)
        return self.done[key]


async def test_one_replica_holds_the_connection_and_the_other_relays_replies(
    ngircd: Ngircd,
) -> None:
    relay = LocalRelay()
    held = anyio.Event()

    async def leader(work: Any) -> None:
        held.set()
        await work(MemoryCursors())

    async def never(work: Any) -> None:
        await anyio.sleep_forever()

    holder = IrcChannel(settings_for(ngircd, channels=[]), pacing=FAST)
    standby = IrcChannel(settings_for(ngircd, channels=[]), pacing=FAST)
    holder.lead, holder.relay, holder.replicas = leader, relay, True
    standby.lead, standby.relay, standby.replicas = never, relay, True
    gina = ngircd.person("gina1")
    async with running(holder, Recorder(answer=False)), running(standby, Recorder()):
        # (ngIRCd may not have let go of the nick of an earlier test yet: it is asked back.)
        await eventually(lambda: holder._me is not None and holder._me.nick == BOT)
        reply = OutboundMessage("irc", "test:gina1", "relayed", "irc:test:gina1", "r-1")
        await standby.send(reply)
        await standby.send(reply)  # asked again (a retry): one line only
        await wait_for(gina, "relayed")
        await anyio.sleep(0.5)
    assert standby.connections == 0 and holder.connections == 1
    got = [text for _, sender, _, text in gina.received() if sender == BOT]
    assert got == ["relayed"]
    gina.close()


# --------------------------------------------------------------------------- chathistory


async def test_with_chathistory_what_was_missed_is_read_back_once_in_order() -> None:
    """A server with IRCv3 chathistory (the fake; ngIRCd has none): after a restart the
    bot reads back, page by page, what its channel and its private conversations got
    while it was away, a private message from someone new included, before the live
    messages that came meanwhile; a message read twice is dropped by its msgid."""
    store = MemoryCursors()

    async def lead(work: Any) -> None:
        await work(store)

    @dataclass
    class Journal(Recorder):
        """The recorder, dropping a message id the journal has (across restarts)."""

        async def __call__(self, message: InboundMessage) -> Taken:
            if message.message_id in journaled:
                return Taken(True)
            journaled.add(str(message.message_id))
            return await super().__call__(message)

    journaled: set[str] = set()

    with FakeIrc.running({}, history=True, history_limit=2) as fake:
        settings = fake_settings(fake, sasl_username=None, sasl_password=None, channels=["#room"])
        first = IrcChannel(settings, pacing=FAST)
        first.lead = lead
        async with running(first, Journal(answer=False)) as before:
            fake.post("alice", "#room", f"{BOT}: one")
            fake.post("carol", BOT, "hello")
            await eventually(lambda: len(before.messages) == 2)
            await eventually(lambda: EVERYTHING in first._positions)
        assert [m.text for m in before.messages] == ["one", "hello"]
        # Away: the channel, a known correspondent and a new one write.
        for text in ("two", "chatter", f"{BOT}: three", f"{BOT}, four"):
            fake.post("alice", "#room", text)
        fake.post("carol", BOT, "again")
        fake.post("dave", BOT, "first time")
        fake.history_delay = 0.5
        second = IrcChannel(settings, pacing=FAST)
        second.lead = lead
        async with running(second, Journal(answer=False)) as after:
            await eventually(lambda: any("AFTER #room" in line for line in fake.received))
            fake.post("alice", "#room", f"{BOT}: live")  # while the history is on its way
            await eventually(lambda: len(after.messages) == 7)
            await anyio.sleep(0.3)
        room = [m for m in after.messages if m.session_key.endswith("#room")]
        assert [m.text for m in room] == ["two", "chatter", "three", "four", "live"]
        assert [m.metadata[META_MENTIONED] for m in room] == [False, False, True, True, True]
        private = {m.session_key: m.text for m in after.messages if "#" not in m.session_key}
        assert private == {"irc:127.0.0.1:carol": "again", "irc:127.0.0.1:dave": "first time"}
        assert len(after.messages) == 7 and second.read_back >= 6


async def test_with_chathistory_what_came_during_a_drain_is_taken_then() -> None:
    """A drain goes on reading (the dispatcher journals what comes for the next start);
    what the next start reads back again is the same message (its id), which the
    journal answers once."""
    store = MemoryCursors()

    async def lead(work: Any) -> None:
        await work(store)

    with FakeIrc.running({}, history=True) as fake:
        settings = fake_settings(fake, sasl_username=None, sasl_password=None)
        first = IrcChannel(settings, pacing=FAST)
        first.lead = lead
        async with running(first, Recorder(answer=False)) as before:
            fake.post("carol", BOT, "hello")
            await eventually(lambda: before.messages)
            first.pause_intake()
            await eventually(lambda: any(line.startswith("AWAY") for line in fake.received))
            fake.post("carol", BOT, "during the drain")
            await eventually(lambda: len(before.messages) == 2)
        assert [m.text for m in before.messages] == ["hello", "during the drain"]
        second = IrcChannel(settings, pacing=FAST)
        second.lead = lead
        async with running(second, Recorder(answer=False)) as after:
            fake.post("carol", BOT, "after")
            await eventually(lambda: any(m.text == "after" for m in after.messages))
        # What is read back again (a second before the position) carries the ids the
        # journal has, so it is answered once.
        first_ids = {m.text: m.message_id for m in before.messages}
        again = [m for m in after.messages if m.text != "after"]
        assert all(first_ids[m.text] == m.message_id for m in again)
