"""The delivery promise at the dispatcher and the journal: journal before confirm, the
outbox, and a replay that neither stores a message twice nor runs a turn twice.

The real `FileDedupeStore` on a temp file and the real `Dispatcher`; the handlers are
small async functions standing in for the agent (the agent's own half of the promise,
finding a replayed message in its session, is tested in tests/test_agent_replay.py).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import pytest

from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.lanes import SubmitStatus
from gateway.journal.protocol import dedupe_key
from gateway.journal.store import FileDedupeStore, MemoryDedupeStore
from gateway.messages import (
    META_IN_SESSION,
    META_REPLAYED,
    InboundMessage,
    OutboundMessage,
    reply_for,
)
from tests.test_dispatch import running

pytestmark = pytest.mark.anyio


def message(chat: str, text: str, message_id: str, at: float = 0.0) -> InboundMessage:
    return InboundMessage(
        channel="test", chat_id=chat, text=text, message_id=message_id, received_at=at or 1.0
    )


def key_of(msg: InboundMessage) -> str:
    key = dedupe_key(msg)
    assert key is not None
    return key


class Turns:
    """The handler: answers "re: <text>", recording what it was asked and how."""

    def __init__(self) -> None:
        self.handled: list[InboundMessage] = []

    async def __call__(self, msg: InboundMessage) -> OutboundMessage:
        self.handled.append(msg)
        return reply_for(msg, f"re: {msg.text}")

    @property
    def texts(self) -> list[str]:
        return [m.text for m in self.handled]


async def settle(dispatcher: Dispatcher) -> None:
    with anyio.fail_after(5):
        while dispatcher.stats().queued_total or dispatcher.stats().in_flight:  # noqa: ASYNC110
            await anyio.sleep(0.01)
        await anyio.sleep(0.05)


# --------------------------------------------------------------------------- the journal


async def test_submit_returns_once_the_message_is_journaled(tmp_path: Path) -> None:
    """Journal before confirm: when `submit` returns (and the channel confirms the
    message to its platform), the message is on file, before its turn even began."""
    store = FileDedupeStore(tmp_path / "j.sqlite")
    turn_started = anyio.Event()
    release = anyio.Event()

    async def slow(msg: InboundMessage) -> OutboundMessage:
        turn_started.set()
        await release.wait()
        return reply_for(msg, "done")

    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    async with running(Dispatcher(slow, deliver, dedupe=store)) as d:
        ticket = await d.submit(message("1", "hello", "1:1"))
        assert ticket.taken and ticket.status is SubmitStatus.ACCEPTED
        # Another connection to the file sees it now: a SIGKILL here loses nothing.
        with sqlite3.connect(tmp_path / "j.sqlite") as other:
            rows = other.execute("SELECT key FROM inbox").fetchall()
        assert rows == [(key_of(message("1", "hello", "1:1")),)]
        await turn_started.wait()
        release.set()
        assert (await ticket.reply()) is not None
    await store.aclose()
    reopened = FileDedupeStore(tmp_path / "j.sqlite")
    assert await reopened.unanswered() == []  # answered: out of the journal
    await reopened.aclose()


class BrokenJournal(MemoryDedupeStore):
    """A store whose journal cannot be written (a full disk) until `healed`."""

    def __init__(self) -> None:
        super().__init__()
        self.healed = False
        self.released: list[str] = []

    async def journal(self, key: str, msg: InboundMessage) -> None:
        if not self.healed:
            raise OSError(28, "No space left on device")

    async def release(self, key: str) -> None:
        self.released.append(key)
        await super().release(key)


async def test_a_message_that_cannot_be_journaled_is_not_taken_and_comes_again() -> None:
    """A message the journal cannot keep is not taken: no turn, no reply, the claim is
    given back, and the channel must leave it with the platform; its redelivery (the
    same platform id) is then taken like a new message."""
    store = BrokenJournal()
    turns = Turns()
    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    msg = message("1", "hello", "1:1")
    async with running(Dispatcher(turns, deliver, dedupe=store)) as d:
        ticket = await d.submit(msg)
        assert not ticket.taken and ticket.status is SubmitStatus.RETRY_LATER
        assert await ticket.reply() is None
        await settle(d)
        assert turns.handled == [] and sent == []
        assert store.released == [key_of(msg)]
        assert d.stats().not_taken == 1

        store.healed = True
        again = await d.submit(msg)
        assert again.taken and again.status is SubmitStatus.ACCEPTED
        reply = await again.reply()
        assert reply is not None and reply.text == "re: hello"
    assert turns.texts == ["hello"]


# --------------------------------------------------------------------------- the outbox


async def test_a_reply_is_in_the_outbox_while_it_is_sent(tmp_path: Path) -> None:
    """The reply is recorded before `deliver` is called and gone after: a crash during
    the send leaves the recorded reply for the replay to send again."""
    path = tmp_path / "j.sqlite"
    store = FileDedupeStore(path)
    seen_during_send: list[list[str]] = []

    async def deliver(out: OutboundMessage) -> None:
        with sqlite3.connect(path) as other:
            rows = other.execute("SELECT reply FROM outbox").fetchall()
        seen_during_send.append([OutboundMessage.from_dict(json.loads(r[0])).text for r in rows])

    async with running(Dispatcher(Turns(), deliver, dedupe=store)) as d:
        ticket = await d.submit(message("1", "hello", "1:1"))
        await ticket.reply()
        await settle(d)
    await store.aclose()
    assert seen_during_send == [["re: hello"]]
    with sqlite3.connect(path) as other:
        assert other.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
        assert other.execute("SELECT count(*) FROM inbox").fetchone() == (0,)


async def test_a_reply_the_session_holds_needs_no_outbox_record(tmp_path: Path) -> None:
    """A reply the handler marks as the session's stored answer (`META_IN_SESSION`) is
    found there by a replay, so it costs no outbox write; a merged turn's reply is
    recorded all the same (one replayed message must not re-send it for each)."""
    path = tmp_path / "j.sqlite"
    store = FileDedupeStore(path)
    outbox_sizes: list[int] = []

    async def stored_answer(msg: InboundMessage) -> OutboundMessage:
        out = reply_for(msg, f"re: {msg.text}")
        return OutboundMessage(**{**out.to_dict(), "metadata": {META_IN_SESSION: True}})

    async def deliver(out: OutboundMessage) -> None:
        with sqlite3.connect(path) as other:
            outbox_sizes.append(other.execute("SELECT count(*) FROM outbox").fetchone()[0])

    async with running(Dispatcher(stored_answer, deliver, dedupe=store)) as d:
        await (await d.submit(message("1", "hello", "1:1"))).reply()
        await settle(d)
    assert outbox_sizes == [0]
    gate = anyio.Event()

    async def slow_first(msg: InboundMessage) -> OutboundMessage:
        if msg.text == "a":
            await gate.wait()  # a slow first turn, so the next two merge
        return await stored_answer(msg)

    async with running(Dispatcher(slow_first, deliver, dedupe=store, mode="collect")) as d:
        first = await d.submit(message("2", "a", "2:1"))
        await d.submit(message("2", "b", "2:2"))
        await d.submit(message("2", "c", "2:3"))
        gate.set()
        await first.reply()
        await settle(d)
    assert outbox_sizes == [0, 0, 2]  # the merged turn recorded for both of its messages
    await store.aclose()


# --------------------------------------------------------------------------- the replay


async def crashed_journal(
    path: Path, messages: list[InboundMessage], replies: dict[str, OutboundMessage]
) -> None:
    """A journal as a crash leaves it: `messages` taken in, `replies` recorded (by
    message id), nothing marked answered."""
    store = FileDedupeStore(path)
    for msg in messages:
        key = key_of(msg)
        assert not await store.seen_or_add(key)
        await store.journal(key, msg)
    for message_id, reply in replies.items():
        [msg] = [m for m in messages if m.message_id == message_id]
        await store.record_reply([key_of(msg)], reply)
    await store.aclose()


async def test_replay_resends_recorded_replies_and_runs_only_unfinished_turns(
    tmp_path: Path,
) -> None:
    """After a crash: a message whose reply was recorded gets that reply again and its
    turn does not run; one without runs (marked replayed), ahead of what arrives after
    the restart; each is then answered for good, so redeliveries are duplicates."""
    path = tmp_path / "j.sqlite"
    done = message("1", "first", "1:1", at=1.0)
    unfinished = message("1", "second", "1:2", at=2.0)
    other = message("2", "elsewhere", "2:1", at=3.0)
    await crashed_journal(
        path, [done, unfinished, other], {"1:1": reply_for(done, "the first answer")}
    )

    store = FileDedupeStore(path)
    turns = Turns()
    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    async with running(Dispatcher(turns, deliver, dedupe=store)) as d:
        assert await d.replay() == 3
        newer = await d.submit(message("1", "third", "1:3", at=4.0))
        await newer.reply()
        await settle(d)
        for msg in (done, unfinished, other):
            assert (await d.submit(msg)).status is SubmitStatus.DUPLICATE
    assert [o.text for o in sent if o.chat_id == "1"] == [
        "the first answer",
        "re: second",
        "re: third",
    ]
    assert [o.text for o in sent if o.chat_id == "2"] == ["re: elsewhere"]
    assert sorted(turns.texts) == ["elsewhere", "second", "third"]  # "first" never ran again
    replayed = {m.text: bool(m.metadata.get(META_REPLAYED)) for m in turns.handled}
    assert replayed == {"second": True, "elsewhere": True, "third": False}
    assert await store.unanswered() == []
    await store.aclose()


async def test_a_reply_recorded_for_a_merged_turn_is_sent_once(tmp_path: Path) -> None:
    """Collect mode answers several messages with one reply; after a crash that reply
    is re-sent once, not once per message."""
    path = tmp_path / "j.sqlite"
    a, b = message("1", "a", "1:1", at=1.0), message("1", "b", "1:2", at=2.0)
    store = FileDedupeStore(path)
    for msg in (a, b):
        assert not await store.seen_or_add(key_of(msg))
        await store.journal(key_of(msg), msg)
    await store.record_reply([key_of(a), key_of(b)], reply_for(b, "one answer for both"))
    await store.aclose()

    store = FileDedupeStore(path)
    turns = Turns()
    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    async with running(Dispatcher(turns, deliver, dedupe=store, mode="collect")) as d:
        await d.replay()
        await settle(d)
    assert [o.text for o in sent] == ["one answer for both"]
    assert turns.handled == []
    assert await store.unanswered() == []
    await store.aclose()


async def test_a_replayed_message_no_longer_allowed_leaves_the_journal(tmp_path: Path) -> None:
    """A replayed message the access policy now refuses (the sender's pairing was
    revoked) does not run, and it does not come back at every start."""
    from gateway.access.policy import Ignore

    class RefuseAll:
        def screen(self, msg: InboundMessage) -> None:
            return None

        async def check(self, msg: InboundMessage) -> Ignore:
            return Ignore("revoked")

    path = tmp_path / "j.sqlite"
    await crashed_journal(path, [message("1", "hello", "1:1")], {})
    store = FileDedupeStore(path)
    turns = Turns()

    async def deliver(out: OutboundMessage) -> None:
        raise AssertionError("nothing is sent")

    async with running(Dispatcher(turns, deliver, dedupe=store, access=RefuseAll())) as d:
        await d.replay()
        await settle(d)
    assert turns.handled == []
    assert await store.unanswered() == []
    await store.aclose()


async def test_the_journal_schema_moves_from_version_2_keeping_the_inbox(tmp_path: Path) -> None:
    """A journal written by the previous version (no outbox) keeps its unanswered
    messages when this version opens it."""
    path = tmp_path / "j.sqlite"
    msg = message("1", "kept", "1:1")
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE answered (key TEXT PRIMARY KEY, seen_at REAL NOT NULL)")
        conn.execute("CREATE TABLE inbox (key TEXT PRIMARY KEY, received_at REAL, message TEXT)")
        conn.execute(
            "INSERT INTO inbox VALUES (?, ?, ?)",
            (key_of(msg), 1.0, json.dumps(msg.to_dict())),
        )
        conn.execute("PRAGMA user_version = 2")
    store = FileDedupeStore(path)
    [entry] = await store.unanswered()
    assert entry.message == msg and entry.reply is None
    await store.record_reply([key_of(msg)], reply_for(msg, "now recorded"))
    [entry] = await store.unanswered()
    assert entry.reply is not None and entry.reply.text == "now recorded"
    await store.aclose()


async def test_a_replay_larger_than_the_queue_bounds_is_queued_whole(tmp_path: Path) -> None:
    """What a crash left was taken from the platform already: the lane and total bounds,
    which refuse new messages with "send it again", never refuse a replayed one."""
    path = tmp_path / "j.sqlite"
    backlog = [message("1", f"m{i}", f"1:{i}", at=float(i + 1)) for i in range(8)]
    await crashed_journal(path, backlog, {})
    store = FileDedupeStore(path)
    turns = Turns()
    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    bounded = Dispatcher(turns, deliver, dedupe=store, max_queue_per_lane=2, max_queued_total=3)
    async with running(bounded) as d:
        assert await d.replay() == 8
        await settle(d)
    assert turns.texts == [f"m{i}" for i in range(8)]
    assert [o.text for o in sent] == [f"re: m{i}" for i in range(8)]
    await store.aclose()


# --------------------------------------------------------------------------- redelivery


class FlakyPlatform:
    """The `deliver` end of a platform that is down: its channel raises `DeliveryFailed`
    (the reply certainly did not go out) until `up` is set."""

    def __init__(self) -> None:
        self.up = False
        self.attempts: list[str] = []
        self.sent: list[str] = []

    async def deliver(self, out: OutboundMessage) -> None:
        from gateway.channel import DeliveryFailed

        self.attempts.append(out.text)
        if not self.up:
            raise DeliveryFailed("the platform is down")
        self.sent.append(out.text)


async def test_a_reply_the_platform_could_not_take_is_sent_again_and_only_then_answered(
    tmp_path: Path,
) -> None:
    """A reply whose channel says it certainly did not go out is sent again, with
    backoff, its conversation's later replies waiting behind it; its message is marked
    answered only once it went out. (Before: marked answered at the first failure, the
    reply lost.)"""
    store = FileDedupeStore(tmp_path / "j.sqlite")
    platform = FlakyPlatform()
    turns = Turns()
    async with running(Dispatcher(turns, platform.deliver, dedupe=store)) as d:
        first = await d.submit(message("1", "first", "1:1"))
        second = await d.submit(message("1", "second", "1:2"))
        with anyio.fail_after(10):
            while len(platform.attempts) < 2:  # noqa: ASYNC110 (the first reply failed, and again)
                await anyio.sleep(0.05)
        assert platform.sent == [] and len(await store.unanswered()) == 2
        assert not first.finished and not second.finished
        platform.up = True
        with anyio.fail_after(10):
            await first.wait_finished()
            await second.wait_finished()
    assert platform.sent == ["re: first", "re: second"]
    assert set(platform.attempts) == {"re: first", "re: second"}
    assert first.marked and second.marked
    assert await store.unanswered() == []
    await store.aclose()


async def test_a_reply_still_undelivered_at_a_stop_is_sent_by_the_next_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "j.sqlite"
    store = FileDedupeStore(path)
    platform = FlakyPlatform()
    turns = Turns()
    async with running(Dispatcher(turns, platform.deliver, dedupe=store), grace=0.5) as d:
        ticket = await d.submit(message("1", "hello", "1:1"))
        with anyio.fail_after(10):
            while not platform.attempts:  # noqa: ASYNC110
                await anyio.sleep(0.02)
    assert not ticket.marked and platform.sent == []
    [left] = await store.unanswered()
    assert left.message.text == "hello" and left.reply is not None  # in the outbox
    await store.aclose()

    store = FileDedupeStore(path)  # the next start: the platform is back
    platform.up = True
    async with running(Dispatcher(turns, platform.deliver, dedupe=store)) as d:
        assert await d.replay() == 1
        with anyio.fail_after(10):
            while not platform.sent:  # noqa: ASYNC110
                await anyio.sleep(0.02)
    assert platform.sent == ["re: hello"] and turns.texts == ["hello"]  # one turn
    assert await store.unanswered() == []
    await store.aclose()


async def test_a_reply_undeliverable_past_the_window_is_given_up(tmp_path: Path) -> None:
    store = FileDedupeStore(tmp_path / "j.sqlite")
    platform = FlakyPlatform()
    dispatcher = Dispatcher(Turns(), platform.deliver, dedupe=store, redeliver_window=1.5)
    async with running(dispatcher) as d:
        ticket = await d.submit(message("1", "hello", "1:1"))
        with anyio.fail_after(10):
            await ticket.wait_finished()
    assert len(platform.attempts) >= 2 and platform.sent == []
    assert ticket.marked and await store.unanswered() == []
    await store.aclose()


# --------------------------------------------------------------------------- parts sent


def test_parts_sent_remembers_the_newest_replies_and_forgets_a_taken_one() -> None:
    """`PartsSent`, every splitting channel's memory of replies cut short: a reply kept
    again is the newest, the oldest go past the bound, and taking one forgets it (a
    reply that then goes out whole is not resumed a second time)."""
    from gateway.channel import PartsSent

    parts = PartsSent[str, int](3)
    for n, reply in enumerate("abcd"):
        parts.keep(reply, n)
    assert "a" not in parts and len(parts) == 3
    parts.keep("b", 5)  # the newest now: "c" goes first
    parts.keep("e", 6)
    assert "c" not in parts and "b" in parts
    assert parts.take("b", 0) == 5 and parts.take("b", 0) == 0
    assert parts.take("zzz", None) is None
    with pytest.raises(ValueError, match="bound"):
        PartsSent[str, int](0)
