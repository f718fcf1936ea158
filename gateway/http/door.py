"""The agent behind the OpenAI-compatible API: a turn of `/v1/chat/completions` runs
through the dispatcher like every other message (journal, lanes, dedupe, replicas).

Promises (tested in tests/test_openai_api.py):
- A request with an `Idempotency-Key` is one message: a retry (after a timeout, a lost
  connection, or a gateway killed mid-turn and restarted) gets the reply of its one turn,
  never a second turn. A retry of a turn still running is told 503 + Retry-After.
- A stateless call (no session name) runs in a throwaway session seeded with the
  client's own messages; nothing of it is consolidated into memory, and the session is
  deleted after the turn, unless the call has an Idempotency-Key (its retry must find
  the reply there).
- A full queue is 429 with Retry-After; a draining gateway 503 with Retry-After.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import anyio
from loguru import logger

from gateway.agent.turns import find_turn
from gateway.http.chat_api import API_SENDER, ApiError
from gateway.http.namespace import API_CHANNEL
from gateway.http.openai_api import OpenAIError
from gateway.http.openai_routes import DeltaSink, DoorReply, DoorTurn
from gateway.llm.types import LLMMessage
from gateway.messages import META_API_STREAM, META_EPHEMERAL, InboundMessage
from gateway.sessions.entries import MessageEntry

if TYPE_CHECKING:
    from gateway.agent import AgentLoop
    from gateway.config import LLMSettings
    from gateway.dispatch.lanes import SubmitStatus
    from gateway.messages import OutboundMessage
    from gateway.sessions import Session
    from gateway.usage.protocol import UsageRow

#: How a message of the API is run and answered: the daemon's `api_turn` (its submit
#: status and its reply; ApiError(503) when it was not taken in).
ApiTurn = Callable[[InboundMessage], Awaitable[tuple["SubmitStatus", "OutboundMessage | None"]]]

#: Seconds a client is asked to wait before sending again (429, 503).
RETRY_AFTER_SECONDS = "2"
#: How often a retry of a message polls its session for the reply (the file mode).
_POLL_SECONDS = 0.1


class AgentDoor:
    """`gateway.http.openai_routes.Door` over a running daemon: its agent, its `[llm]`
    settings, how it runs an API message (`api_turn`), and where a streamed reply's text
    deltas go (`streams`, by stream id, which the daemon's delivery writes to)."""

    def __init__(
        self,
        agent: AgentLoop,
        llm: LLMSettings,
        api_turn: ApiTurn,
        streams: dict[str, Callable[[str], None]],
    ) -> None:
        self.agent = agent
        self.llm = llm
        self.api_turn = api_turn
        self.streams = streams
        self._usage: dict[str, Counter[str]] = {}
        self._usage_lock = threading.Lock()
        usage = agent.usage
        if usage is not None:
            usage.on_record(self._count)

    def models(self) -> list[str]:
        llm = self.llm
        return list(dict.fromkeys([llm.model, *llm.fallback_models, *llm.aliases]))

    async def stored_user_texts(self, session_key: str) -> list[str]:
        session = await self.agent.sessions.aget_or_create(session_key)
        branch = await anyio.to_thread.run_sync(session.get_branch)
        return [
            entry.message.content
            for entry in branch
            if isinstance(entry, MessageEntry)
            and entry.message.role == "user"
            and isinstance(entry.message.content, str)
        ]

    # ------------------------------------------------------------------ usage

    def _count(self, row: UsageRow) -> None:
        """A model call's tokens, for the request waiting on its session (may run in a
        worker thread)."""
        with self._usage_lock:
            counter = self._usage.get(row.session_key)
            if counter is not None:
                counter["prompt"] += row.prompt_tokens
                counter["completion"] += row.completion_tokens

    # ------------------------------------------------------------------ the turn

    async def run(self, turn: DoorTurn, on_delta: DeltaSink | None) -> DoorReply:
        from gateway.dispatch.lanes import SubmitStatus

        key = turn.session_key
        _, _, chat_id = key.partition(":")
        metadata: dict[str, object] = {}
        stream_id = None
        if on_delta is not None:
            stream_id = uuid.uuid4().hex
            metadata[META_API_STREAM] = stream_id
            self.streams[stream_id] = on_delta
        if turn.stateless:
            metadata[META_EPHEMERAL] = True
        message = InboundMessage(
            channel=API_CHANNEL,
            chat_id=chat_id,
            text=turn.text,
            sender_id=API_SENDER,
            message_id=turn.message_id,
            metadata=metadata,
        )
        counter: Counter[str] = Counter()
        with self._usage_lock:
            self._usage[key] = counter
        seeded: Session | None = None
        try:
            if turn.stateless:
                seeded = await self._seed(key, turn)
            try:
                status, reply = await self.api_turn(message)
            except ApiError as exc:
                raise OpenAIError(
                    exc.status,
                    exc.message,
                    type="server_error",
                    code="retry",
                    headers={"Retry-After": "1"},
                ) from None
        finally:
            with self._usage_lock:
                self._usage.pop(key, None)
            if stream_id is not None:
                self.streams.pop(stream_id, None)
            if turn.stateless and turn.message_id is None:
                await self._discard(key)
            elif seeded is not None:
                # Kept for a retry (its Idempotency-Key): durable even if no turn ran
                # (a turn's own appends made them so already: then nothing to do).
                with anyio.CancelScope(shield=True):
                    await seeded.asettle()
        if status is SubmitStatus.REJECTED_FULL:
            raise OpenAIError(
                429,
                "the gateway's queue is full; send the request again in a moment",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
        if status is SubmitStatus.REJECTED_DRAINING:
            raise OpenAIError(
                503,
                "the gateway is shutting down; send the request again in a moment",
                type="server_error",
                code="unavailable",
                headers={"Retry-After": RETRY_AFTER_SECONDS},
            )
        if reply is None and status is SubmitStatus.DUPLICATE and turn.message_id:
            # The file mode's retry of a message taken in already: its reply is in the
            # session once its one turn ends (here, or replayed after a restart).
            return DoorReply(await self._earlier_reply(key, turn.message_id))
        if reply is None:
            return DoorReply("")
        return DoorReply(
            reply.text,
            prompt_tokens=counter["prompt"],
            completion_tokens=counter["completion"],
            is_notice=reply.is_error,
        )

    async def _earlier_reply(self, key: str, message_id: str) -> str:
        """The reply its session holds for `message_id`, waited for while its turn runs;
        OpenAIError(503) when none comes in time."""
        session = await self.agent.sessions.aget_or_create(key)
        with anyio.move_on_after(self.llm.timeout * 3):
            while True:
                await anyio.to_thread.run_sync(session.refresh)
                branch = await anyio.to_thread.run_sync(session.get_branch)
                found = find_turn(branch, message_id)
                if found is not None and found.reply is not None:
                    return found.reply
                if found is not None and not found.is_latest:
                    raise OpenAIError(
                        409,
                        "this message's turn was interrupted by a later one and has no "
                        "reply; send it again with a new Idempotency-Key",
                        code="turn_interrupted",
                    )
                await anyio.sleep(_POLL_SECONDS)
        raise OpenAIError(
            503,
            "this message (same Idempotency-Key) is still being answered; send it again "
            "to get its reply",
            type="server_error",
            code="still_running",
            headers={"Retry-After": "1"},
        )

    async def _seed(self, key: str, turn: DoorTurn) -> Session | None:
        """A stateless call's throwaway session, holding the client's messages (None
        when it needs none or holds them already)."""
        session = await self.agent.sessions.aget_or_create(key)
        if not turn.earlier or session.message_count > 0:
            return None  # nothing to hold, or a retry's session, seeded already
        for said in turn.earlier:
            # Durable in the turn's round, with the question and the reply.
            await session.aadd_message(LLMMessage(role=said.role, content=said.text), defer=True)
        return session

    async def _discard(self, key: str) -> None:
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.agent.sessions.delete, key)
                self.agent.forget(key)
        except Exception as exc:  # a leftover file is harmless; say so, do not fail
            logger.warning("stateless session {} was not deleted: {}", key, exc)
