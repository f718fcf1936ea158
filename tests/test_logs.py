"""Logs: JSON lines carry the session key; secrets never reach a line."""

from __future__ import annotations

import json

import pytest
from loguru import logger

from gateway.logs import setup_logging


def test_json_lines_carry_the_session_and_hide_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("INFO", "json", secrets=["hunter2-token-value"])
    try:
        with logger.contextualize(session="telegram:42"):
            logger.info("calling with token hunter2-token-value and Bearer abcdef123456")
        logger.debug("not shown at INFO")
    finally:
        setup_logging("INFO", "text")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1
    record = lines[0]["record"]
    assert record["extra"]["session"] == "telegram:42"
    assert "hunter2-token-value" not in lines[0]["text"]
    assert "abcdef123456" not in lines[0]["text"]
    assert "***" in record["message"]


def test_text_lines_show_the_session(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging("INFO", "text")
    with logger.contextualize(session="slack:C1"):
        logger.info("turn done")
    err = capsys.readouterr().err
    assert "slack:C1" in err and "turn done" in err
