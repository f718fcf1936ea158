"""Three ways to break the example channel, for the conformance kit's own tests: its
negative controls (tests/test_kit_negative_controls.py in the gateway's repository).

Each variant runs, answers people and looks fine when tried by hand; each breaks the
delivery promise (docs/delivery.md) in a way a real channel has, and the kit must catch
it. `[channels.example] defect` picks one. Nothing here belongs in a channel of your own.
"""

from __future__ import annotations

import dataclasses
import math

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from gateway.channel import Submit
from gateway.messages import META_IS_GROUP, META_MENTIONED, InboundMessage, OutboundMessage

from gateway_channel_example.channel import ExampleChannel, Update
from gateway_channel_example.settings import Defect


class ConfirmsBeforeJournal(ExampleChannel):
    """Confirms an update as soon as it holds it in memory and journals it later, from a
    worker: python-telegram-bot's Updater, whose next poll confirms a batch still waiting
    in its queue; a webhook that answers 200 before `submit` returned. A kill between the
    two loses what was confirmed (the kit: `kill_before_journal_loses_nothing`)."""

    _held: MemoryObjectSendStream[Update]

    async def run(
        self,
        submit: Submit,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        self._held, held = anyio.create_memory_object_stream[Update](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._journal_later, held)
            await super().run(submit, task_status=task_status)

    async def _take(self, update: Update) -> bool:
        self._held.send_nowait(update)
        return True  # "the gateway has it": only this process's memory has

    async def _journal_later(self, held: MemoryObjectReceiveStream[Update]) -> None:
        async for update in held:
            await super()._take(update)


class AnswersUnaddressed(ExampleChannel):
    """Takes every group message as addressed to the bot (a mention check left out): the
    bot answers people who were talking to each other, and their chatter is stored and
    sent to the model (the kit: the group and busy-room scenarios)."""

    def _translate(self, update: Update) -> InboundMessage | None:
        message = super()._translate(update)
        if message is None or not message.metadata.get(META_IS_GROUP):
            return message
        return dataclasses.replace(message, metadata={**message.metadata, META_MENTIONED: True})


class RepostsOnReplay(ExampleChannel):
    """Names a message after the delivery that brought it (``<message id>@<update id>``)
    and replies to the message the name starts with: when Example Chat hands a message
    over again, the gateway takes it for a new one and posts a second answer (the kit:
    `duplicate_delivery_is_answered_once`)."""

    def _translate(self, update: Update) -> InboundMessage | None:
        message = super()._translate(update)
        if message is None:
            return None
        delivery = f"{message.message_id}@{update['update_id']}"
        return dataclasses.replace(message, message_id=delivery)

    async def send(self, message: OutboundMessage) -> None:
        reply_to = message.reply_to.partition("@")[0] if message.reply_to else None
        await super().send(dataclasses.replace(message, reply_to=reply_to))


DEFECTS: dict[Defect, type[ExampleChannel]] = {
    "confirm_before_journal": ConfirmsBeforeJournal,
    "answer_unaddressed": AnswersUnaddressed,
    "repost_on_replay": RepostsOnReplay,
}
