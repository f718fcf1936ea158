"""The delivery promise in the same words everywhere it is made (issue 37, item 7):
docs/delivery.md, the README and the page of every channel under channels/, so a page
that says more ("answered once", where a crash can add a reply) or a new channel's page
that leaves it out fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The promise, word for word (the line breaks of a page do not count).
PROMISE = (
    "A message handed to the gateway is answered exactly once. A crash at the worst moment "
    '(SIGKILL, the OOM killer, a power cut with `fsync = "always"`) adds at most one extra '
    "reply per conversation: the reply that was on its way is sent again. The message is "
    "never lost, and never stored twice in its conversation."
)


def channel_names() -> list[str]:
    """The platform channels: each package under channels/ (the terminal is a module)."""
    return sorted(p.parent.name for p in (ROOT / "channels").glob("*/__init__.py"))


def test_every_platform_channel_is_found() -> None:
    assert {"telegram", "slack", "discord", "matrix", "whatsapp", "email"} <= set(channel_names())


@pytest.mark.parametrize(
    "page", ["docs/delivery.md", "README.md", *(f"docs/{name}.md" for name in channel_names())]
)
def test_the_page_makes_the_delivery_promise_in_its_words(page: str) -> None:
    path = ROOT / page
    assert path.is_file(), f"{page}: every channel has a page that makes the promise"
    text = " ".join(path.read_text(encoding="utf-8").split())
    assert text.count(PROMISE) == 1, f"{page} does not say, once, word for word: {PROMISE}"
