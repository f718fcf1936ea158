"""The user's side of a turn: the text to store and send (attachments read in, the
speaker's name in a group) and the images that go with it this turn."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.agent.speakers import with_speaker
from gateway.llm.types import LLMMessage
from gateway.media import FileSource, MediaPreparer
from gateway.media.prepare import META_ATTACHMENTS
from gateway.messages import InboundMessage

NO_MEDIA_TEXT = "I can't open attachments here: reading files is turned off."


@dataclass(frozen=True, slots=True)
class UserInput:
    """`text` is the user's message as stored; `images` (data URLs) go to the model with
    it this turn; `meta` goes into the user's entry; `problem` is the answer when nothing
    in the message could be used (the entry is stored all the same)."""

    text: str
    images: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


async def read_user_input(
    inbound: InboundMessage,
    text: str,
    *,
    media: MediaPreparer | None,
    files: FileSource | None,
    model: str,
) -> UserInput:
    """What the user said, with attachments read and, in a group, who said it."""
    if not inbound.attachments:
        return UserInput(with_speaker(text, inbound.metadata))
    if media is None:
        records = [a.to_dict() | {"status": "failed"} for a in inbound.attachments]
        for record in records:
            record.pop("url", None)
        body = text or "[The user sent attachments the gateway could not read.]"
        return UserInput(
            with_speaker(body, inbound.metadata),
            meta={META_ATTACHMENTS: records},
            problem=None if text else NO_MEDIA_TEXT,
        )
    prepared = await media.prepare(text, inbound.attachments, files, model=model)
    problem = None
    if not prepared.usable:
        problem = "\n".join(prepared.problems) or "I could not read what you sent."
    return UserInput(
        text=with_speaker(prepared.text, inbound.metadata),
        images=tuple(image.data_url for image in prepared.images),
        meta={META_ATTACHMENTS: list(prepared.records)},
        problem=problem,
    )


def with_images(messages: Sequence[LLMMessage], images: tuple[str, ...]) -> list[LLMMessage]:
    """`messages` with `images` on the last user message (the turn's own message)."""
    result = list(messages)
    if not images:
        return result
    for index in range(len(result) - 1, -1, -1):
        if result[index].role == "user":
            result[index] = dataclasses.replace(result[index], images=images)
            break
    return result
