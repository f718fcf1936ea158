"""Logs: flat JSON lines with the session and error fields; secrets never reach a line,
in the message, a bound value, an exception's text or its traceback, in either format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from gateway.logs import setup_logging
from gateway.redaction import Redactor

TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw1"  # a Telegram bot token's shape
URL = f"https://api.telegram.org/bot{TOKEN}/getUpdates"


@pytest.fixture
def json_logs(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    setup_logging("INFO", "json", Redactor(["hunter2-token-value", TOKEN]))
    try:
        yield capsys
    finally:
        setup_logging("INFO", "text")


def lines_of(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]


def fail_with_url() -> None:
    try:
        raise OSError("connection reset")
    except OSError as exc:
        raise ConnectionError(f"GET {URL} failed (Bearer abcdef123456)") from exc


def test_a_json_line_is_one_flat_object_with_the_message_once(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    with logger.contextualize(session="telegram:42"):
        logger.info("turn done in 12 ms")
    logger.debug("not shown at INFO")
    raw = json_logs.readouterr().err
    assert raw.count("\n") == 1 and raw.count("turn done") == 1
    assert len(raw.encode()) < 250  # loguru's serialize=True wrote about 700 bytes
    line = json.loads(raw)
    assert list(line)[:5] == ["time", "level", "message", "session", "channel"]
    assert line["level"] == "INFO" and line["message"] == "turn done in 12 ms"
    assert line["session"] == "telegram:42" and line["channel"] == "telegram"
    assert line["time"].endswith(("+00:00", "Z")) or line["time"][-6] in "+-"
    assert not any(isinstance(value, dict | list) for value in line.values())


def test_bound_values_are_their_own_fields_and_a_line_without_session_has_nulls(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    logger.bind(job="disk", attempt=2, channel="system").warning("heartbeat late")
    logger.info("starting")
    bound, plain = lines_of(json_logs)
    assert (bound["job"], bound["attempt"], bound["channel"]) == ("disk", 2, "system")
    assert bound["session"] is None
    assert (plain["session"], plain["channel"]) == (None, None)


def test_an_error_has_flat_error_fields_with_the_token_redacted(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    with logger.contextualize(session="telegram:42"):
        try:
            fail_with_url()
        except ConnectionError:
            logger.exception("polling failed")
    (line,) = lines_of(json_logs)
    assert line["message"] == "polling failed"
    assert line["error.type"] == "ConnectionError"
    assert line["error.message"].startswith("GET https://api.telegram.org/bot***/getUpdates")
    assert "Traceback" in line["error.stack"] and "OSError: connection reset" in line["error.stack"]
    text = json.dumps(line)
    assert TOKEN not in text and "abcdef123456" not in text


def test_secrets_in_the_message_and_in_bound_values_are_redacted(
    json_logs: pytest.CaptureFixture[str],
) -> None:
    logger.bind(url=URL).info("calling with token hunter2-token-value and Bearer abcdef123456")
    raw = json_logs.readouterr().err
    for secret in ("hunter2-token-value", "abcdef123456", TOKEN):
        assert secret not in raw
    assert "***" in json.loads(raw)["message"]


def test_text_lines_redact_exception_text_and_tracebacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    setup_logging("INFO", "text", Redactor([TOKEN]))
    with logger.contextualize(session="slack:C1"):
        logger.info("turn done")
        try:
            fail_with_url()
        except ConnectionError as exc:
            logger.opt(exception=exc).error("channel telegram failed")
    err = capsys.readouterr().err
    assert "slack:C1" in err and "turn done" in err
    assert "Traceback" in err and "ConnectionError: GET https://api.telegram.org/bot***/" in err
    assert TOKEN not in err and "abcdef123456" not in err


def test_token_shapes_are_redacted_without_being_configured() -> None:
    redact = Redactor().redact
    # The bot id before the colon is not secret and says which bot it was.
    assert redact(f"GET {URL}") == "GET https://api.telegram.org/bot123456789:***/getUpdates"
    assert redact(f"token {TOKEN} used") == "token 123456789:*** used"
    assert redact("xoxb-1234567890-abcdefghij") == "xoxb-***"
    assert redact("xapp-1-A0123-456-abcdef") == "xapp-***"
    # Ordinary text with numbers and colons is left alone.
    assert redact("at 10:30 session 1234567:abc") == "at 10:30 session 1234567:abc"
