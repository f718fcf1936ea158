"""The fake IRC server keeps IRCv3's rules for capability negotiation and SASL PLAIN
(tests/fakes/irc_server.py): what the IRC channel's SASL tests rely on, checked with a
bare socket."""

from __future__ import annotations

import base64
import socket
from collections.abc import Iterator

import pytest

from tests.fakes.irc_server import FakeIrc


@pytest.fixture
def fake() -> Iterator[FakeIrc]:
    with FakeIrc.running({"bot": "secret"}) as server:
        yield server


class Bare:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.file = self.sock.makefile("rb")

    def send(self, *lines: str) -> None:
        self.sock.sendall("".join(f"{line}\r\n" for line in lines).encode())

    def read(self) -> str:
        return self.file.readline().decode().rstrip("\r\n")

    def until(self, marker: str) -> list[str]:
        seen = []
        while True:
            line = self.read()
            assert line, f"closed before {marker!r}: {seen}"
            seen.append(line)
            if marker in line:
                return seen


def plain(authzid: str, authcid: str, password: str) -> str:
    return base64.b64encode(f"{authzid}\0{authcid}\0{password}".encode()).decode()


def test_registration_waits_for_cap_end(fake: FakeIrc) -> None:
    client = Bare(fake.port)
    client.send("CAP LS 302", "NICK bot", "USER bot 0 * :Bot")
    first, second = client.read(), client.read()
    assert " LS * :" in first and " LS :" in second  # a list in two lines
    assert "sasl=PLAIN,EXTERNAL" in first + second
    client.send("PING :x")
    assert "PONG" in client.read()  # not registered yet: no 001 came
    client.send("CAP END")
    assert " 001 bot " in client.read()


def test_sasl_plain_logs_in_with_the_right_password_only(fake: FakeIrc) -> None:
    good = Bare(fake.port)
    good.send("CAP LS 302", "NICK bot", "USER bot 0 * :Bot", "CAP REQ :sasl")
    assert " ACK :sasl" in good.until("ACK")[-1]
    good.send("AUTHENTICATE PLAIN")
    assert good.read() == "AUTHENTICATE +"
    good.send(f"AUTHENTICATE {plain('bot', 'bot', 'secret')}")
    lines = good.until(" 903 ")
    assert any(" 900 bot " in line for line in lines)
    bad = Bare(fake.port)
    bad.send("CAP LS 302", "NICK other", "USER o 0 * :O", "CAP REQ :sasl", "AUTHENTICATE PLAIN")
    bad.until("AUTHENTICATE +")
    bad.send(f"AUTHENTICATE {plain('bot', 'bot', 'wrong')}")
    assert " 904 " in bad.read()


def test_a_payload_of_400_bytes_waits_for_a_plus(fake: FakeIrc) -> None:
    fake.accounts["a" * 100] = "p" * 96  # 2 * 100 + 2 + 96 bytes: base64 of exactly 400
    payload = plain("a" * 100, "a" * 100, "p" * 96)
    assert len(payload) == 400
    client = Bare(fake.port)
    client.send("CAP LS 302", "NICK bot", "USER bot 0 * :Bot", "CAP REQ :sasl")
    client.until("ACK")
    client.send("AUTHENTICATE PLAIN")
    client.until("AUTHENTICATE +")
    client.send(f"AUTHENTICATE {payload}", "PING :between")
    assert "PONG" in client.read()  # the exchange is not over: nothing about SASL yet
    client.send("AUTHENTICATE +")
    assert " 903 " in client.until(" 903 ")[-1]


def test_cap_req_of_an_unoffered_capability_is_refused_whole(fake: FakeIrc) -> None:
    client = Bare(fake.port)
    client.send("CAP LS 302", "CAP REQ :sasl no-such-cap")
    assert " NAK :sasl no-such-cap" in client.until("NAK")[-1]


def test_an_unknown_mechanism_is_listed_and_refused(fake: FakeIrc) -> None:
    client = Bare(fake.port)
    client.send("CAP LS 302", "CAP REQ :sasl")
    client.until("ACK")
    client.send("AUTHENTICATE SCRAM-SHA-256")
    assert " 908 " in client.read() and " 904 " in client.read()


def test_tags_reach_only_a_client_that_acknowledged_message_tags(fake: FakeIrc) -> None:
    tagged, bare = Bare(fake.port), Bare(fake.port)
    tagged.send("CAP LS 302", "NICK t", "USER t 0 * :T", "CAP REQ :message-tags", "CAP END")
    bare.send("NICK b", "USER b 0 * :B")
    tagged.until(" 376 ")
    bare.until(" 376 ")
    fake.tell("t", "@msgid=abc :alice!a@h PRIVMSG t :hi")
    fake.tell("b", "@msgid=abc :alice!a@h PRIVMSG b :hi")
    assert tagged.read() == "@msgid=abc :alice!a@h PRIVMSG t :hi"
    assert bare.read() == ":alice!a@h PRIVMSG b :hi"


def test_history_is_read_back_in_batches_by_time_or_after_a_message() -> None:
    with FakeIrc.running({}, history=True, history_limit=2) as fake:
        client = Bare(fake.port)
        client.send(
            "CAP LS 302",
            "NICK bot",
            "USER bot 0 * :Bot",
            "CAP REQ :message-tags batch draft/chathistory",
            "CAP END",
        )
        assert "CHATHISTORY=2" in "".join(client.until(" 376 "))
        client.send("JOIN #room")
        client.until(" 366 ")
        for text in ("a", "b", "c"):
            fake.post("alice", "#room", text)
        fake.post("carol", "bot", "private")
        live = [client.read() for _ in range(4)]
        assert all(line.startswith("@time=") and ";msgid=msg" in line for line in live)
        client.send("CHATHISTORY AFTER #room timestamp=2020-01-01T00:00:00.000Z 10")
        first = client.until("BATCH -")
        assert " BATCH +" in first[0] and first[0].endswith("chathistory #room")
        texts = [line.rsplit(":", 1)[1] for line in first[1:-1]]
        assert texts == ["a", "b"]  # at most history_limit
        assert all(line.startswith("@batch=") for line in first[1:-1])
        last = first[-2].split("msgid=", 1)[1].split(" ", 1)[0]
        client.send(f"CHATHISTORY AFTER #room msgid={last} 10")
        assert [line.rsplit(":", 1)[1] for line in client.until("BATCH -")[1:-1]] == ["c"]
        client.send(
            "CHATHISTORY TARGETS timestamp=2020-01-01T00:00:00.000Z "
            "timestamp=2100-01-01T00:00:00.000Z 10"
        )
        targets = client.until("BATCH -")
        assert any(" CHATHISTORY TARGETS carol " in line for line in targets)
        assert any(" CHATHISTORY TARGETS #room " in line for line in targets)
