"""The email channel against real servers: Debian's Dovecot for the mailbox (IMAPS and
STARTTLS, IDLE) and aiosmtpd for sending, each on 127.0.0.1 (tests/dovecot_server.py,
tests/smtp_server.py). A recorder stands in for the dispatcher, as in the Telegram
channel's tests; tests/test_email_e2e.py runs the whole gateway."""

from __future__ import annotations

from collections.abc import Iterator
from email.message import EmailMessage
from pathlib import Path
from typing import Any

import anyio
import pytest

from channels.email import EmailChannel, EmailSetupError, Pacing, check_mailbox
from channels.email.channel import SendFailure
from channels.email.settings import EmailSettings
from channels.email.state import MailboxMark, MailboxMarks
from gateway.channel import DeliveryFailed
from gateway.journal.cursors import CURSOR_FILE, FileCursorStore, run_with
from gateway.journal.protocol import Lead
from gateway.media import MediaError
from gateway.messages import InboundMessage, OutboundMessage, reply_for
from tests.dovecot_server import Dovecot, running_dovecot
from tests.smtp_server import SmtpServer, running_smtp

pytestmark = pytest.mark.anyio

BOT, ALICE, BOB = "bot@example.org", "alice@example.org", "bob@example.org"
USERS = {BOT: "bot-pw", ALICE: "alice-pw", BOB: "bob-pw"}
FAST = Pacing(idle_check=0.2, retry_backoff=0.05, retry_backoff_max=0.2, timeout=10)
SEEN = b"\\Seen"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def servers() -> Iterator[tuple[Dovecot, SmtpServer]]:
    with running_dovecot(USERS) as dovecot, running_smtp(USERS, dovecot=dovecot) as smtp:
        yield dovecot, smtp


def file_lead(folder: Path) -> Lead:
    """The one-process `Lead`, with the mark in the cursor file of `folder`."""
    return run_with(FileCursorStore(folder / CURSOR_FILE))


def settings_for(dovecot: Dovecot, smtp: SmtpServer, **overrides: Any) -> EmailSettings:
    options: dict[str, Any] = {
        "enabled": True,
        "address": BOT,
        "imap_host": dovecot.host,
        "imap_port": dovecot.imaps_port,
        "smtp_host": "127.0.0.1",
        "smtp_port": smtp.port,
        "tls_ca_file": str(dovecot.ca_file),
        "password": USERS[BOT],
        "allow_from": ["*"],
    }
    return EmailSettings.model_validate(options | overrides)


def raw_mail(
    text: str,
    *,
    sender: str = ALICE,
    message_id: str | None = None,
    subject: str = "Hello",
    headers: dict[str, str] | None = None,
    files: list[tuple[str, str, bytes]] | None = None,
) -> bytes:
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = BOT
    msg["Subject"] = subject
    msg["Message-ID"] = message_id or f"<{abs(hash(text))}@example.org>"
    for name, value in (headers or {}).items():
        msg[name] = value
    msg.set_content(text)
    for name, mime, data in files or ():
        main, _, sub = mime.partition("/")
        msg.add_attachment(data, maintype=main, subtype=sub, filename=name)
    return msg.as_bytes()


class Ticket:
    def __init__(self, taken: bool) -> None:
        self.taken = taken

    async def reply(self) -> OutboundMessage | None:
        return None


class Recorder:
    """Stands in for the dispatcher: records what the channel submits; `refuse` makes
    the next submissions not taken (as when the journal cannot write)."""

    def __init__(self) -> None:
        self.messages: list[InboundMessage] = []
        self.refuse = 0

    async def submit(self, message: InboundMessage) -> Ticket:
        self.messages.append(message)
        if self.refuse:
            self.refuse -= 1
            return Ticket(False)
        return Ticket(True)

    async def wait(self, count: int) -> list[InboundMessage]:
        with anyio.fail_after(10):
            while len(self.messages) < count:  # noqa: ASYNC110 (polling a test recorder)
                await anyio.sleep(0.02)
        return self.messages

    def texts(self) -> list[str]:
        return [m.text for m in self.messages]


def flags_of(dovecot: Dovecot, user: str = BOT, folder: str = "INBOX") -> list[set[bytes]]:
    return [flags for _, flags, _ in dovecot.messages(user, folder)]


async def run_channel(
    channel: EmailChannel, recorder: Recorder, body: Any, *, wait_live: bool = True
) -> None:
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, recorder.submit)
        if wait_live:
            with anyio.fail_after(10):
                await channel.live.wait()
        await body()
        tg.cancel_scope.cancel()


async def until(predicate: Any) -> None:
    with anyio.fail_after(10):
        while not predicate():  # noqa: ASYNC110 (polling the channel's counters)
            await anyio.sleep(0.02)


async def in_thread(func: Any, *args: Any) -> Any:
    return await anyio.to_thread.run_sync(func, *args)


# -- reading ---------------------------------------------------------------------------


async def test_unseen_mail_from_before_the_start_is_taken_and_then_flagged_seen(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """The first start catches up on unseen mail (mail read by a person before is left
    alone); from then on every message above the mark is taken, read or not."""
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("already read by a person"), flags=(SEEN,))
    dovecot.append(BOT, raw_mail("waiting since yesterday"))
    recorder = Recorder()
    state = MailboxMarks(FileCursorStore(tmp_path / CURSOR_FILE))
    channel = EmailChannel(settings_for(dovecot, smtp), lead=run_with(state.store), pacing=FAST)

    async def body() -> None:
        await recorder.wait(1)
        await in_thread(
            lambda: dovecot.append(BOT, raw_mail("read elsewhere first"), flags=(SEEN,))
        )
        await in_thread(lambda: dovecot.append(BOT, raw_mail("new while running")))
        await until(lambda: channel.taken == 3)

    await run_channel(channel, recorder, body)
    assert recorder.texts() == [
        "Subject: Hello\n\nwaiting since yesterday",
        "Subject: Hello\n\nread elsewhere first",
        "Subject: Hello\n\nnew while running",
    ]
    assert flags_of(dovecot) == [{SEEN}, {SEEN}, {SEEN}, {SEEN}]
    mark = await state.load(channel.mailbox)
    assert mark is not None and mark.last_uid == 4


async def test_polling_without_idle_takes_new_mail(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    settings = settings_for(dovecot, smtp, idle=False, poll_interval_seconds=0.2)
    recorder = Recorder()
    channel = EmailChannel(settings, lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        await in_thread(lambda: dovecot.append(BOT, raw_mail("polled")))
        await recorder.wait(1)

    await run_channel(channel, recorder, body)
    assert recorder.texts() == ["Subject: Hello\n\npolled"]


async def test_mail_that_comes_while_other_mail_is_handled_is_not_left_waiting(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """Mail that arrives while the channel handles earlier mail is announced in the
    answers to its FETCH and STORE commands, and IDLE never announces it again: the
    channel reads until a round finds nothing before it idles (it used to wait for the
    next mail, or for IDLE's renewal minutes later)."""
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("first", message_id="<b1@example.org>"))
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)
    arrived = False

    async def slow_submit(message: InboundMessage) -> Ticket:
        nonlocal arrived
        if not arrived:
            arrived = True
            for n in (2, 3):
                raw = raw_mail(f"burst {n}", message_id=f"<b{n}@example.org>")
                await in_thread(lambda raw=raw: dovecot.append(BOT, raw))
        return await recorder.submit(message)

    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, slow_submit)
        await until(lambda: channel.taken == 3)
        tg.cancel_scope.cancel()
    assert [m.message_id for m in recorder.messages] == [
        "<b1@example.org>",
        "<b2@example.org>",
        "<b3@example.org>",
    ]


async def test_mail_the_journal_did_not_take_stays_unseen_and_comes_again(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("first", message_id="<f1@example.org>"))
    dovecot.append(BOT, raw_mail("second", message_id="<f2@example.org>"))
    recorder = Recorder()
    recorder.refuse = 1
    # The next round comes after a second: time to look at the flags meanwhile.
    patient = Pacing(idle_check=0.2, retry_backoff=1.0, timeout=10)
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=patient)
    seen_after_refusal: list[list[set[bytes]]] = []

    async def body() -> None:
        await until(lambda: channel.taken == 2)

    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, recorder.submit)
        await recorder.wait(1)
        # Refused: the round stops there, nothing confirmed.
        seen_after_refusal.append(await in_thread(flags_of, dovecot))
        await body()
        tg.cancel_scope.cancel()
    assert seen_after_refusal == [[set(), set()]]
    ids = [m.message_id for m in recorder.messages]
    assert ids == ["<f1@example.org>", "<f1@example.org>", "<f2@example.org>"]
    assert flags_of(dovecot) == [{SEEN}, {SEEN}]


async def test_a_killed_reader_leaves_unconfirmed_mail_unseen_and_takes_it_after(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """Cancelled while the dispatcher holds the message (before submit returned): the
    message stays unseen and the mark stays below it; the next start takes it."""
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("slow journal", message_id="<s1@example.org>"))
    state = MailboxMarks(FileCursorStore(tmp_path / CURSOR_FILE))
    await state.save(
        f"{BOT}@{dovecot.host}/INBOX", MailboxMark(await in_thread(_uidvalidity, dovecot), 0)
    )
    entered = anyio.Event()

    async def stuck(message: InboundMessage) -> Ticket:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError

    channel = EmailChannel(settings_for(dovecot, smtp), lead=run_with(state.store), pacing=FAST)
    async with anyio.create_task_group() as tg:
        await tg.start(channel.run, stuck)
        await entered.wait()
        tg.cancel_scope.cancel()
    assert flags_of(dovecot) == [set()]
    recorder = Recorder()
    again = EmailChannel(settings_for(dovecot, smtp), lead=run_with(state.store), pacing=FAST)

    async def body() -> None:
        await until(lambda: again.taken == 1)

    await run_channel(again, recorder, body)
    assert [m.message_id for m in recorder.messages] == ["<s1@example.org>"]
    assert flags_of(dovecot) == [{SEEN}]


def _uidvalidity(dovecot: Dovecot) -> int:
    client: Any = dovecot.client(BOT)
    try:
        return int(client.folder_status("INBOX", [b"UIDVALIDITY"])[b"UIDVALIDITY"])
    finally:
        client.logout()


async def test_a_renumbered_folder_is_read_by_message_id_not_answered_again(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """After a UIDVALIDITY change only unseen mail is read: what was confirmed is not
    read again, and a message left unseen by a crash comes with the Message-ID the
    journal already holds (the dispatcher drops it as a duplicate)."""
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("one", message_id="<r1@example.org>"))
    dovecot.append(BOT, raw_mail("two", message_id="<r2@example.org>"))
    state = MailboxMarks(FileCursorStore(tmp_path / CURSOR_FILE))
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=run_with(state.store), pacing=FAST)

    async def body() -> None:
        await until(lambda: channel.taken == 2)

    await run_channel(channel, recorder, body)
    before = await state.load(channel.mailbox)
    # A crash between the journal and the flag, then a server that renumbered the folder.
    client: Any = dovecot.client(BOT)
    client.remove_flags([2], [SEEN])
    client.logout()
    dovecot.renumber(BOT)
    dovecot.append(BOT, raw_mail("three", message_id="<r3@example.org>"))
    again = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=run_with(state.store), pacing=FAST)

    async def body2() -> None:
        await until(lambda: channel.taken == 2)

    await run_channel(channel, again, body2)
    assert [m.message_id for m in again.messages] == ["<r2@example.org>", "<r3@example.org>"]
    after = await state.load(channel.mailbox)
    assert before is not None and after is not None
    assert after.uidvalidity != before.uidvalidity and after.last_uid == 3


async def test_a_server_restart_is_waited_out_and_reading_goes_on(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """The IMAP server goes away while the channel idles: the channel reconnects with
    backoff until it is back (it does not stop, as it does for a refused login)."""
    dovecot, smtp = servers
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        await in_thread(lambda: dovecot.restart(down_for=1.0))
        await in_thread(lambda: dovecot.append(BOT, raw_mail("after the restart")))
        await until(lambda: channel.taken == 1)

    await run_channel(channel, recorder, body)
    assert recorder.texts() == ["Subject: Hello\n\nafter the restart"]


async def test_machines_mail_is_not_submitted_nor_flagged(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("vacation", headers={"Auto-Submitted": "auto-replied"}))
    dovecot.append(BOT, raw_mail("newsletter", headers={"List-Id": "<news.example.org>"}))
    dovecot.append(BOT, raw_mail("from myself", sender=BOT))
    dovecot.append(BOT, raw_mail("a person"))
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        await until(lambda: channel.taken == 1)

    await run_channel(channel, recorder, body)
    assert recorder.texts() == ["Subject: Hello\n\na person"]
    assert channel.skipped == 3
    assert flags_of(dovecot) == [set(), set(), set(), {SEEN}]


def _logins(dovecot: Dovecot) -> int:
    return dovecot.log_path.read_text(errors="replace").count(f"Login: user=<{BOT}>")


async def test_a_mails_files_are_read_from_the_server_once(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """A turn asks for a mail's files one after another: the mail is fetched once, not
    once per file (a login and the whole mail each time)."""
    dovecot, smtp = servers
    pdf, png = b"%PDF-1.4 " + b"p" * 500, b"\x89PNG\r\n\x1a\n" + b"x" * 700
    dovecot.append(
        BOT,
        raw_mail(
            "two files",
            message_id="<two@example.org>",
            files=[("a.pdf", "application/pdf", pdf), ("b.png", "image/png", png)],
        ),
    )
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        (message,) = await recorder.wait(1)
        first, second = message.attachments
        await until(lambda: _logins(dovecot) >= 2)  # the start's check and the watcher's
        before = _logins(dovecot)
        assert await channel.fetch_file(first, max_bytes=10_000) == pdf
        await until(lambda: _logins(dovecot) == before + 1)
        assert await channel.fetch_file(second, max_bytes=10_000) == png
        await anyio.sleep(0.5)  # a second login would be in the log by now
        assert _logins(dovecot) == before + 1

    await run_channel(channel, recorder, body)


async def test_processed_mail_is_moved_and_its_files_are_still_found(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    png = b"\x89PNG\r\n\x1a\n" + b"x" * 1000
    dovecot.append(
        BOT,
        raw_mail(
            "see the photo", message_id="<p1@example.org>", files=[("a.png", "image/png", png)]
        ),
    )
    settings = settings_for(dovecot, smtp, processed_folder="Processed")
    recorder = Recorder()
    channel = EmailChannel(settings, lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        (message,) = await recorder.wait(1)
        (attachment,) = message.attachments
        assert (attachment.kind, attachment.name, attachment.size) == ("image", "a.png", len(png))
        assert await channel.fetch_file(attachment, max_bytes=10_000) == png
        with pytest.raises(MediaError, match="limit"):
            await channel.fetch_file(attachment, max_bytes=100)

    await run_channel(channel, recorder, body)
    assert dovecot.messages(BOT) == []
    assert [flags for _, flags, _ in dovecot.messages(BOT, "Processed")] == [set()]


async def test_imap_over_starttls(servers: tuple[Dovecot, SmtpServer], tmp_path: Path) -> None:
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("over starttls"))
    settings = settings_for(dovecot, smtp, imap_security="starttls", imap_port=dovecot.imap_port)
    recorder = Recorder()
    channel = EmailChannel(settings, lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        await recorder.wait(1)

    await run_channel(channel, recorder, body)
    assert recorder.texts() == ["Subject: Hello\n\nover starttls"]


async def test_a_refused_login_or_a_missing_folder_stops_the_channel_with_what_to_fix(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    state = MailboxMarks(FileCursorStore(tmp_path / CURSOR_FILE))
    for overrides, expected in (
        ({"password": "wrong"}, "refused the login of bot@example.org"),
        ({"folder": "Nope"}, "has no folder 'Nope'"),
    ):
        channel = EmailChannel(
            settings_for(dovecot, smtp, **overrides), lead=run_with(state.store), pacing=FAST
        )
        with pytest.raises(EmailSetupError, match=expected) as caught:
            await channel.run(Recorder().submit)
        assert "wrong" not in str(caught.value) or "password" in overrides


async def test_pause_leaves_new_mail_on_the_server(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    recorder = Recorder()
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)

    async def body() -> None:
        channel.pause_intake()
        await anyio.sleep(0.5)
        await in_thread(lambda: dovecot.append(BOT, raw_mail("during the drain")))
        await anyio.sleep(1.0)

    await run_channel(channel, recorder, body)
    assert recorder.messages == []
    assert flags_of(dovecot) == [set()]


# -- sending ---------------------------------------------------------------------------


async def test_a_reply_lands_in_the_correspondents_mailbox_threaded(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    dovecot.append(BOT, raw_mail("What is the plan?", message_id="<q1@example.org>"))
    recorder = Recorder()
    channel = EmailChannel(
        settings_for(dovecot, smtp, from_name="Assistant"),
        lead=file_lead(tmp_path),
        pacing=FAST,
    )

    async def body() -> None:
        (message,) = await recorder.wait(1)
        await channel.send(reply_for(message, "The plan:\n\n1. **eat**\n2. sleep"))

    await run_channel(channel, recorder, body)
    ((_, _, raw),) = dovecot.messages(ALICE)
    from email import policy
    from email.parser import BytesParser

    reply = BytesParser(policy=policy.default).parsebytes(raw)
    assert reply["From"] == "Assistant <bot@example.org>"
    assert reply["Subject"] == "Re: Hello"
    assert reply["In-Reply-To"] == "<q1@example.org>"
    assert reply["References"] == "<q1@example.org>"
    assert reply["Auto-Submitted"] == "auto-replied"
    assert "<strong>eat</strong>" in reply.get_body(preferencelist=("html",)).get_content()  # type: ignore[union-attr]
    assert smtp.accepted[0].mail_from == BOT and smtp.accepted[0].rcpt_tos == (ALICE,)
    assert smtp.logins == [(BOT, True)]


async def test_a_temporary_refusal_is_retried_and_a_final_one_is_not(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    dovecot, smtp = servers
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)
    out = OutboundMessage("email", ALICE, "hi", "email:alice@example.org", reply_to="<x@y>")
    smtp.refuse_next = ["451 4.3.0 try again later"]
    await channel.send(out)
    assert len(smtp.accepted) == 1
    smtp.refuse_next = ["554 5.7.1 rejected"]
    with pytest.raises(SendFailure, match="554"):
        await channel.send(out)
    assert len(smtp.accepted) == 1 and smtp.refuse_next == []
    wrong = EmailChannel(
        settings_for(dovecot, smtp, smtp_password="nope"),
        lead=file_lead(tmp_path),
        pacing=FAST,
    )
    with pytest.raises(SendFailure, match="refused the SMTP login"):
        await wrong.send(out)
    assert smtp.logins[-1] == (BOT, False)
    # One attempt, not retried: aiosmtplib tries PLAIN, then LOGIN, once each.
    assert len([ok for _, ok in smtp.logins if not ok]) == 2


async def test_a_reply_refused_for_now_past_the_channels_retries_is_delivery_failed(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """A 4xx answer more times than the channel tries: the reply certainly did not go
    out and may later, so `send` raises `DeliveryFailed` (the dispatcher sends it again)
    and the reply sent again is the same mail, Message-ID included. (Before: a
    SendFailure, and the dispatcher marked the message answered, its reply lost.)"""
    dovecot, smtp = servers
    channel = EmailChannel(settings_for(dovecot, smtp), lead=file_lead(tmp_path), pacing=FAST)
    out = OutboundMessage("email", ALICE, "hi", "email:alice@example.org", reply_to="<x@y>")
    smtp.refuse_next = ["451 4.3.0 try again later"] * FAST.send_attempts
    with pytest.raises(DeliveryFailed, match="451") as failed:
        await channel.send(out)
    assert failed.value.sent == 0 and smtp.accepted == []
    await channel.send(out)
    (taken,) = smtp.accepted
    assert len(smtp.refused) == FAST.send_attempts
    assert {a.message["Message-ID"] for a in smtp.refused} == {taken.message["Message-ID"]}


async def test_a_reply_with_the_smtp_server_unreachable_is_delivery_failed(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    """Nothing listens on the SMTP port: the reply certainly did not go out, and may
    once the server is back (`DeliveryFailed`)."""
    from tests.fakes._serving import free_port

    dovecot, smtp = servers
    settings = settings_for(dovecot, smtp, smtp_port=free_port())
    channel = EmailChannel(settings, lead=file_lead(tmp_path), pacing=FAST)
    out = OutboundMessage("email", ALICE, "hi", "email:alice@example.org", reply_to="<x@y>")
    with pytest.raises(DeliveryFailed):
        await channel.send(out)
    assert smtp.accepted == []


# aiosmtpd's own warning: it takes a connection that is TLS from the first byte for one
# without TLS (see tests/smtp_server.py).
@pytest.mark.filterwarnings("ignore:Requiring AUTH while not requiring TLS")
async def test_smtp_over_tls_from_the_first_byte(tmp_path: Path) -> None:
    with (
        running_dovecot(USERS) as dovecot,
        running_smtp(USERS, dovecot=dovecot, implicit_tls=True) as smtp,
    ):
        settings = settings_for(dovecot, smtp, smtp_security="tls")
        channel = EmailChannel(settings, lead=file_lead(tmp_path), pacing=FAST)
        out = OutboundMessage("email", ALICE, "over TLS", "email:alice@example.org")
        await channel.send(out)
        assert smtp.texts() == ["over TLS"]
        assert smtp.logins == [(BOT, True)]


# -- doctor ----------------------------------------------------------------------------


async def test_doctor_logs_in_to_both_servers_and_names_what_is_wrong(
    servers: tuple[Dovecot, SmtpServer],
) -> None:
    dovecot, smtp = servers
    found = await check_mailbox(settings_for(dovecot, smtp))
    assert found == (f"IMAP bot@example.org@127.0.0.1: INBOX (IDLE); SMTP 127.0.0.1:{smtp.port}")
    with pytest.raises(EmailSetupError, match="refused the login"):
        await check_mailbox(settings_for(dovecot, smtp, password="wrong"))
    with pytest.raises(EmailSetupError, match="no folder 'Done'"):
        await check_mailbox(settings_for(dovecot, smtp, processed_folder="Done"))
    with pytest.raises(EmailSetupError, match="refused the SMTP login"):
        await check_mailbox(settings_for(dovecot, smtp, smtp_password="wrong"))


async def test_doctor_warns_when_nobody_or_anybody_may_write(
    servers: tuple[Dovecot, SmtpServer], tmp_path: Path
) -> None:
    from channels.email.spec import SPEC
    from gateway.config import Settings, load_settings
    from gateway.registry import Finding

    async def check_email(settings: Settings) -> list[Finding]:
        assert SPEC.checks is not None
        return await SPEC.checks(settings.channels.email)

    dovecot, smtp = servers
    prefix = "GATEWAY_CHANNELS__EMAIL__"
    environ = {
        "GATEWAY_WORKSPACE": str(tmp_path),
        f"{prefix}ENABLED": "true",
        f"{prefix}ADDRESS": BOT,
        f"{prefix}IMAP_HOST": dovecot.host,
        f"{prefix}IMAP_PORT": str(dovecot.imaps_port),
        f"{prefix}SMTP_HOST": "127.0.0.1",
        f"{prefix}SMTP_PORT": str(smtp.port),
        f"{prefix}TLS_CA_FILE": str(dovecot.ca_file),
        f"{prefix}PASSWORD": USERS[BOT],
    }
    nobody = await check_email(load_settings(environ=environ))
    assert [f.status for f in nobody] == ["ok", "warn"]
    assert nobody[0].what.startswith("email works: IMAP bot@example.org@127.0.0.1: INBOX")
    assert "answers nobody" in nobody[1].what
    anybody = await check_email(load_settings(environ=environ | {f"{prefix}DM_POLICY": "open"}))
    assert [f.status for f in anybody] == ["ok", "warn"]
    assert "require_auth" in anybody[1].fix
    broken = await check_email(load_settings(environ=environ | {f"{prefix}PASSWORD": "no"}))
    assert broken[0].status == "fail" and "refused the login" in broken[0].what
    incomplete = await check_email(
        load_settings(environ={k: v for k, v in environ.items() if "SMTP_HOST" not in k})
    )
    assert incomplete[0].status == "fail" and "channels.email.smtp_host" in incomplete[0].what
