"""Shared fixtures: the anyio backend, the fake OpenAI server and a gateway wired to it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings, load_settings
from gateway.llm.openai_provider import OpenAIProvider
from tests.fakes.openai_server import FakeOpenAI

# PostgreSQL fixtures (a schema per test) for every test module; llama.cpp's server;
# Synapse (the Matrix tests); the channel conformance kit (tests/conformance).
pytest_plugins = [
    "tests.local_pg",
    "tests.llama_server",
    "tests.synapse_server",
    "gateway.testing.plugin",
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def fake_openai() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI(models=("gpt-4o-mini", "other-model", "backup")) as fake:
        yield fake


@pytest.fixture
async def provider(fake_openai: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    """The real OpenAI provider talking to `fake_openai` (no retries, 5 s timeout)."""
    real = OpenAIProvider(
        base_url=fake_openai.base_url,
        api_key=fake_openai.api_key,
        model="gpt-4o-mini",
        max_retries=0,
        timeout=5,
    )
    yield real
    await real.aclose()


@pytest.fixture
def fake_openai_thread() -> Iterator[FakeOpenAI]:
    with FakeOpenAI.in_thread(models=("gpt-4o-mini", "other-model", "backup")) as fake:
        yield fake


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Settings]:
    """Settings pointing at a fake server and a private workspace; keyword arguments
    are GATEWAY_* style overrides as dotted keys (e.g. `agent__memory_window=4`)."""

    def make(fake: FakeOpenAI, **overrides: Any) -> Settings:
        env = {
            "OPENAI_BASE_URL": fake.base_url,
            "OPENAI_API_KEY": fake.api_key or "",
            "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
            "GATEWAY_LLM__MAX_RETRIES": "0",
            "GATEWAY_LLM__TIMEOUT": "10",
        }
        for key, value in overrides.items():
            env["GATEWAY_" + key.upper()] = str(value)
        return load_settings(None, environ=env)

    return make
