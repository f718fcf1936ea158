"""Logging setup: loguru to stderr, human-readable or JSON lines, secrets redacted."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from loguru import logger

if TYPE_CHECKING:
    from loguru import Record

# `sk-` only at a word start: "ask-questions" or "task-list" are not keys.
_BEARER = re.compile(r"(?i)(bearer\s+|api[_-]?key[=:]\s*|\bsk-)[A-Za-z0-9._\-]{6,}")


class Redactor:
    """Replaces known secret values, and anything shaped like a bearer token or an
    OpenAI key, with `***` before a record is written."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _BEARER.sub(lambda m: m.group(1) + "***", text)

    def __call__(self, record: Record) -> bool:
        record["message"] = self.redact(record["message"])
        return True


def setup_logging(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    logger.remove()
    redactor = Redactor(secrets)
    if fmt == "json":
        logger.add(sys.stderr, level=level, serialize=True, filter=redactor, diagnose=False)
    else:
        logger.add(
            sys.stderr,
            level=level,
            filter=redactor,
            diagnose=False,  # tracebacks must not print local variables (secrets)
            format="<green>{time:YYYY-MM-DD HH:mm:ss}</green> <level>{level: <7}</level> "
            "{extra[session]} <level>{message}</level>",
        )
    logger.configure(extra={"session": "-"})
