"""Subagents: the `spawn` tool runs a task in its own session, `<parent key>:sub:<id>`.

A subagent is an ordinary turn of the agent loop in a session of its own (listed and
shown like any other), sharing the memory scope of the conversation it serves
(`gateway.memory.scopes`), with its own token budget. The promises kept here:

- a runaway model cannot multiply itself: subagents nest at most `max_depth` deep and
  at most `max_concurrent` run at once in the whole gateway; a spawn past either limit
  is answered at once with an error the model can read, and nothing starts;
- the parent's session records the spawn (the tool call) and its result (the tool
  result); a background subagent's result comes back into the parent's conversation as
  a journaled message through the dispatcher (so it keeps the conversation's order,
  is stored there, and its answer is delivered to the chat).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from loguru import logger

from gateway.agent.commands import parse_command
from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import ToolSpec
from gateway.messages import META_MENTIONED, InboundMessage, subagent_depth, subagent_session_key

if TYPE_CHECKING:
    from gateway.agent.loop import AgentLoop
    from gateway.channel import Submit

#: Metadata of the message that brings a background subagent's result to its parent.
META_SUBAGENT = "subagent"


@dataclass(frozen=True, slots=True)
class SubagentLimits:
    """The `[subagents]` settings."""

    max_depth: int = 1
    max_concurrent: int = 4
    token_budget: int = 20_000
    timeout_seconds: float = 300.0


SPAWN_SPEC = ToolSpec(
    name="spawn",
    description=(
        "Hand a self-contained task to a subagent: it works on it in a separate session "
        "(with the same memory and tools) and returns its result. Set background to true "
        "for a long task: the result is then posted to this conversation when it is done."
    ),
    parameters={
        "type": "object",
        "properties": {
            "task": {"type": "string", "description": "What the subagent should do."},
            "background": {
                "type": "boolean",
                "description": "Run without waiting; the result arrives later.",
            },
        },
        "required": ["task"],
        "additionalProperties": False,
    },
)


class Subagents:
    """Runs subagents for the `spawn` tool. Start `run` in a task group for background
    subagents and set `submit` (the dispatcher's) for their results to come back; without
    them a background spawn runs in the foreground."""

    def __init__(self, agent: AgentLoop, limits: SubagentLimits) -> None:
        self.agent = agent
        self.limits = limits
        self.submit: Submit | None = None
        self.active = 0  # running now, foreground and background
        self.refused = 0  # spawns refused by a limit, for tests and metrics
        self._tg: anyio.abc.TaskGroup | None = None

    def tool(self) -> Tool:
        # The registry's own timeout bounds a foreground subagent (and cancels it).
        return Tool(SPAWN_SPEC, self._spawn, timeout=self.limits.timeout_seconds)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Host background subagents until cancelled (they end with it)."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    async def _spawn(self, args: dict[str, Any], context: ToolContext) -> str:
        task = args.get("task")
        if not isinstance(task, str) or not task.strip():
            return "error: spawn needs a non-empty 'task' string"
        if parse_command(task) is not None:
            return "error: a task cannot be a chat command; describe the work in words"
        depth = subagent_depth(context.session_key)
        if depth >= self.limits.max_depth:
            self.refused += 1
            logger.warning("spawn refused: depth {} reached", depth)
            return (
                f"error: subagents may not spawn further subagents (depth limit "
                f"{self.limits.max_depth}); do this task yourself"
            )
        if self.active >= self.limits.max_concurrent:
            self.refused += 1
            logger.warning("spawn refused: {} subagents are running", self.active)
            return (
                f"error: {self.active} subagents are running, the most allowed at once; "
                "wait for their results or do this task yourself"
            )
        key = subagent_session_key(context.session_key, uuid.uuid4().hex[:12])
        background = args.get("background") is True
        if background and (self._tg is None or self.submit is None or context.inbound is None):
            background = False  # nowhere to deliver a later result: wait for it now
        self.active += 1  # no await since the check: the limit holds
        if background:
            assert self._tg is not None and context.inbound is not None
            self._tg.start_soon(self._run_background, key, task, context.inbound)
            return (
                f"started subagent {key} in the background; its result will be posted "
                "to this conversation when it is done"
            )
        try:
            return await self._run_foreground(key, task, context)
        finally:
            self.active -= 1

    def _inbound(self, key: str, task: str, parent: InboundMessage | None) -> InboundMessage:
        if parent is None:
            return InboundMessage(
                channel="system", chat_id=key, text=task, session_key_override=key
            )
        return InboundMessage(
            channel=parent.channel,
            chat_id=parent.chat_id,
            text=task,
            sender_id=parent.sender_id,
            thread_kind=parent.thread_kind,
            thread_id=parent.thread_id,
            session_key_override=key,
        )

    async def _run_foreground(self, key: str, task: str, context: ToolContext) -> str:
        logger.info("subagent {} starts", key)
        reply = await self.agent.handle(
            self._inbound(key, task, context.inbound), token_budget=self.limits.token_budget
        )
        logger.info("subagent {} finished", key)
        if reply.is_error:
            return f"error: subagent {key} failed: {reply.text}"
        return f"subagent {key} finished:\n{reply.text}"

    async def _run_background(self, key: str, task: str, parent: InboundMessage) -> None:
        status, result_text = "failed", "an internal error (the gateway's log says more)"
        with logger.contextualize(session=key):
            try:
                logger.info("subagent {} starts in the background", key)
                with anyio.fail_after(self.limits.timeout_seconds):
                    reply = await self.agent.handle(
                        self._inbound(key, task, parent), token_budget=self.limits.token_budget
                    )
                status = "failed" if reply.is_error else "finished"
                result_text = reply.text
            except TimeoutError:
                status = f"did not finish within {self.limits.timeout_seconds:g}s"
                result_text = "(no result)"
            except Exception:
                logger.exception("background subagent {} failed", key)
            finally:
                self.active -= 1
            logger.info("subagent {} done; its result goes to {}", key, parent.session_key)
            assert self.submit is not None
            sub_id = key.rsplit(":", 1)[-1]
            message = InboundMessage(
                channel=parent.channel,
                chat_id=parent.chat_id,
                text=(
                    f"[Background subagent {key} {status}]\n{result_text}\n\n"
                    f"(The task was: {task}. Tell the user what it found.)"
                ),
                sender_id=parent.sender_id,
                # Journaled like a platform message: its turn runs once.
                message_id=f"subagent:{sub_id}:result",
                thread_kind=parent.thread_kind,
                thread_id=parent.thread_id,
                session_key_override=parent.session_key,
                # The conversation asked for it: a group's mention rule lets it through.
                metadata={META_SUBAGENT: key, META_MENTIONED: True},
            )
            try:
                await self.submit(message)
            except Exception:
                logger.exception("the result of subagent {} could not be queued", key)
