"""The Matrix channel's pure parts: the formatter (Markdown to `formatted_body`, split
under the event size limit), the translation of timeline events, and the cursor file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from channels.matrix import Identity, Notice, RoomFacts, Skip, parse_target, translate_event
from channels.matrix.format import (
    MAX_CONTENT_BYTES,
    content_bytes,
    edit_content,
    markdown_to_html,
    notice_content,
    split_reply,
    strip_reply_fallback,
    text_content,
)
from gateway.config import ConfigError, load_settings
from gateway.journal.cursors import FileCursorStore
from gateway.messages import (
    META_EDIT_OF,
    META_IS_GROUP,
    META_MENTIONED,
    META_QUOTED_TEXT,
    META_REPLY_TO_BOT,
)

ME = Identity("@bot:example.org", "Gateway")
DM = RoomFacts(member_count=2, names={"@alice:example.org": "Alice"})
GROUP = RoomFacts(member_count=3, names={"@alice:example.org": "Alice"})
ROOM = "!room:example.org"


def event(
    content: dict[str, Any], sender: str = "@alice:example.org", eid: str = "$e1"
) -> dict[str, Any]:
    return {
        "type": "m.room.message",
        "sender": sender,
        "event_id": eid,
        "origin_server_ts": 1_700_000_000_000,
        "content": content,
    }


def test_what_the_bot_writes_mentions_nobody_so_at_room_pings_nobody() -> None:
    """With `m.mentions` (Matrix 1.7, intentional mentions) the homeserver no longer
    reads the body for a display name or "@room": the bot notifies only whom it names."""
    text = text_content("Tell @room")
    assert text["m.mentions"] == {}
    assert notice_content("Ask @room")["m.mentions"] == {}
    edit = edit_content("$shown", text)
    assert edit["m.mentions"] == {} and edit["m.new_content"]["m.mentions"] == {}


def test_markdown_becomes_matrix_html_with_the_models_html_escaped() -> None:
    assert markdown_to_html("Hello **Alice**!") == "Hello <strong>Alice</strong>!"
    assert markdown_to_html("~~gone~~") == "<del>gone</del>"
    html = markdown_to_html("<script>alert(1)</script> [x](javascript:alert(1))")
    assert "<script>" not in html and "&lt;script&gt;" in html and "href" not in html
    assert "<br />" in markdown_to_html("one\ntwo")
    assert '<code class="language-py">' in markdown_to_html("```py\nx = 1\n```")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('ab &<>"*_`\n#|-\x01é😀')), max_size=60_000))
def test_every_piece_fits_the_event_limit_and_none_is_lost(text: str) -> None:
    pieces = split_reply(text)
    for piece in pieces:
        assert piece.strip()
        assert content_bytes(text_content(piece)) <= MAX_CONTENT_BYTES
    assert "".join("".join(pieces).split()) == "".join(text.split()) or "```" in text


def test_markup_heavy_text_is_split_smaller_to_fit() -> None:
    text = "\n".join(f"| `<{i}>` | **&&** |" for i in range(4000))
    pieces = split_reply(text)
    assert len(pieces) > 1
    assert all(content_bytes(text_content(p)) <= MAX_CONTENT_BYTES for p in pieces)


def test_a_reply_fallback_is_cut_from_the_body() -> None:
    assert strip_reply_fallback("> <@a:b> quoted\n> more\n\nmy answer") == "my answer"
    assert strip_reply_fallback("> a quote I wrote") == "> a quote I wrote"


def test_a_direct_message_is_translated_with_its_sender() -> None:
    message = translate_event(ROOM, event({"msgtype": "m.text", "body": "hi"}), me=ME, facts=DM)
    assert not isinstance(message, Skip | Notice)
    assert message.session_key == f"matrix:{ROOM}"
    assert message.message_id == "$e1" and message.text == "hi"
    assert message.metadata[META_IS_GROUP] is False
    assert message.metadata["sender_name"] == "Alice (@alice:example.org)"


def test_mentions_in_a_group_are_found_and_cut() -> None:
    for content in (
        {"msgtype": "m.text", "body": "Gateway: what now?"},
        {"msgtype": "m.text", "body": "what now?", "m.mentions": {"user_ids": [ME.user_id]}},
        {
            "msgtype": "m.text",
            "body": "Gateway what now?",
            "formatted_body": '<a href="https://matrix.to/#/@bot:example.org">Gateway</a> hm',
        },
    ):
        message = translate_event(ROOM, event(content), me=ME, facts=GROUP)
        assert not isinstance(message, Skip | Notice)
        assert message.metadata[META_MENTIONED] is True, content
        assert message.metadata[META_IS_GROUP] is True
    plain = translate_event(ROOM, event({"msgtype": "m.text", "body": "chat"}), me=ME, facts=GROUP)
    assert not isinstance(plain, Skip | Notice) and plain.metadata[META_MENTIONED] is False


def test_a_reply_to_the_bot_carries_the_quoted_text_in_groups() -> None:
    mine = event({"msgtype": "m.text", "body": "the answer"}, sender=ME.user_id, eid="$mine")
    reply = event(
        {
            "msgtype": "m.text",
            "body": "> <@bot:example.org> the answer\n\nwhy?",
            "m.relates_to": {"m.in_reply_to": {"event_id": "$mine"}},
        }
    )
    message = translate_event(ROOM, reply, me=ME, facts=GROUP, related=mine)
    assert not isinstance(message, Skip | Notice)
    assert message.text == "why?"
    assert message.metadata[META_REPLY_TO_BOT] is True
    assert message.metadata[META_QUOTED_TEXT] == "the answer"


def test_threads_edits_own_events_and_notices() -> None:
    threaded = event(
        {
            "msgtype": "m.text",
            "body": "in thread",
            "m.relates_to": {
                "rel_type": "m.thread",
                "event_id": "$root",
                "is_falling_back": True,
                "m.in_reply_to": {"event_id": "$root"},
            },
        }
    )
    message = translate_event(ROOM, threaded, me=ME, facts=DM)
    assert not isinstance(message, Skip | Notice)
    assert message.session_key == f"matrix:{ROOM}:thread:$root"
    edit = event(
        {
            "msgtype": "m.text",
            "body": "* fixed",
            "m.new_content": {"msgtype": "m.text", "body": "fixed"},
            "m.relates_to": {"rel_type": "m.replace", "event_id": "$orig"},
        },
        eid="$edit",
    )
    edited = translate_event(ROOM, edit, me=ME, facts=DM)
    assert not isinstance(edited, Skip | Notice)
    assert edited.text == "fixed" and edited.metadata[META_EDIT_OF] == "$orig"
    assert edited.message_id == "$edit"
    own = event({"msgtype": "m.text", "body": "me"}, sender=ME.user_id)
    assert isinstance(translate_event(ROOM, own, me=ME, facts=DM), Skip)
    notice = event({"msgtype": "m.notice", "body": "another bot"})
    assert isinstance(translate_event(ROOM, notice, me=ME, facts=DM), Skip)
    video = event({"msgtype": "m.video", "body": "clip.mp4", "url": "mxc://s/v"})
    assert isinstance(translate_event(ROOM, video, me=ME, facts=DM), Notice)
    assert isinstance(translate_event(ROOM, video, me=ME, facts=GROUP), Skip)


def test_files_become_attachments_with_their_caption() -> None:
    image = event(
        {
            "msgtype": "m.image",
            "body": "what is this?",
            "filename": "cat.png",
            "url": "mxc://example.org/abc",
            "info": {"mimetype": "image/png", "size": 123},
        }
    )
    message = translate_event(ROOM, image, me=ME, facts=DM)
    assert not isinstance(message, Skip | Notice)
    [attachment] = message.attachments
    assert (attachment.kind, attachment.file_id, attachment.name) == (
        "image",
        "mxc://example.org/abc",
        "cat.png",
    )
    assert message.text == "what is this?"


def test_targets_name_a_thread_in_the_chat_id() -> None:
    assert parse_target("!r:s:thread:$ev") == ("!r:s", "$ev")
    assert parse_target("!r:s", "$t") == ("!r:s", "$t")
    assert parse_target("!r:s") == ("!r:s", None)


def test_the_cursor_file_survives_a_reload_and_a_damaged_one_is_moved_aside(
    tmp_path: Path,
) -> None:
    store = FileCursorStore(tmp_path / "channel-cursors.json")
    assert anyio.run(store.load, "matrix:@bot:s") is None
    anyio.run(store.save, "matrix:@bot:s", "s1_2")
    assert anyio.run(FileCursorStore(store.path).load, "matrix:@bot:s") == "s1_2"
    assert json.loads(store.path.read_text()) == {"matrix:@bot:s": "s1_2"}
    store.path.write_text("{not json")
    assert anyio.run(store.load, "matrix:@bot:s") is None
    assert list(tmp_path.glob("channel-cursors.json.damaged.*"))


def test_the_access_token_is_refused_in_the_file_and_read_from_a_file(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('[channels.matrix]\naccess_token = "syt_secret"\n')
    with pytest.raises(ConfigError, match="GATEWAY_CHANNELS__MATRIX__ACCESS_TOKEN"):
        load_settings(config, environ={})
    secret = tmp_path / "token"
    secret.write_text("syt_from_file\n")
    config.write_text(f'[channels.matrix]\naccess_token_file = "{secret}"\n')
    assert load_settings(config, environ={}).channels.matrix.resolved_token() == "syt_from_file"
    with pytest.raises(ConfigError, match="user_id"):
        load_settings(None, environ={"GATEWAY_CHANNELS__MATRIX__USER_ID": "gateway"})


def test_channel_blobs_are_private_files_whose_names_never_leave_their_folder(
    tmp_path: Path,
) -> None:
    import stat

    store = FileCursorStore(tmp_path / "channel-cursors.json")
    name = "matrix-crypto:@bot:s:../../etc/DEV"
    assert anyio.run(store.load_blob, name) is None
    anyio.run(store.save_blob, name, b"\x00state")
    path = store.blob_path(name)
    assert path.parent == tmp_path / "channel-state" and path.read_bytes() == b"\x00state"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert anyio.run(store.load_blob, name) == b"\x00state"
    assert store.blob_path("a:b") != store.blob_path("a_b")


def test_an_encrypted_files_reference_carries_its_key_and_a_changed_file_is_refused() -> None:
    from channels.matrix.channel import file_attachment
    from channels.matrix.crypto import decrypt_file, encrypt_file, split_file_id

    ciphertext, keys = encrypt_file(b"PLUM")
    attachment = file_attachment(
        {
            "msgtype": "m.file",
            "body": "note.txt",
            "file": {"url": "mxc://s/abc", **keys},
            "info": {"mimetype": "text/plain", "size": 4},
        }
    )
    assert attachment is not None and attachment.file_id.startswith("mxc://s/abc#e2e=")
    url, secret = split_file_id(attachment.file_id)
    assert url == "mxc://s/abc" and secret is not None
    assert decrypt_file(ciphertext, secret) == b"PLUM"
    with pytest.raises(ValueError, match="SHA-256"):
        decrypt_file(ciphertext[:-1] + bytes([ciphertext[-1] ^ 1]), secret)
    assert split_file_id("mxc://s/plain") == ("mxc://s/plain", None)
    assert file_attachment({"msgtype": "m.file", "body": "x", "file": {"url": "mxc://s/a"}}) is None
