"""Logging setup: loguru to stderr, human-readable or flat JSON lines, secrets redacted.

The promise kept here: no configured secret, and nothing shaped like a token, reaches
stderr. Redaction runs on everything written, in both formats: the message, bound
values, and an exception's text and traceback (a token inside a URL in an error is
the usual way a secret leaks into a log).

`log.format = "json"` writes one flat object per line, the shape log shippers (Vector,
Fluent Bit, Loki, Datadog) index without a parser: `time`, `level`, `message`,
`session`, `channel`, `logger`, then for an error `error.type`, `error.message`,
`error.stack`, then any other bound values under their own names.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from loguru import logger

if TYPE_CHECKING:
    from loguru import Message, Record

# Shapes of secrets worth catching even when not configured: bearer tokens, `api_key=`
# values, OpenAI keys (`sk-` only at a word start: "ask-questions" is not a key), Slack
# tokens, and Telegram bot tokens (`<bot id>:<35 characters>`, also inside API URLs).
_TOKEN_SHAPES = re.compile(
    r"(?i)(bearer\s+|api[_-]?key[=:]\s*|\bsk-|\bxox[abposr]-|\bxapp-)[A-Za-z0-9._\-]{6,}"
    r"|(?<![A-Za-z0-9])(bot)?(\d{6,}:)[A-Za-z0-9_-]{30,}"
)

# Keys of the JSON line that bound values may not take over.
_OWN_FIELDS = ("time", "level", "message", "session", "channel", "logger")

TEXT_FORMAT = (
    "<green>{time:YYYY-MM-DD HH:mm:ss}</green> <level>{level: <7}</level> "
    "{extra[session]} <level>{message}</level>"
)


def text_format(record: Record) -> str:
    """`TEXT_FORMAT`, with the trace id after the session key on a traced turn's lines."""
    traced = " trace={extra[trace_id]}" if "trace_id" in record["extra"] else ""
    return TEXT_FORMAT.replace("{extra[session]}", "{extra[session]}" + traced) + "\n{exception}"


def _keep_prefix(match: re.Match[str]) -> str:
    if match.group(1) is not None:
        return match.group(1) + "***"
    return (match.group(2) or "") + match.group(3) + "***"


class Redactor:
    """Replaces known secret values, and anything shaped like a token, with `***`."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _TOKEN_SHAPES.sub(_keep_prefix, text)


class TextSink:
    """Writes loguru's formatted line (message and traceback) with secrets redacted."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor

    def __call__(self, message: Message) -> None:
        # Looked up at each write: tests and the CLI may replace sys.stderr.
        sys.stderr.write(self.redactor.redact(str(message)))


class JsonSink:
    """Writes each record as one flat, redacted JSON object per line."""

    def __init__(self, redactor: Redactor) -> None:
        self.redactor = redactor

    def line(self, record: Record) -> str:
        redact = self.redactor.redact
        extra = record["extra"]
        session = extra.get("session")
        session = None if session in (None, "-") else str(session)
        fields: dict[str, Any] = {
            "time": record["time"].isoformat(timespec="milliseconds"),
            "level": record["level"].name,
            "message": redact(record["message"]),
            "session": None if session is None else redact(session),
            # Session keys are `channel:id`; a bound `channel` wins.
            "channel": extra.get("channel") or (session.partition(":")[0] if session else None),
            "logger": record["name"],
        }
        error = record["exception"]
        if error is not None and error.type is not None:
            fields["error.type"] = error.type.__name__
            fields["error.message"] = redact(str(error.value))
            fields["error.stack"] = redact(
                "".join(traceback.format_exception(error.type, error.value, error.traceback))
            )
        for key, value in extra.items():
            if key not in fields and key not in _OWN_FIELDS:
                if not isinstance(value, bool | int | float | None):
                    value = redact(str(value))
                fields[key] = value
        return json.dumps(fields, ensure_ascii=False, default=str) + "\n"

    def __call__(self, message: Message) -> None:
        sys.stderr.write(self.line(message.record))


def _nothing(record: Record) -> str:
    # The JSON sink builds its line from the record; loguru need not format one.
    return ""


def setup_logging(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    logger.remove()
    redactor = Redactor(secrets)
    if fmt == "json":
        logger.add(JsonSink(redactor), level=level, format=_nothing, diagnose=False)
    else:
        logger.add(
            TextSink(redactor),
            level=level,
            format=text_format,
            colorize=sys.stderr.isatty(),
            diagnose=False,  # tracebacks must not print local variables (secrets)
        )
    logger.configure(extra={"session": "-"})
