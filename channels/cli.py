"""The terminal channel: interactive chat and one-shot messages over stdin/stdout."""

from __future__ import annotations

import getpass
import sys
from typing import TextIO

import anyio
import anyio.abc

from gateway.agent import AgentLoop
from gateway.channel import Submit
from gateway.messages import InboundMessage, OutboundMessage
from gateway.sessions.keys import encode_key

EXIT_WORDS = frozenset({"/quit", "/exit"})


def cli_session_key(name: str | None) -> str:
    """`--session work` means `cli:work`; a full key (with a colon) is used as given.

    Raises SessionKeyError (a ValueError) for a key that cannot be stored."""
    if not name:
        return "cli:direct"
    key = name if ":" in name else f"cli:{name}"
    encode_key(key)
    return key


class CLIChannel:
    """Turns lines typed in a terminal into inbound messages and prints the replies.

    Two ways to run: `run_interactive`/`send_once` call the agent directly (for
    `gateway chat`, with streaming); `run`/`send` go through the daemon's dispatcher
    like every other channel (for `gateway run`).
    """

    name = "cli"
    #: In the daemon, the end of the terminal chat (Ctrl-D, /quit) stops the gateway.
    ends_gateway = True

    def __init__(
        self,
        agent: AgentLoop | None = None,
        *,
        session_key: str = "cli:direct",
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
    ) -> None:
        self.agent = agent
        self.session_key = session_key
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        try:
            self.user = getpass.getuser()
        except (KeyError, OSError):
            self.user = "local"

    def _inbound(self, text: str) -> InboundMessage:
        _, _, chat_id = self.session_key.partition(":")
        return InboundMessage(
            channel="cli",
            chat_id=chat_id or "direct",
            text=text,
            sender_id=self.user,
            session_key_override=self.session_key,
        )

    def _require_agent(self) -> AgentLoop:
        if self.agent is None:
            raise RuntimeError("this CLIChannel runs through the dispatcher; use run()")
        return self.agent

    async def send_once(self, text: str) -> OutboundMessage:
        """One message, one reply (for `gateway chat -m`)."""
        return await self._require_agent().handle(self._inbound(text))

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Daemon mode: each line goes to the dispatcher; the reply arrives via `send`.
        Returns at end of input or /quit."""
        self._print(
            f"Chatting in session {self.session_key}. /help for commands, /quit or Ctrl-D to stop."
        )
        task_status.started()
        while True:
            line = await self._next_line()
            if line is None:
                return
            if line.strip():
                ticket = await submit(self._inbound(line))
                await ticket.reply()  # the prompt comes back once the reply is printed

    async def send(self, message: OutboundMessage) -> None:
        prefix = "error> " if message.is_error else "bot> "
        self._print(prefix + message.text)

    async def _next_line(self) -> str | None:
        try:
            line = await anyio.to_thread.run_sync(self._read_line, abandon_on_cancel=True)
        except KeyboardInterrupt:
            line = None
        if line is None or line.strip() in EXIT_WORDS:
            self._print()
            return None
        return line

    def _print(self, text: str = "", end: str = "\n") -> None:
        self.stdout.write(text + end)
        self.stdout.flush()

    def _read_line(self) -> str | None:
        if self.stdin is sys.stdin and sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
            try:
                return input("you> ")
            except EOFError:
                return None
        line = self.stdin.readline()
        return line.rstrip("\n") if line else None

    async def run_interactive(self) -> None:
        """Read lines until end of input or /quit; each line is one turn."""
        agent = self._require_agent()
        self._print(
            f"Chatting in session {self.session_key}. /help for commands, /quit or Ctrl-D to leave."
        )
        while True:
            line = await self._next_line()
            if line is None:
                return
            if not line.strip():
                continue
            streamed = False

            async def on_delta(text: str) -> None:
                nonlocal streamed
                if not streamed:
                    self.stdout.write("bot> ")
                    streamed = True
                self.stdout.write(text)
                self.stdout.flush()

            reply = await agent.handle(self._inbound(line), on_delta=on_delta)
            if streamed:
                self._print()
                if reply.is_error:
                    self._print("error> " + reply.text)
            else:
                prefix = "error> " if reply.is_error else "bot> "
                self._print(prefix + reply.text)
