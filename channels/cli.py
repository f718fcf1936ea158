"""The terminal channel: interactive chat and one-shot messages over stdin/stdout.

On a terminal, lines are read with prompt_toolkit (line editing, history) and keys
behave as in a shell: Ctrl-C clears the line being typed, Ctrl-C while a reply is
awaited stops waiting for it, Ctrl-D on an empty line leaves. Piped input is read
line by line until its end.
"""

from __future__ import annotations

import getpass
import signal
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TextIO, TypeVar

import anyio
import anyio.abc

from gateway.agent import AgentLoop
from gateway.channel import Submit
from gateway.messages import (
    DEFAULT_TERMINAL_SESSION,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
)

if TYPE_CHECKING:
    from prompt_toolkit import PromptSession

EXIT_WORDS = frozenset({"/quit", "/exit"})
PROMPT = "you> "
#: Shown when Ctrl-C stopped the wait for a reply.
INTERRUPTED = "interrupted: not waiting for that reply; your message is kept in the session"

T = TypeVar("T")


class CLIChannel:
    """Turns lines typed in a terminal into inbound messages and prints the replies.

    Two ways to run: `run_interactive`/`send_once` call the agent directly (for
    `gateway chat`, with streaming); `run`/`send` go through the daemon's dispatcher
    like every other channel (for `gateway run`).

    Promise: Ctrl-C never loses what the session holds. At the prompt it only clears
    the line (nothing was sent); during a turn it stops the wait, and what the turn
    stored so far (the user's message first of all) stays in the session.
    """

    name = "cli"
    #: In the daemon, the end of the terminal chat (Ctrl-D, /quit) stops the gateway.
    ends_gateway = True

    def __init__(
        self,
        agent: AgentLoop | None = None,
        *,
        session_key: str = DEFAULT_TERMINAL_SESSION,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
    ) -> None:
        self.agent = agent
        self.session_key = session_key
        self.stdin = stdin or sys.stdin
        self.stdout = stdout or sys.stdout
        #: A person at a terminal (not a pipe): prompt, line editing, Ctrl-C handling.
        self.terminal = self.stdin is sys.stdin and sys.stdin.isatty()
        self._prompt: PromptSession[str] | None = None
        #: In the daemon: where its HTTP port and admin page are, said at the start.
        self.serving: str | None = None
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
        Returns at end of input, /quit or Ctrl-C at the prompt: for the daemon, whose
        terminal chat ends the gateway, Ctrl-C keeps its usual meaning (stop)."""
        if self.serving:
            self._print(self.serving)
        self._print(
            f"Chatting in session {self.session_key}. /help for commands, /quit or Ctrl-D to stop."
        )
        task_status.started()
        while True:
            line = await self._next_line(ctrl_c_ends=True)
            if line is None:
                return
            if line.strip():
                ticket = await submit(self._inbound(line))
                await ticket.reply()  # the prompt comes back once the reply is printed

    async def notice(self, message: InboundMessage, text: str) -> None:
        """A line about the turn in progress (the model server still busy, say)."""
        self._print("... " + text)

    async def send(self, message: OutboundMessage) -> None:
        prefix = "error> " if message.is_error else "bot> "
        self._print(prefix + message.text)
        for file in message.files:
            self._print(render_file(file))

    async def _next_line(self, *, ctrl_c_ends: bool = False) -> str | None:
        """The next line typed, or None at the end (Ctrl-D, /quit, end of input)."""
        if self.terminal:
            line = await self._prompt_line(ctrl_c_ends=ctrl_c_ends)
        else:
            try:
                line = await anyio.to_thread.run_sync(self._read_piped_line, abandon_on_cancel=True)
            except KeyboardInterrupt:
                line = None
        if line is None or line.strip() in EXIT_WORDS:
            self._print()
            return None
        return line

    async def _prompt_line(self, *, ctrl_c_ends: bool) -> str | None:
        if self._prompt is None:
            from prompt_toolkit import PromptSession

            self._prompt = PromptSession()
        while True:
            try:
                # SIGINT stays ours: in raw mode Ctrl-C arrives as a key, not a signal.
                return await self._prompt.prompt_async(PROMPT, handle_sigint=False)
            except EOFError:
                return None
            except KeyboardInterrupt:
                if ctrl_c_ends:
                    return None
                # As in a shell: the typed line is dropped and a fresh prompt follows.

    def _print(self, text: str = "", end: str = "\n") -> None:
        self.stdout.write(text + end)
        self.stdout.flush()

    def _read_piped_line(self) -> str | None:
        line = self.stdin.readline()
        return line.rstrip("\n") if line else None

    async def _until_ctrl_c(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None if Ctrl-C (SIGINT) came first and cancelled it.

        The handler is installed before `work` starts, so no Ctrl-C in between ends the
        process; on leaving, SIGINT's previous handler is back (exit with 130)."""
        if not self.terminal:
            return await work
        result: T | None = None
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:

                async def cancel_on_signal() -> None:
                    async for _ in signals:
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(cancel_on_signal)
                result = await work
                tg.cancel_scope.cancel()
        return result

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

            async def on_notice(text: str) -> None:
                self._print("... " + text)

            turn = agent.handle(self._inbound(line), on_delta=on_delta, on_notice=on_notice)
            reply = await self._until_ctrl_c(turn)
            if streamed:
                self._print()
            if reply is None:
                self._print("error> " + INTERRUPTED)
            elif streamed:
                if reply.is_error:
                    self._print("error> " + reply.text)
            else:
                prefix = "error> " if reply.is_error else "bot> "
                self._print(prefix + reply.text)


def render_file(file: OutboundFile) -> str:
    """A reply's file as the terminal shows it: a header line, then its text when it
    is text (a terminal cannot show an image or binary)."""
    header = f"[file {file.name}, {len(file.data):,} bytes, {file.mime_type}]"
    if file.is_image:
        return header
    try:
        return f"{header}\n{file.data.decode('utf-8').rstrip()}"
    except UnicodeDecodeError:
        return header
