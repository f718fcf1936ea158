"""Child process for the session tests: appends messages to one session and prints
``ack <n>`` after each append returns (so the parent knows what was acknowledged).

    python tests/sessions_child.py DIR KEY FSYNC START COUNT TAG

COUNT 0 means forever (until killed). Message contents are ``<TAG>:<n>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from loguru import logger

from gateway.llm import LLMMessage
from gateway.sessions import SessionManager


def main() -> None:
    folder, key, fsync, start, count, tag = sys.argv[1:7]
    logger.remove()  # keep stdout/stderr for the protocol
    manager = SessionManager(Path(folder), fsync=fsync)  # type: ignore[arg-type]
    session = manager.get_or_create(key)
    n, end = int(start), int(start) + int(count)
    print("ready", flush=True)
    while int(count) == 0 or n < end:
        session.add_message(LLMMessage(role="user", content=f"{tag}:{n}"))
        sys.stdout.write(f"ack {n}\n")
        sys.stdout.flush()
        n += 1


if __name__ == "__main__":
    main()
