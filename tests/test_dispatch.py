"""The dispatcher's promises: per-session order, no cross-session blocking, the global
cap, no silent drops, dedupe (also across a restart), collect mode, drain, failures.

The handlers are small async functions standing in for the agent: the dispatcher is
generic over its handler, so nothing of ours is mocked.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from gateway import failpoints
from gateway.access.policy import ALLOW, AccessGate, ChannelAccessPolicy, Decision, Ignore
from gateway.access.store import PairingStore
from gateway.dispatch.dispatcher import (
    BUSY_TEXT,
    DRAINING_TEXT,
    ERROR_TEXT,
    RESTART_TEXT,
    Dispatcher,
    Handler,
    merge_messages,
)
from gateway.dispatch.lanes import SubmitStatus, Ticket
from gateway.dispatch.queue_modes import QueueMode, TurnInbox, current_inbox
from gateway.journal.protocol import dedupe_key
from gateway.journal.store import FileDedupeStore, MemoryDedupeStore
from gateway.messages import (
    MERGED_IDS_KEY,
    META_IS_GROUP,
    META_MENTIONED,
    InboundMessage,
    OutboundMessage,
)

pytestmark = pytest.mark.anyio


def inbound(chat: str, text: str, message_id: str | None = None) -> InboundMessage:
    return InboundMessage(channel="test", chat_id=chat, text=text, message_id=message_id)


def reply_to(msg: InboundMessage, text: str) -> OutboundMessage:
    return OutboundMessage(
        channel=msg.channel,
        chat_id=msg.chat_id,
        text=text,
        session_key=msg.session_key,
        reply_to=msg.message_id,
    )


async def echo(msg: InboundMessage) -> OutboundMessage:
    return reply_to(msg, f"re: {msg.text}")


class Outbox:
    """The `deliver` end: what the channels would have sent."""

    def __init__(self) -> None:
        self.sent: list[OutboundMessage] = []

    async def deliver(self, out: OutboundMessage) -> None:
        self.sent.append(out)

    def texts(self, chat: str) -> list[str]:
        return [o.text for o in self.sent if o.chat_id == chat]


@asynccontextmanager
async def running(dispatcher: Dispatcher, grace: float = 5.0) -> AsyncIterator[Dispatcher]:
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        try:
            yield dispatcher
        finally:
            with anyio.CancelScope(shield=True):
                await dispatcher.drain(grace)


class SlowOpenAccess:
    """An access check that lets everyone in after a random delay (a thread hop)."""

    def screen(self, msg: InboundMessage) -> None:

        return None

    async def check(self, msg: InboundMessage) -> Decision:
        await anyio.sleep(random.random() * 0.002)
        return ALLOW


class SlowDedupe(MemoryDedupeStore):
    """A dedupe store that answers after a random delay, as a busy disk would."""

    async def seen_or_add(self, key: str) -> bool:
        await anyio.sleep(random.random() * 0.002)
        return await super().seen_or_add(key)


# --------------------------------------------------------------------------- ordering


async def test_each_session_is_handled_in_submit_order_under_concurrent_load() -> None:
    """Promise: messages of one session are handled strictly in arrival order, one at
    a time, whatever the other sessions, the handler's timing and the dedupe store's."""
    rng = random.Random(7)
    sessions, per_session = 40, 25
    submitted: dict[str, list[str]] = defaultdict(list)
    handled: dict[str, list[str]] = defaultdict(list)
    busy: set[str] = set()
    overlaps: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        key = msg.session_key
        if key in busy:
            overlaps.append(key)
        busy.add(key)
        handled[key].append(msg.text)
        await anyio.sleep(rng.random() * 0.003)
        busy.discard(key)
        return await echo(msg)

    outbox = Outbox()
    dispatcher = Dispatcher(
        handler,
        outbox.deliver,
        max_concurrent_turns=6,
        dedupe=SlowDedupe(),
        access=SlowOpenAccess(),
    )

    async def submit(msg: InboundMessage) -> None:
        submitted[msg.session_key].append(msg.text)  # arrival: the call of submit
        ticket = await dispatcher.submit(msg)
        assert ticket.status is SubmitStatus.ACCEPTED

    async def client(chat: str) -> None:
        async with anyio.create_task_group() as tg:
            for n in range(per_session):
                # Bursts of concurrent submits, so dedupe answers can overtake each other.
                tg.start_soon(submit, inbound(chat, f"{chat}-{n}", message_id=str(n)))
                if rng.random() < 0.3:
                    await anyio.sleep(rng.random() * 0.002)

    async with running(dispatcher), anyio.create_task_group() as tg:
        for s in range(sessions):
            tg.start_soon(client, f"c{s}")

    assert not overlaps
    assert len(outbox.sent) == sessions * per_session
    for key, texts in submitted.items():
        assert handled[key] == texts
        chat = key.split(":", 1)[1]
        assert outbox.texts(chat) == [f"re: {t}" for t in texts]  # replies in order too
    stats = dispatcher.stats()
    assert stats.turns_finished == stats.accepted == sessions * per_session


# --------------------------------------------------------------------------- isolation


async def test_a_slow_session_does_not_delay_another() -> None:
    async def handler(msg: InboundMessage) -> OutboundMessage:
        if msg.chat_id == "slow":
            await anyio.sleep(1.0)
        return await echo(msg)

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver, max_concurrent_turns=2)) as d:
        for n in range(5):  # a deep queue of slow turns holds one slot, not the cap
            await d.submit(inbound("slow", f"s{n}"))
        await anyio.sleep(0.01)
        start = time.perf_counter()
        fast = await d.submit(inbound("fast", "hi"))
        reply = await fast.reply()
        waited = time.perf_counter() - start
        assert reply is not None and reply.text == "re: hi"
        assert waited < 0.05, f"the fast session waited {waited * 1000:.0f} ms"
        assert d.stats().queue_depths == {"test:slow": 4}
        await d.drain(0)  # no need to wait for the slow ones


async def test_the_global_cap_is_respected_and_reached() -> None:
    cap, active, peak = 4, 0, 0

    async def handler(msg: InboundMessage) -> OutboundMessage:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await anyio.sleep(0.01)
        active -= 1
        return await echo(msg)

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver, max_concurrent_turns=cap)) as d:
        tickets = [await d.submit(inbound(f"c{n % 20}", str(n))) for n in range(60)]
        for ticket in tickets:
            await ticket.reply()
    assert peak == cap
    assert len(outbox.sent) == 60


# --------------------------------------------------------------------------- no drops


async def test_a_full_lane_tells_the_sender_to_wait_and_counts_it() -> None:
    """Promise: a message is never silently dropped, even when its lane is full."""
    release = anyio.Event()
    started = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        started.set()
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver, max_queue_per_lane=3)) as d:
        first = await d.submit(inbound("a", "1"))
        await started.wait()  # "1" is in flight, the queue is empty
        queued = [await d.submit(inbound("a", t)) for t in ("2", "3", "4")]
        refused = await d.submit(inbound("a", "5", message_id="m5"))
        other = await d.submit(inbound("b", "elsewhere"))  # other lanes are unaffected

        assert refused.status is SubmitStatus.REJECTED_FULL
        notice = await refused.reply()
        assert notice is not None and notice.is_error and notice.text == BUSY_TEXT
        assert notice.reply_to == "m5"
        stats = d.stats()
        assert stats.dropped_full == 1 and stats.queue_depths["test:a"] == 3
        release.set()
        for ticket in [first, *queued, other]:
            assert ticket.status is SubmitStatus.ACCEPTED
            reply = await ticket.reply()
            assert reply is not None and not reply.is_error
    assert outbox.texts("a") == [BUSY_TEXT, "re: 1", "re: 2", "re: 3", "re: 4"]


async def test_the_gateway_as_a_whole_is_bounded_too() -> None:
    """Many sessions at once cannot grow the queues without bound: past
    `max_queued_total` senders are told to wait, whichever lane they are in."""
    release = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    dispatcher = Dispatcher(handler, outbox.deliver, max_concurrent_turns=2, max_queued_total=5)
    async with running(dispatcher) as d:
        accepted = [await d.submit(inbound(f"s{i}", "hi")) for i in range(5)]
        refused = await d.submit(inbound("s99", "one too many"))
        assert refused.status is SubmitStatus.REJECTED_FULL
        notice = await refused.reply()
        assert notice is not None and notice.text == BUSY_TEXT
        assert d.stats().dropped_full == 1
        release.set()
        for ticket in accepted:
            assert ticket.status is SubmitStatus.ACCEPTED
            reply = await ticket.reply()
            assert reply is not None and not reply.is_error


async def test_a_failing_turn_gets_an_error_reply_and_the_lane_goes_on() -> None:
    async def handler(msg: InboundMessage) -> OutboundMessage:
        if msg.text == "boom":
            raise RuntimeError("handler bug")
        return await echo(msg)

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver)) as d:
        failed = await d.submit(inbound("a", "boom", message_id="1"))
        after = await d.submit(inbound("a", "after"))
        await after.reply()
        error = await failed.reply()
    assert error is not None and error.is_error and error.text == ERROR_TEXT
    assert error.reply_to == "1" and error.session_key == "test:a"
    assert "handler bug" not in error.text
    assert outbox.texts("a") == [ERROR_TEXT, "re: after"]
    assert d.stats().turn_failures == 1


async def test_a_failing_delivery_is_counted_and_the_lane_goes_on() -> None:
    delivered: list[str] = []

    async def deliver(out: OutboundMessage) -> None:
        if out.text == "re: lost":
            raise ConnectionError("platform down")
        delivered.append(out.text)

    async with running(Dispatcher(echo, deliver)) as d:
        await d.submit(inbound("a", "lost"))
        last = await d.submit(inbound("a", "kept"))
        await last.reply()
        await anyio.sleep(0.01)
    assert delivered == ["re: kept"]
    assert d.stats().delivery_failures == 1


# ----------------------------------------------------------------- busy rooms, backlogs


def room_gate(tmp_path: Path) -> AccessGate:
    """The real access gate: the `test` channel's groups open to all, answered only when
    the bot is mentioned (the default `require_mention`)."""
    policy = ChannelAccessPolicy(dm_policy="open", group_policy="open")
    return AccessGate({"test": policy}, PairingStore(tmp_path / "pairing.json"))


async def settle_lanes(dispatcher: Dispatcher) -> None:
    with anyio.fail_after(10):
        while (  # noqa: ASYNC110
            dispatcher.stats().queued_total
            or dispatcher.stats().in_flight
            or dispatcher.stats().waiting_in_journal
        ):
            await anyio.sleep(0.01)
        await anyio.sleep(0.05)


def in_room(sender: str, text: str, message_id: str, *, mention: bool) -> InboundMessage:
    return InboundMessage(
        channel="test",
        chat_id="room",
        sender_id=sender,
        text=text,
        message_id=message_id,
        metadata={META_IS_GROUP: True, META_MENTIONED: mention},
    )


async def test_a_busy_room_queues_only_what_addresses_the_bot_and_tells_bystanders_nothing(
    tmp_path: Path,
) -> None:
    """Issue 37's live Discord shape: a mention while the model is slow, 60 messages
    that do not address the bot, then a second mention, in a lane bounded at 3. The
    chatter takes no place in the queue and gets no notice; both mentions are answered,
    each to the person who wrote it."""
    release = anyio.Event()
    handled: list[str] = []

    async def slow(msg: InboundMessage) -> OutboundMessage:
        handled.append(msg.text)
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    bounded = Dispatcher(
        slow, outbox.deliver, dedupe=store, access=room_gate(tmp_path), max_queue_per_lane=3
    )
    async with running(bounded) as d:
        first = await d.submit(in_room("alice", "@bot one", "1", mention=True))
        chatter = [
            await d.submit(in_room(f"user{i}", f"chatter {i}", str(100 + i), mention=False))
            for i in range(60)
        ]
        second = await d.submit(in_room("bob", "@bot two", "2", mention=True))
        assert {t.status for t in chatter} == {SubmitStatus.IGNORED}
        assert first.status is second.status is SubmitStatus.ACCEPTED
        assert d.stats().queue_depths == {"test:room": 1}  # only the second mention waits
        release.set()
        replies = [await first.reply(), await second.reply()]
    await store.aclose()
    assert handled == ["@bot one", "@bot two"]
    assert [(o.text, o.reply_to) for o in outbox.sent] == [
        ("re: @bot one", "1"),
        ("re: @bot two", "2"),
    ]
    assert [r.text for r in replies if r is not None] == ["re: @bot one", "re: @bot two"]
    assert d.stats().dropped_full == 0 and d.stats().ignored == 60


async def test_a_backlog_longer_than_the_lane_is_answered_once_each_in_order(
    tmp_path: Path,
) -> None:
    """A catch-up after downtime hands one conversation a backlog of 500 platform
    messages at once, ten times the lane bound: each is journaled and taken (the channel
    may confirm it), none is refused, and each is answered once, in order."""
    started = anyio.Event()
    release = anyio.Event()
    handled: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        handled.append(msg.text)
        started.set()
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    bounded = Dispatcher(handler, outbox.deliver, dedupe=store, max_queue_per_lane=50)
    texts = [f"m{i:03d}" for i in range(500)]
    async with running(bounded) as d:
        tickets = [await d.submit(inbound("a", t, message_id=t)) for t in texts]
        await started.wait()
        assert all(t.taken and t.status is SubmitStatus.ACCEPTED for t in tickets)
        assert len(await store.unanswered()) == 500  # all journaled before being taken
        release.set()
        for ticket in tickets:
            await ticket.reply()
        await settle_lanes(d)
    assert await store.unanswered() == []
    await store.aclose()
    assert handled == texts
    assert outbox.texts("a") == [f"re: {t}" for t in texts]
    assert d.stats().dropped_full == 0


async def test_past_the_total_bound_a_platform_message_waits_in_the_journal(
    tmp_path: Path,
) -> None:
    """At `max_queued_total` the gateway holds no more in memory, but a platform's
    message is still taken (many platforms would hand it over again only at a
    reconnect): it is journaled (`KEPT`), its sender is told nothing, and it is fed to
    its lane once the gateway is down to half its bound, behind its session's earlier
    messages and ahead of its later ones. A redelivery of it meanwhile is a duplicate.
    A message its sender holds (no platform id) is refused with a notice, as before."""
    release = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    full = Dispatcher(handler, outbox.deliver, dedupe=store, max_queued_total=4)
    async with running(full) as d:
        held = [await d.submit(inbound(f"s{i}", "hi", message_id=str(i))) for i in range(3)]
        first = await d.submit(inbound("late", "l0", message_id="l0"))
        kept = [await d.submit(inbound("late", f"l{i}", message_id=f"l{i}")) for i in (1, 2)]
        again = await d.submit(inbound("late", "l1", message_id="l1"))
        refused = await d.submit(inbound("api", "from the chat API"))
        assert all(t.status is SubmitStatus.ACCEPTED for t in [*held, first])
        assert all(t.status is SubmitStatus.KEPT and t.taken for t in kept)
        assert await kept[0].reply() is None
        assert again.status is SubmitStatus.DUPLICATE
        assert refused.status is SubmitStatus.REJECTED_FULL
        stats = d.stats()
        assert stats.kept_in_journal == 2 and stats.waiting_in_journal == 2
        # Once room is back, a newer message of the same conversation waits behind them.
        release.set()
        for ticket in [*held, first]:
            await ticket.reply()
        newer = await d.submit(inbound("late", "l3", message_id="l3"))
        await settle_lanes(d)
        await newer.reply()
        await settle_lanes(d)
        assert d.stats().waiting_in_journal == 0
    assert await store.unanswered() == []
    await store.aclose()
    assert outbox.texts("late") == ["re: l0", "re: l1", "re: l2", "re: l3"]
    assert outbox.texts("api") == [BUSY_TEXT]


async def test_while_draining_a_platform_message_is_left_with_the_platform(
    tmp_path: Path,
) -> None:
    """A platform's message that comes in during a drain is not taken and its sender is
    told nothing (the platform hands it to the next start); group chatter is ignored."""
    started = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        started.set()
        await anyio.sleep(0.2)
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    dispatcher = Dispatcher(handler, outbox.deliver, dedupe=store, access=room_gate(tmp_path))
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        await dispatcher.submit(in_room("alice", "@bot hi", "1", mention=True))
        await started.wait()
        tg.start_soon(dispatcher.drain, 5)
        await anyio.sleep(0.01)
        late = await dispatcher.submit(in_room("bob", "@bot late", "2", mention=True))
        chatter = await dispatcher.submit(in_room("carol", "chatter", "3", mention=False))
    await store.aclose()
    assert late.status is SubmitStatus.RETRY_LATER and not late.taken
    assert chatter.status is SubmitStatus.IGNORED
    assert [o.text for o in outbox.sent] == ["re: @bot hi"]


def pushed(chat: str, text: str, message_id: str) -> InboundMessage:
    """A message of a platform that never hands one over again (channel "push")."""
    return InboundMessage(channel="push", chat_id=chat, text=text, message_id=message_id)


def only_test_redelivers(channel: str) -> bool:
    return channel != "push"


async def test_a_platform_that_never_redelivers_is_never_left_a_message_while_draining(
    tmp_path: Path,
) -> None:
    """A push without a receipt (WeCom's robot, Google Chat, IRC) cannot be left with
    its platform: while draining, its message is journaled (`KEPT`, taken) and the next
    start's replay answers it once; its sender is told nothing meanwhile. A redelivering
    platform's message is still left with its platform, and a second push of the same
    message is a duplicate."""
    path = tmp_path / "dedupe.sqlite3"
    started = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        started.set()
        await anyio.sleep(0.2)
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(path)
    dispatcher = Dispatcher(handler, outbox.deliver, dedupe=store, redelivers=only_test_redelivers)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        await dispatcher.submit(pushed("p", "first", "1"))
        await started.wait()
        tg.start_soon(dispatcher.drain, 5)
        await anyio.sleep(0.01)
        kept = await dispatcher.submit(pushed("p", "during the drain", "2"))
        again = await dispatcher.submit(pushed("p", "during the drain", "2"))
        left = await dispatcher.submit(inbound("t", "redelivered later", message_id="3"))
    # ... and after the drain, while the channels stop:
    after = await dispatcher.submit(pushed("q", "after the drain", "4"))
    await store.aclose()
    assert kept.status is SubmitStatus.KEPT and kept.taken and await kept.reply() is None
    assert again.status is SubmitStatus.DUPLICATE
    assert after.status is SubmitStatus.KEPT
    assert left.status is SubmitStatus.RETRY_LATER and not left.taken
    assert dispatcher.stats().kept_in_journal == 2
    assert [o.text for o in outbox.sent] == ["re: first"]

    store = FileDedupeStore(path)
    async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:
        assert await d.replay() == 2
        await settle_lanes(d)
    assert await store.unanswered() == []
    await store.aclose()
    assert outbox.texts("p") == ["re: first", "re: during the drain"]
    assert outbox.texts("q") == ["re: after the drain"]


async def test_many_messages_past_the_bound_keep_every_conversation_in_order(
    tmp_path: Path,
) -> None:
    """200 platform messages over 5 conversations into a gateway with room for 10:
    every one is answered once, each conversation's in the order written, and never
    more than the bound waited in memory."""
    peak = 0
    current = 0

    async def handler(msg: InboundMessage) -> OutboundMessage:
        nonlocal peak, current
        current += 1
        await anyio.sleep(0.001)
        current -= 1
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    bounded = Dispatcher(handler, outbox.deliver, dedupe=store, max_queued_total=10)
    async with running(bounded) as d:
        for n in range(200):
            await d.submit(pushed(f"c{n % 5}", f"m{n}", f"id{n}"))
            peak = max(peak, d.stats().queued_total)
        await settle_lanes(d)
    assert await store.unanswered() == []
    await store.aclose()
    assert peak <= 10
    for c in range(5):
        assert outbox.texts(f"c{c}") == [f"re: m{n}" for n in range(c, 200, 5)]


async def test_room_taken_while_the_journal_is_read_back_is_not_given_twice(
    tmp_path: Path,
) -> None:
    """Messages journaled past the bound are read back once there is room; another
    conversation's messages that take that room while the journal is read are not
    followed by as many from the journal as there was room before: memory stays within
    the bound (a full run once saw 11 of 10)."""
    gates = {"a": anyio.Event(), "b": anyio.Event()}
    seen: list[int] = []
    dispatcher: Dispatcher | None = None

    async def handler(msg: InboundMessage) -> OutboundMessage:
        assert dispatcher is not None
        held = dispatcher.stats()
        seen.append(held.queued_total + held.in_flight)  # this one among them
        await gates[msg.chat_id].wait()
        return await echo(msg)

    paused, resume = anyio.Event(), anyio.Event()

    async def slow_read(name: str, session_key: str) -> None:
        paused.set()
        await resume.wait()

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    dispatcher = Dispatcher(handler, outbox.deliver, dedupe=store, max_queued_total=4)
    failpoints.arm("dispatch.before_refill", slow_read)
    try:
        async with running(dispatcher) as d:
            for n in range(6):  # four in memory, two journaled past the bound
                await d.submit(pushed("a", f"a{n}", f"a{n}"))
            assert d.stats().waiting_in_journal == 2
            gates["a"].set()
            with anyio.fail_after(10):
                await paused.wait()  # room for the two: the refill reads the journal
                while len(outbox.texts("a")) < 4:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                for n in range(3):  # another conversation takes three of the four places
                    await d.submit(pushed("b", f"b{n}", f"b{n}"))
                resume.set()
                while len(outbox.texts("a")) < 5:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            gates["b"].set()
            await settle_lanes(d)
    finally:
        failpoints.disarm_all()
    assert await store.unanswered() == []
    await store.aclose()
    assert max(seen) <= 4, seen
    assert outbox.texts("a") == [f"re: a{n}" for n in range(6)]
    assert outbox.texts("b") == [f"re: b{n}" for n in range(3)]


async def test_at_the_drain_deadline_journaled_messages_wait_for_the_next_start(
    tmp_path: Path,
) -> None:
    """A journaled message still waiting at the drain deadline is not answered with
    "send it again" (its sender would then send it twice): the next start's replay
    answers it, once."""
    path = tmp_path / "dedupe.sqlite3"

    async def stuck(msg: InboundMessage) -> OutboundMessage:
        await anyio.sleep_forever()
        raise AssertionError

    outbox = Outbox()
    store = FileDedupeStore(path)
    async with running(Dispatcher(stuck, outbox.deliver, dedupe=store), grace=0.05) as d:
        for i in range(3):
            await d.submit(inbound("a", f"q{i}", message_id=str(i)))
        await d.submit(inbound("b", "no platform id"))
        await anyio.sleep(0.05)
    await store.aclose()
    assert outbox.texts("a") == [] and outbox.texts("b") == [RESTART_TEXT]

    store = FileDedupeStore(path)
    async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:
        assert await d.replay() == 3
        await settle_lanes(d)
    await store.aclose()
    assert outbox.texts("a") == ["re: q0", "re: q1", "re: q2"]


# --------------------------------------------------------------------------- dedupe


async def test_a_redelivered_message_is_answered_once_also_after_a_restart(
    tmp_path: Path,
) -> None:
    path = tmp_path / "dedupe.sqlite3"
    calls: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        calls.append(msg.text)
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(path)
    async with running(Dispatcher(handler, outbox.deliver, dedupe=store)) as d:
        first = await d.submit(inbound("a", "hello", message_id="42"))
        again = await d.submit(inbound("a", "hello", message_id="42"))
        no_id = [await d.submit(inbound("a", "no id")) for _ in range(2)]
        await first.reply()
        for ticket in no_id:
            await ticket.reply()
        assert again.status is SubmitStatus.DUPLICATE and await again.reply() is None
    await store.aclose()
    assert d.stats().duplicates == 1

    store = FileDedupeStore(path)  # a new process on the same workspace
    async with running(Dispatcher(handler, outbox.deliver, dedupe=store)) as d:
        redelivered = await d.submit(inbound("a", "hello", message_id="42"))
        same_id_other_chat = await d.submit(inbound("b", "hello", message_id="42"))
        await same_id_other_chat.reply()
    await store.aclose()
    assert redelivered.status is SubmitStatus.DUPLICATE
    assert same_id_other_chat.status is SubmitStatus.ACCEPTED
    assert calls == ["hello", "no id", "no id", "hello"]


async def first_and_copy(
    d: Dispatcher,
    meanwhile: Callable[[dict[str, Ticket]], Awaitable[None]] | None = None,
) -> dict[str, Ticket]:
    """A platform message ("first") held at the `dispatch.before_journal` failpoint, and
    a copy of it submitted then; 0.2 s later `meanwhile` runs with the tickets so far,
    then the first goes on. Both tickets."""
    paused, resume = anyio.Event(), anyio.Event()

    async def hold(name: str, key: str) -> None:
        paused.set()
        await resume.wait()

    tickets: dict[str, Ticket] = {}

    async def submit(name: str) -> None:
        tickets[name] = await d.submit(inbound("a", "hello", message_id="42"))

    failpoints.arm("dispatch.before_journal", hold, "test:a")
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(submit, "first")
            await paused.wait()
            tg.start_soon(submit, "copy")
            await anyio.sleep(0.2)
            if meanwhile is not None:
                await meanwhile(tickets)
            resume.set()
    finally:
        failpoints.disarm_all()
    return tickets


async def test_a_copy_that_comes_while_the_first_is_journaled_is_confirmed_after_it(
    tmp_path: Path,
) -> None:
    """A platform that re-sends after a few seconds without a confirmation (Slack's and
    Feishu's do) can hand a message over again while its first copy is still on its way
    into the journal. The copy is a duplicate, but only the first copy's journal write
    makes it safe to confirm: until then the copy waits (a crash in between loses
    nothing), and once the write is done it is confirmed as a duplicate."""
    outbox = Outbox()
    path = tmp_path / "dedupe.sqlite3"
    store = FileDedupeStore(path)
    try:
        async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:

            async def meanwhile(tickets: dict[str, Ticket]) -> None:
                # Only in memory so far: nothing may tell the platform we have it.
                assert tickets == {}
                assert await FileDedupeStore(path).unanswered() == []

            tickets = await first_and_copy(d, meanwhile)
            assert tickets["first"].status is SubmitStatus.ACCEPTED
            assert tickets["copy"].status is SubmitStatus.DUPLICATE and tickets["copy"].taken
            await tickets["first"].reply()
    finally:
        await store.aclose()
    assert outbox.texts("a") == ["re: hello"]


async def test_a_copy_of_a_message_whose_first_copy_was_never_journaled_is_taken_instead(
    tmp_path: Path,
) -> None:
    """The first copy's intake is cancelled before its journal write (its request was
    aborted, and the copy waiting on it is likely the platform's retry): the claim is
    given back and the copy is taken in its place, journaled, confirmed and answered
    once. A later copy is a duplicate."""
    paused = anyio.Event()

    async def stuck(name: str, key: str) -> None:
        paused.set()
        await anyio.sleep_forever()

    outbox = Outbox()
    path = tmp_path / "dedupe.sqlite3"
    store = FileDedupeStore(path)
    failpoints.arm("dispatch.before_journal", stuck, "test:a")
    try:
        async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:
            copies: list[Ticket] = []

            async def copy() -> None:
                copies.append(await d.submit(inbound("a", "hello", message_id="42")))

            async with anyio.create_task_group() as tg, anyio.create_task_group() as first:
                first.start_soon(d.submit, inbound("a", "hello", message_id="42"))
                await paused.wait()
                tg.start_soon(copy)
                await anyio.sleep(0.2)
                assert copies == []  # nothing confirmed while only in memory
                first.cancel_scope.cancel()
            assert [t.status for t in copies] == [SubmitStatus.ACCEPTED]
            assert copies[0].taken
            # Journaled before it was confirmed: a crash now would replay it.
            assert [e.message.message_id for e in await FileDedupeStore(path).unanswered()] in (
                ["42"],
                [],  # answered already
            )
            reply = await copies[0].reply()
            again = await d.submit(inbound("a", "hello", message_id="42"))
            assert again.status is SubmitStatus.DUPLICATE and again.taken
    finally:
        failpoints.disarm_all()
        await store.aclose()
    assert reply is not None and outbox.texts("a") == ["re: hello"]


async def test_a_copy_is_left_with_its_platform_when_the_journal_fails_for_it_too(
    tmp_path: Path,
) -> None:
    """The first copy's journal write fails, and so does the copy's own: the copy is not
    taken (its platform keeps it), and once the journal works the next copy is."""

    class FailingJournal(FileDedupeStore):
        failing = True

        async def journal(self, key: str, msg: InboundMessage) -> None:
            if self.failing:
                raise OSError(28, "No space left on device")
            await super().journal(key, msg)

    outbox = Outbox()
    store = FailingJournal(tmp_path / "dedupe.sqlite3")
    try:
        async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:
            tickets = await first_and_copy(d)
            assert [tickets[n].taken for n in ("first", "copy")] == [False, False]
            store.failing = False
            again = await d.submit(inbound("a", "hello", message_id="42"))
            assert again.status is SubmitStatus.ACCEPTED
            reply = await again.reply()
    finally:
        await store.aclose()
    assert reply is not None and outbox.texts("a") == ["re: hello"]


async def test_a_copy_is_not_settled_on_a_claim_the_store_could_not_give_back(
    tmp_path: Path,
) -> None:
    """The first copy's journal write fails, and so does giving its claim back: the key
    stays claimed with nothing on file. The copy that waited is left with its platform,
    not settled as a duplicate (which would lose the message)."""

    class BrokenStore(FileDedupeStore):
        async def journal(self, key: str, msg: InboundMessage) -> None:
            raise OSError(5, "Input/output error")

        async def release(self, key: str) -> None:
            raise OSError(5, "Input/output error")

    store = BrokenStore(tmp_path / "dedupe.sqlite3")
    try:
        async with running(Dispatcher(echo, Outbox().deliver, dedupe=store)) as d:
            tickets = await first_and_copy(d)
    finally:
        await store.aclose()
    assert [tickets[n].status for n in ("first", "copy")] == [SubmitStatus.RETRY_LATER] * 2
    assert not tickets["copy"].taken


async def test_a_message_cut_off_by_a_restart_is_answered_when_redelivered(
    tmp_path: Path,
) -> None:
    path = tmp_path / "dedupe.sqlite3"
    started = anyio.Event()

    async def stuck(msg: InboundMessage) -> OutboundMessage:
        started.set()
        await anyio.sleep_forever()
        raise AssertionError

    outbox = Outbox()
    store = FileDedupeStore(path)
    async with running(Dispatcher(stuck, outbox.deliver, dedupe=store), grace=0.05) as d:
        await d.submit(inbound("a", "question", message_id="7"))
        await started.wait()
    await store.aclose()
    # Journaled: its sender is not asked to send it again (it would be answered twice).
    assert outbox.texts("a") == []

    store = FileDedupeStore(path)  # the platform redelivers after the restart
    async with running(Dispatcher(echo, outbox.deliver, dedupe=store)) as d:
        ticket = await d.submit(inbound("a", "question", message_id="7"))
        assert ticket.status is SubmitStatus.ACCEPTED
        reply = await ticket.reply()
        again = await d.submit(inbound("a", "question", message_id="7"))
    await store.aclose()
    assert reply is not None and reply.text == "re: question"
    assert again.status is SubmitStatus.DUPLICATE


# --------------------------------------------------------------------------- collect


async def test_collect_mode_merges_what_queued_while_busy() -> None:
    release = anyio.Event()
    started = anyio.Event()
    seen: list[InboundMessage] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        seen.append(msg)
        started.set()
        await release.wait()
        return await echo(msg)

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver, mode="collect")) as d:
        await d.submit(inbound("a", "first", message_id="1"))
        await started.wait()
        later = [
            await d.submit(
                InboundMessage(
                    channel="test",
                    chat_id="a",
                    text=text,
                    message_id=mid,
                    sender_id="u",
                    metadata={"n": mid},
                )
            )
            for text, mid in (("second", "2"), ("third", "3"), ("fourth", "4"))
        ]
        release.set()
        replies = [await t.reply() for t in later]
    assert [m.text for m in seen] == ["first", "second\n\nthird\n\nfourth"]
    merged = seen[1]
    assert merged.message_id == "4" and merged.metadata["n"] == "4"
    assert merged.metadata[MERGED_IDS_KEY] == ["2", "3", "4"]
    assert replies[0] is replies[1] is replies[2]
    assert replies[0] is not None and replies[0].reply_to == "4"
    assert len(outbox.sent) == 2
    assert d.stats().merged_messages == 3


# --------------------------------------------------------------------------- steer


async def test_steer_the_running_turn_takes_what_waits_behind_it_in_order(
    tmp_path: Path,
) -> None:
    """Promise: a message the running turn takes in (`TurnInbox.take`) is the turn's: it
    gets the turn's one reply and is marked answered with it; a message the turn does
    not accept stays queued, and so does everything behind it, in order. Once the turn
    has returned, nothing more joins it."""
    step = anyio.Event()
    inboxes: list[TurnInbox] = []
    turns: list[list[str]] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        inbox = current_inbox(msg.session_key)
        assert inbox is not None and current_inbox("another:key") is None
        inboxes.append(inbox)
        said = [msg.text]
        if msg.text == "first":
            await step.wait()  # the turn's tool calls run; messages queue meanwhile
            said += [m.text for m in inbox.take(lambda m: not m.text.startswith("/"))]
        turns.append(said)
        return reply_to(msg, " + ".join(said))

    outbox = Outbox()
    store = FileDedupeStore(tmp_path / "dedupe.sqlite3")
    async with running(Dispatcher(handler, outbox.deliver, dedupe=store)) as d:
        first = await d.submit(inbound("a", "first", message_id="1"))
        later = [
            await d.submit(inbound("a", text, message_id=str(n)))
            for n, text in enumerate(("second", "third", "/cmd", "fourth"), start=2)
        ]
        step.set()
        replies = [await t.reply() for t in (first, *later)]
        for ticket in (first, *later):
            await ticket.wait_finished()
        left = await store.unanswered()
    await store.aclose()
    assert turns == [["first", "second", "third"], ["/cmd"], ["fourth"]]
    assert replies[0] is replies[1] is replies[2]
    assert replies[0] is not None and replies[0].text == "first + second + third"
    assert outbox.texts("a") == ["first + second + third", "/cmd", "fourth"]
    assert all(t.marked for t in (first, *later)) and left == []
    assert d.stats().steered_messages == 2
    assert inboxes[0].closed and inboxes[0].take(lambda m: True) == []


async def test_steer_a_replayed_message_never_joins_a_turn(tmp_path: Path) -> None:
    """A message a crash left journaled may be in the session already: it gets a turn
    of its own (where the agent finds what the session holds), never a join."""
    path = tmp_path / "dedupe.sqlite3"
    before = FileDedupeStore(path)
    for n in (1, 2):
        msg = inbound("a", f"m{n}", message_id=str(n))
        key = dedupe_key(msg)
        assert key is not None and not await before.seen_or_add(key)
        await before.journal(key, msg)
    await before.aclose()
    taken: list[list[str]] = []
    gate = anyio.Event()

    async def handler(msg: InboundMessage) -> OutboundMessage:
        inbox = current_inbox(msg.session_key)
        assert inbox is not None
        await gate.wait()
        taken.append([m.text for m in inbox.take(lambda m: True)])
        return await echo(msg)

    outbox = Outbox()
    store = FileDedupeStore(path)
    async with running(Dispatcher(handler, outbox.deliver, dedupe=store)) as d:
        assert await d.replay() == 2
        gate.set()
        with anyio.fail_after(5):
            while d.stats().turns_finished < 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    await store.aclose()
    assert taken == [[], []]
    assert outbox.texts("a") == ["re: m1", "re: m2"]


async def test_each_sessions_mode_is_its_own() -> None:
    """`mode_for` gives each session its mode: collect merges in one, followup keeps
    the other's messages apart."""
    release = anyio.Event()
    seen: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        seen.append(msg.text)
        await release.wait()
        return await echo(msg)

    def mode_for(msg: InboundMessage) -> QueueMode:
        return "collect" if msg.chat_id == "c" else "followup"

    outbox = Outbox()
    async with running(Dispatcher(handler, outbox.deliver, mode_for=mode_for)) as d:
        for chat in ("c", "f"):
            await d.submit(inbound(chat, f"{chat}-one"))
        with anyio.fail_after(5):
            while len(seen) < 2:  # noqa: ASYNC110  (both turns running)
                await anyio.sleep(0.01)
        for chat in ("c", "f"):
            for text in ("two", "three"):
                await d.submit(inbound(chat, f"{chat}-{text}"))
        release.set()
    assert sorted(outbox.texts("c")) == ["re: c-one", "re: c-two\n\nc-three"]
    assert outbox.texts("f") == ["re: f-one", "re: f-two", "re: f-three"]


# --------------------------------------------------------------------------- interrupt


async def test_interrupt_stops_the_running_turn_and_the_next_takes_what_waits() -> None:
    """Promise: in the interrupt mode a message that may join turns stops the running
    one (once, however many arrive), which answers as stopped; the next turn merges
    what waits. A message that may not join (a command) stops nothing and waits."""
    stopped = anyio.Event()
    asked: list[int] = []
    seen: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        seen.append(msg.text)
        inbox = current_inbox(msg.session_key)
        assert inbox is not None and inbox.mode is None
        if msg.text == "first":

            def on_stop() -> None:
                asked.append(1)
                stopped.set()

            inbox.on_stop = on_stop
            await stopped.wait()
            return reply_to(msg, "(stopped)")
        return await echo(msg)

    def joinable(msg: InboundMessage) -> bool:
        return not msg.text.startswith("/")

    outbox = Outbox()
    dispatcher = Dispatcher(handler, outbox.deliver, mode="interrupt", joinable=joinable)
    async with running(dispatcher) as d:
        await d.submit(inbound("a", "first"))
        with anyio.fail_after(5):
            while not seen:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await d.submit(inbound("a", "/cmd"))
        assert not stopped.is_set()
        await d.submit(inbound("a", "second"))
        await d.submit(inbound("a", "third"))
    assert asked == [1]
    assert outbox.texts("a") == ["(stopped)", "re: /cmd", "re: second\n\nthird"]
    assert d.stats().interrupted_turns == 1


def test_merge_keeps_a_single_message_as_it_is() -> None:
    one = inbound("a", "only", message_id="1")
    assert merge_messages([one]) is one
    with pytest.raises(ValueError):
        merge_messages([])


# --------------------------------------------------------------------------- drain


async def test_drain_finishes_in_flight_and_queued_turns_and_refuses_new_ones() -> None:
    async def handler(msg: InboundMessage) -> OutboundMessage:
        await anyio.sleep(0.05)
        return await echo(msg)

    outbox = Outbox()
    dispatcher = Dispatcher(handler, outbox.deliver)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        for text in ("1", "2", "3"):
            await dispatcher.submit(inbound("a", text))
        await dispatcher.submit(inbound("b", "x"))

        reports = []

        async def drain() -> None:
            reports.append(await dispatcher.drain(5))

        tg.start_soon(drain)
        await anyio.sleep(0.01)
        late = await dispatcher.submit(inbound("c", "too late", message_id="9"))
        assert late.status is SubmitStatus.REJECTED_DRAINING
        notice = await late.reply()
        assert notice is not None and notice.is_error and notice.text == DRAINING_TEXT
    report = reports[0]
    assert report.clean and report.finished == 4
    assert outbox.texts("a") == ["re: 1", "re: 2", "re: 3"] and outbox.texts("b") == ["re: x"]
    assert outbox.texts("c") == [DRAINING_TEXT]
    after = await dispatcher.submit(inbound("d", "after stop"))
    assert after.status is SubmitStatus.REJECTED_DRAINING
    assert dispatcher.stats().rejected_draining == 2


async def test_drain_deadline_tells_every_waiting_sender_to_send_again() -> None:
    async def handler(msg: InboundMessage) -> OutboundMessage:
        if msg.chat_id == "stuck":
            await anyio.sleep_forever()
        return await echo(msg)

    outbox = Outbox()
    dispatcher = Dispatcher(handler, outbox.deliver)
    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        tickets = [await dispatcher.submit(inbound("stuck", t)) for t in ("1", "2", "3")]
        done = await dispatcher.submit(inbound("fine", "ok"))
        await done.reply()
        report = await dispatcher.drain(0.05)
    assert report.sessions_left == ("test:stuck",)
    assert report.unfinished_in_flight == 1 and report.unfinished_queued == 2
    # One notice per session, addressed to the newest message; every ticket resolved.
    assert outbox.texts("stuck") == [RESTART_TEXT]
    for ticket in tickets:
        reply = await ticket.reply()
        assert reply is not None and reply.text == RESTART_TEXT


# --------------------------------------------------------------------------- plumbing


async def test_metrics_hooks_and_idle_lanes_go_away() -> None:
    samples: list[tuple[str, float]] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        await anyio.sleep(0.01)
        return await echo(msg)

    d = Dispatcher(
        handler,
        Outbox().deliver,
        idle_lane_ttl=0.02,
        on_turn_done=lambda reply, seconds: samples.append((reply.session_key, seconds)),
    )
    async with running(d):
        ticket = await d.submit(inbound("a", "hi"))
        assert d.stats().lanes == 1
        await ticket.reply()
        await anyio.sleep(0.1)
        stats = d.stats()
        assert stats.lanes == 0 and stats.in_flight == 0 and stats.queued_total == 0
    assert samples[0][0] == "test:a" and 0.009 < samples[0][1] < 1


async def test_submit_needs_a_running_dispatcher() -> None:
    d = Dispatcher(echo, Outbox().deliver)
    with pytest.raises(RuntimeError, match="run"):
        await d.submit(inbound("a", "hi"))


def test_settings_are_checked() -> None:
    handler: Handler = echo
    with pytest.raises(ValueError):
        Dispatcher(handler, Outbox().deliver, max_concurrent_turns=0)
    with pytest.raises(ValueError):
        Dispatcher(handler, Outbox().deliver, mode="other")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- access


class PairingAccess:
    """The real access gate with a pairing policy on the `test` channel."""

    def __init__(self, path: Path) -> None:
        from gateway.access.policy import AccessGate, ChannelAccessPolicy
        from gateway.access.store import PairingStore

        self.store = PairingStore(path)
        self.gate = AccessGate({"test": ChannelAccessPolicy(dm_policy="pairing")}, self.store)

    def screen(self, msg: InboundMessage) -> Ignore | None:
        return self.gate.screen(msg)

    async def check(self, msg: InboundMessage) -> Decision:
        return await self.gate.check(msg)


def dm(sender: str, text: str, **meta: object) -> InboundMessage:
    return InboundMessage(
        channel="test", chat_id=sender, sender_id=sender, text=text, metadata=dict(meta)
    )


async def test_strangers_get_a_pairing_code_and_reach_the_agent_once_approved(
    tmp_path: Path,
) -> None:
    from gateway.access.store import PairingStore
    from gateway.messages import META_IS_GROUP

    handled: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        handled.append(msg.text)
        return await echo(msg)

    outbox = Outbox()
    access = PairingAccess(tmp_path / "pairing.json")
    async with running(Dispatcher(handler, outbox.deliver, access=access)) as d:
        first = await d.submit(dm("42", "hello?"))
        assert first.status is SubmitStatus.DENIED
        notice = await first.reply()
        assert notice is not None and not notice.is_error
        code = PairingStore(tmp_path / "pairing.json").list().pending[0].code
        assert code in notice.text

        chatter = await d.submit(dm("42", "in a group", **{META_IS_GROUP: True}))
        assert chatter.status is SubmitStatus.IGNORED and await chatter.reply() is None

        assert PairingStore(tmp_path / "pairing.json").approve("test", code) == "42"
        allowed = await d.submit(dm("42", "now?"))
        assert allowed.status is SubmitStatus.ACCEPTED
        await allowed.reply()
    assert handled == ["now?"]
    assert [o.text for o in outbox.sent][1:] == ["re: now?"]
    stats = d.stats()
    assert stats.denied == 1 and stats.ignored == 1 and stats.accepted == 1


async def test_a_broken_access_check_lets_nobody_through() -> None:
    class Broken:
        def screen(self, msg: InboundMessage) -> None:
            return None

        async def check(self, msg: InboundMessage) -> Decision:
            raise OSError("disk gone")

    outbox = Outbox()
    async with running(Dispatcher(echo, outbox.deliver, access=Broken())) as d:
        ticket = await d.submit(dm("1", "hi"))
    assert ticket.status is SubmitStatus.IGNORED and not outbox.sent
    assert d.stats().access_errors == 1


async def test_a_submit_cancelled_during_the_access_check_lets_nothing_through() -> None:
    class Slow:
        def screen(self, msg: InboundMessage) -> None:
            return None

        async def check(self, msg: InboundMessage) -> Decision:
            await anyio.sleep(1)
            return ALLOW

    handled: list[str] = []

    async def handler(msg: InboundMessage) -> OutboundMessage:
        handled.append(msg.text)
        return await echo(msg)

    async with running(Dispatcher(handler, Outbox().deliver, access=Slow())) as d:
        with anyio.move_on_after(0.02):
            await d.submit(dm("1", "cut off"))  # e.g. the HTTP client went away
        await anyio.sleep(0.02)
        assert d.stats().ignored == 1
    assert handled == []
