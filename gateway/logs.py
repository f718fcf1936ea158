"""Logging setup: loguru to stderr, human-readable or flat JSON lines, secrets redacted.

The promise kept here: no configured secret, and nothing shaped like a token, reaches
stderr. The process's one redactor (`gateway.redaction`, `Settings.redactor`) runs on
everything written, in both formats: the message, bound values, and an exception's text
and traceback (a token inside a URL in an error is the usual way a secret leaks into a
log).

`log.format = "json"` writes one flat object per line, the shape log shippers (Vector,
Fluent Bit, Loki, Datadog) index without a parser: `time`, `level`, `message`,
`session`, `channel`, `logger`, then for an error `error.type`, `error.message`,
`error.stack`, then any other bound values under their own names.

`logger` here is loguru's, imported at its first use: loguru brings asyncio and
multiprocessing along, a third of a one-shot `gateway sessions list`'s start. The modules
such a command runs (`gateway.sessions`, `gateway.fsutil`) log through it, and the
command sets logging up with `defer=True`: loguru is imported, and set up, only if
something is logged.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import TYPE_CHECKING, Any, cast

from gateway.redaction import Redactor

if TYPE_CHECKING:
    from loguru import Logger, Message, Record

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


#: The set-up `setup_logging(defer=True)` left for loguru's first use.
_deferred: tuple[str, str, Redactor] | None = None


def setup_logging(
    level: str = "INFO",
    fmt: str = "text",
    redactor: Redactor | None = None,
    *,
    defer: bool = False,
) -> None:
    """Log to stderr at `level` and above, as text or JSON lines (`fmt`), through
    `redactor` (the settings' `redactor`; None: token shapes only). With `defer`, while
    loguru is not imported yet, this is done at the first use of `logger` instead: a
    command that logs nothing never imports it. A deferring caller must log only through
    `logger` (loguru imported by another module would log unconfigured)."""
    global _deferred
    redactor = redactor if redactor is not None else Redactor()
    if defer and "loguru" not in sys.modules:
        _deferred = (level, fmt, redactor)
        return
    _deferred = None
    _configure(level, fmt, redactor)


def _configure(level: str, fmt: str, redactor: Redactor) -> None:
    from loguru import logger

    logger.remove()
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


def _loguru() -> Logger:
    """loguru's logger, set up as `setup_logging` deferred it on first use."""
    global _deferred
    from loguru import logger

    if _deferred is not None:
        deferred, _deferred = _deferred, None
        _configure(*deferred)
    return logger


class _LazyLogger:
    """Stands for loguru's logger; each attribute is the real logger's (`_loguru`). A
    method is looked up here and called by the caller, so loguru's record names the
    caller's module and line, as with loguru's logger itself."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(_loguru(), name)


#: loguru's logger, imported at first use (see the module's docstring).
logger = cast("Logger", _LazyLogger())
