"""The response cache through the real agent loop: the real openai client, the fake
server, sessions and the SQLite cache on disk."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI

pytestmark = pytest.mark.anyio


def msg(text: str, channel: str = "telegram", chat: str = "1", sender: str = "1") -> InboundMessage:
    return InboundMessage(channel=channel, chat_id=chat, sender_id=sender, text=text)


def entries(settings: Settings, key: str) -> list[dict[str, Any]]:
    path = settings.sessions_dir / f"{encode_key(key)}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_standalone_question_is_shared_across_channels_and_persisted(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        first = await gw.agent.handle(msg("What is the capital of France?"))
        second = await gw.agent.handle(
            msg("what is the capital of   france", channel="slack", chat="C1", sender="U9")
        )
    finally:
        await gw.aclose()
    assert len(fake_openai.chat_requests) == 1
    assert second.text == first.text and second.metadata.get("cached") is True
    stored = [e for e in entries(settings, "slack:C1") if e["type"] == "message"]
    assert [e["message"]["role"] for e in stored] == ["user", "assistant"]
    assert stored[1].get("meta", {}).get("cached") is True


async def test_context_dependent_answer_never_crosses_sessions(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    fake_openai.add_reply("Nice to meet you, Ada.")
    fake_openai.add_reply("Your name is Ada.")
    fake_openai.add_reply("Nice to meet you, Bob.")
    fake_openai.add_reply("Your name is Bob.")
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(msg("my name is Ada", chat="1", sender="1"))
        ada = await gw.agent.handle(msg("what's my name?", chat="1", sender="1"))
        await gw.agent.handle(msg("my name is Bob", chat="2", sender="2"))
        bob = await gw.agent.handle(msg("what's my name?", chat="2", sender="2"))
    finally:
        await gw.aclose()
    assert ada.text == "Your name is Ada."
    assert bob.text == "Your name is Bob." and not bob.metadata.get("cached")
    assert len(fake_openai.chat_requests) == 4


async def test_same_question_after_different_context_is_a_miss(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(msg("Tell me about Alan Turing", chat="1"))
        await gw.agent.handle(msg("how old was he?", chat="1"))
        await gw.agent.handle(msg("Tell me about Ada Lovelace", chat="2"))
        other = await gw.agent.handle(msg("how old was he?", chat="2"))
    finally:
        await gw.aclose()
    assert not other.metadata.get("cached")
    assert len(fake_openai.chat_requests) == 4


async def test_nocache_prefix_and_disabled_channel_bypass(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, cache__disabled_channels='["slack"]')
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(msg("what is 2+2?", chat="1"))
        fresh = await gw.agent.handle(msg("/nocache what is 2+2?", chat="2"))
        slack = await gw.agent.handle(msg("what is 2+2?", channel="slack", chat="C2"))
        hit = await gw.agent.handle(msg("what is 2+2?", chat="3"))
    finally:
        await gw.aclose()
    assert not fresh.metadata.get("cached") and not slack.metadata.get("cached")
    assert fake_openai.chat_requests[1].last_user_text == "what is 2+2?"  # prefix stripped
    assert hit.metadata.get("cached") is True
    assert len(fake_openai.chat_requests) == 3


async def test_cached_answers_survive_a_restart(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(msg("How many legs does a spider have?", chat="1"))
    finally:
        await gw.aclose()
    gw = Gateway.build(settings)
    try:
        again = await gw.agent.handle(msg("How many legs does a spider have?", chat="2"))
    finally:
        await gw.aclose()
    assert again.metadata.get("cached") is True and len(fake_openai.chat_requests) == 1


async def test_tool_answers_hot_samples_and_streams_are_not_cached(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    settings = make_settings(fake_openai)
    fake_openai.add_tool_call("current_time", {})
    fake_openai.add_reply("It is noon.")
    gw = Gateway.build(settings)
    try:
        await gw.agent.handle(msg("what time is it?", chat="1"))
        again = await gw.agent.handle(msg("what time is it?", chat="2"))
    finally:
        await gw.aclose()
    assert not again.metadata.get("cached")

    hot = make_settings(fake_openai, llm__temperature="0.9")
    gw = Gateway.build(hot)
    try:
        await gw.agent.handle(msg("tell me a joke", chat="5"))
        joke = await gw.agent.handle(msg("tell me a joke", chat="6"))
    finally:
        await gw.aclose()
    assert not joke.metadata.get("cached")


async def test_cache_can_be_disabled(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai, cache__enabled="false")
    gw = Gateway.build(settings)
    try:
        assert gw.cache is None
        await gw.agent.handle(msg("ping?", chat="1"))
        await gw.agent.handle(msg("ping?", chat="2"))
    finally:
        await gw.aclose()
    assert len(fake_openai.chat_requests) == 2
    assert not (settings.workspace_path / "cache.sqlite").exists()


class CountingEmbedder:
    """The cache's own embedder, with the texts it is given written down."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.texts: list[str] = []

    def embed(self, texts: Any) -> Any:
        self.texts.extend(texts)
        return self.inner.embed(texts)


async def test_a_turn_embeds_its_question_once_for_the_near_duplicate_lookup(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    pytest.importorskip("onnxruntime")
    settings = make_settings(fake_openai)
    fake_openai.add_reply("In your account, under Renew.")
    gw = Gateway.build(settings)
    try:
        cache = gw.agent.cache
        assert cache is not None and cache.near_duplicates_on  # the default
        near = cache._near
        assert near is not None
        await cache.warm_up()  # the daemon's start does this: no turn waits for it
        counting = CountingEmbedder(near._embedder)
        near._embedder = counting
        await gw.agent.handle(msg("How do I renew my car insurance online?"))
        counting.texts.clear()
        second = await gw.agent.handle(
            msg("How can I renew my car insurance online?", channel="slack", chat="C1")
        )
    finally:
        await gw.aclose()
    assert second.metadata.get("cached") is True
    assert counting.texts == ["how can i renew my car insurance online"]
    assert cache.near_counts.hits == 1
    assert len(fake_openai.chat_requests) == 1
