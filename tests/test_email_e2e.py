"""The whole gateway (`gateway run`) on email, end to end: a correspondent's mail in
Dovecot is answered by mail that lands in their mailbox (through aiosmtpd), threaded
under it; a reply to the reply continues the same conversation; strangers get nothing;
and a folder the server renumbered is not answered again."""

from __future__ import annotations

import json
import time
import urllib.request
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from pathlib import Path

import pytest

from gateway.sessions.keys import key_from_filename
from tests.dovecot_server import running_dovecot
from tests.email_gateway import BOT, BOT_PASSWORD, email_env, person_mail
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import GatewayProcess, wait_until
from tests.smtp_server import running_smtp

ALICE, CAROL = "alice@example.org", "carol@stranger.example"
USERS = {BOT: BOT_PASSWORD, ALICE: "alice-pw", CAROL: "carol-pw"}


def inbox(dovecot: object, user: str) -> list[EmailMessage]:
    parser = BytesParser(policy=policy.default)
    found = []
    for _, _, raw in dovecot.messages(user):  # type: ignore[attr-defined]
        msg = parser.parsebytes(raw)
        assert isinstance(msg, EmailMessage)
        found.append(msg)
    return found


def plain(msg: EmailMessage) -> str:
    body = msg.get_body(preferencelist=("plain",))
    assert body is not None
    return str(body.get_content()).replace("\r\n", "\n").strip()


@pytest.mark.timeout(180)
def test_a_conversation_by_mail_end_to_end(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    with (
        running_dovecot(USERS) as dovecot,
        running_smtp(USERS, dovecot=dovecot) as smtp,
        FakeOpenAI.in_thread() as llm,
    ):
        env = email_env(workspace, llm, dovecot, smtp, allow_from=["example.org"])
        gateway = GatewayProcess(env, tmp_path)
        try:
            port = gateway.wait_ready()
            gateway.wait_readyz(port)
            dovecot.append(
                BOT, person_mail(ALICE, "What is on today?", message_id="<e1@example.org>")
            )
            wait_until(lambda: len(inbox(dovecot, ALICE)) == 1, 30, "the first reply")
            (first,) = inbox(dovecot, ALICE)
            assert plain(first) == "echo: Subject: note\n\nWhat is on today?"
            assert first["Subject"] == "Re: note"
            assert first["In-Reply-To"] == "<e1@example.org>"
            assert first["Auto-Submitted"] == "auto-replied"
            assert first.get_body(preferencelist=("html",)) is not None
            # Alice answers the reply, quoting it, as her mail client does.
            dovecot.append(
                BOT,
                person_mail(
                    ALICE,
                    f"And tomorrow?\n\nOn Tue, Bot <{BOT}> wrote:\n> {plain(first)}\n",
                    message_id="<e2@example.org>",
                    subject="Re: note",
                    in_reply_to=first["Message-ID"],
                    references=f"<e1@example.org> {first['Message-ID']}",
                ),
            )
            # A stranger is refused without a word (the allowlist holds example.org), and
            # an auto-reply is not even taken in.
            dovecot.append(BOT, person_mail(CAROL, "hello?", message_id="<c1@stranger.example>"))
            vacation = person_mail(
                ALICE,
                "I am away",
                message_id="<v1@example.org>",
                headers={"Auto-Submitted": "auto-replied"},
            )
            dovecot.append(BOT, vacation)
            wait_until(lambda: len(inbox(dovecot, ALICE)) == 2, 30, "the second reply")
            second = inbox(dovecot, ALICE)[1]
            assert plain(second) == "echo: And tomorrow?"
            assert second["References"] == (
                f"<e1@example.org> {first['Message-ID']} <e2@example.org>"
            )
            time.sleep(1.0)
            assert inbox(dovecot, CAROL) == []
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                scrape = r.read().decode()
            assert 'gateway_email_mail_total{outcome="taken"} 3.0' in scrape
            assert 'gateway_email_mail_total{outcome="not_answered"} 1.0' in scrape
            assert 'gateway_channel_up{channel="email"} 1.0' in scrape
            assert gateway.terminate() == 0
        finally:
            gateway.stop()
        keys = sorted(
            key
            for path in (workspace / "sessions").glob("*.jsonl")
            if (key := key_from_filename(path.name)) is not None
        )
        assert keys == ["email:alice@example.org:thread:e1@example.org"]
        assert [a for a in smtp.accepted if a.rcpt_tos != (ALICE,)] == []


@pytest.mark.timeout(180)
def test_a_renumbered_mailbox_is_not_answered_again(tmp_path: Path) -> None:
    """The server gives the folder a new UIDVALIDITY while the gateway is stopped, and
    a message answered before (but left unseen, as a kill between journal and flag
    leaves it) is among the unseen mail: only the new message is answered."""
    workspace = tmp_path / "ws"
    with (
        running_dovecot(USERS) as dovecot,
        running_smtp(USERS, dovecot=dovecot) as smtp,
        FakeOpenAI.in_thread() as llm,
    ):
        env = email_env(workspace, llm, dovecot, smtp)
        for n in (1, 2):
            dovecot.append(BOT, person_mail(ALICE, f"question {n}", message_id=f"<q{n}@x.org>"))
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_readyz(gateway.wait_ready())
            wait_until(lambda: len(smtp.accepted) == 2, 30, "two replies")
            assert gateway.terminate() == 0
        finally:
            gateway.stop()
        client = dovecot.client(BOT)
        client.remove_flags([2], [b"\\Seen"])  # type: ignore[attr-defined]
        client.logout()  # type: ignore[attr-defined]
        dovecot.renumber(BOT)
        dovecot.append(BOT, person_mail(ALICE, "question 3", message_id="<q3@x.org>"))
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_readyz(gateway.wait_ready())
            wait_until(lambda: len(smtp.accepted) >= 3, 30, "the third reply")
            gateway.wait_for_line("was renumbered", timeout=5)
            time.sleep(1.5)
            assert gateway.terminate() == 0
        finally:
            gateway.stop()
        # Two threads (each mail starts one) are answered side by side: any order.
        answered = sorted(plain(a.message) for a in smtp.accepted)
        assert answered == [
            "echo: Subject: note\n\nquestion 1",
            "echo: Subject: note\n\nquestion 2",
            "echo: Subject: note\n\nquestion 3",
        ]
        assert all(b"\\Seen" in flags for _, flags, _ in dovecot.messages(BOT))


@pytest.mark.timeout(180)
def test_a_stranger_pairs_by_a_code_sent_by_mail(tmp_path: Path) -> None:
    """`dm_policy = "pairing"`: a stranger's first mail is answered with a pairing code
    (threaded under it, like any reply); once the operator approves the code, their mail
    reaches the assistant."""
    import re
    import subprocess
    import sys

    workspace = tmp_path / "ws"
    with (
        running_dovecot(USERS) as dovecot,
        running_smtp(USERS, dovecot=dovecot) as smtp,
        FakeOpenAI.in_thread() as llm,
    ):
        env = email_env(workspace, llm, dovecot, smtp, allow_from=[]) | {
            "GATEWAY_CHANNELS__EMAIL__DM_POLICY": "pairing"
        }
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_readyz(gateway.wait_ready())
            dovecot.append(BOT, person_mail(CAROL, "hello?", message_id="<p1@stranger.example>"))
            wait_until(lambda: len(inbox(dovecot, CAROL)) == 1, 30, "the pairing code")
            (challenge,) = inbox(dovecot, CAROL)
            assert challenge["In-Reply-To"] == "<p1@stranger.example>"
            found = re.search(r"pairing code is ([A-Z0-9]{8})", plain(challenge))
            assert found, plain(challenge)
            approve = subprocess.run(
                [sys.executable, "-m", "gateway.cli", "pairing", "approve", "email", found[1]],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert approve.returncode == 0, approve.stderr
            assert f"Approved {CAROL}" in approve.stdout
            dovecot.append(
                BOT,
                person_mail(
                    CAROL,
                    "hello again",
                    message_id="<p2@stranger.example>",
                    references="<p1@stranger.example>",
                ),
            )
            wait_until(lambda: len(inbox(dovecot, CAROL)) == 2, 30, "the answer")
            assert plain(inbox(dovecot, CAROL)[1]) == "echo: hello again"
            assert gateway.terminate() == 0
        finally:
            gateway.stop()


@pytest.mark.timeout(180)
def test_a_photo_and_a_pdf_by_mail_reach_the_model(tmp_path: Path) -> None:
    """Attachments are the message's media: the image goes to the (vision) model as an
    image, the PDF as its text; both fetched from the mailbox when the turn starts."""
    from tests.media_files import pdf, png

    workspace = tmp_path / "ws"
    with (
        running_dovecot(USERS) as dovecot,
        running_smtp(USERS, dovecot=dovecot) as smtp,
        FakeOpenAI.in_thread() as llm,
    ):
        env = email_env(workspace, llm, dovecot, smtp)
        gateway = GatewayProcess(env, tmp_path)
        try:
            gateway.wait_readyz(gateway.wait_ready())
            msg = EmailMessage()
            msg["From"] = ALICE
            msg["To"] = BOT
            msg["Subject"] = "files"
            msg["Message-ID"] = "<f1@example.org>"
            msg.set_content("What is in these?")
            msg.add_attachment(png(64, 48), maintype="image", subtype="png", filename="a.png")
            msg.add_attachment(
                pdf("The quarterly figures are up."),
                maintype="application",
                subtype="pdf",
                filename="report.pdf",
            )
            dovecot.append(BOT, msg.as_bytes())
            wait_until(lambda: len(smtp.accepted) == 1, 60, "the answer")
            answer = plain(smtp.accepted[0].message)
            assert answer.startswith("echo: Subject: files\n\nWhat is in these?")
            assert "[image 64x48 png]" in answer
            (request,) = llm.chat_requests
            assert "The quarterly figures are up." in json.dumps(request.body)
            assert gateway.terminate() == 0
        finally:
            gateway.stop()
