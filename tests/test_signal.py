"""The Signal channel: what signal-cli hands over as the gateway's messages (pure), and
the adapter against the fake signal-cli daemon (tests/fakes/signal_server.py): one
`receive` at a time, journal before the next and before the read receipt, what the
gateway did not take held and submitted first after a restart, replies with styles and
quotes, `DeliveryFailed` resumed at the part that failed, files in, the doctor."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.signal.channel import Pacing, SignalChannel, SignalSetupError, check_daemon
from channels.signal.client import SignalError, error_from
from channels.signal.inbound import Me, Notice, Received, Skip, parse_target, translate
from channels.signal.settings import SignalSettings
from channels.signal.spec import SPEC
from gateway.channel import DeliveryFailed
from gateway.journal.cursors import FileCursorStore, run_with
from gateway.media import MediaError
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_TEXT,
    META_REPLY_TO_BOT,
    META_SENDER_NAME,
    Attachment,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
    reply_for,
)
from tests.fakes.signal_server import (
    RECEIVE_BUSY,
    FakeSignalCli,
    network_failure,
    rate_limited,
    untrusted_identity,
)
from tests.fakes.tcp_proxy import tcp_proxy

pytestmark = pytest.mark.anyio

ME = Me("+15550000001", "0b0b0b0b-0000-4000-8000-00000000b0b0")


# --------------------------------------------------------------------------- translation


def envelope(**data: Any) -> dict[str, Any]:
    base = {"timestamp": 1700000000123, "message": "hello"}
    return {
        "account": ME.number,
        "envelope": {
            "sourceNumber": "+15551112222",
            "sourceUuid": "aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa",
            "sourceName": "Alice",
            "timestamp": 1700000000123,
            "dataMessage": {**base, **data},
        },
    }


GROUP = {"groupId": "R3JvdXA=", "groupName": "Team", "revision": 2, "type": "DELIVER"}


def test_a_dm_is_keyed_by_the_senders_uuid() -> None:
    found = translate(envelope(), ME)
    assert isinstance(found, Received)
    message = found.message
    assert message.session_key == "signal:aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa"
    assert message.message_id == "aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa:1700000000123"
    assert message.sender_id == "aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa"
    assert message.metadata[META_SENDER_NAME] == "Alice (+15551112222)"
    assert message.metadata[META_IS_GROUP] is False
    assert found.receipt == ("aaaaaaaa-1111-4111-8111-aaaaaaaaaaaa", 1700000000123)


def test_a_group_message_mentioning_the_bot_addresses_it_and_loses_the_mention() -> None:
    mention = {"number": ME.number, "uuid": ME.uuid, "start": 0, "length": 1, "name": ME.number}
    other = {"number": "+15553334444", "uuid": "b" * 8, "start": 10, "length": 1, "name": "x"}
    found = translate(
        envelope(
            message="\ufffc, ask 😀 \ufffc about it", mentions=[mention, other], groupInfo=GROUP
        ),
        ME,
    )
    assert isinstance(found, Received)
    assert found.message.session_key == "signal:group:R3JvdXA="
    assert found.message.text == "ask 😀 @+15553334444 about it"
    assert found.message.metadata[META_MENTIONED] is True
    assert found.receipt is not None
    assert parse_target(found.message.chat_id).params() == {"groupId": "R3JvdXA="}


def test_group_chatter_is_passed_on_unaddressed_without_a_receipt() -> None:
    found = translate(envelope(groupInfo=GROUP), ME)
    assert isinstance(found, Received)
    assert found.message.metadata[META_MENTIONED] is False
    assert found.message.metadata[META_REPLY_TO_BOT] is False
    assert found.receipt is None  # the bot does not tell chatter it read it


def test_a_quote_of_the_bot_is_a_reply_to_it_and_carries_the_quoted_text() -> None:
    quote = {"id": 5, "authorNumber": ME.number, "authorUuid": ME.uuid, "text": "echo: earlier"}
    found = translate(envelope(quote=quote, groupInfo=GROUP), ME)
    assert isinstance(found, Received)
    assert found.message.metadata[META_REPLY_TO_BOT] is True
    assert found.message.metadata[META_QUOTED_TEXT] == "echo: earlier"


def test_an_edit_names_the_first_message() -> None:
    edited = envelope()
    inner = edited["envelope"].pop("dataMessage")
    inner.update(timestamp=1700000009999, message="changed")
    edited["envelope"]["editMessage"] = {"targetSentTimestamp": 1700000000123, "dataMessage": inner}
    found = translate(edited, ME)
    assert isinstance(found, Received)
    assert found.message.text == "changed"
    assert found.message.message_id.endswith(":1700000009999")
    assert found.message.metadata[META_EDIT_OF].endswith(":1700000000123")


def test_what_is_not_a_message_is_skipped_and_what_cannot_be_read_is_a_notice() -> None:
    own = envelope()
    own["envelope"]["sourceNumber"] = ME.number
    assert isinstance(translate(own, ME), Skip)
    receipt = envelope()
    receipt["envelope"].pop("dataMessage")
    receipt["envelope"]["receiptMessage"] = {"isDelivery": True, "timestamps": [1]}
    assert isinstance(translate(receipt, ME), Skip)
    assert isinstance(translate(envelope(reaction={"emoji": "👍"}), ME), Skip)
    sticker = translate(envelope(message=None, sticker={"packId": "00", "stickerId": 1}), ME)
    assert isinstance(sticker, Notice) and "a sticker" in sticker.text
    group_sticker = envelope(message=None, sticker={"stickerId": 1}, groupInfo=GROUP)
    assert isinstance(translate(group_sticker, ME), Skip)
    update = {**GROUP, "type": "UPDATE"}
    assert isinstance(translate(envelope(message=None, groupInfo=update), ME), Skip)


def test_attachments_become_file_references() -> None:
    files = [
        {"contentType": "image/jpeg", "id": "p.jpg", "filename": None, "size": 10},
        {"contentType": "audio/aac", "id": "v.aac", "filename": "voice.aac", "size": 20},
        {"contentType": "application/pdf", "id": "d.pdf", "filename": "a.pdf", "size": 30},
        {"contentType": "text/x-signal-plain", "id": "long.txt", "size": 3000},
    ]
    found = translate(envelope(message=None, attachments=files), ME)
    assert isinstance(found, Received)
    assert [(a.kind, a.file_id, a.name) for a in found.message.attachments] == [
        ("image", "p.jpg", "image"),
        ("voice", "v.aac", "voice.aac"),
        ("document", "d.pdf", "a.pdf"),
    ]


def test_signal_clis_errors_are_told_apart_by_what_a_retry_would_do() -> None:
    limited = error_from(_error(rate_limited(3)))
    assert (limited.kind, limited.retry_after) == ("not_done", 3.0)
    assert error_from(_error(network_failure())).kind == "not_done"
    untrusted = error_from(_error(untrusted_identity()))
    assert untrusted.kind == "final" and "trust" in str(untrusted)
    assert error_from({"code": -3, "message": "Error while receiving messages"}).kind == "not_done"
    busy = error_from({"code": -1, "message": RECEIVE_BUSY})
    assert busy.busy and busy.kind == "final"
    assert error_from({"code": -1, "message": "The user +1 is not registered."}).kind == "final"
    assert not error_from({"code": -32601, "message": "Method not implemented"}).busy


def _error(scripted: Any) -> dict[str, Any]:
    return {"code": scripted.code, "message": scripted.message, "data": scripted.data}


# --------------------------------------------------------------------------- the adapter


class Tickets:
    """A stand-in for the dispatcher's `submit`: records what it was given, takes it
    unless told not to, and lets a test look at the fake when a message is submitted."""

    def __init__(self, fake: FakeSignalCli) -> None:
        self.fake = fake
        self.taken: list[InboundMessage] = []
        self.refuse = False
        self.receipts_at_submit: list[int] = []

    async def submit(self, message: InboundMessage) -> Any:
        self.receipts_at_submit.append(len(self.fake.receipts))
        taken = not self.refuse
        if taken:
            self.taken.append(message)
        return _Ticket(taken)


class _Ticket:
    def __init__(self, taken: bool) -> None:
        self._taken = taken

    @property
    def taken(self) -> bool:
        return self._taken

    async def reply(self) -> OutboundMessage | None:
        return None


@pytest.fixture
async def fake() -> AsyncIterator[FakeSignalCli]:
    async with FakeSignalCli() as server:
        yield server


def make_channel(fake: FakeSignalCli, folder: Path, **settings: Any) -> SignalChannel:
    section = SignalSettings(
        enabled=True, account=fake.account, url=fake.url, receive_timeout=1.0, **settings
    )
    store = FileCursorStore(folder / "channel-cursors.json")
    pacing = Pacing(retry_window=2.0, retry_backoff=0.05, retry_backoff_max=0.2)
    return SignalChannel(section, lead=run_with(store), pacing=pacing)


async def until(check: Callable[[], object], seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while not check():  # noqa: ASYNC110 (the fake changes in its own loop)
            await anyio.sleep(0.02)


async def test_messages_are_taken_one_receive_at_a_time_and_read_after_the_journal(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice, bob = fake.person("Alice"), fake.person("Bob")
    for n in range(3):
        fake.dm(alice if n % 2 == 0 else bob, f"m{n}")
    tickets = Tickets(fake)
    channel = make_channel(fake, tmp_path, seen_reaction="👀")
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, tickets.submit)
        await until(lambda: len(fake.receipts) == 3 and len(fake.reactions) == 3)
        tg.cancel_scope.cancel()
    assert [m.text for m in tickets.taken] == ["m0", "m1", "m2"]
    receives = fake.calls_to("receive")
    assert all(c.params == {"timeout": 1.0, "maxMessages": 1} for c in receives)
    # A message is read (receipt) only once it was submitted: never before.
    assert tickets.receipts_at_submit == [0, 1, 2] or tickets.receipts_at_submit[0] == 0
    assert {r["recipient"] for r in fake.receipts} == {alice.uuid, bob.uuid}
    assert fake.reactions[0]["emoji"] == "👀"


async def test_what_the_gateway_did_not_take_is_held_and_submitted_first_next_time(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice = fake.person("Alice")
    fake.dm(alice, "refused at first")
    tickets = Tickets(fake)
    tickets.refuse = True
    channel = make_channel(fake, tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, tickets.submit)
        await until(lambda: fake.waiting() == 0 and len(tickets.receipts_at_submit) >= 1)
        fake.dm(alice, "written later")
        await anyio.sleep(0.5)
        tg.cancel_scope.cancel()
    blob = tmp_path / "channel-state" / "signal-held%3A%2B15550000001"
    held = json.loads(blob.read_bytes())
    assert [i["envelope"]["dataMessage"]["message"] for i in held["items"]] == ["refused at first"]
    assert fake.waiting() == 1  # nothing more was asked for while one waits
    tickets.refuse = False
    again = make_channel(fake, tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(again.run, tickets.submit)
        await until(lambda: len(tickets.taken) == 2)
        tg.cancel_scope.cancel()
    assert [m.text for m in tickets.taken] == ["refused at first", "written later"]
    assert json.loads(blob.read_bytes())["items"] == []


async def test_a_stop_waits_for_the_receive_in_flight_and_keeps_what_it_brings(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice = fake.person("Alice")
    tickets = Tickets(fake)
    channel = make_channel(fake, tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, tickets.submit)
        await until(lambda: fake._receiving)
        channel.pause_intake()
        tickets.refuse = True  # draining: the dispatcher leaves it with the platform
        tg.cancel_scope.cancel()
        fake.dm(alice, "arrives while the call is open")
    assert fake.lost_in_transit == [] and fake.waiting() == 0
    blob = tmp_path / "channel-state" / "signal-held%3A%2B15550000001"
    held = json.loads(blob.read_bytes())["items"]
    assert [i["envelope"]["dataMessage"]["message"] for i in held] == [
        "arrives while the call is open"
    ]


async def test_a_receive_cut_off_loses_the_one_message_it_took_and_counts_it(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    """The platform's limit (docs/signal.md, Delivery): signal-cli's `receive` call goes
    on when the network to the gateway is cut, takes the next message and answers no one.
    The channel counts the cut and takes everything after it."""
    alice = fake.person("Alice")
    tickets = Tickets(fake)
    with tcp_proxy("127.0.0.1", int(fake.url.rsplit(":", 1)[1])) as proxy:
        channel = make_channel(fake, tmp_path)
        channel.settings = channel.settings.model_copy(
            update={"url": f"http://127.0.0.1:{proxy.port}", "receive_timeout": 3.0}
        )
        channel.rpc.url = channel.settings.url
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, tickets.submit)
            await until(lambda: fake._receiving)
            proxy.cut()
            lost = fake.dm(alice, "taken by a call nobody reads")
            await until(lambda: fake.lost_in_transit)
            proxy.restore()
            fake.dm(alice, "after the cut")
            await until(lambda: tickets.taken)
            tg.cancel_scope.cancel()
    assert fake.lost_in_transit == [lost]
    assert [m.text for m in tickets.taken] == ["after the cut"]
    assert channel.stats.receive_cut == 1


async def test_a_group_reply_quotes_its_message_in_styled_parts(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice = fake.person("Alice")
    group = fake.group("Team", [alice])
    said = fake.group_message(group, alice, "question", mention_bot=True)
    tickets = Tickets(fake)
    channel = make_channel(fake, tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, tickets.submit)
        await until(lambda: tickets.taken)
        inbound = tickets.taken[0]
        long = "**Answer**\n\n" + "\n\n".join("para " + "word " * 60 for _ in range(12))
        await channel.send(reply_for(inbound, long))
        await channel.send(reply_for(fake_dm := _dm_inbound(alice.uuid), "in a DM"))
        tg.cancel_scope.cancel()
    parts = fake.sent_to(group.id)
    assert len(parts) >= 2
    assert parts[0].quote == (said["timestamp"], alice.uuid)
    assert all(p.quote is None for p in parts[1:])
    assert parts[0].styles[0] == (0, 6, "BOLD") and parts[0].text.startswith("Answer")
    assert all(len(p.text.encode()) <= 2000 for p in parts)
    dm = fake.sent_to(fake_dm.chat_id)
    assert dm[0].quote is None and dm[0].text == "in a DM"


def _dm_inbound(uuid: str) -> InboundMessage:
    return InboundMessage("signal", uuid, "hi", sender_id=uuid, message_id=f"{uuid}:1")


async def test_a_reply_that_cannot_go_out_now_fails_and_resumes_at_that_part(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice = fake.person("Alice")
    channel = make_channel(fake, tmp_path)
    reply = reply_for(_dm_inbound(alice.uuid), "\n\n".join(f"P{n} " + "x" * 900 for n in range(4)))
    fake.fail_next("send", network_failure(), times=2)
    fake.fail_next("send", rate_limited(1))
    await channel.send(reply)  # network failures and a rate limit are waited out
    assert len(fake.sent_to(alice.uuid)) >= 2
    sent_before = len(fake.sent)
    original = fake._send

    def fail_second(self: FakeSignalCli, params: dict[str, Any]) -> dict[str, Any]:
        if len(fake.sent) == sent_before + 1:
            from tests.fakes.signal_server import USER_ERROR, RpcFailure

            raise RpcFailure(USER_ERROR, "Failed to send message",
                             {"response": {"results": [{"type": "NETWORK_FAILURE"}]}})  # fmt: skip
        return original(params)

    import tests.fakes.signal_server as module

    module._METHODS["send"] = fail_second
    try:
        with pytest.raises(DeliveryFailed) as failed:
            await channel.send(reply)
        assert failed.value.sent == 1
    finally:
        module._METHODS["send"] = FakeSignalCli._send
    await channel.send(reply)  # the dispatcher's next attempt: only the rest
    first_reply = [s.text for s in fake.sent[:sent_before]]
    assert [s.text for s in fake.sent[sent_before:]] == first_reply  # each part once
    await channel.rpc.aclose()


async def test_an_untrusted_identity_is_no_retry_and_no_delivery_failure(
    fake: FakeSignalCli, tmp_path: Path
) -> None:
    alice = fake.person("Alice")
    channel = make_channel(fake, tmp_path)
    fake.fail_next("send", untrusted_identity())
    with pytest.raises(SignalError) as refused:
        await channel.send(reply_for(_dm_inbound(alice.uuid), "hi"))
    assert not isinstance(refused.value, DeliveryFailed) and refused.value.kind == "final"
    assert "trust" in str(refused.value)
    await channel.rpc.aclose()


async def test_a_daemon_that_is_down_is_a_delivery_failure(tmp_path: Path) -> None:
    async with FakeSignalCli() as fake:
        alice = fake.person("Alice")
        channel = make_channel(fake, tmp_path)
    with pytest.raises(DeliveryFailed):
        await channel.send(reply_for(_dm_inbound(alice.uuid), "hi"))
    await channel.rpc.aclose()


async def test_files_in_and_out(fake: FakeSignalCli, tmp_path: Path) -> None:
    alice = fake.person("Alice")
    channel = make_channel(fake, tmp_path)
    found = fake.add_attachment(b"%PDF-1.4 ...", "application/pdf", "a.pdf")
    attachment = Attachment("document", found["id"], "a.pdf", "application/pdf", found["size"])
    assert await channel.fetch_file(attachment, max_bytes=1000) == b"%PDF-1.4 ..."
    with pytest.raises(MediaError, match="limit"):
        await channel.fetch_file(attachment, max_bytes=5)
    with pytest.raises(MediaError):
        await channel.fetch_file(Attachment("image", "gone.jpg"), max_bytes=1000)
    image = OutboundFile("chart; v2.png", b"\x89PNG", "image/png", caption="the chart")
    await channel.send(reply_for(_dm_inbound(alice.uuid), "see below", files=(image,)))
    sent = fake.sent_to(alice.uuid)
    assert [s.text for s in sent] == ["see below", "the chart"]
    assert sent[1].attachments == (("image/png", "chart_v2.png", b"\x89PNG"),)
    await channel.rpc.aclose()


async def test_multi_account_mode_names_the_account(tmp_path: Path) -> None:
    async with FakeSignalCli(multi_account=True) as fake:
        alice = fake.person("Alice")
        fake.dm(alice, "hi")
        tickets = Tickets(fake)
        channel = make_channel(fake, tmp_path)
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, tickets.submit)
            await until(lambda: tickets.taken)
            tg.cancel_scope.cancel()
        assert all(c.ok for c in fake.calls_to("receive"))


async def test_a_daemon_that_receives_by_itself_is_reported_not_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with FakeSignalCli(receive_mode="on-start") as fake:
        tickets = Tickets(fake)
        channel = make_channel(fake, tmp_path)
        channel.pacing = Pacing(busy_grace=0.2, retry_backoff=0.05, retry_backoff_max=0.1)
        async with anyio.create_task_group() as tg:
            await tg.start(channel.run, tickets.submit)
            await until(lambda: len(fake.calls_to("receive")) >= 4)
            tg.cancel_scope.cancel()
        assert not any(c.ok for c in fake.calls_to("receive"))


async def test_the_doctor_and_a_daemon_on_another_address(fake: FakeSignalCli) -> None:
    section = SignalSettings(enabled=True, account=fake.account, url=fake.url)
    assert "serves +15550000001 (single-account mode)" in await check_daemon(section)
    findings = await SPEC.checks(section)  # type: ignore[misc]
    assert [f.status for f in findings] == ["ok"]
    none = await SPEC.checks(SignalSettings(enabled=True))  # type: ignore[misc]
    assert none[0].status == "fail" and "ACCOUNT" in none[0].fix
    # Listening on 127.0.0.1:PORT, signal-cli refuses a Host of another port (a port
    # mapped by Docker, a proxy).
    async with FakeSignalCli(pin_host=True) as pinned:
        with tcp_proxy("127.0.0.1", int(pinned.url.rsplit(":", 1)[1])) as proxy:
            elsewhere = SignalSettings(
                enabled=True, account=pinned.account, url=f"http://127.0.0.1:{proxy.port}"
            )
            with pytest.raises(SignalSetupError, match="Host header"):
                await check_daemon(elsewhere)


def test_settings_refuse_a_number_out_of_shape_and_streaming() -> None:
    with pytest.raises(ValueError, match=r"E\.164"):
        SignalSettings(account="555 123")
    with pytest.raises(ValueError, match="10 edits"):
        SignalSettings(streaming=True)
    assert SignalSettings().enabled is False
