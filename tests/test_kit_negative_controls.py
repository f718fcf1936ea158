"""The conformance kit catches what it exists to catch. Three broken variants of the
example channel (`gateway_channel_example.defects`, picked by `[channels.example] defect`)
each fail the scenarios that must catch them, and the failure names what broke; the
correct channel passes the same scenarios, on the same platform, with the same seed.

| defect | the channel | caught by | as |
|---|---|---|---|
| `confirm_before_journal` | confirms before journaling | a kill before journaling | lost |
| `answer_unaddressed` | takes group chatter for mentions | a group, a busy room | bystanders told |
| `repost_on_replay` | names a message after its delivery | a redelivery | answered twice |

Needs the example package installed (tests/example_channel.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from gateway.testing import ChannelDriver, suite
from gateway.testing import kit as kit_module
from gateway.testing.kit import Kit
from tests.example_channel import require_example

pytestmark = pytest.mark.conformance

#: A lost message's failure quotes the log lines that name it (the platform's record
#: shows it pushed: a CI failure whose files are gone still says what happened to it).
LOST = r"\d+ lost \(never stored, never answered\)(.|\n)*what the logs say of m\d{5} .*: [1-9]"
TOLD = r"\d+ posts to people who never addressed the bot"
CHATTER_STORED = r"\d+ unaddressed messages stored"
CHATTER_TO_MODEL = r"\d+ unaddressed messages that reached the model"
SENT_TWICE = r"\d+ replies sent twice"
STORED_TWICE = r"\d+ stored twice"


@dataclass(frozen=True)
class Control:
    """A broken channel, a scenario that must catch it, and what its failure must say."""

    defect: str
    scenario: Callable[[Kit], None]
    mode: str
    says: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.scenario.__name__.removeprefix("test_")


CONTROLS = [
    Control(
        "confirm_before_journal", suite.test_kill_before_journal_loses_nothing, "polling", (LOST,)
    ),
    Control(
        "confirm_before_journal", suite.test_kill_before_journal_loses_nothing, "webhook", (LOST,)
    ),
    Control(
        "answer_unaddressed",
        suite.test_group_mentions_are_answered_once_each_to_their_sender,
        "polling",
        (TOLD, CHATTER_STORED, CHATTER_TO_MODEL),
    ),
    Control(
        "answer_unaddressed",
        suite.test_busy_room_live_answers_only_the_mentions,
        "polling",
        (TOLD, CHATTER_STORED, CHATTER_TO_MODEL),
    ),
    Control(
        "repost_on_replay",
        suite.test_duplicate_delivery_is_answered_once,
        "polling",
        (SENT_TWICE, STORED_TWICE),
    ),
]
#: The same scenarios and modes, run on the correct channel.
SAME = sorted({(c.name, c.mode): c for c in CONTROLS}.items())


@pytest.fixture
def channel_driver(request: pytest.FixtureRequest) -> ChannelDriver:
    require_example()
    from gateway_channel_example.kit_driver import ExampleDriver

    mode, defect = request.param
    return ExampleDriver(mode=mode, defect=defect)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A lost answer is given up on after 2 s without posts, not 15."""
    monkeypatch.setattr(kit_module, "STALL", 2.0)
    yield


@pytest.mark.parametrize(
    ("channel_driver", "control"),
    [pytest.param((c.mode, c.defect), c, id=f"{c.defect}-{c.name}-{c.mode}") for c in CONTROLS],
    indirect=["channel_driver"],
)
def test_the_kit_catches_a_broken_channel(
    kit: Kit, quick: None, control: Control, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(AssertionError) as failed:
        control.scenario(kit)
    message = str(failed.value)
    with capsys.disabled():  # what the kit said, in CI's log
        print("".join(f"\n  {line}" for line in message.splitlines()[1:-1]))
    missing = [says for says in control.says if not re.search(says, message)]
    assert not missing, f"the failure does not say {missing}:\n{message}"


@pytest.mark.parametrize(
    ("channel_driver", "control"),
    [pytest.param((mode, None), c, id=f"{name}-{mode}") for (name, mode), c in SAME],
    indirect=["channel_driver"],
)
def test_the_correct_channel_passes_the_same_scenarios(kit: Kit, control: Control) -> None:
    control.scenario(kit)
