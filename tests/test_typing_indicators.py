"""The typing indicator the channel adapters share (channels/typing_indicators.py)."""

from __future__ import annotations

import anyio
import pytest

from channels.typing_indicators import TypingIndicators
from gateway.messages import OutboundMessage

pytestmark = pytest.mark.anyio


class Turn:
    """A `gateway.channel.Ticket` whose reply is ready when the test says so."""

    def __init__(self) -> None:
        self.ready = anyio.Event()

    @property
    def taken(self) -> bool:
        return True

    async def reply(self) -> OutboundMessage | None:
        await self.ready.wait()
        return None


async def test_one_loop_per_place_while_any_turn_there_waits() -> None:
    shown: list[str] = []

    async def show(where: str) -> None:
        shown.append(where)

    typing = TypingIndicators[str](show)
    first, second = Turn(), Turn()
    with anyio.fail_after(5):  # the loop not stopping would hang the task group
        async with anyio.create_task_group() as tg:
            pace = {"spawn": tg.start_soon, "grace": 0.02, "interval": 60.0, "limit": 30.0}
            tg.start_soon(lambda: typing.while_pending(first, "chat", **pace))
            tg.start_soon(lambda: typing.while_pending(second, "chat", **pace))
            tg.start_soon(lambda: typing.while_pending(Turn(), "other", **pace | {"limit": 0.2}))
            await anyio.sleep(0.3)
            # One loop per place (its first indicator shown at once), not one per turn.
            assert sorted(shown) == ["chat", "other"]
            first.ready.set()
            await anyio.sleep(0.05)
            second.ready.set()  # the last turn waiting there: its loop stops


async def test_no_indicator_for_a_reply_ready_within_the_grace() -> None:
    shown: list[str] = []

    async def show(where: str) -> None:
        shown.append(where)

    typing = TypingIndicators[str](show)
    turn = Turn()
    turn.ready.set()
    async with anyio.create_task_group() as tg:
        await typing.while_pending(
            turn, "chat", spawn=tg.start_soon, grace=0.5, interval=0.05, limit=5.0
        )
    assert shown == []


async def test_hide_is_called_once_when_the_last_turn_of_a_place_is_answered() -> None:
    """A platform whose indicator lasts until it is turned off (Matrix) is told once the
    loop stops, even though the loop is stopped by cancellation."""
    shown: list[str] = []
    hidden: list[str] = []

    async def show(where: str) -> None:
        shown.append(where)

    async def hide(where: str) -> None:
        await anyio.sleep(0.01)  # a request: it runs although the loop was cancelled
        hidden.append(where)

    typing = TypingIndicators[str](show, hide)
    turn = Turn()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            pace = {"spawn": tg.start_soon, "grace": 0.02, "interval": 60.0, "limit": 30.0}
            tg.start_soon(lambda: typing.while_pending(turn, "room", **pace))
            await anyio.sleep(0.2)
            assert (shown, hidden) == (["room"], [])
            turn.ready.set()
    assert hidden == ["room"]
