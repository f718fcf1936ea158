"""The agent loop: one turn of one session, from inbound message to persisted reply."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import operator
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from loguru import logger

from gateway import failpoints
from gateway.agent.commands import (
    PRIVILEGED,
    Command,
    help_text,
    is_stop_command,
    parse_command,
    unknown_command_text,
)
from gateway.agent.context import ContextBuilder, ContextPlan, repair_tool_pairs, reserve_cap
from gateway.agent.inputs import UserInput, read_user_input, with_images
from gateway.agent.memory_tools import correct_text, facts_text, forget_text, memory_texts
from gateway.agent.offline import is_stale, message_age, offline_notice
from gateway.agent.rewind import (
    NOTHING_TO_UNDO_TEXT,
    OLD_EDIT_TEXT,
    branch_for_edit,
    undo_last_exchange,
)
from gateway.agent.speakers import with_speaker
from gateway.agent.tokens import estimate_messages_tokens, estimate_tools_tokens
from gateway.agent.tool_outputs import OUTPUT_GROUP, ToolOutputs
from gateway.agent.tools import ToolContext, ToolRegistry
from gateway.agent.turns import META_STEERED, EarlierTurn, find_turn, user_entry_meta
from gateway.agent.windows import ContextWindows, window_probe, window_routes
from gateway.cache import CacheContext, SemanticCache, digest_messages, strip_nocache
from gateway.dispatch.queue_modes import (
    MODE_TEXTS,
    QUEUE_MODE_INFO,
    QUEUE_MODES,
    QueueMode,
    QueueModes,
    TurnInbox,
    current_inbox,
    stored_mode,
)
from gateway.llm.types import (
    DEFAULT_CONTEXT_WINDOW,
    ContextOverflow,
    LLMError,
    LLMMessage,
    LLMProvider,
    LLMResponse,
    TokenUsage,
    ToolSpec,
)
from gateway.llm.window import WINDOW_SETTINGS
from gateway.media import FileSource, MediaPreparer
from gateway.media.outbound import code_blocks_as_files
from gateway.messages import (
    META_EDIT_OF,
    META_EPHEMERAL,
    META_IN_SESSION,
    META_IS_GROUP,
    META_NOTICE,
    META_REPLAYED,
    META_REPLY_ENTRY,
    META_SESSION_CURRENT,
    InboundMessage,
    OutboundFile,
    OutboundMessage,
    reply_for,
)
from gateway.people.protocol import PeopleStore, dm_channels
from gateway.sessions.errors import SessionError, SessionKeyError
from gateway.telemetry import telemetry
from gateway.usage.meter import UsageMeter, usage_scope

if TYPE_CHECKING:
    # Type-only: importing these at run time would make an import cycle.
    from gateway.agent.consolidation import Consolidator
    from gateway.memory.protocol import MemoryBackend
    from gateway.sessions import Session, SessionContext, SessionManager

DeltaCallback = Callable[[str], Awaitable[None]]
#: Tells the person something while their turn runs (a line in the terminal).
NoticeCallback = Callable[[str], Awaitable[None]]

#: The reply of a turn /stop ended before the model said anything.
STOPPED_EMPTY_TEXT = "(stopped before I answered)"
#: The commands that see, correct and forget remembered facts.
MEMORY_COMMANDS = frozenset({"memory", "facts", "correct", "forget"})
#: What /stop answers.
STOP_DONE_TEXT = "Stopped. Messages you sent after that one will still be answered."
STOP_IDLE_TEXT = "Nothing is running here to stop."
#: /stop of a conversation whose turns another replica runs (the shared mode): passed on.
STOP_PASSED_TEXT = (
    "Stopping the answer in progress. Messages you sent after that one will still be answered."
)
#: The tool result of a call /stop cut short (every call keeps its result).
STOPPED_TOOL_RESULT = "error: stopped by the user (/stop) before this tool finished"

INTERRUPTED_TEXT = (
    "I was restarting while answering an earlier message and lost my place. Please send it again."
)
#: Said once when a model call waits while the server may still be busy with an answer
#: that was stopped (local servers such as llama.cpp's work one request at a time and
#: some finish an abandoned one first).
MODEL_BUSY_TEXT = (
    "The model is still finishing an answer that was stopped; yours comes right after it."
)
#: Seconds a stopped model call may keep its server busy, for `MODEL_BUSY_TEXT`.
ABANDONED_BUSY_FOR = 600.0

_notice: ContextVar[NoticeCallback | None] = ContextVar("gateway_turn_notice", default=None)

_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SURROGATES = re.compile(r"[\ud800-\udfff]")


def clean_user_text(text: str) -> str:
    """Text safe to store and send: valid UTF-8 (undecodable bytes become U+FFFD) and no
    control characters other than tab and newlines."""
    return _CONTROL_CHARS.sub("", _SURROGATES.sub("\ufffd", text))


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """The agent's knobs, taken from `[agent]` and `[llm]` of the configuration."""

    model: str
    system_prompt: str = "You are a helpful assistant."
    memory_window: int = 10
    max_tool_iterations: int = 8
    #: `[llm] context_window`: an upper bound the operator set; None fits each model to
    #: what its server says (`gateway.agent.windows`), else `DEFAULT_CONTEXT_WINDOW`.
    context_window: int | None = None
    reply_reserve_tokens: int = 1024
    max_message_chars: int = 100_000
    temperature: float | None = None
    max_tokens: int | None = None
    stream: bool = False
    owners: frozenset[str] = field(default_factory=frozenset)
    cache_disabled_channels: frozenset[str] = field(default_factory=frozenset)
    auto_consolidate: bool = True
    #: Seconds a turn's memory recall waits for a search index being built.
    memory_recall_wait: float = 1.0
    #: Seconds after which a message gets an "I was offline" notice (0: never).
    offline_after: float = 3600.0
    #: A reply's code block longer than this goes out as a file (0: never).
    code_block_file_chars: int = 0
    #: What a message does when it arrives while its conversation's turn runs
    #: (`[dispatch] mode` and `channel_modes`; `/queue` sets a conversation's own).
    queue_modes: QueueModes = field(default_factory=QueueModes)


@dataclass(frozen=True, slots=True)
class _TurnResult:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    files: tuple[OutboundFile, ...] = ()


@dataclass(slots=True)
class _Progress:
    """How far a turn got, for /stop: the text streamed of the answer being written, and
    the tool calls persisted without their results yet."""

    said: list[str] = field(default_factory=list)
    pending: list[Any] = field(default_factory=list)

    def stopped_text(self) -> str:
        said = "".join(self.said).strip()
        return f"{said}\n\n(stopped)" if said else STOPPED_EMPTY_TEXT


def _turn_start(ctx: SessionContext, turn_entry: str | None) -> int | None:
    """The position in `ctx.messages` of the running turn's user message: `turn_entry`'s,
    else the last user message (None: there is none)."""
    if turn_entry is not None and turn_entry in ctx.entry_ids:
        return ctx.entry_ids.index(turn_entry)
    return next(
        (i for i in range(len(ctx.messages) - 1, -1, -1) if ctx.messages[i].role == "user"),
        None,
    )


def _unsaved(inbound: InboundMessage, exc: SessionError) -> OutboundMessage:
    """The answer to a turn whose session could not be stored."""
    logger.error("session storage failed: {}", exc)
    return reply_for(
        inbound,
        "I could not save this conversation right now, so I did not answer. "
        "Please try again shortly.",
        is_error=True,
    )


class AgentLoop:
    """Runs turns. The promises it keeps:

    - the user's message is in the session file before the model is called, so neither
      a crash nor an LLM failure loses what the user said; it is made durable (fsynced,
      under `fsync = "batch"`) in the group-commit round of the turn's next append, or
      when the turn ends without one, and always before the turn's reply is given (a
      power cut before that loses it from the file, not from the inbound journal, which
      gives it again; an API request is not answered then);
    - a message is stored once: its entry carries the platform message id, and a
      message replayed after a crash (`META_REPLAYED`) that the session holds already
      is not stored again; its turn goes on where it stopped, or, when it had finished,
      its reply is given again without asking the model;
    - turns of one session run one at a time, in the order `handle` was called;
    - every tool call persisted is followed by its persisted tool result, and the
      history sent to the model never holds an orphaned result or an unanswered call;
    - a tool result too big for the context is stored whole before the entry that
      shows its preview is appended (`gateway.agent.tool_outputs`);
    - a cached answer is looked up only after the context is built, because the key
      covers everything the answer depended on, and it is persisted like any other
      reply (marked `cached` in the entry's meta);
    - a message that joins a running turn (the `steer` queue mode) is stored once, in
      arrival order: after the tool results of the step it joined, with its platform id
      and `steered` in its entry's meta; the model sees it at its next call, and the
      turn's one reply answers it. Every request of the turn holds the turn's own
      message and all that joined it (the context's window never cuts into the running
      turn). A turn that has its final answer takes nothing more.
    """

    def __init__(
        self,
        *,
        sessions: SessionManager,
        provider: LLMProvider,
        config: AgentConfig,
        tools: ToolRegistry | None = None,
        cache: SemanticCache | None = None,
        memory: MemoryBackend | None = None,
        consolidator: Consolidator | None = None,
        usage: UsageMeter | None = None,
        people: PeopleStore | None = None,
        media: MediaPreparer | None = None,
        windows: ContextWindows | None = None,
        outputs: ToolOutputs | None = None,
    ) -> None:
        self.sessions = sessions
        self.usage = usage
        #: With `memory.scope = "person"`: direct conversations are noted as their
        #: sender's, so their memory is the person's (`gateway.people`).
        self.people = people
        self._dm_owners: dict[str, str] = {}
        self.provider = provider
        self.config = config
        self.tools = tools or ToolRegistry()
        #: Big tool results stored whole beside the session, read back by two tools
        #: (registered here, their own group); None: cut in the middle as they come.
        self.outputs = outputs if outputs is not None and outputs.on else None
        if self.outputs is not None:
            for tool in self.outputs.tools():
                self.tools.register(tool, group=OUTPUT_GROUP)
        self.cache = cache
        self.memory = memory
        self.consolidator = consolidator
        self.media = media
        #: The tools' definitions last offered and their estimated tokens (the same
        #: specs turn after turn: estimating them is a JSON dump each).
        self._offered: tuple[tuple[ToolSpec, ...], int] = ((), 0)
        self._toolless: set[tuple[str, int]] = set()  # (model, window) told of no tools
        #: The window each model's requests are fitted to (shared with consolidation).
        self.windows = windows or ContextWindows(
            configured=config.context_window,
            probe=window_probe(provider),
            routes=window_routes(provider),
        )
        self.context = ContextBuilder(
            context_window=config.context_window or DEFAULT_CONTEXT_WINDOW,
            reply_reserve=config.reply_reserve_tokens,
            max_messages=config.memory_window + 1,
        )
        #: Failed turns by error kind, for metrics.
        self.llm_errors: collections.Counter[str] = collections.Counter()
        #: Turns whose memory recall answered from part of the memory, for metrics.
        self.incomplete_recalls = 0
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        #: The cancel scope of each session's running model-and-tools part (for /stop).
        self._running: dict[str, anyio.CancelScope] = {}
        #: The shared mode's /stop for a session another replica runs: passes the stop
        #: on (`SessionRouter.stop_elsewhere`); True when a replica holds the session.
        self.stop_elsewhere: Callable[[str], Awaitable[bool]] | None = None
        #: When a model call was last abandoned (stopped, cancelled) before its answer:
        #: its server may still be working on it (`_complete`).
        self._abandoned_at: float | None = None

    #: Seconds a model call waits before `MODEL_BUSY_TEXT` is said (see `_complete`).
    busy_notice_after = 3.0

    def _lock_for(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._locks[key] = lock
        return lock

    async def handle(
        self,
        inbound: InboundMessage,
        *,
        on_delta: DeltaCallback | None = None,
        token_budget: int | None = None,
        files: FileSource | None = None,
        on_notice: NoticeCallback | None = None,
    ) -> OutboundMessage:
        """Answer one inbound message. Never raises for user or model problems: the
        reply then says what went wrong (`is_error=True`). With `token_budget`, the
        turn's model calls stop once they have used that many tokens (a subagent's).
        `files` fetches the message's attachments (its channel). `on_notice` tells the
        person, while the turn runs, what keeps it waiting (`MODEL_BUSY_TEXT`)."""
        token = _notice.set(on_notice)
        try:
            return await self._handle(inbound, on_delta, token_budget, files)
        finally:
            _notice.reset(token)

    async def _handle(
        self,
        inbound: InboundMessage,
        on_delta: DeltaCallback | None,
        token_budget: int | None,
        files: FileSource | None,
    ) -> OutboundMessage:
        key = inbound.session_key
        with logger.contextualize(session=key), usage_scope(key):
            if is_stop_command(clean_user_text(inbound.text)):
                # Not behind the lock: it must reach the turn it stops.
                text = STOP_DONE_TEXT if self.stop(key) else STOP_IDLE_TEXT
                if text is STOP_IDLE_TEXT and self.stop_elsewhere is not None:
                    try:
                        if await self.stop_elsewhere(key):
                            text = STOP_PASSED_TEXT
                    except Exception as exc:
                        logger.error("/stop could not be passed to the other replicas: {}", exc)
                return reply_for(inbound, text, metadata={"command": "stop"})
            async with self._lock_for(key), self._usage_riding():
                try:
                    return await self._handle_locked(inbound, on_delta, token_budget, files)
                except SessionError as exc:  # the user's message could not be settled
                    return _unsaved(inbound, exc)

    def _usage_riding(self) -> AbstractAsyncContextManager[None]:
        """The turn's model calls counted with its session appends (`UsageMeter.riding`)."""
        return self.usage.riding() if self.usage is not None else contextlib.nullcontext()

    async def _handle_locked(
        self,
        inbound: InboundMessage,
        on_delta: DeltaCallback | None,
        token_budget: int | None,
        files: FileSource | None = None,
    ) -> OutboundMessage:
        text, nocache = strip_nocache(clean_user_text(inbound.text).strip())
        text = text.strip()
        if not text and not inbound.attachments:
            return reply_for(inbound, "Send some text and I will answer.", is_error=True)
        if len(text) > self.config.max_message_chars:
            logger.warning("message refused: {} characters", len(text))
            return reply_for(
                inbound,
                f"That message is too long ({len(text):,} characters; the limit is "
                f"{self.config.max_message_chars:,}). Please shorten it or split it up.",
                is_error=True,
            )
        # A caption is not a command: the file would be dropped unanswered.
        command = None if inbound.attachments else parse_command(text)
        stale = is_stale(inbound, time.time(), self.config.offline_after)
        if command is not None and stale:
            # Commands are not stored; a late one is not carried out either.
            logger.info("command /{} sent while offline: not run", command.name)
            age = message_age(inbound, time.time())
            return reply_for(inbound, offline_notice(age), metadata={"offline": True})
        if command is not None:
            answer = await self._run_command(inbound, command)
            # Marked so metrics count it as a command, not a model turn.
            marked = {**answer.metadata, "command": command.name}
            return dataclasses.replace(answer, metadata=marked)

        started = time.monotonic()
        opened: Session | None = None
        try:
            user_message = LLMMessage(role="user", content=text)
            if inbound.attachments and not text:
                # What is stored when the model is not called (offline, over budget).
                names = ", ".join(a.name or a.kind for a in inbound.attachments)
                user_message = LLMMessage(role="user", content=f"[sent files: {names}]")
            session, earlier = await self._open_session(inbound)
            opened = session
            inbox = current_inbox(session.key)
            if inbox is not None:  # the dispatcher's interrupt check reads it there
                inbox.mode = self.config.queue_modes.resolve(
                    inbound.channel, session.custom_info(QUEUE_MODE_INFO)
                )
            if earlier is not None:
                if earlier.reply is not None:
                    logger.info("replayed message: its reply is in the session; not run again")
                    meta = {
                        "replayed": True,
                        META_IN_SESSION: True,
                        META_REPLY_ENTRY: earlier.reply_entry,
                    }
                    return self._reply(inbound, _TurnResult(earlier.reply, meta))
                if not earlier.is_latest:
                    logger.warning("replayed message: its turn cannot go on after later ones")
                    return reply_for(inbound, INTERRUPTED_TEXT, is_error=True)
            notice = inbound.metadata.get(META_NOTICE)
            if isinstance(notice, str) and notice:
                logger.info("answered with the gateway's notice; the model is not called")
                return await self._answer_without_model(
                    session, user_message, inbound, earlier is None, notice, "notice"
                )
            if stale:
                age = message_age(inbound, time.time())
                logger.info("message sent {:.0f} s ago: answered with the offline notice", age)
                notice = offline_notice(age)
                return await self._answer_without_model(
                    session, user_message, inbound, earlier is None, notice, "offline"
                )
            over = await self._over_budget(inbound.session_key)
            if over is not None:
                logger.warning("token budget used up: the model is not called")
                return await self._answer_without_model(
                    session, user_message, inbound, earlier is None, over, "budget"
                )
            if earlier is not None:
                logger.info("replayed message: its turn goes on where a crash stopped it")
                nocache = True
            elif inbound.metadata.get(META_EDIT_OF):
                edited = str(inbound.metadata[META_EDIT_OF])
                plan = await anyio.to_thread.run_sync(branch_for_edit, session, edited)
                if not plan.rerun:
                    logger.info("edit of an earlier message: not re-run, sender told")
                    return reply_for(inbound, OLD_EDIT_TEXT, metadata={"edit": "old"})
                logger.info("edited message: re-run as a new branch from {}", plan.branched_from)
                # A fresh answer: the cache would give back the one the person just saw
                # when the edit only changed what normalization ignores.
                nocache = True
            if earlier is None:
                said = await read_user_input(
                    inbound,
                    text,
                    media=self.media,
                    files=files,
                    model=self._model_for(session) if inbound.attachments else self.config.model,
                )
            else:
                # The session holds the message as it was read (attachments included).
                said = UserInput(text)
            user_message = LLMMessage(role="user", content=said.text)
            # One embedding of the question a turn (a worker thread, ~1.4 ms of CPU),
            # shared by the cache's near-duplicate lookup and the memory recall.
            query_vector = await self._query_vector(said.text)
            ctx, texts = await self._open_turn(
                session, user_message, inbound, earlier is None, said.meta, query_vector
            )
            if said.problem is not None:
                # The entry is stored (nothing the person sent is lost); no model call.
                return reply_for(inbound, said.problem, is_error=True)
            # An image is not in the cache key's text: such a turn is never cached.
            nocache = nocache or bool(said.images)
            reply = await self._run_model(
                session,
                ctx,
                texts,
                inbound,
                on_delta,
                nocache=nocache,
                token_budget=token_budget,
                images=said.images,
                turn_entry=earlier.turn_entry if earlier is not None else None,
                query_vector=query_vector,
                vector_text=said.text,
            )
        except LLMError as exc:
            logger.error("turn failed: {}", exc)
            self.llm_errors[type(exc).__name__] += 1
            return reply_for(inbound, exc.user_message, is_error=True)
        except SessionKeyError as exc:
            logger.warning("unusable session key: {}", exc)
            return reply_for(
                inbound,
                "This conversation cannot be stored: its address is invalid.",
                is_error=True,
            )
        except SessionError as exc:
            return _unsaved(inbound, exc)
        finally:
            if opened is not None:
                # The user's message was appended deferred (`_open_turn`); a turn that
                # stored nothing after it (an LLM failure, a message it could not read,
                # a cancelled turn) makes it durable here, before its reply goes out.
                # Raises SessionError if the disk refuses: `_handle` answers that
                # instead of the reply.
                with anyio.CancelScope(shield=True):
                    await opened.asettle()
        logger.info(
            "turn done in {:.0f} ms ({} chars)",
            (time.monotonic() - started) * 1000,
            len(reply.text),
        )
        if earlier is not None and inbound.message_id:
            # A replayed turn that went on: messages that joined it are replayed after
            # it and find this reply as theirs; the dispatcher sends it once for all.
            found = find_turn(await self._branch(session), inbound.message_id)
            if found is not None and found.reply_entry is not None:
                meta = {**reply.metadata, META_REPLY_ENTRY: found.reply_entry}
                reply = dataclasses.replace(reply, metadata=meta)
        ephemeral = bool(inbound.metadata.get(META_EPHEMERAL))
        if self.consolidator is not None and self.config.auto_consolidate and not ephemeral:
            # Runs in the background after this reply. The trigger check is cheap on
            # the context (a count, then at most twice the window's messages).
            self.consolidator.maybe_schedule(inbound.session_key, session.build_context())
        # The reply is the session's last entry: a replay finds it (no outbox needed).
        return self._reply(inbound, reply)

    def _reply(self, inbound: InboundMessage, result: _TurnResult) -> OutboundMessage:
        """The outbound reply of a turn: long code blocks go out as files, with the
        files the turn's tools attached. The session keeps the whole text."""
        text, blocks = code_blocks_as_files(result.text, self.config.code_block_file_chars)
        return reply_for(
            inbound,
            text,
            metadata={**result.metadata, META_IN_SESSION: True},
            files=result.files + blocks,
        )

    async def _note_dm(self, inbound: InboundMessage) -> None:
        """Record whose direct conversation this is (once per process and session)."""
        if inbound.metadata.get(META_IS_GROUP) is not False or not inbound.sender_id:
            return
        if inbound.channel not in dm_channels():
            return
        key, sender = inbound.session_key, f"{inbound.channel}:{inbound.sender_id}"
        if self._dm_owners.get(key) == sender or self.people is None:
            return
        await anyio.to_thread.run_sync(self.people.note_dm, key, sender)
        self._dm_owners[key] = sender

    def _usage_line(self, key: str) -> str:
        assert self.usage is not None
        try:
            tokens, cost = self.usage.today(key)
        except Exception as exc:
            # /status still answers; the ledger's trouble is logged for the operator.
            logger.error("usage ledger unreadable: {}", exc)
            return "Tokens today: unknown (the usage ledger cannot be read)"
        line = f"Tokens today: {tokens:,} ({cost})"
        limit = self.usage.budgets.conversation_per_day
        return f"{line}, budget {limit:,} per day" if limit is not None else line

    async def _answer_without_model(
        self,
        session: Session,
        user_message: LLMMessage,
        inbound: InboundMessage,
        append: bool,
        notice: str,
        reason: str,
    ) -> OutboundMessage:
        """A notice instead of a turn (the message is too old, a budget is used up): the
        message and the notice are stored like a turn, both marked with `reason` (nothing
        the person said is lost, and a replay finds the notice as the message's answer),
        and the model is not called."""
        if append:
            meta = {**(user_entry_meta(inbound) or {}), reason: True}
            await session.aadd_message(user_message, meta, defer=True)  # in the notice's round
        await session.aadd_message(LLMMessage(role="assistant", content=notice), {reason: True})
        return reply_for(inbound, notice, metadata={reason: True, META_IN_SESSION: True})

    async def _over_budget(self, key: str) -> str | None:
        if self.usage is None or not self.usage.budgets.any:
            return None
        try:
            return await anyio.to_thread.run_sync(self.usage.budget_notice, key)
        except Exception as exc:
            # An unreadable ledger does not stop conversations; it is logged loudly.
            logger.error("token budget could not be checked: {}", exc)
            return None

    def queue_mode(self, inbound: InboundMessage) -> QueueMode:
        """The queue mode of `inbound`'s conversation (`gateway.dispatch.queue_modes`): its own
        (`/queue`) when its session is in memory here, else its channel's. Never reads
        the store: the dispatcher asks it on the event loop. A running turn tells its
        inbox the mode as it read it from the session (`TurnInbox.mode`)."""
        session = self.sessions.cached(inbound.session_key)
        stored = session.custom_info(QUEUE_MODE_INFO) if session is not None else None
        return self.config.queue_modes.resolve(inbound.channel, stored)

    def may_join(self, inbound: InboundMessage) -> bool:
        """May `inbound` join the turn of an earlier message (steered into it, merged
        with it, or stopping it in the interrupt mode)? Only plain text that would run
        as a turn as it is: not a command, no attachments, no edit, no gateway notice,
        not too long, not sent while the gateway was offline, not `/nocache`."""
        text, nocache = strip_nocache(clean_user_text(inbound.text).strip())
        text = text.strip()
        if nocache or not text or inbound.attachments or parse_command(text) is not None:
            return False
        if len(text) > self.config.max_message_chars:
            return False
        meta = inbound.metadata
        if meta.get(META_EDIT_OF) or meta.get(META_NOTICE):
            return False
        return not is_stale(inbound, time.time(), self.config.offline_after)

    def forget(self, key: str) -> None:
        """Drop what this loop keeps per session for `key` (a thrown-away session), unless
        a turn of it runs."""
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]
        self._dm_owners.pop(key, None)

    def stop(self, key: str) -> bool:
        """Cancel the running turn of session `key` at once (its LLM request or tool
        call); the turn records what was said so far and answers that it stopped.
        False when no turn of that session is running."""
        scope = self._running.get(key)
        if scope is None:
            return False
        logger.info("turn stopped by /stop")
        scope.cancel()
        return True

    async def _open_session(self, inbound: InboundMessage) -> tuple[Session, EarlierTurn | None]:
        """The session, and for a replayed message what the session holds of its turn
        already (None: nothing, the turn runs as new). Only replays look: a message the
        dispatcher takes in for the first time cannot be in the session. A message the
        shared mode's router marks `META_SESSION_CURRENT` takes the cached session as it
        is (read afresh otherwise, in case another replica wrote to it)."""
        session = None
        if inbound.metadata.get(META_SESSION_CURRENT):
            session = self.sessions.cached(inbound.session_key)  # no round trip
        if session is None:
            session = await self.sessions.aget_or_create(inbound.session_key)
        earlier = None
        if inbound.metadata.get(META_REPLAYED) and inbound.message_id:
            earlier = find_turn(await self._branch(session), inbound.message_id)
        return session, earlier

    @staticmethod
    async def _branch(session: Session) -> list[Any]:
        """The session's branch, root to leaf: read in memory on the loop unless a
        worker thread holds the session, then in a worker thread."""
        branch = session.branch_nowait()
        if branch is None:
            branch = await anyio.to_thread.run_sync(session.get_branch)
        return branch

    async def _open_turn(
        self,
        session: Session,
        user_message: LLMMessage,
        inbound: InboundMessage,
        append: bool,
        meta: dict[str, Any] | None = None,
        query_vector: Any = None,
    ) -> tuple[SessionContext, list[str]]:
        """The user's message appended (the promise: what the user said is in the
        session file before the model sees it, durable before the reply is given) unless
        the session holds it already, the context
        rebuilt from the branch, and the memory relevant to the message. The session
        steps run on the event loop when they cannot block (see
        `SessionManager.aget_or_create`); memory search runs in a worker thread when
        there is memory to search, and waits at most `memory_recall_wait` for an index
        being built: then it uses the newest facts, and the turn is logged and counted
        (`incomplete_recalls`) as one whose recall was incomplete."""
        key = session.key
        if self.people is not None:
            await self._note_dm(inbound)
        if append:
            entry_meta = {**(user_entry_meta(inbound) or {}), **(meta or {})} or None
            await failpoints.reach("turn.before_user_append", key)
            # Deferred: in the file now, durable in the round of the turn's next append
            # (the reply, or the first tool call), one group commit a turn.
            await session.aadd_message(user_message, entry_meta, defer=True)
        texts: list[str] = []
        ctx = session.build_context()
        if self.memory is not None and (
            not self.sessions.io_on_loop or self.memory.exists(key)  # one stat
        ):
            wait = self.config.memory_recall_wait
            recall = await anyio.to_thread.run_sync(
                functools.partial(
                    memory_texts,
                    self.memory,
                    key,
                    user_message.content or "",
                    wait=wait,
                    exclude=ctx.entry_ids,  # messages the model sees anyway
                    query_vector=query_vector,  # the cache's: one embedding a turn
                )
            )
            if not recall.complete:
                # Answered from the newest facts: a turn does not wait for a whole build.
                self.incomplete_recalls += 1
                logger.warning(
                    "memory recall is incomplete: the facts index was still being built "
                    "after {:g} s, so only the newest facts were searched",
                    wait,
                )
            texts = recall
        return ctx, texts

    async def _query_vector(self, text: str) -> Any:
        """The turn's question embedded once (a numpy float32 unit vector), or None
        when the cache's near-duplicate layer is off or not loaded yet (the memory
        recall then embeds it itself when its dense search is on). Cache and memory
        share one model (`gateway.embedding.shared_sentence_embedder`)."""
        if self.cache is None or not self.cache.near_duplicates_on or not text.strip():
            return None
        try:
            return await self.cache.embed_query(text)
        except Exception as exc:  # the lookup embeds it itself, or misses
            logger.warning("question not embedded: {}: {}", type(exc).__name__, exc)
            return None

    def _model_for(self, session: Session) -> str:
        return session.build_context().model or self.config.model

    async def _run_model(
        self,
        session: Session,
        ctx: SessionContext,
        texts: list[str],
        inbound: InboundMessage,
        on_delta: DeltaCallback | None,
        *,
        nocache: bool = False,
        token_budget: int | None = None,
        images: tuple[str, ...] = (),
        turn_entry: str | None = None,
        query_vector: Any = None,
        vector_text: str = "",
    ) -> _TurnResult:
        """The model's answer to the turn whose context is `ctx`: its user message is
        `turn_entry`'s (a replayed turn that goes on, perhaps with messages that joined
        it before the crash), else the last user message of `ctx` (the one just stored).
        Every request of the turn holds everything from that message on. `query_vector`
        is the embedding of `vector_text`, used when that is the question looked up."""
        model = ctx.model or self.config.model
        turn_start = _turn_start(ctx, turn_entry)
        query = ctx.messages[-1].content or "" if ctx.messages else ""
        specs = self.tools.specs()
        tool_tokens = self._tools_tokens(specs)
        await self.windows.ensure(model)  # asks the server once per model, bounded
        if specs and tool_tokens > reserve_cap(self.windows.known(model).tokens):
            specs, tool_tokens = self._without_tools(model, tool_tokens)

        def fit(history: Sequence[LLMMessage], cap: int | None = None) -> ContextPlan:
            window = self.windows.known(model).tokens
            plan = self.context.build(
                system_prompt=self.config.system_prompt,
                history=history,
                summary=ctx.summary,
                memory_texts=texts,
                query=query,
                session_key=session.key,
                context_window=min(window, cap) if cap else window,
                fixed_tokens=tool_tokens,
                turn_start=turn_start,
            )
            if not images:
                return plan
            # The turn's images ride on its user message, in every request of the turn.
            return dataclasses.replace(plan, messages=tuple(with_images(plan.messages, images)))

        with telemetry().span("gateway.context.build") as span:
            plan = fit(ctx.messages)
            span.set_attribute("gateway.context.tokens", plan.estimated_tokens)
            span.set_attribute("gateway.context.budget_tokens", plan.budget_tokens)
            span.set_attribute("gateway.context.messages", len(plan.messages))
            span.set_attribute("gateway.context.pruned", len(plan.pruned))
            span.set_attribute("gateway.context.memory_injected", plan.memory_injected)
        messages = list(plan.messages)
        said = self.windows.known(model).server
        cut = said is not None and said.server == "ollama" and plan.over_budget
        if cut and said is not None and plan.estimated_tokens > said.tokens:
            # Ollama would cut the message silently and answer what is left of it.
            refused = ContextOverflow(
                f"the message alone is about {plan.estimated_tokens:,} tokens; "
                f"{said.source} is {said.tokens:,}: not sent",
                context_tokens=said.tokens,
                prompt_tokens=None,
                server="ollama",
            )
            raise self._too_long(model, messages, refused)
        cache_ctx = self._cache_context(
            inbound, session, model, messages, specs, on_delta, nocache, plan.memory_injected
        )
        if cache_ctx is not None and self.cache is not None:
            with telemetry().span("gateway.cache.lookup") as span:
                same_text = query_vector is not None and cache_ctx.query == vector_text
                hit = await self.cache.lookup(
                    cache_ctx, query_vector=query_vector if same_text else None
                )
                span.set_attribute("gateway.cache.hit", hit is not None)
            if hit is not None:
                cached = LLMMessage(role="assistant", content=hit.response, model=model)
                # The key lets an operator drop a wrong answer from the transcript.
                meta = {"cached": True, "cache_match": hit.match, "cache_key": hit.key}
                await session.aadd_message(cached, meta)
                logger.info("answered from cache ({} match)", hit.match)
                return _TurnResult(hit.response, {"cached": True})

        attached: list[OutboundFile] = []
        said_last = bool(ctx.messages) and ctx.messages[-1].role == "user"
        tool_context = ToolContext(
            session_key=session.key,
            sender_id=inbound.sender_id,
            inbound=inbound,
            attach=attached.append,
            user_entry_id=ctx.entry_ids[-1] if said_last and ctx.entry_ids else "",
        )
        progress = _Progress()
        inbox = current_inbox(session.key)
        with anyio.CancelScope() as scope:
            self._running[session.key] = scope
            if inbox is not None:
                # The interrupt mode stops the turn as /stop does, also one that was
                # asked to stop before it got here (then before its first model call).
                inbox.on_stop = scope.cancel
                if inbox.stopping:
                    scope.cancel()
            try:
                if scope.cancel_called:
                    await anyio.lowlevel.checkpoint()  # raises: the scope is cancelled
                reply, used_tools = await self._tool_loop(
                    session,
                    ctx,
                    fit,
                    messages,
                    model,
                    specs,
                    tool_context,
                    on_delta,
                    progress,
                    token_budget,
                    inbox if inbox is not None and inbox.mode == "steer" else None,
                )
            finally:
                if inbox is not None:
                    inbox.on_stop = None
                if self._running.get(session.key) is scope:
                    del self._running[session.key]
        if scope.cancelled_caught:
            text = await self._record_stop(session, progress, model)
            return _TurnResult(text, {"stopped": True})
        if cache_ctx is not None and self.cache is not None:
            stored_ctx = dataclasses.replace(cache_ctx, tool_calls_made=used_tools)
            same_text = query_vector is not None and cache_ctx.query == vector_text
            await self.cache.store(
                stored_ctx, reply, query_vector=query_vector if same_text else None
            )
        return _TurnResult(reply, files=tuple(attached))

    async def _tool_loop(
        self,
        session: Session,
        ctx: SessionContext,
        fit: Callable[[Sequence[LLMMessage], int | None], ContextPlan],
        messages: list[LLMMessage],
        model: str,
        specs: list[ToolSpec],
        tool_context: ToolContext,
        on_delta: DeltaCallback | None,
        progress: _Progress,
        token_budget: int | None = None,
        steering: TurnInbox | None = None,
    ) -> tuple[str, bool]:
        """Model calls and tool calls until a final answer; (the answer, whether tools
        were called). `progress` says how far it got when /stop cancels it; the writes
        are shielded, so what is persisted and what `progress` says always agree. With
        `steering` (the steer mode), the messages that arrived meanwhile join the turn
        after each round of tool calls, before the next model call."""
        streamed: DeltaCallback | None = None
        if on_delta is not None:
            forward = on_delta

            async def streamed(text: str) -> None:
                progress.said.append(text)
                await forward(text)

        turn: list[LLMMessage] = []  # what this turn added after the user's message
        reply: str | None = None
        spent = 0
        tool_tokens = self._tools_tokens(specs)

        def refit(cap: int | None = None) -> list[LLMMessage]:
            return list(fit([*ctx.messages, *turn], cap).messages)

        def refit_repaired(cap: int | None = None) -> list[LLMMessage]:
            return repair_tool_pairs(refit(cap))

        for _ in range(self.config.max_tool_iterations):
            progress.said.clear()
            response, messages = await self._complete_fitted(
                session.key, messages, refit, model, specs, streamed
            )
            self.context.observe(session.key, messages, response.usage, tool_tokens)
            assistant = response.message
            with anyio.CancelScope(shield=True):
                await session.aadd_message(assistant)
                progress.pending = list(assistant.tool_calls)
            turn.append(assistant)
            if not assistant.tool_calls:
                reply = assistant.content or ""
                break
            spent += response.usage.total_tokens if response.usage else 0
            if token_budget is not None and spent >= token_budget:
                reply = await self._out_of_budget(session, assistant, token_budget, spent)
                progress.pending = []
                break
            progress.said.clear()  # said with the tool calls, and stored with them
            for call in assistant.tool_calls:
                logger.info("tool call {}", call.function_name)
                with telemetry().span(
                    f"execute_tool {call.function_name}",
                    {
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": call.function_name,
                        "gen_ai.tool.call.id": call.id,
                    },
                ):
                    result = await self.tools.execute(
                        call, tool_context, max_chars=self._result_cap
                    )
                with anyio.CancelScope(shield=True):
                    # A big result is stored whole before the entry showing its preview.
                    content, meta = await self._shelve(session, call.function_name, result)
                    tool_message = LLMMessage(
                        role="tool", content=content, tool_call_id=call.id, name=call.function_name
                    )
                    await session.aadd_message(tool_message, meta)
                    progress.pending.remove(call)
                turn.append(tool_message)
            if steering is not None:
                turn.extend(await self._take_joined(session, steering))
            # Re-fit: tool results can be large, and the request must stay in the window.
            messages = refit()
        if reply is None:
            # Out of tool rounds: ask once more without tools, so the user gets an answer.
            logger.warning("tool loop hit {} iterations", self.config.max_tool_iterations)
            progress.said.clear()
            response, _ = await self._complete_fitted(
                session.key, repair_tool_pairs(messages), refit_repaired, model, [], streamed
            )
            with anyio.CancelScope(shield=True):
                await session.aadd_message(response.message)
            reply = response.message.content or ""
        return reply, any(m.tool_calls for m in turn)

    async def _take_joined(self, session: Session, inbox: TurnInbox) -> list[LLMMessage]:
        """The steer mode, between two model calls: the messages waiting behind the
        turn that may join it (`may_join`) are stored, in arrival order, each with its
        platform id and `steered` in its entry's meta (`gateway.agent.turns`), and
        returned for the next request. Each append is shielded: a message taken is
        stored whole, or the turn fails and its reply (an error) answers it."""
        joined: list[LLMMessage] = []
        for inbound in inbox.take(self.may_join):
            text = with_speaker(clean_user_text(inbound.text).strip(), inbound.metadata)
            message = LLMMessage(role="user", content=text)
            meta = {**(user_entry_meta(inbound) or {}), META_STEERED: True}
            with anyio.CancelScope(shield=True):
                await failpoints.reach("turn.before_steered_append", session.key)
                await session.aadd_message(message, meta)
            joined.append(message)
            logger.info("a message joined the running turn ({} characters)", len(text))
        return joined

    @property
    def _result_cap(self) -> int | None:
        """The longest tool result kept: the stored-output limit when big results are
        stored whole, else the registry's own (`ToolRegistry.MAX_RESULT_CHARS`)."""
        outputs = self.outputs
        return outputs.limits.max_chars if outputs is not None and outputs.on else None

    async def _shelve(
        self, session: Session, tool: str, result: str
    ) -> tuple[str, dict[str, Any] | None]:
        """The tool result as the session and the context keep it: a big one stored whole
        beside the session and shown as a preview (`ToolOutputs.shelve`)."""
        if self.outputs is None:
            return result, None
        return await self.outputs.shelve(session.key, session.session_id, tool, result)

    async def _out_of_budget(
        self, session: Session, assistant: LLMMessage, budget: int, spent: int
    ) -> str:
        """The token budget is spent: the calls just made are answered as not run (so
        the transcript stays whole) and the answer says how far the work got."""
        logger.warning("token budget spent ({} of {} tokens); the turn ends", spent, budget)
        with anyio.CancelScope(shield=True):
            for call in assistant.tool_calls:
                await session.aadd_message(
                    LLMMessage(
                        role="tool",
                        content=f"error: not run: the token budget ({budget}) is spent",
                        tool_call_id=call.id,
                        name=call.function_name,
                    )
                )
            said = (assistant.content or "").strip()
            text = f"(stopped: the token budget of {budget} tokens is spent)"
            text = f"{said}\n\n{text}" if said else text
            await session.aadd_message(
                LLMMessage(role="assistant", content=text, model=assistant.model),
                {"budget_spent": True},
            )
        return text

    async def _record_stop(self, session: Session, progress: _Progress, model: str) -> str:
        """After /stop: each tool call cut short gets its result, then the text said so
        far is stored as the answer (meta `stopped`), so the transcript stays whole."""
        with anyio.CancelScope(shield=True):
            for call in progress.pending:
                await session.aadd_message(
                    LLMMessage(
                        role="tool",
                        content=STOPPED_TOOL_RESULT,
                        tool_call_id=call.id,
                        name=call.function_name,
                    )
                )
            text = progress.stopped_text()
            stopped = LLMMessage(role="assistant", content=text, model=model)
            await session.aadd_message(stopped, {"stopped": True})
        logger.info("turn stopped; {} characters of the answer kept", len(text))
        return text

    def _cache_context(
        self,
        inbound: InboundMessage,
        session: Session,
        model: str,
        messages: list[LLMMessage],
        specs: list[ToolSpec],
        on_delta: DeltaCallback | None,
        nocache: bool,
        memory_injected: bool,
    ) -> CacheContext | None:
        """What a cached answer for this turn depends on: the system prompt as sent,
        the tools offered and every message before the new one (summary included)."""
        if self.cache is None:
            return None
        return CacheContext(
            query=messages[-1].content or "",
            model=model,
            temperature=self.config.temperature,
            session_key=session.key,
            sender_id=inbound.sender_id,
            system_prompt=messages[0].content or "",
            tools=tuple(specs),
            context_digest=digest_messages(messages[1:-1]),
            memory_injected=memory_injected,
            streaming=self.config.stream and on_delta is not None,
            nocache=nocache or inbound.channel in self.config.cache_disabled_channels,
        )

    async def _complete_fitted(
        self,
        key: str,
        messages: list[LLMMessage],
        refit: Callable[[int | None], list[LLMMessage]],
        model: str,
        specs: list[ToolSpec],
        on_delta: DeltaCallback | None,
    ) -> tuple[LLMResponse, list[LLMMessage]]:
        """One model call, and the messages it was made with.

        When the server refuses the request as longer than the model's context window,
        what its error says (the window, the prompt's real size) is remembered, the
        request is fitted again (`refit`) and sent once more. When that cannot help or
        fails too, the error says what is too long and what to change: "/new" only when
        earlier turns of the conversation were in the request. A request that another
        provider than the first refused (failover) is fitted again to the smaller of the
        two windows, so that either can take it."""
        try:
            response = await self._complete(messages, model, specs, on_delta)
        except ContextOverflow as exc:
            logger.warning("the model's server refused the request as too long: {}", exc)
            self._learn_overflow(key, model, messages, specs, exc)
            again = refit(self.windows.known(model, exc.provider).tokens)
            if again == messages:  # nothing the window and the count change: no use
                raise self._too_long(model, messages, exc) from None
            try:
                response = await self._complete(again, model, specs, on_delta)
            except ContextOverflow as still:
                logger.warning("still too long after fitting it again: {}", still)
                self._learn_overflow(key, model, again, specs, still)
                raise self._too_long(model, again, still) from None
            messages = again
        self.windows.answered(model, response.provider)
        return response, messages

    def _learn_overflow(
        self,
        key: str,
        model: str,
        sent: Sequence[LLMMessage],
        specs: Sequence[ToolSpec],
        exc: ContextOverflow,
    ) -> None:
        """Remember what an overflow error said: the window it named (for the model), and
        the prompt tokens it counted (the session's estimates scale up to it)."""
        if exc.context_tokens:
            self.windows.learn(model, exc.context_tokens, exc.server, exc.provider)
        if exc.prompt_tokens:
            counted = TokenUsage(prompt_tokens=exc.prompt_tokens)
            self.context.observe(key, sent, counted, self._tools_tokens(specs))

    def _without_tools(self, model: str, tool_tokens: int) -> tuple[list[ToolSpec], int]:
        """No tools for a window they would crowd: their definitions take more than a
        quarter of it (llama-server's 2,048 tokens hold ten tools and little else), so
        the model answers without them rather than the request overflowing, or leaving
        the reply a few dozen tokens. Said once per model and window size."""
        window = self.windows.known(model)
        if (model, window.tokens) not in self._toolless:
            self._toolless.add((model, window.tokens))
            # Info, not a warning: `gateway chat -m` shows warnings on every call.
            logger.info(
                "{}'s context window of {:,} tokens is too small for the tools' "
                "definitions (about {:,} tokens): the model answers without tools; give the "
                "model's server a larger context size to use them",
                model,
                window.tokens,
                tool_tokens,
            )
        return [], 0

    def _tools_tokens(self, specs: Sequence[ToolSpec]) -> int:
        """`estimate_tools_tokens(specs)`, estimated again only when the tools change."""
        offered, tokens = self._offered
        same = len(offered) == len(specs) and all(map(operator.is_, offered, specs))
        if not same:
            tokens = estimate_tools_tokens(specs)
            self._offered = (tuple(specs), tokens)
        return tokens

    def _too_long(self, model: str, sent: Sequence[LLMMessage], exc: ContextOverflow) -> LLMError:
        """The error of a request the model's context window cannot hold, saying what
        is too long (the conversation, or the message itself) and what to change."""
        window = self.windows.known(model, exc.provider)
        said = window.server
        if said is None and not exc.context_tokens:
            return LLMError(
                str(exc),
                user_message="The model's server refused the request as longer than its "
                "context window, and did not say its size. The operator should set "
                "[llm] context_window to the server's context size.",
            )
        users = [i for i, m in enumerate(sent) if m.role == "user"]
        earlier = [m for m in sent[: users[-1] if users else 0] if m.role != "system"]
        holds = f"{window.tokens:,} tokens ({window.source})"
        if earlier:
            text = f"This conversation is too long for the model's context window of {holds}."
            return LLMError(str(exc), user_message=f"{text} Start a new one with /new.")
        if window.source.startswith("[llm] context_window"):
            change = "raise [llm] context_window"
        else:
            change = WINDOW_SETTINGS[(said.server if said is not None else None) or exc.server]
        counted = (
            f"the request came to {exc.prompt_tokens:,} tokens"
            if exc.prompt_tokens
            else f"the request came to about {estimate_messages_tokens(sent):,} tokens"
        )
        return LLMError(
            str(exc),
            user_message=f"Your message is too long for the model: {counted}, and its context "
            f"window holds {holds}. Shorten the message, or the operator can {change}.",
        )

    async def _complete(
        self,
        messages: list[LLMMessage],
        model: str,
        specs: list[ToolSpec],
        on_delta: DeltaCallback | None,
    ) -> LLMResponse:
        """One model call. A call cut short (/stop, Ctrl-C) closes its connection, so a
        server that stops on disconnect stops; one that finishes the abandoned answer
        first keeps the next call waiting, and after `busy_notice_after` seconds without
        an answer the person is told so, once (`MODEL_BUSY_TEXT`)."""
        try:
            async with self._busy_notice() as answered:
                response = await self._call_model(messages, model, specs, on_delta, answered)
        except anyio.get_cancelled_exc_class():
            self._abandoned_at = time.monotonic()
            raise
        self._abandoned_at = None  # answered: nothing abandoned holds the server now
        return response

    @contextlib.asynccontextmanager
    async def _busy_notice(self) -> AsyncIterator[Callable[[], None]]:
        """While the body runs: say `MODEL_BUSY_TEXT` after `busy_notice_after` seconds
        if a model call was abandoned lately and nothing has come back yet. Yields what
        to call at the first sign of an answer (a streamed delta)."""
        notice = _notice.get()
        abandoned = self._abandoned_at
        if notice is None or abandoned is None or time.monotonic() - abandoned > ABANDONED_BUSY_FOR:
            yield lambda: None
            return

        async def tell() -> None:
            await anyio.sleep(self.busy_notice_after)
            self._abandoned_at = None  # said once, not at every call of this turn
            logger.info("the model server is still busy with a stopped answer: person told")
            try:
                await notice(MODEL_BUSY_TEXT)
            except Exception as exc:  # the notice is a courtesy; the turn goes on
                logger.warning("the busy notice could not be shown: {}", exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(tell)
            try:
                yield tg.cancel_scope.cancel
            finally:
                tg.cancel_scope.cancel()

    async def _call_model(
        self,
        messages: list[LLMMessage],
        model: str,
        specs: list[ToolSpec],
        on_delta: DeltaCallback | None,
        answered: Callable[[], None],
    ) -> LLMResponse:
        """One model call, in a span with the GenAI semantic conventions when traced."""
        tracing = telemetry()
        if not tracing.enabled:
            return await self._call_model_untraced(messages, model, specs, on_delta, answered)
        attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
        with tracing.span(f"chat {model}", attributes) as span:
            tracing.content(span, "gen_ai.prompt", messages[-1].content if messages else None)
            response = await self._call_model_untraced(messages, model, specs, on_delta, answered)
            span.set_attribute("gen_ai.response.model", response.model)
            if response.provider:
                span.set_attribute("gen_ai.provider.name", response.provider)
            if response.finish_reason:
                span.set_attribute("gen_ai.response.finish_reasons", response.finish_reason)
            if response.usage is not None:
                span.set_attribute("gen_ai.usage.input_tokens", response.usage.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", response.usage.completion_tokens)
            span.set_attribute("gateway.tool_calls", len(response.message.tool_calls or ()))
            tracing.content(span, "gen_ai.completion", response.message.content)
            return response

    async def _call_model_untraced(
        self,
        messages: list[LLMMessage],
        model: str,
        specs: list[ToolSpec],
        on_delta: DeltaCallback | None,
        answered: Callable[[], None],
    ) -> LLMResponse:
        if self.config.stream and on_delta is not None:
            final: LLMResponse | None = None
            async for delta in self.provider.stream(
                messages,
                model=model,
                tools=specs,
                temperature=self.config.temperature,
                max_tokens=self.config.max_tokens,
            ):
                answered()
                if delta.text:
                    await on_delta(delta.text)
                if delta.response is not None:
                    final = delta.response
            if final is None:
                raise LLMError("stream ended without a final response")
            return final
        return await self.provider.chat(
            messages,
            model=model,
            tools=specs,
            temperature=self.config.temperature,
            max_tokens=self.config.max_tokens,
        )

    # ------------------------------------------------------------------ commands

    def _is_owner(self, inbound: InboundMessage) -> bool:
        # The terminal and system jobs run on the operator's own machine.
        if inbound.channel in ("cli", "system"):
            return True
        return f"{inbound.channel}:{inbound.sender_id}" in self.config.owners

    async def _run_command(self, inbound: InboundMessage, command: Command) -> OutboundMessage:
        key = inbound.session_key
        if not command.known:
            return reply_for(inbound, unknown_command_text(command.name), is_error=True)
        if command.name in PRIVILEGED and not self._is_owner(inbound):
            return reply_for(inbound, f"/{command.name} is for the bot's owners.", is_error=True)
        if command.name == "help":
            return reply_for(inbound, help_text())
        if command.name == "start":
            return reply_for(inbound, f"Hello! Write to me, or use a command.\n{help_text()}")
        if command.name in MEMORY_COMMANDS:
            return await self._memory_command(inbound, command)
        if command.name in ("new", "reset"):
            await anyio.to_thread.run_sync(self.sessions.reset, key)
            logger.info("session reset by /{}", command.name)
            return reply_for(inbound, "Started a new conversation. The old one is kept.")
        session = await anyio.to_thread.run_sync(self.sessions.get_or_create, key)
        if command.name == "queue":
            return await self._queue_command(inbound, session, command.argument)
        if command.name == "model":
            aliases: tuple[str, ...] = getattr(self.provider, "aliases", ())
            offered = f" (aliases: {', '.join(aliases)})" if aliases else ""
            if not command.argument:
                model = await anyio.to_thread.run_sync(self._model_for, session)
                return reply_for(inbound, f"Model: {model}{offered}")
            name = command.argument.split()[0]
            serves = getattr(self.provider, "serves", None)
            if serves is not None and not serves(name):
                text = f"No configured model provider offers {name}; the model is unchanged."
                if aliases:
                    text += f" The aliases are {', '.join(aliases)}."
                return reply_for(inbound, text, is_error=True)
            await anyio.to_thread.run_sync(session.append_model_change, name)
            logger.info("model switched to {}", name)
            return reply_for(inbound, f"Model for this conversation: {name}")
        if command.name == "undo":
            undone = await anyio.to_thread.run_sync(undo_last_exchange, session)
            if undone is None:
                return reply_for(inbound, NOTHING_TO_UNDO_TEXT, is_error=True)
            logger.info("/undo: leaf moved back before entry {}", undone.id)
            quoted = " ".join((undone.message.content or "").split())
            if len(quoted) > 60:
                quoted = quoted[:57] + "..."
            if undone.answered:
                text = (
                    f'Undone: your message "{quoted}" and my answer. I will answer as if '
                    "they had not been sent (they stay in the history)."
                )
            else:  # its turn failed or was stopped: there was no answer to take back
                text = (
                    f'Undone: your message "{quoted}" (it had no answer). I will answer as '
                    "if it had not been sent (it stays in the history)."
                )
            return reply_for(inbound, text)
        if command.name == "compact":
            if self.consolidator is None:
                return reply_for(inbound, "Memory is turned off here.", is_error=True)
            outcome = await self.consolidator.consolidate_now(key, force=True)
            return reply_for(inbound, outcome.describe(), is_error=not outcome.ok)
        if command.name == "status":
            ctx = await anyio.to_thread.run_sync(session.build_context)
            model = ctx.model or self.config.model
            window = await self.windows.ensure(model)
            used = estimate_messages_tokens(ctx.messages[-(self.config.memory_window + 1) :])
            share = 100 * used / window.tokens
            lines = [
                f"Session: {key}",
                f"Messages: {session.message_count}",
                f"Model: {model}",
                f"Context: ~{used:,} of {window.tokens:,} tokens "
                f"({share:.0f}%; from {window.source})",
            ]
            statuses = getattr(self.provider, "statuses", None)
            if statuses is not None:  # each provider's breaker (`gateway.llm.failover`)
                lines += [f"Provider {status.describe()}" for status in statuses()]
            if ctx.summary:
                lines.append("Summary: yes (older turns are summarized)")
            if self.usage is not None:
                lines.append(await anyio.to_thread.run_sync(self._usage_line, key))
            lines += [f"Tools {group.describe()}" for group in self.tools.groups()]
            return reply_for(inbound, "\n".join(lines))
        raise AssertionError(f"unhandled command {command.name}")  # parse_command bounds this

    async def _queue_command(
        self, inbound: InboundMessage, session: Session, argument: str
    ) -> OutboundMessage:
        """/queue MODE keeps this conversation's queue mode in its session (so it holds
        after a restart, on any replica); /queue default goes back to the channel's;
        /queue alone says the mode and where it comes from."""
        modes = self.config.queue_modes
        default = modes.for_channel(inbound.channel)
        choices = f"/queue {'|'.join(QUEUE_MODES)}, or /queue default"
        if not argument:
            own = stored_mode(session.custom_info(QUEUE_MODE_INFO))
            mode = own or default
            source = "set here with /queue" if own else "this channel's default"
            text = f"Queue mode: {mode} ({source}): {MODE_TEXTS[mode]}. Change it with {choices}."
            return reply_for(inbound, text)
        wanted = argument.split()[0].lower()
        if wanted != "default" and wanted not in QUEUE_MODES:
            return reply_for(
                inbound, f"There is no queue mode {wanted!r}; use {choices}.", is_error=True
            )
        chosen: QueueMode | None = None if wanted == "default" else stored_mode({"mode": wanted})
        await anyio.to_thread.run_sync(
            session.append_custom_info, QUEUE_MODE_INFO, {"mode": chosen}
        )
        mode = chosen or default
        logger.info("queue mode set to {}", wanted)
        return reply_for(inbound, f"Queue mode for this conversation: {mode}: {MODE_TEXTS[mode]}.")

    async def _memory_command(self, inbound: InboundMessage, command: Command) -> OutboundMessage:
        """/memory (/facts), /correct and /forget on the memory this conversation uses (in
        the person mode, its person's): another scope's fact id is simply not found."""
        memory = self.memory
        if memory is None:
            return reply_for(inbound, "Memory is turned off here.", is_error=True)
        key, argument = inbound.session_key, command.argument
        if self.people is not None:
            await self._note_dm(inbound)  # whose memory a first message here means
        sender = f"{inbound.channel}:{inbound.sender_id}" if inbound.sender_id else key

        def run() -> tuple[bool, str]:
            if command.name in ("memory", "facts"):
                if not memory.exists(key):  # a look creates nothing
                    return True, "I have no facts remembered about this conversation."
                return True, facts_text(memory.for_session(key))
            if not argument:
                return False, f"Write /{command.name} ID; /memory lists the facts with their ids."
            if not memory.exists(key):
                return False, f"no fact {argument.split()[0]} in your memory"
            scope = memory.for_session(key)
            if command.name == "correct":
                ident, _, text = argument.partition(" ")
                return correct_text(scope, ident, text, by=f"{sender} (/correct)")
            return forget_text(scope, argument)

        try:
            done, text = await anyio.to_thread.run_sync(run)
        except Exception as exc:  # storage trouble: one line for the person, the log has it
            logger.opt(exception=exc).error("/{} failed", command.name)
            return reply_for(inbound, "I could not reach my memory right now.", is_error=True)
        if done and command.name in ("correct", "forget"):
            logger.info("/{}: {}", command.name, text.rsplit("(fact ", 1)[-1].rstrip(")"))
            await self._drop_cached_answers(key)
        return reply_for(inbound, text, is_error=not done)

    async def _drop_cached_answers(self, key: str) -> None:
        """A corrected or forgotten fact may be in an answer cached for this
        conversation: those answers go."""
        if self.cache is None:
            return
        try:
            await self.cache.invalidate(session_key=key)
        except Exception as exc:  # the fact is gone from memory either way
            logger.warning("cached answers of this conversation not dropped: {}", exc)
