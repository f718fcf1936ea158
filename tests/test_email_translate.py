"""What the email channel makes of a mail and of a reply, without servers: which mail is
answered (machines, loops, authentication), its session key and text, its files, the
reply's headers, and who may write (channels.email.{channel,headers}, gateway.access)."""

from __future__ import annotations

from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.email.channel import (
    Skip,
    attachment_bytes,
    attachment_parts,
    compose_reply,
    parse_file_id,
    reply_message_id,
    translate_mail,
)
from channels.email.headers import (
    automated,
    parse_authentication_results,
    sender_of,
    thread_root,
)
from channels.email.settings import EmailSettings
from gateway.access.policy import Allow, Deny, Ignore, decide
from gateway.config import load_settings
from gateway.daemon import access_policies
from gateway.messages import META_REPLY_CONTEXT, InboundMessage, OutboundFile, reply_for

SETTINGS = EmailSettings.model_validate(
    {"address": "Bot@Example.org", "imap_host": "imap.example.org", "smtp_host": "smtp.x"}
)


def mail(
    body: str = "Hello there",
    *,
    sender: str = "Alice <alice@example.com>",
    subject: str = "Plans",
    message_id: str | None = "<m1@example.com>",
    headers: dict[str, str] | None = None,
    html: str | None = None,
    files: list[tuple[str, str, bytes]] | None = None,
) -> bytes:
    msg = EmailMessage()
    msg["From"] = sender
    msg["To"] = "bot@example.org"
    msg["Subject"] = subject
    msg["Date"] = "Tue, 03 Mar 2026 09:12:00 +0000"
    if message_id:
        msg["Message-ID"] = message_id
    for name, value in (headers or {}).items():
        msg[name] = value
    msg.set_content(body)
    if html is not None:
        msg.add_alternative(html, subtype="html")
    for name, mime, data in files or ():
        main, _, sub = mime.partition("/")
        msg.add_attachment(data, maintype=main, subtype=sub, filename=name)
    return msg.as_bytes()


def translate(raw: bytes, settings: EmailSettings = SETTINGS, **kw: Any) -> InboundMessage:
    result = translate_mail(raw, uidvalidity=7, uid=42, settings=settings, **kw)
    assert isinstance(result, InboundMessage), result
    return result


def skipped(raw: bytes, settings: EmailSettings = SETTINGS) -> str:
    result = translate_mail(raw, uidvalidity=7, uid=42, settings=settings)
    assert isinstance(result, Skip), result
    return result.reason


# -- keys and text ---------------------------------------------------------------------


def test_a_new_mail_starts_a_thread_named_by_its_message_id() -> None:
    msg = translate(mail("Lunch on Friday?\n\n-- \nAlice"))
    assert msg.session_key == "email:alice@example.com:thread:m1@example.com"
    assert msg.sender_id == msg.chat_id == "alice@example.com"
    assert msg.message_id == "<m1@example.com>"
    assert msg.text == "Subject: Plans\n\nLunch on Friday?"
    assert msg.metadata[META_REPLY_CONTEXT] == {
        "subject": "Plans",
        "references": ["<m1@example.com>"],
    }
    assert msg.metadata["sender_name"] == "Alice <alice@example.com>"
    assert msg.metadata["sent_at"] == 1772529120.0


def test_a_reply_joins_the_thread_of_its_root_without_the_subject() -> None:
    raw = mail(
        "Friday works.\n\nOn Mon, Bot <bot@example.org> wrote:\n> Lunch?\n",
        subject="Re: Plans",
        message_id="<m3@example.com>",
        headers={
            "In-Reply-To": "<gw.1@example.org>",
            "References": "<m1@example.com> <gw.1@example.org>",
        },
    )
    msg = translate(raw)
    assert msg.session_key == "email:alice@example.com:thread:m1@example.com"
    assert msg.text == "Friday works."
    assert msg.metadata[META_REPLY_CONTEXT]["references"] == [
        "<m1@example.com>",
        "<gw.1@example.org>",
        "<m3@example.com>",
    ]


def test_a_command_stays_first_without_the_subject() -> None:
    assert translate(mail("/new\n\n-- \nAlice")).text == "/new"


def test_without_threads_one_conversation_per_correspondent() -> None:
    settings = SETTINGS.model_copy(update={"threads": False})
    assert translate(mail(), settings).session_key == "email:alice@example.com"


def test_a_long_root_id_is_hashed_into_the_key() -> None:
    long_id = "<" + "x" * 250 + "@example.com>"
    msg = translate(mail(message_id=long_id))
    assert msg.thread_id is not None and msg.thread_id.startswith("h")
    assert len(msg.thread_id) == 17
    assert thread_root(BytesParser(policy=policy.default).parsebytes(mail(message_id=long_id)))


def test_without_message_id_the_journal_key_is_where_it_was_read() -> None:
    msg = translate(mail(message_id=None))
    assert msg.message_id == "uid:7:42"
    assert msg.session_key == "email:alice@example.com"


def test_html_only_mail_is_read_as_text() -> None:
    msg = EmailMessage()
    msg["From"] = "alice@example.com"
    msg["Subject"] = "Q"
    msg["Message-ID"] = "<h1@example.com>"
    msg.set_content("<p>Is it <b>done</b>?</p><div class='gmail_quote'>old</div>", subtype="html")
    assert translate(msg.as_bytes()).text == "Subject: Q\n\nIs it done?"


def test_a_mail_too_large_is_answered_from_its_subject() -> None:
    msg = translate(mail(), whole=False, size=40 * 2**20)
    assert "40.0 MB" in msg.text and msg.text.startswith("Subject: Plans")
    assert msg.attachments == ()


def test_files_become_attachments_found_again_by_index() -> None:
    raw = mail(
        "See attached",
        files=[
            ("photo.png", "image/png", b"\x89PNG fake"),
            ("notes.txt", "text/plain", b"some notes"),
            ("memo.ogg", "audio/ogg", b"OggS"),
        ],
        headers={},
    )
    msg = translate(raw)
    kinds = [(a.kind, a.name, a.mime_type, a.size) for a in msg.attachments]
    assert kinds == [
        ("image", "photo.png", "image/png", 9),
        ("document", "notes.txt", "text/plain", 10),
        ("voice", "memo.ogg", "audio/ogg", 4),
    ]
    assert parse_file_id(msg.attachments[1].file_id) == (7, 42, 1, "<m1@example.com>")
    parsed = BytesParser(policy=policy.default).parsebytes(raw)
    assert attachment_bytes(attachment_parts(parsed)[1]) == b"some notes"  # type: ignore[arg-type]


def test_an_empty_reply_is_not_answered() -> None:
    raw = mail("> only a quote\n", headers={"In-Reply-To": "<m0@example.com>"})
    assert translate(raw).text == "> only a quote"
    empty = mail("", headers={"In-Reply-To": "<m0@example.com>"}, subject="")
    assert skipped(empty) == "an empty mail"


def test_an_unknown_charset_is_read_as_utf8() -> None:
    raw = (
        b"From: alice@example.com\nMessage-ID: <u@example.com>\nSubject: s\n"
        b'Content-Type: text/plain; charset="unknown-8bit"\n\nGr\xc3\xbc\xc3\x9fe\n'
    )
    assert translate(raw).text == "Subject: s\n\nGrüße"


def test_an_encoded_subject_and_sender_name_are_decoded() -> None:
    raw = mail(subject="Grüße aus Köln", sender="Jörg Müller <joerg@example.com>")
    assert b"=?utf-8?" in raw
    msg = translate(raw)
    assert msg.text.startswith("Subject: Grüße aus Köln\n\n")
    assert msg.metadata["sender_name"] == "Jörg Müller <joerg@example.com>"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_no_mail_makes_translation_raise(data: st.DataObject) -> None:
    """Whatever bytes arrive, the mail is answered or skipped with a reason: a mail that
    raised would stop the mailbox at every start."""
    raw = bytearray(
        mail(
            "Hi",
            html="<p>Hi</p>",
            files=[("a.txt", "text/plain", b"x")],
            headers={"References": "<a@b> <c@d>"},
        )
    )
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at : at + 1] = data.draw(st.binary(min_size=0, max_size=3))
    result = translate_mail(bytes(raw), uidvalidity=7, uid=42, settings=SETTINGS)
    assert isinstance(result, InboundMessage | Skip)


# -- never answered --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "sender", "reason"),
    [
        ({"Auto-Submitted": "auto-replied"}, None, "Auto-Submitted"),
        ({"Auto-Submitted": "auto-generated; owner-email=x@y"}, None, "Auto-Submitted"),
        ({"Precedence": "bulk"}, None, "Precedence"),
        ({"Precedence": "list"}, None, "Precedence"),
        ({"List-Id": "<news.example.com>"}, None, "mailing list"),
        ({"List-Unsubscribe": "<mailto:u@example.com>"}, None, "mailing list"),
        ({"Return-Path": "<>"}, None, "bounce"),
        ({}, "MAILER-DAEMON@example.com", "bounce"),
        ({}, "postmaster@example.com", "bounce"),
        ({"X-Autoreply": "yes"}, None, "auto-responder"),
        ({"X-Auto-Response-Suppress": "OOF, AutoReply"}, None, "no automatic replies"),
        ({}, "no-reply@shop.example", "no-reply"),
        ({}, "Bot <BOT@example.org>", "own address"),
    ],
)
def test_machines_and_the_gateway_itself_are_never_answered(
    headers: dict[str, str], sender: str | None, reason: str
) -> None:
    raw = mail(headers=headers, sender=sender or "Alice <alice@example.com>")
    assert reason in skipped(raw)


def test_auto_submitted_no_is_a_person() -> None:
    assert translate(mail(headers={"Auto-Submitted": "no"})).text


def test_an_alias_listed_as_own_is_never_answered() -> None:
    settings = SETTINGS.model_copy(update={"own_addresses": ["Help@Example.org"]})
    assert "own address" in skipped(mail(sender="help@example.org"), settings)


def test_a_reply_the_gateway_sent_is_not_answered_by_another_gateway() -> None:
    """Two gateways writing to each other stop at the first reply: it carries
    Auto-Submitted, which the other one never answers."""
    inbound = translate(mail(sender="other-bot@elsewhere.example"))
    reply = compose_reply(reply_for(inbound, "hi"), SETTINGS, now=0)
    msg = BytesParser(policy=policy.default).parsebytes(reply.as_bytes())
    sender = sender_of(msg)
    assert sender is not None
    assert automated(msg, sender, frozenset({"other-bot@elsewhere.example"})) is not None
    assert "Auto-Submitted" in (automated(msg, sender, frozenset()) or "")


def test_a_delivery_report_is_not_answered() -> None:
    report = EmailMessage()
    report["From"] = "Mail System <system@example.com>"
    report["Message-ID"] = "<r@example.com>"
    report.set_content("delivery failed")
    report.make_mixed()
    report.replace_header("Content-Type", 'multipart/report; report-type="delivery-status"')
    assert "report" in skipped(report.as_bytes())


# -- authentication --------------------------------------------------------------------

AUTH = SETTINGS.model_copy(
    update={"require_auth": ["dmarc", "dkim"], "authserv_id": "mx.example.org"}
)


def test_passing_aligned_results_of_our_server_are_accepted() -> None:
    results = (
        "mx.example.org; dkim=pass header.d=example.com header.s=s1 (good signature); "
        "spf=pass smtp.mailfrom=alice@example.com; dmarc=pass (p=reject) header.from=example.com"
    )
    assert translate(mail(headers={"Authentication-Results": results}), AUTH).text


def test_results_written_by_anyone_else_do_not_count() -> None:
    forged = "evil.example; dkim=pass header.d=example.com; dmarc=pass header.from=example.com"
    assert "no Authentication-Results from mx.example.org" in skipped(
        mail(headers={"Authentication-Results": forged}), AUTH
    )


def test_a_signature_of_another_domain_does_not_prove_the_sender() -> None:
    results = (
        "mx.example.org; dkim=pass header.d=mailer.example; dmarc=pass header.from=example.com"
    )
    assert "dkim did not pass for example.com" in skipped(
        mail(headers={"Authentication-Results": results}), AUTH
    )


def test_failing_dmarc_is_refused_and_a_parent_domain_signature_aligns() -> None:
    failing = "mx.example.org; dkim=pass header.d=example.com; dmarc=fail header.from=example.com"
    assert "dmarc did not pass" in skipped(mail(headers={"Authentication-Results": failing}), AUTH)
    parent = (
        "mx.example.org; dkim=pass header.d=example.com; dmarc=pass header.from=mail.example.com"
    )
    sub = mail(sender="alice@mail.example.com", headers={"Authentication-Results": parent})
    assert translate(sub, AUTH).sender_id == "alice@mail.example.com"


def test_authentication_results_parsing_handles_comments_and_quotes() -> None:
    serv, results = parse_authentication_results(
        "mx.example.org 1; spf=pass (sender ip is 1.2.3.4 (nested)) smtp.mailfrom=a@b.c; "
        'dkim=fail reason="bad; sig" header.d=b.c'
    )
    assert serv == "mx.example.org"
    assert [(r.method, r.result) for r in results] == [("spf", "pass"), ("dkim", "fail")]
    assert results[1].properties["header.d"] == "b.c"


def test_require_auth_without_authserv_id_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="authserv_id"):
        EmailSettings.model_validate({"require_auth": ["dmarc"]})


# -- the reply -------------------------------------------------------------------------


def test_the_reply_threads_under_the_message_with_plain_and_html_parts() -> None:
    inbound = translate(
        mail(
            "Question",
            subject="Re: Plans",
            message_id="<m3@example.com>",
            headers={"References": "<m1@example.com> <gw.1@example.org>"},
        )
    )
    files = (OutboundFile("chart.png", b"\x89PNG", "image/png"),)
    reply = compose_reply(reply_for(inbound, "**Yes**, Friday.", files=files), SETTINGS, now=0)
    assert reply["To"] == "alice@example.com"
    assert reply["From"] == "bot@example.org"
    assert reply["Subject"] == "Re: Plans"
    assert reply["In-Reply-To"] == "<m3@example.com>"
    assert reply["References"] == "<m1@example.com> <gw.1@example.org> <m3@example.com>"
    assert reply["Auto-Submitted"] == "auto-replied"
    assert reply["X-Auto-Response-Suppress"] == "All"
    assert reply.get_body(preferencelist=("plain",)).get_content().strip() == "**Yes**, Friday."  # type: ignore[union-attr]
    html = reply.get_body(preferencelist=("html",)).get_content()  # type: ignore[union-attr]
    assert "<strong>Yes</strong>, Friday." in html
    attached = list(reply.iter_attachments())
    assert [(a.get_filename(), a.get_content_type()) for a in attached] == [
        ("chart.png", "image/png")
    ]


def test_a_message_nobody_asked_for_is_auto_generated_with_a_subject_of_its_own() -> None:
    from gateway.messages import OutboundMessage

    out = OutboundMessage("email", "alice@example.com", "Daily note", "email:alice@example.com")
    mail_out = compose_reply(out, SETTINGS.model_copy(update={"from_name": "Assistant"}), now=0)
    assert mail_out["Auto-Submitted"] == "auto-generated"
    assert mail_out["In-Reply-To"] is None
    assert mail_out["Subject"] == "A message from your assistant"
    assert mail_out["From"] == "Assistant <bot@example.org>"


def test_the_same_reply_gets_the_same_message_id() -> None:
    inbound = translate(mail())
    first = reply_for(inbound, "Answer")
    assert reply_message_id(first, "example.org") == reply_message_id(first, "example.org")
    assert reply_message_id(first, "example.org") != reply_message_id(
        reply_for(inbound, "Other answer"), "example.org"
    )


# -- who may write ---------------------------------------------------------------------


def test_allow_from_takes_addresses_and_domains_and_refuses_silently(tmp_path: Any) -> None:
    settings = load_settings(
        environ={
            "GATEWAY_WORKSPACE": str(tmp_path),
            "GATEWAY_CHANNELS__EMAIL__ALLOW_FROM": (
                '["Boss@Corp.example", "example.com", "@team.example"]'
            ),
        }
    )
    policy_ = access_policies(settings)["email"]
    assert policy_.dm_policy == "allowlist"
    from gateway.access.protocol import EMPTY_STATE

    def verdict(address: str) -> object:
        msg = InboundMessage("email", address, "hi", sender_id=address)
        return decide(msg, policy_, EMPTY_STATE, 0.0)

    assert isinstance(verdict("boss@corp.example"), Allow)
    assert isinstance(verdict("anyone@example.com"), Allow)
    assert isinstance(verdict("x@team.example"), Allow)
    assert isinstance(verdict("x@sub.example.com"), Ignore)  # a domain, not its subdomains
    assert isinstance(verdict("other@corp.example"), Ignore)
    loud = load_settings(
        environ={
            "GATEWAY_WORKSPACE": str(tmp_path),
            "GATEWAY_CHANNELS__EMAIL__REFUSAL_REPLIES": "true",
        }
    )
    msg = InboundMessage("email", "x@y.example", "hi", sender_id="x@y.example")
    assert isinstance(decide(msg, access_policies(loud)["email"], EMPTY_STATE, 0.0), Deny)


def test_the_password_is_a_secret_refused_in_the_file(tmp_path: Any) -> None:
    from gateway.config import ConfigError

    config = tmp_path / "gateway.toml"
    config.write_text('[channels.email]\npassword = "hunter2"\n')
    with pytest.raises(ConfigError, match="GATEWAY_CHANNELS__EMAIL__PASSWORD"):
        load_settings(config, environ={})
    secret = tmp_path / "pw"
    secret.write_text("hunter2\n")
    config.write_text(f'[channels.email]\npassword_file = "{secret}"\n')
    settings = load_settings(config, environ={})
    assert settings.channels.email.resolved_password() == "hunter2"
    assert settings.channels.email.resolved_smtp_password() == "hunter2"
    assert "hunter2" in settings.secrets()
