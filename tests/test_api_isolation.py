"""One API client's session names never reach another client's conversations (issue 37,
item 3), end to end: a real daemon and its HTTP server, the real `openai` client on
`/v1`, aiohttp on `/api/chat` and `/admin`, the model faked at the HTTP level.

The pure rule (every spelling of a name, every door) is tested in
tests/test_http_namespace.py; this file holds the promise where a client sees it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import openai
import pytest

from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from tests.fakes.openai_server import FakeOpenAI

pytestmark = pytest.mark.anyio

CHAT_TOKEN = "chat-client-token-0123456789abcdef"
IDE_TOKEN = "ide-client-token-0123456789abcdefgh"
ADMIN_TOKEN = "admin-only-token-0123456789abcdefg"
SECRET = "the vault code is 7731"
QUESTION = "what is the vault code?"
IDE_KEY = "api:ide:ide-proj"


@pytest.fixture(params=["file", "postgresql"])
def storage(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "file":
        return {}
    return {"storage__url": request.getfixturevalue("migrated_pg_url")}


def isolation_settings(
    make_settings: Callable[..., Settings], fake: FakeOpenAI, **kw: Any
) -> Settings:
    """The issue's setup: a chat client (`[http] token`), an `ide` client limited to
    `ide-` names, and an admin token set apart."""
    return make_settings(
        fake,
        http__port=0,
        http__token=CHAT_TOKEN,
        http__admin_token=ADMIN_TOKEN,
        http__api_tokens__ide__token=IDE_TOKEN,
        http__api_tokens__ide__sessions='["ide-"]',
        **kw,
    )


@asynccontextmanager
async def running(settings: Settings) -> AsyncIterator[tuple[str, Daemon]]:
    daemon = Daemon(Gateway.build(settings), interactive=False)
    async with anyio.create_task_group() as tg:
        port = await tg.start(daemon.run)
        try:
            yield f"http://127.0.0.1:{port}", daemon
        finally:
            daemon.stop()


@asynccontextmanager
async def ide_client(url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The `ide` client's real openai client, closed however the test ends."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=IDE_TOKEN, max_retries=0) as client:
        yield client


def user_texts(daemon: Daemon, key: str) -> list[str]:
    session = daemon.gateway.sessions.get_or_create(key)
    session.refresh()
    return [str(m.content) for m in session.messages if m.role == "user"]


def model_saw(fake: FakeOpenAI, text: str) -> bool:
    """Whether any request to the model held `text` anywhere in its messages."""
    return any(text in str(m.get("content")) for r in fake.chat_requests for m in r.messages)


async def chat(url: str, session: str, text: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{url}/api/chat",
            json={"session": session, "text": text},
            headers={"Authorization": f"Bearer {CHAT_TOKEN}"},
        ) as response,
    ):
        return response.status, await response.json()


async def test_the_chat_token_cannot_reach_the_ide_clients_conversation(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], storage: dict[str, Any]
) -> None:
    """The issue's exact scenario: `ide` tells its conversation a secret on /v1; the chat
    client names that conversation's key on /api/chat. It is refused and told which
    names are its own; the model never sees its question beside the secret, and the
    `ide` client's next request (its whole conversation, as the openai client resends
    it) is answered, not 409."""
    settings = isolation_settings(make_settings, fake_openai, **storage)
    async with running(settings) as (url, daemon), ide_client(url) as ide:
        first = await ide.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": SECRET}], user="ide-proj"
        )
        assert first.choices[0].message.content == f"echo: {SECRET}"

        status, body = await chat(url, IDE_KEY, QUESTION)
        assert status == 403, body
        message = body["error"]
        assert "api:<name>" in message  # it says what the token may name
        assert IDE_KEY not in message and "7731" not in message
        assert len(fake_openai.chat_requests) == 1  # the refused question ran no turn

        second = await ide.chat.completions.create(
            model="gpt-4o-mini",
            messages=[
                {"role": "user", "content": SECRET},
                {"role": "assistant", "content": f"echo: {SECRET}"},
                {"role": "user", "content": "and the door code?"},
            ],
            user="ide-proj",
        )
        assert second.choices[0].message.content == "echo: and the door code?"
        assert user_texts(daemon, IDE_KEY) == [SECRET, "and the door code?"]
    assert not model_saw(fake_openai, QUESTION)


async def test_no_spelling_of_another_clients_key_reaches_it(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """Every way to write the `ide` client's key on /api/chat (prefixes, case, unicode
    lookalikes, percent-encoding, extra colons, a subagent's key whose memory is the
    conversation's, the client's bare name) is refused, or is a session of the chat
    client's own: never `api:ide:...`, and no model request of it holds the secret."""
    spellings = [
        "api:ide:ide-proj",
        "ide:ide-proj",
        "api:api:ide:ide-proj",
        "api:IDE:ide-proj",
        "api:Ide:ide-proj",
        "api:\uff49\uff44\uff45:ide-proj",  # fullwidth "ide"
        "api:ide\uff1aide-proj",  # fullwidth colon
        "api:\u0456de:ide-proj",  # Cyrillic i: another key, the chat client's own
        "api:ide:ide-proj:sub:1",  # a subagent's session shares its parent's memory
        "ide:ide-proj:sub:1",
        "api%3Aide%3Aide-proj",
        "api:ide%3Aide-proj",
        "api:ide:ide-",
        "api:ide",
        "ide",
        "ide-proj",
    ]
    settings = isolation_settings(make_settings, fake_openai)
    async with running(settings) as (url, daemon), ide_client(url) as ide:
        await ide.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": SECRET}], user="ide-proj"
        )
        outcomes = {}
        for spelling in spellings:
            before = len(fake_openai.chat_requests)
            status, body = await chat(url, spelling, QUESTION)
            outcomes[spelling] = status
            if status == 200:
                assert not body["session"].startswith("api:ide:"), (spelling, body)
                for request in fake_openai.chat_requests[before:]:
                    assert not any(SECRET in str(m.get("content")) for m in request.messages)
            else:
                assert status in (400, 403), (spelling, status, body)
                assert len(fake_openai.chat_requests) == before
        # The ide client's conversation holds only what it said itself.
        assert user_texts(daemon, IDE_KEY) == [SECRET]
    refused = {s for s, status in outcomes.items() if status != 200}
    assert {
        "api:ide:ide-proj",
        "ide:ide-proj",
        "api:IDE:ide-proj",
        "api:\uff49\uff44\uff45:ide-proj",
        "api:ide\uff1aide-proj",
        "api:ide:ide-proj:sub:1",
    } <= refused


async def test_the_operator_reaches_any_session_and_the_chat_token_is_no_operator(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The admin page reads every session, the `ide` client's too, on purpose: with its
    own token. The chat client's token opens no admin page when the two are apart."""
    settings = isolation_settings(make_settings, fake_openai)
    async with (
        running(settings) as (url, _),
        aiohttp.ClientSession() as http,
        ide_client(url) as ide,
    ):
        await ide.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": SECRET}], user="ide-proj"
        )
        page = f"{url}/admin/session"
        operator = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        async with http.get(page, params={"key": IDE_KEY}, headers=operator) as r:
            assert r.status == 200
            assert SECRET in await r.text()
        chatter = {"Authorization": f"Bearer {CHAT_TOKEN}"}
        async with http.get(page, params={"key": IDE_KEY}, headers=chatter) as r:
            assert r.status == 401
            assert SECRET not in await r.text()
