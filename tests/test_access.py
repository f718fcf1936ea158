"""Access control: DM policies, group mention rules, and pairing end to end through the
pairing file shared by the daemon and the operator's CLI (a second store instance)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.access.commands import cli_pairing_approve, cli_pairing_list, cli_pairing_revoke
from gateway.access.policy import (
    PAIRING_FULL_TEXT,
    AccessGate,
    Allow,
    Challenge,
    ChannelAccessPolicy,
    Deny,
    Ignore,
    decide,
)
from gateway.access.protocol import (
    CODE_ALPHABET,
    CODE_LENGTH,
    EMPTY_STATE,
    PairingError,
    new_pairing_code,
)
from gateway.access.rules import PAIRING_RESEND_INTERVAL
from gateway.access.store import PairingStore
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.lanes import SubmitStatus
from gateway.messages import (
    META_IS_GROUP,
    META_MENTIONED,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    InboundMessage,
    OutboundMessage,
)

NOW = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def dm(sender: str, text: str = "hi", channel: str = "telegram", **meta: Any) -> InboundMessage:
    return InboundMessage(
        channel=channel, chat_id=sender, sender_id=sender, text=text, metadata=dict(meta)
    )


def group(chat: str, sender: str, **meta: Any) -> InboundMessage:
    return InboundMessage(
        channel="telegram",
        chat_id=chat,
        sender_id=sender,
        text="hello all",
        metadata={META_IS_GROUP: True, **meta},
    )


PAIRING = ChannelAccessPolicy(dm_policy="pairing")


# --------------------------------------------------------------------------- DM policies


def test_open_dm_lets_everyone_in() -> None:
    assert decide(dm("1"), ChannelAccessPolicy(dm_policy="open"), EMPTY_STATE, NOW) == Allow()


def test_allowlist_admits_listed_senders_and_tells_others_their_id() -> None:
    policy = ChannelAccessPolicy(dm_policy="allowlist", allow_from=frozenset({"7"}))
    assert isinstance(decide(dm("7"), policy, EMPTY_STATE, NOW), Allow)
    denied = decide(dm("8"), policy, EMPTY_STATE, NOW)
    assert isinstance(denied, Deny) and "(8)" in denied.reply
    anyone = ChannelAccessPolicy(dm_policy="allowlist", allow_from=frozenset({"*"}))
    assert isinstance(decide(dm("8"), anyone, EMPTY_STATE, NOW), Allow)


def test_allow_from_given_as_a_list_works_too() -> None:
    policy = ChannelAccessPolicy(dm_policy="allowlist", allow_from=["7"])  # type: ignore[arg-type]
    assert isinstance(decide(dm("7"), policy, EMPTY_STATE, NOW), Allow)
    with pytest.raises(ValueError, match="dm_policy"):
        ChannelAccessPolicy(dm_policy="everyone")  # type: ignore[arg-type]


def test_pairing_codes_are_short_and_unambiguous() -> None:
    codes = {new_pairing_code() for _ in range(200)}
    assert len(codes) == 200
    for code in codes:
        assert len(code) == CODE_LENGTH and set(code) <= set(CODE_ALPHABET)
    assert not set("0O1IL") & set(CODE_ALPHABET)


def test_decide_mints_only_for_a_new_stranger() -> None:
    minted: list[str] = []

    def mint() -> str:
        minted.append("ABCDEFGH")
        return "ABCDEFGH"

    first = decide(dm("5", **{META_SENDER_NAME: "Ada"}), PAIRING, EMPTY_STATE, NOW, mint=mint)
    assert isinstance(first, Challenge) and first.is_new and "ABCDEFGH" in first.reply
    assert first.request.label == "Ada" and first.request.expires_at == NOW + 3600
    assert isinstance(decide(dm("5"), ChannelAccessPolicy("open"), EMPTY_STATE, NOW), Allow)
    assert minted == ["ABCDEFGH"]


# --------------------------------------------------------------------------- groups


@pytest.mark.parametrize(
    ("policy", "meta", "allowed"),
    [
        (ChannelAccessPolicy(allow_from=frozenset({"g1"})), {}, False),
        (ChannelAccessPolicy(allow_from=frozenset({"g1"})), {META_MENTIONED: True}, True),
        (ChannelAccessPolicy(allow_from=frozenset({"g1"})), {META_REPLY_TO_BOT: True}, True),
        (ChannelAccessPolicy(allow_from=frozenset({"g1"}), require_mention=False), {}, True),
        (ChannelAccessPolicy(allow_from=frozenset({"other"})), {META_MENTIONED: True}, False),
        (ChannelAccessPolicy(allow_from=frozenset({"u1"})), {META_MENTIONED: True}, True),
        (ChannelAccessPolicy(group_policy="open"), {META_MENTIONED: True}, True),
        (ChannelAccessPolicy(group_policy="open"), {}, False),
        (
            ChannelAccessPolicy(group_policy="disabled", dm_policy="open"),
            {META_MENTIONED: 1},
            False,
        ),
    ],
)
def test_group_rules(policy: ChannelAccessPolicy, meta: dict[str, Any], allowed: bool) -> None:
    decision = decide(group("g1", "u1", **meta), policy, EMPTY_STATE, NOW)
    assert isinstance(decision, Allow) is allowed
    if not allowed:
        assert isinstance(decision, Ignore)  # groups are never answered with a refusal


# --------------------------------------------------------------------------- pairing e2e


@pytest.mark.anyio
async def test_pairing_end_to_end_with_the_cli_in_another_store(tmp_path: Path) -> None:
    path = tmp_path / "ws" / "pairing.json"
    clock = Clock()
    gate = AccessGate({"telegram": PAIRING}, PairingStore(path, clock=clock), clock=clock)

    first = await gate.check(dm("42", "hello, can I use this?", **{META_SENDER_NAME: "Ada"}))
    assert isinstance(first, Challenge) and first.code in first.reply
    clock.now += PAIRING_RESEND_INTERVAL  # a code is re-sent at most this often
    again = await gate.check(dm("42", "hello??"))
    assert isinstance(again, Challenge) and again.code == first.code and not again.is_new
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

    cli = PairingStore(path, clock=clock)  # the operator's `gateway pairing` process
    listing = cli_pairing_list(cli, "telegram")
    assert first.code in listing and "42 (Ada)" in listing
    typed = first.code.lower()[:4] + "-" + first.code.lower()[4:]  # as a person types it
    assert "Approved 42 (Ada)" in cli_pairing_approve(cli, "telegram", typed)

    assert isinstance(await gate.check(dm("42", "now?")), Allow)
    assert isinstance(await gate.check(dm("43")), Challenge)  # others still need a code
    assert "No pending" not in cli_pairing_list(cli)
    with pytest.raises(PairingError, match="no pending request"):
        cli_pairing_approve(cli, "telegram", first.code)  # one-time
    with pytest.raises(PairingError):
        cli_pairing_approve(cli, "slack", "ABCDEFGH")


@pytest.mark.anyio
async def test_a_pending_code_is_resent_at_most_once_per_interval_through_the_dispatcher(
    tmp_path: Path,
) -> None:
    clock = Clock()
    gate = AccessGate(
        {"telegram": PAIRING}, PairingStore(tmp_path / "pairing.json", clock=clock), clock=clock
    )
    sent: list[OutboundMessage] = []

    async def deliver(out: OutboundMessage) -> None:
        sent.append(out)

    async def agent(msg: InboundMessage) -> OutboundMessage:
        raise AssertionError(f"a stranger's message reached the agent: {msg.text}")

    dispatcher = Dispatcher(agent, deliver, access=gate)

    async def write(sender: str, text: str) -> SubmitStatus:
        ticket = await dispatcher.submit(dm(sender, text))
        await ticket.reply()
        return ticket.status

    async def notices(count: int) -> list[str]:
        with anyio.fail_after(5):
            while len(sent) < count:  # noqa: ASYNC110 (notices go out in the background)
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)  # and no more than that
        return [out.text for out in sent]

    async with anyio.create_task_group() as tg:
        await tg.start(dispatcher.run)
        assert await write("42", "hello?") is SubmitStatus.DENIED
        [first] = await notices(1)
        code = first.split("pairing code is ", 1)[1].split()[0]
        for n in range(5):  # keeps writing: silently ignored, and counted
            clock.now += PAIRING_RESEND_INTERVAL / 10
            assert await write("42", f"hello {n}??") is SubmitStatus.IGNORED
        assert await write("43", "me too") is SubmitStatus.DENIED  # others get their own
        assert len(await notices(2)) == 2
        assert dispatcher.stats().ignored == 5

        clock.now += PAIRING_RESEND_INTERVAL / 2  # the interval is over
        assert await write("42", "anyone?") is SubmitStatus.DENIED
        texts = await notices(3)
        assert len(texts) == 3 and f"pairing code is {code}" in texts[2]  # same code
        assert await write("42", "and now?") is SubmitStatus.IGNORED
        await dispatcher.drain(1)
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_codes_expire_and_a_new_one_is_issued(tmp_path: Path) -> None:
    clock = Clock()
    store = PairingStore(tmp_path / "pairing.json", clock=clock)
    gate = AccessGate({"telegram": PAIRING}, store, clock=clock)
    old = await gate.check(dm("42"))
    assert isinstance(old, Challenge)
    clock.now += 3601
    assert store.approve("telegram", old.code) is None
    new = await gate.check(dm("42"))
    assert isinstance(new, Challenge) and new.is_new and new.code != old.code
    assert [r.code for r in store.list().pending] == [new.code]  # the old one is gone


@pytest.mark.anyio
async def test_pending_requests_are_bounded_per_channel(tmp_path: Path) -> None:
    clock = Clock()
    policy = ChannelAccessPolicy(
        dm_policy="pairing", max_pending=3, pairing_ttl=100, pairing_resend_interval=0
    )
    gate = AccessGate(
        {"telegram": policy, "slack": policy},
        PairingStore(tmp_path / "pairing.json", clock=clock),
        clock=clock,
    )
    for n in range(3):
        assert isinstance(await gate.check(dm(f"s{n}")), Challenge)
        clock.now += 10
    refused = await gate.check(dm("s3"))
    assert isinstance(refused, Deny) and refused.reply == PAIRING_FULL_TEXT
    assert isinstance(await gate.check(dm("s0")), Challenge)  # those waiting keep theirs
    assert isinstance(await gate.check(dm("x", channel="slack")), Challenge)  # per channel
    clock.now += 75  # s0's request (the oldest) has expired, the others not yet
    assert isinstance(await gate.check(dm("s3")), Challenge)
    assert isinstance(await gate.check(dm("s4")), Deny)


@pytest.mark.anyio
async def test_revoke_sends_a_sender_back_to_pairing(tmp_path: Path) -> None:
    path = tmp_path / "pairing.json"
    gate = AccessGate({"telegram": PAIRING}, PairingStore(path))
    challenge = await gate.check(dm("42"))
    assert isinstance(challenge, Challenge)
    cli = PairingStore(path)
    assert cli.approve("telegram", challenge.code) == "42"
    assert cli.is_approved("telegram", "42")
    assert isinstance(await gate.check(dm("42")), Allow)

    assert "Revoked 42" in cli_pairing_revoke(cli, "telegram", "42")
    assert isinstance(await gate.check(dm("42")), Challenge)
    with pytest.raises(PairingError, match="not approved"):
        cli_pairing_revoke(cli, "telegram", "nobody")


@pytest.mark.anyio
async def test_an_approved_sender_may_talk_in_groups_when_mentioned(tmp_path: Path) -> None:
    gate = AccessGate({"telegram": PAIRING}, PairingStore(tmp_path / "pairing.json"))
    challenge = await gate.check(dm("42"))
    assert isinstance(challenge, Challenge)
    gate.store.approve("telegram", challenge.code)
    assert isinstance(await gate.check(group("g9", "42", **{META_MENTIONED: True})), Allow)
    assert isinstance(await gate.check(group("g9", "42")), Ignore)
    assert isinstance(await gate.check(group("g9", "43", **{META_MENTIONED: True})), Ignore)


@pytest.mark.anyio
async def test_a_channel_without_a_policy_is_closed_unless_trusted(tmp_path: Path) -> None:
    gate = AccessGate({}, PairingStore(tmp_path / "pairing.json"), trusted=frozenset({"cli"}))
    assert isinstance(await gate.check(dm("1", channel="slack")), Ignore)
    assert isinstance(await gate.check(dm("1", channel="cli")), Allow)


# --------------------------------------------------------------------------- the file


def test_a_damaged_file_is_moved_aside_and_reported_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "pairing.json"
    path.write_text('{"version": 1, "approved": [', encoding="utf-8")
    store = PairingStore(path)
    assert store.list().approved == ()
    assert store.load_error and "moved to" in store.load_error
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("pairing.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_text() == '{"version": 1, "approved": ['
    assert "warning:" in cli_pairing_list(store)


def test_readable_entries_of_a_damaged_file_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "pairing.json"
    good = {"channel": "telegram", "sender_id": "42", "approved_at": NOW, "label": ""}
    original = json.dumps({"version": 1, "approved": [good, {"channel": 5}], "pending": []})
    path.write_text(original, encoding="utf-8")
    store = PairingStore(path)
    assert store.is_approved("telegram", "42") and store.load_error
    assert PairingStore(path).is_approved("telegram", "42")  # salvage written back
    aside = next(p for p in tmp_path.iterdir() if ".corrupt-" in p.name)
    assert aside.read_text() == original


def test_a_file_from_a_newer_version_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "pairing.json"
    path.write_text('{"version": 99}', encoding="utf-8")
    store = PairingStore(path)
    assert store.list().approved == () and store.load_error
    assert (tmp_path / "pairing.json").exists() is False  # moved aside, not replaced
