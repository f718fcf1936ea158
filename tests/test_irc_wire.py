"""The IRC wire (channels/irc/wire.py): lines parsed and rendered, names folded as the
server compares them, ISUPPORT, SASL PLAIN's payload and the token bucket."""

from __future__ import annotations

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from channels.irc.wire import (
    Casemap,
    ISupport,
    Line,
    TokenBucket,
    ctcp,
    decode,
    parse_source,
    sasl_plain_chunks,
    strip_formatting,
)


def test_a_line_with_tags_source_and_trailing_parameter() -> None:
    line = Line.parse(
        "@msgid=a\\sb;time=2024-01-02T03:04:05.000Z :alice!~a@host PRIVMSG #Team :hi: there"
    )
    assert line.tags == {"msgid": "a b", "time": "2024-01-02T03:04:05.000Z"}
    assert line.source == "alice!~a@host" and line.nick == "alice"
    assert line.command == "PRIVMSG" and line.params == ("#Team", "hi: there")
    assert parse_source(line.source) == ("alice", "~a", "host")
    assert Line.parse("PING :irc.example").params == ("irc.example",)
    assert Line.parse(":srv 005 me CASEMAPPING=ascii :are supported").params[-1] == "are supported"


@given(
    st.text(alphabet=st.characters(blacklist_characters="\r\n\0 :", min_codepoint=33), min_size=1),
    st.text(alphabet=st.characters(blacklist_characters="\r\n\0"), max_size=200),
)
def test_render_then_parse_gives_the_line_back(target: str, text: str) -> None:
    line = Line("PRIVMSG", (target, text))
    assert Line.parse(line.render()).params == (target, text)


@pytest.mark.parametrize("text", ["a\r\nQUIT :bye", "a\nJOIN #x", "a\0b", "\r"])
def test_a_line_never_carries_a_second_command(text: str) -> None:
    with pytest.raises(ValueError, match="CR, LF or NUL"):
        Line("PRIVMSG", ("#team", text)).render()
    with pytest.raises(ValueError):
        Line("PRIVMSG", ("#a b", "x")).render()


def test_names_fold_as_the_server_compares_them() -> None:
    assert Casemap("ascii").fold("Bob[1]") == "bob[1]"
    assert Casemap("rfc1459").fold("Bob[1]~\\") == "bob{1}^|"
    assert Casemap("strict-rfc1459").fold("Bob[1]~") == "bob{1}~"
    assert Casemap("unknown").fold("A[") == "a{"  # the protocol's default
    support = ISupport()
    support.update(("CASEMAPPING=ascii", "CHANTYPES=#&", "NETWORK=Libera.Chat", "LINELEN=1024"))
    assert support.casemap.fold("A[") == "a["
    assert support.network == "Libera.Chat" and support.linelen == 1024
    assert support.is_channel("&local") and not support.is_channel("bob")


def test_formatting_and_ctcp() -> None:
    assert strip_formatting("\x02bold\x02 \x0304,01red\x03 \x1ditalic\x0f") == "bold red italic"
    assert ctcp("\x01ACTION waves\x01") == ("ACTION", "waves")
    assert ctcp("\x01VERSION\x01") == ("VERSION", "")
    assert ctcp("hello") is None
    assert decode("é".encode()) == "é"
    assert decode("é".encode("latin-1")) == "é"  # an old client's Latin-1: kept, not lost


@pytest.mark.parametrize("password_length", [1, 96, 97, 400, 1000])
def test_sasl_plain_payload_in_chunks_of_400_and_a_plus_after_a_full_one(
    password_length: int,
) -> None:
    chunks = sasl_plain_chunks("a" * 100, "p" * password_length)
    assert all(len(chunk) <= 400 for chunk in chunks)
    payload = "".join(c for c in chunks if c != "+")
    assert (
        base64.b64decode(payload)
        == b"a" * 100 + b"\0" + b"a" * 100 + b"\0" + b"p" * password_length
    )
    ends_with_plus = chunks[-1] == "+"
    assert ends_with_plus == (len(payload) % 400 == 0)


def test_the_bucket_lets_a_burst_through_then_one_line_per_interval() -> None:
    bucket = TokenBucket(burst=3, interval=1.0)
    waits = [bucket.take(100.0) for _ in range(3)]
    assert waits == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(1.0)  # the fourth at once waits a second
    assert bucket.take(101.0) == pytest.approx(1.0)  # and the fifth a second after it
    assert bucket.take(110.0) == 0.0  # a quiet while fills it again
    assert [bucket.take(110.0) for _ in range(2)] == [0.0, 0.0]
    assert bucket.take(110.0) > 0
