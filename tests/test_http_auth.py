"""Binding policy, bearer tokens and the chat API's request parsing, as pure functions."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from gateway.config import ConfigError
from gateway.http.auth import (
    BearerCheck,
    HttpConfigError,
    check_bearer,
    check_bind_policy,
    is_loopback,
    secret_value,
    www_authenticate,
)
from gateway.http.chat_api import (
    MAX_NAME_CHARS,
    ApiError,
    ChatRequest,
    parse_chat_request,
    reply_body,
)
from gateway.http.namespace import CHAT_CALLER, SessionRefused, resolve_session
from gateway.messages import OutboundMessage
from gateway.sessions.keys import encode_key


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)
    check_bind_policy(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.168.1.10", "gateway.example.com"])
def test_non_loopback_bind_needs_a_token(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(HttpConfigError) as raised:
        check_bind_policy(host, None)
    message = str(raised.value)
    assert "http.host" in message and "GATEWAY_HTTP__TOKEN" in message
    assert "\n" not in message
    assert isinstance(raised.value, ConfigError)  # the CLI maps it to exit code 78
    check_bind_policy(host, "a-long-random-token")


def test_secret_value_treats_empty_as_unset() -> None:
    assert secret_value(None) is None
    assert secret_value(SecretStr("")) is None
    assert secret_value("") is None
    assert secret_value(SecretStr("abc")) == "abc"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, BearerCheck.MISSING),
        ("", BearerCheck.MISSING),
        ("Bearer", BearerCheck.MISSING),
        ("Bearer   ", BearerCheck.MISSING),
        ("Basic dXNlcjpwYXNz", BearerCheck.MISSING),
        ("Bearer s3cret", BearerCheck.OK),
        ("bearer s3cret", BearerCheck.OK),
        ("Bearer s3cret-not", BearerCheck.INVALID),
        ("Bearer s3cre", BearerCheck.INVALID),
        ("Bearer sécret", BearerCheck.INVALID),  # non-ASCII compares as bytes, no TypeError
    ],
)
def test_bearer_check(header: str | None, expected: BearerCheck) -> None:
    assert check_bearer(header, "s3cret") is expected


def test_www_authenticate_says_why() -> None:
    assert www_authenticate(BearerCheck.MISSING) == 'Bearer realm="gateway"'
    assert 'error="invalid_token"' in www_authenticate(BearerCheck.INVALID)


# --------------------------------------------------------------------------- session keys


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("work", "api:work"),
        ("api:work", "api:work"),
        ("api:default:b", "api:default:b"),  # the token's own /v1 session
        ("my notes", "api:my notes"),
        ("api:my notes: monday", "api:my notes: monday"),  # no client's form
        ("x" * MAX_NAME_CHARS, "api:" + "x" * MAX_NAME_CHARS),
        ("api:" + "é" * 32, "api:" + "é" * 32),  # 2 UTF-8 bytes, 6 file-name bytes each
    ],
)
def test_api_session_keys(raw: str, key: str) -> None:
    assert resolve_session(CHAT_CALLER, raw) == key
    encode_key(key)  # the session it names can be stored


@pytest.mark.parametrize(
    "raw", ["x" * (MAX_NAME_CHARS + 1), "x" * 200, "api:" + "x" * 200, "api:" + "é" * 33]
)
def test_a_session_name_too_long_to_store_is_refused_with_the_limit(raw: str) -> None:
    assert MAX_NAME_CHARS == 194
    with pytest.raises(SessionRefused) as raised:
        resolve_session(CHAT_CALLER, raw)
    assert raised.value.status == 400
    assert raised.value.message.startswith("session: the name is too long to store")
    assert f"the limit is {MAX_NAME_CHARS}" in raised.value.message


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "api:",
        "   ",
        "evil\nINFO forged log line",
        "tab\there",
        "nul\x00",
        "del\x7f",
        "bidi\u202eevil",
        "zero\u200bwidth",
        "line\u2028sep",
        "surrogate\ud800",
        "telegram:123",  # another channel's session is never reachable from the API
        "slack:C1:thread:1.2",
    ],
)
def test_hostile_session_keys_are_refused(raw: str) -> None:
    with pytest.raises(SessionRefused) as raised:
        resolve_session(CHAT_CALLER, raw)
    assert raised.value.status == 400
    assert raised.value.message.startswith("session:")


# --------------------------------------------------------------------------- request bodies


def parse(body: bytes) -> ChatRequest:
    """A body as /api/chat parses it: its caller is the `[http] token`."""
    return parse_chat_request(body, CHAT_CALLER)


def test_another_api_clients_session_is_403_saying_what_is_allowed() -> None:
    with pytest.raises(ApiError) as raised:
        parse(b'{"session": "api:ide:ide-proj", "text": "what is the vault code?"}')
    assert raised.value.status == 403
    assert raised.value.message.startswith("session:") and "api:<name>" in raised.value.message


def test_a_good_request_becomes_an_api_inbound_message() -> None:
    request = parse(json.dumps({"session": "work", "text": "hello"}).encode())
    assert request.session_key == "api:work"
    inbound = request.inbound()
    assert inbound.session_key == "api:work"
    assert (inbound.channel, inbound.chat_id, inbound.text) == ("api", "work", "hello")


def test_unknown_fields_are_ignored_and_a_session_is_required() -> None:
    request = parse(b'{"session": "w", "text": "hi", "future_option": true}')
    assert request.session_key == "api:w"
    with pytest.raises(ApiError) as refused:
        parse(b'{"text": "hi"}')
    assert refused.value.status == 400 and "session: required" in refused.value.message


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[" * 50_000 + b"]" * 50_000, "not valid JSON"),  # nesting past the recursion limit
        (b'["text"]', "JSON object"),
        (b'"hello"', "JSON object"),
        (b"{}", "text: required"),
        (b'{"session": "a"}', "text: required"),
        (b'{"text": 5}', "text: must be a string"),
        (b'{"text": null}', "text: required"),
        (b'{"text": "   \\n "}', "text: is empty"),
        (b'{"text": "x", "session": 7}', "session: must be a string"),
        (b'{"text": "bad \\ud800 surrogate"}', "unpaired surrogate"),
        (b'{"text": "x", "session": "telegram:1"}', "session:"),
    ],
)
def test_bad_bodies_are_400_with_a_reason(body: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as raised:
        parse(body)
    assert raised.value.status == 400
    assert fragment in raised.value.message


def test_reply_body() -> None:
    out = OutboundMessage(channel="api", chat_id="w", text="hi", session_key="api:w")
    assert reply_body("api:w", out) == {"session": "api:w", "reply": "hi", "error": False}
    assert reply_body("api:w", None) == {"session": "api:w", "reply": None, "error": False}
