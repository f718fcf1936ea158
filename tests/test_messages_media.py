"""Attachments on inbound messages and files on replies survive the journal and the outbox."""

from __future__ import annotations

import json

from gateway.messages import Attachment, InboundMessage, OutboundFile, OutboundMessage, reply_for


def test_inbound_attachments_round_trip_through_json() -> None:
    photo = Attachment("image", "AgAC1", name="cat.jpg", mime_type="image/jpeg", size=1234)
    memo = Attachment("voice", "F0VOICE", url="http://127.0.0.1/files-pri/T-F0VOICE/memo.ogg")
    inbound = InboundMessage("telegram", "42", "look", attachments=(photo, memo))
    back = InboundMessage.from_dict(json.loads(json.dumps(inbound.to_dict())))
    assert back.attachments == (photo, memo)
    assert back == inbound


def test_a_journal_record_without_attachments_still_reads() -> None:
    record = InboundMessage("telegram", "42", "hi").to_dict()
    assert "attachments" not in record  # old readers see the record they know
    assert InboundMessage.from_dict(record).attachments == ()


def test_reply_files_round_trip_with_their_bytes() -> None:
    inbound = InboundMessage("slack", "D0AB", "code please", message_id="E1")
    blob = bytes(range(256))
    file = OutboundFile("plot.png", blob, mime_type="image/png", caption="the plot")
    reply = reply_for(inbound, "here", files=(file,))
    back = OutboundMessage.from_dict(json.loads(json.dumps(reply.to_dict())))
    assert back.files == (file,)
    assert back.files[0].data == blob and back.files[0].is_image
    assert not OutboundFile("a.py", b"x", mime_type="text/x-python").is_image
