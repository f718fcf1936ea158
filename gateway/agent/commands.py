"""Chat commands every channel understands (/new, /model, /status, ...): parsing and help."""

from __future__ import annotations

import re
from dataclasses import dataclass

COMMANDS: dict[str, str] = {
    "start": "greet and list these commands (Telegram sends it first)",
    "new": "start a fresh conversation (the old one stays on disk)",
    "reset": "same as /new",
    "status": "session key, message count, model and context use",
    "model": "/model NAME switches this conversation's model or alias; /model alone shows it",
    "compact": "summarize older turns into memory now",
    "memory": "the facts I remember here, with their ids and where each came from",
    "facts": "same as /memory",
    "correct": "/correct ID NEW TEXT fixes a remembered fact (it keeps its id)",
    "forget": "/forget ID (or words from it) removes a remembered fact for good",
    "undo": "take back your last message and my answer (kept in the history)",
    "stop": "stop the answer being worked on now (messages sent after it still run)",
    "queue": "/queue followup|collect|steer|interrupt: what a message sent while I answer "
    "does; /queue alone shows it",
    "help": "this list",
}
PRIVILEGED = frozenset({"model"})


# What a command looks like (Telegram's syntax: letters, digits, underscores, at most
# 32, an optional @botname); "/etc/hosts is a file" or "/ what?" is a message.
_COMMAND = re.compile(r"/([A-Za-z][A-Za-z0-9_]{0,31})(?:@\w+)?(?:\s+(.*))?", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    argument: str

    @property
    def known(self) -> bool:
        return self.name in COMMANDS


def parse_command(text: str) -> Command | None:
    """`/name arg` for anything shaped like a command, else None (a message).

    An unknown name is still a Command (`known` is False): it is answered as unknown,
    never sent to the model. A Telegram-style `/name@botname` suffix is ignored.
    """
    match = _COMMAND.fullmatch(text.strip())
    if match is None:
        return None
    return Command(name=match.group(1).lower(), argument=(match.group(2) or "").strip())


def is_stop_command(text: str) -> bool:
    """True for `/stop`: the one command answered on arrival, outside the session's turn
    order, because it must not wait behind the turn it stops."""
    command = parse_command(text)
    return command is not None and command.name == "stop"


def help_text() -> str:
    lines = ["Commands:"]
    lines += [f"/{name} - {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def unknown_command_text(name: str) -> str:
    """The answer to `/name` that is not a command: what there is instead."""
    known = ", ".join(f"/{n}" for n in COMMANDS)
    return f"unknown command /{name}; the commands are {known} (/help says what they do)"
