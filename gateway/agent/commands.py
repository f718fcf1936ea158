"""Chat commands every channel understands (/new, /model, /status, ...): parsing and help."""

from __future__ import annotations

from dataclasses import dataclass

COMMANDS: dict[str, str] = {
    "new": "start a fresh conversation (the old one stays on disk)",
    "reset": "same as /new",
    "status": "session key, message count, model and context use",
    "model": "/model NAME switches this conversation's model; /model alone shows it",
    "compact": "summarize older turns into memory now",
    "help": "this list",
}
PRIVILEGED = frozenset({"model"})


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    argument: str


def parse_command(text: str) -> Command | None:
    """`/name arg` for a known command name, else None (so "/etc/hosts?" is a message).

    A Telegram-style `/name@botname` suffix is accepted and ignored.
    """
    stripped = text.strip()
    if not stripped.startswith("/") or len(stripped) < 2:
        return None
    head, _, rest = stripped[1:].partition(" ")
    name = head.split("@", 1)[0].lower()
    if name not in COMMANDS:
        return None
    return Command(name=name, argument=rest.strip())


def help_text() -> str:
    lines = ["Commands:"]
    lines += [f"/{name} - {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)
