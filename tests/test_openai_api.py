"""The OpenAI-compatible API (`/v1/chat/completions`, `/v1/models`) of a running daemon,
driven by the real `openai` client (sync and async, streamed and not) and by raw HTTP for
the edge cases, in both storage modes; the model is the fake OpenAI server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import openai
import pytest
from loguru import logger

from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.http.namespace import Caller, Route, SessionRefused, resolve_session
from gateway.http.openai_api import (
    ClientMessage,
    OpenAIError,
    history_conflict,
    parse_completion_request,
)
from tests.fakes.openai_server import FakeOpenAI, Reply

pytestmark = pytest.mark.anyio
TOKEN = "test-openai-door-token-0123456789"
IDE_TOKEN = "test-ide-client-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["file", "postgresql"])
def storage(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The settings of each storage mode (PostgreSQL: a migrated schema of its own)."""
    if request.param == "file":
        return {}
    return {"storage__url": request.getfixturevalue("migrated_pg_url")}


def door_settings(make_settings: Callable[..., Settings], fake: FakeOpenAI, **kw: Any) -> Settings:
    return make_settings(
        fake,
        http__port=0,
        http__token=TOKEN,
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


def user_texts(daemon: Daemon, key: str) -> list[str]:
    session = daemon.gateway.sessions.get_or_create(key)
    session.refresh()
    return [str(m.content) for m in session.messages if m.role == "user"]


#: A stateless call's history: the client holds the conversation.
ADA: Any = [
    {"role": "user", "content": "my name is Ada"},
    {"role": "assistant", "content": "hello Ada"},
    {"role": "user", "content": [{"type": "text", "text": "what is my name?"}]},
]


# ---------------------------------------------------------------- the openai client


async def test_the_openai_client_talks_to_the_agent_in_both_storage_modes(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], storage: dict[str, Any]
) -> None:
    """Async and sync clients, streamed and not: every answer is the agent's, the named
    session holds the conversation, and a client resending the whole conversation
    (the usual OpenAI client) is in agreement with it."""
    settings = door_settings(make_settings, fake_openai, **storage)
    async with running(settings) as (url, daemon):
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        first = await aclient.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "hello door"}],
            user="work",
        )
        assert first.object == "chat.completion"
        assert first.choices[0].message.content == "echo: hello door"
        assert first.choices[0].finish_reason == "stop"
        assert first.model == "gpt-4o-mini"
        assert first.usage is not None and first.usage.prompt_tokens > 0
        assert first.usage.total_tokens == first.usage.prompt_tokens + (
            first.usage.completion_tokens
        )

        history: list[Any] = [
            {"role": "system", "content": "the client's own system prompt (ignored)"},
            {"role": "user", "content": "hello door"},
            {"role": "assistant", "content": "echo: hello door"},
            {"role": "user", "content": "and streamed?"},
        ]
        stream = await aclient.chat.completions.create(
            model="gpt-4o-mini",
            messages=history,
            user="work",
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "echo: and streamed?"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert not chunks[-1].choices and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens > 0
        assert len({c.id for c in chunks}) == 1

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)

        def sync_calls() -> tuple[str | None, str]:
            plain = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "sync plain"}],
                extra_headers={"X-Session": "work"},
            )
            streamed = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "sync streamed"}],
                user="work",
                stream=True,
            )
            pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
            return plain.choices[0].message.content, "".join(pieces)

        plain, streamed_text = await anyio.to_thread.run_sync(sync_calls)
        assert plain == "echo: sync plain" and streamed_text == "echo: sync streamed"
        assert user_texts(daemon, "api:default:work") == [
            "hello door",
            "and streamed?",
            "sync plain",
            "sync streamed",
        ]
        # The model saw the gateway's history, not the client's system prompt.
        seen = fake_openai.chat_requests[1].messages
        assert not any("client's own system" in str(m.get("content")) for m in seen)

        # A client whose history the session does not hold: 409 with the reason.
        with pytest.raises(openai.ConflictError) as conflict:
            await aclient.chat.completions.create(
                model="gpt-4o-mini",
                messages=[
                    {"role": "user", "content": "something never said"},
                    {"role": "assistant", "content": "?"},
                    {"role": "user", "content": "go on"},
                ],
                user="work",
            )
        error = conflict.value.body
        assert isinstance(error, dict) and error["code"] == "conversation_conflict"
        assert "new session" in error["message"]
        await aclient.close()
    assert len(fake_openai.chat_requests) == 4  # the conflict never reached the model


async def test_models_and_an_unknown_model(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = door_settings(
        make_settings,
        fake_openai,
        llm__fallback_models='["backup"]',
        llm__aliases__smart='["default:other-model"]',
    )
    async with running(settings) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        models = [m.id async for m in client.models.list()]
        assert models == ["gpt-4o-mini", "backup", "smart"]
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(
                model="gpt-5-ultra", messages=[{"role": "user", "content": "hi"}], user="x"
            )
        assert isinstance(missing.value.body, dict)
        assert missing.value.body["code"] == "model_not_found"
        bad = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()
        await client.close()
    assert fake_openai.chat_requests == []


# ---------------------------------------------------------------- raw HTTP edges


async def test_errors_the_server_answers_before_a_route_are_in_openai_shape_under_v1(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """A wrong method or an unknown path under /v1/ is refused by the server itself, not
    by the routes: still OpenAI's error object there, `/api/...`'s own shape elsewhere."""
    settings = door_settings(make_settings, fake_openai)
    async with running(settings) as (url, _), aiohttp.ClientSession(base_url=url) as http:
        async with http.get("/v1/chat/completions", headers=AUTH) as resp:
            assert resp.status == 405
            body = await resp.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error"
        assert "POST" in body["error"]["message"]
        async with http.get("/v1/embeddings", headers=AUTH) as resp:
            assert resp.status == 404
            assert set((await resp.json())["error"]) == {"message", "type", "param", "code"}
        async with http.get("/api/chat") as resp:
            assert resp.status == 405
            assert isinstance((await resp.json())["error"], str)


async def test_raw_http_edges_speak_openai_shapes(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = door_settings(make_settings, fake_openai)
    completions = "/v1/chat/completions"
    async with running(settings) as (url, _), aiohttp.ClientSession(base_url=url) as http:

        async def post(body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
            sent = AUTH if headers is None else headers
            async with http.post(completions, json=body, headers=sent) as resp:
                return resp.status, await resp.json()

        hi = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        status, body = await post(hi, {})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert set(body["error"]) == {"message", "type", "param", "code"}
        status, body = await post(hi, {"Authorization": "Bearer nope"})
        assert status == 401 and body["error"]["message"] == "invalid bearer token"

        tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
        status, body = await post({**hi, "tools": [tool]})
        assert status == 400 and body["error"]["code"] == "tools_not_supported"
        assert "tools" in body["error"]["message"] and body["error"]["param"] == "tools"
        status, body = await post({**hi, "stream_options": {"include_usage": True}})
        assert status == 400 and body["error"]["param"] == "stream_options"
        status, body = await post({**hi, "user": "a"}, {**AUTH, "X-Session": "b"})
        assert status == 400 and "different sessions" in body["error"]["message"]
        last_assistant = {**hi, "messages": [*hi["messages"], {"role": "assistant"}]}
        status, body = await post(last_assistant)
        assert status == 400 and "last message" in body["error"]["message"]
        async with http.post(completions, data=b"{nope", headers=AUTH) as resp:
            assert resp.status in (400, 415)
            assert "error" in await resp.json()

        # The exact SSE wire format: data lines, blank-line separated, [DONE] last.
        async with http.post(
            completions, json={**hi, "stream": True, "user": "sse"}, headers=AUTH
        ) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = (await resp.read()).decode()
        events = [e for e in raw.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert "usage" not in chunks[0]  # include_usage not asked
        said = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert said == "echo: hi"

        # Named clients: their own namespace, and only their allowed names.
        ide = {"Authorization": f"Bearer {IDE_TOKEN}"}
        status, body = await post({**hi, "user": "ide-main"}, ide)
        assert status == 200 and body["choices"][0]["message"]["content"] == "echo: hi"
        status, body = await post({**hi, "user": "main"}, ide)
        assert status == 403 and body["error"]["code"] == "session_not_allowed"
    sessions = Path(settings.workspace_path) / "sessions"
    names = sorted(p.name for p in sessions.glob("*.jsonl"))
    assert names == ["api%3Adefault%3Asse.jsonl", "api%3Aide%3Aide-main.jsonl"]


async def test_a_stateless_call_sees_the_clients_messages_and_keeps_nothing(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], storage: dict[str, Any]
) -> None:
    settings = door_settings(make_settings, fake_openai, **storage)
    async with running(settings) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        answer = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=ADA,
        )
        await client.close()
    assert answer.choices[0].message.content == "echo: what is my name?"
    sent = [m.get("content") for m in fake_openai.chat_requests[0].messages]
    assert "my name is Ada" in sent and "hello Ada" in sent
    if not storage:
        workspace = Path(settings.workspace_path)
        assert not list((workspace / "sessions").glob("*stateless*"))
        assert not list(workspace.rglob("*stateless*"))  # noqa: ASYNC240 (a test check)
    else:
        import psycopg

        with psycopg.connect(storage["storage__url"]) as conn:
            left = conn.execute(
                "SELECT count(*) FROM gw_sessions WHERE key LIKE 'api:default:~stateless%'"
            ).fetchone()
        assert left == (0,)


async def test_a_kept_stateless_session_is_durable_in_the_turns_one_round(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """A stateless call with an Idempotency-Key keeps its session for a retry: the
    client's earlier messages, its question and the reply are made durable together,
    in one group-commit round, before the answer is given."""
    from gateway.http.namespace import STATELESS_PREFIX
    from gateway.sessions.keys import key_from_filename
    from gateway.sessions.store import FileSessionStore

    settings = door_settings(make_settings, fake_openai)
    async with running(settings) as (url, daemon):
        manager = daemon.gateway.sessions
        rounds = manager._async_committer.rounds
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        answer = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=ADA,
            extra_headers={"Idempotency-Key": "kept-1"},
        )
        await client.close()
        ((key, path),) = [
            (key, path)
            for path in (Path(settings.workspace_path) / "sessions").glob("*.jsonl")
            if STATELESS_PREFIX in (key := key_from_filename(path.name) or "")
        ]
        session = manager.cached(key)
        assert session is not None
        store = session._store
        assert isinstance(store, FileSessionStore) and store._handle is not None
        assert not store.unsettled and not store._handle.dirty
        assert manager._async_committer.rounds == rounds + 1
    assert answer.choices[0].message.content == "echo: what is my name?"
    stored = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["message"]["content"] for e in stored if e["type"] == "message"] == [
        "my name is Ada",
        "hello Ada",
        "what is my name?",
        "echo: what is my name?",
    ]


async def test_streamed_deltas_reach_the_client_as_the_model_writes(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = door_settings(make_settings, fake_openai, llm__stream="true")
    fake_openai.add(Reply(text="one two three four five six"))
    async with running(settings) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        stream = await client.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "count"}],
            user="counting",
            stream=True,
        )
        pieces = [c.choices[0].delta.content async for c in stream if c.choices]
        await client.close()
    texts = [p for p in pieces if p]
    assert "".join(texts) == "one two three four five six"
    assert len(texts) > 2  # streamed in pieces, not one piece at the end


async def test_a_full_queue_is_429_with_retry_after(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = door_settings(
        make_settings,
        fake_openai,
        dispatch__max_concurrent_turns=1,
        dispatch__max_queue_per_lane=1,
    )
    fake_openai.hold(lambda body: True, count=1)
    async with running(settings) as (url, _), aiohttp.ClientSession(base_url=url) as http:
        body = {"model": "gpt-4o-mini", "user": "busy"}
        answers: list[int] = []

        async def ask(text: str) -> None:
            message = {**body, "messages": [{"role": "user", "content": text}]}
            async with http.post("/v1/chat/completions", json=message, headers=AUTH) as r:
                answers.append(r.status)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "first")
            await anyio.to_thread.run_sync(fake_openai.wait_held)
            tg.start_soon(ask, "second")  # queued behind the first
            await anyio.sleep(0.3)
            message = {**body, "messages": [{"role": "user", "content": "third"}]}
            async with http.post("/v1/chat/completions", json=message, headers=AUTH) as r:
                refused = (r.status, r.headers.get("Retry-After"), await r.json())
            fake_openai.release()
    assert refused[0] == 429 and refused[1] is not None and int(refused[1]) > 0
    assert refused[2]["error"]["type"] == "rate_limit_error"
    assert sorted(answers) == [200, 200]


async def test_an_idempotency_key_makes_a_retry_the_same_message(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], storage: dict[str, Any]
) -> None:
    """The same request sent twice with one Idempotency-Key (a client retrying after a
    lost answer): one turn, one model call, the same reply twice; stream or not."""
    settings = door_settings(make_settings, fake_openai, **storage)
    async with running(settings) as (url, daemon):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        replies = []
        for stream in (False, False, True):
            kwargs: Any = {
                "model": "gpt-4o-mini",
                "messages": [{"role": "user", "content": "only once"}],
                "user": "retry",
                "extra_headers": {"Idempotency-Key": "k-123"},
            }
            if stream:
                chunks = await client.chat.completions.create(stream=True, **kwargs)
                replies.append("".join([c.choices[0].delta.content or "" async for c in chunks]))
            else:
                answer = await client.chat.completions.create(**kwargs)
                replies.append(answer.choices[0].message.content)
        await client.close()
        stored = user_texts(daemon, "api:default:retry")
    assert replies == ["echo: only once"] * 3
    assert len(fake_openai.chat_requests) == 1
    assert stored == ["only once"]


async def test_a_client_that_leaves_a_stream_does_not_stop_the_turn(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The client hangs up while the model is still answering: the turn goes on and is
    stored, and the client's retry (same Idempotency-Key) gets its reply, with no second
    model call. A turn that ends in the gateway's notice says so in a header."""
    settings = door_settings(make_settings, fake_openai, llm__stream="true")
    fake_openai.add(Reply(text="a slow answer", delay=1.0))
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "take your time"}],
        "user": "leaver",
        "stream": True,
    }
    headers = {**AUTH, "Idempotency-Key": "leave-1"}
    async with running(settings) as (url, daemon), aiohttp.ClientSession(base_url=url) as http:
        with anyio.move_on_after(0.3):
            async with http.post("/v1/chat/completions", json=body, headers=headers) as r:
                await r.read()
        await anyio.to_thread.run_sync(fake_openai.wait_for_requests, 1)
        await anyio.sleep(1.5)  # the model's answer comes while nobody listens
        assert user_texts(daemon, "api:default:leaver") == ["take your time"]
        retry = {**body, "stream": False}
        async with http.post("/v1/chat/completions", json=retry, headers=headers) as r:
            answer = await r.json()
        fake_openai.add_error(400)
        failing = {**retry, "messages": [{"role": "user", "content": "this fails"}]}
        async with http.post("/v1/chat/completions", json=failing, headers=AUTH) as r:
            notice = (r.status, r.headers.get("X-Gateway-Notice"), await r.json())
    assert answer["choices"][0]["message"]["content"] == "a slow answer"
    assert len(fake_openai.chat_requests) == 2  # the slow answer once, and the failing one
    assert notice[:2] == (200, "true")
    assert notice[2]["choices"][0]["message"]["content"]  # the notice's text


# ---------------------------------------------------------------- a stream cut off

#: The notice docs/failover.md promises when a streamed answer breaks off.
CUT_OFF_NOTICE = "The model's answer was cut off. Please try again."
LONG_ANSWER = " ".join(f"word{i}" for i in range(40))
#: What the client has of LONG_ANSWER when the model server dies 25 words into it.
FIRST_25_WORDS = " ".join(LONG_ANSWER.split()[:25]) + " "


def cut_off_after(words: int, **kw: Any) -> Reply:
    """LONG_ANSWER from a model server that dies after `words` words (its first event
    carries only the role)."""
    return Reply(text=LONG_ANSWER, break_after=words + 1, **kw)


def stored_messages(daemon: Daemon, key: str) -> list[tuple[str, str]]:
    session = daemon.gateway.sessions.get_or_create(key)
    session.refresh()
    return [(m.role, str(m.content)) for m in session.messages]


async def test_a_stream_the_model_breaks_off_makes_the_openai_client_raise(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings], storage: dict[str, Any]
) -> None:
    """The model server dies 25 words into a streamed answer. The client has those 25
    words, then the openai client (async and sync) raises APIError with the cut-off
    notice: never a finish_reason "stop" nor a usage chunk that would pass the partial
    text for the answer. The session keeps the questions, not the partial answers (the
    turns failed), and answers the next question."""
    settings = door_settings(make_settings, fake_openai, llm__stream="true", **storage)
    fake_openai.add(cut_off_after(25))
    fake_openai.add(cut_off_after(25))
    async with running(settings) as (url, daemon):
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
        stream = await aclient.chat.completions.create(
            model="gpt-4o-mini",
            messages=[{"role": "user", "content": "tell me a long story"}],
            user="cut",
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = []
        with pytest.raises(openai.APIError) as caught:
            async for chunk in stream:
                chunks.append(chunk)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)

        def sync_cut() -> tuple[str, openai.APIError]:
            streamed = client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "and again?"}],
                user="cut",
                stream=True,
            )
            pieces = []
            try:
                for chunk in streamed:
                    pieces.append(chunk.choices[0].delta.content or "")
            except openai.APIError as exc:
                return "".join(pieces), exc
            raise AssertionError("the sync client read the cut-off stream as complete")

        sync_text, sync_error = await anyio.to_thread.run_sync(sync_cut)
        answer = await aclient.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "back?"}], user="cut"
        )
        await aclient.close()
        stored = stored_messages(daemon, "api:default:cut")
    said = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert said == FIRST_25_WORDS and sync_text == FIRST_25_WORDS
    assert all(c.choices and c.choices[0].finish_reason is None for c in chunks)
    for error in (caught.value, sync_error):
        # The model's connection broke, not the client's: the gateway says so itself.
        assert not isinstance(error, openai.APIConnectionError)
        assert error.message == CUT_OFF_NOTICE
        assert (error.code, error.type) == ("answer_cut_off", "server_error")
    assert answer.choices[0].message.content == "echo: back?"
    assert stored == [
        ("user", "tell me a long story"),
        ("user", "and again?"),
        ("user", "back?"),
        ("assistant", "echo: back?"),
    ]


async def test_a_stream_cut_off_ends_with_an_error_event_and_done_on_the_wire(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The exact end of a stream the model broke off: the text sent as it was, one
    error event in OpenAI's error shape, `data: [DONE]`, and a whole HTTP body (the
    gateway's response ends cleanly; only the model's connection broke)."""
    settings = door_settings(make_settings, fake_openai, llm__stream="true")
    fake_openai.add(cut_off_after(25))
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "user": "wire",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        running(settings) as (url, _),
        aiohttp.ClientSession(base_url=url) as http,
        http.post("/v1/chat/completions", json=body, headers=AUTH) as resp,
    ):
        assert resp.status == 200
        raw = (await resp.read()).decode()  # ClientPayloadError if it were cut
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: ")) == {
        "error": {
            "message": CUT_OFF_NOTICE,
            "type": "server_error",
            "param": None,
            "code": "answer_cut_off",
        }
    }
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * len(chunks)
    assert [c["usage"] for c in chunks] == [None] * len(chunks)
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert said == FIRST_25_WORDS


async def test_a_streamed_turn_that_ends_in_a_notice_before_any_text_says_so(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The model refuses before its first word: the notice is the streamed reply's
    text, ended as an answer is, and the response carries X-Gateway-Notice as an
    answer that is not streamed does."""
    settings = door_settings(make_settings, fake_openai, llm__stream="true")
    fake_openai.add_error(400)
    body = {
        "model": "gpt-4o-mini",
        "messages": [{"role": "user", "content": "this fails"}],
        "user": "noticed",
        "stream": True,
    }
    async with (
        running(settings) as (url, _),
        aiohttp.ClientSession(base_url=url) as http,
        http.post("/v1/chat/completions", json=body, headers=AUTH) as resp,
    ):
        notice_header = resp.headers.get("X-Gateway-Notice")
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert notice_header == "true"
    assert said and chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_client_gone_before_the_model_breaks_off_does_not_matter(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    """The client hangs up while the answer streams, then the model server dies: the
    turn ends as cut off (the question kept, no partial answer) with nobody to tell,
    and the session answers the next question. A hang-up is no failure of the
    gateway's: no error is logged for the request."""
    settings = door_settings(make_settings, fake_openai, llm__stream="true")
    fake_openai.add(cut_off_after(25, chunk_delay=0.05))
    errors: list[str] = []
    sink = logger.add(lambda message: errors.append(str(message)), level="ERROR")
    try:
        async with running(settings) as (url, daemon):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0)
            stream = await client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "tell me a long story"}],
                user="gone",
                stream=True,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # the first word read: hang up
            await stream.close()
            # Queued in the session's lane behind the turn, which goes on to the break.
            answer = await client.chat.completions.create(
                model="gpt-4o-mini",
                messages=[{"role": "user", "content": "still there?"}],
                user="gone",
            )
            await client.close()
            stored = stored_messages(daemon, "api:default:gone")
            failed = dict(daemon.gateway.agent.llm_errors)
    finally:
        logger.remove(sink)
    assert failed == {"LLMError": 1}  # the first turn met the broken stream
    assert [line for line in errors if "turn failed" not in line] == []
    assert answer.choices[0].message.content == "echo: still there?"
    assert stored == [
        ("user", "tell me a long story"),
        ("user", "still there?"),
        ("assistant", "echo: still there?"),
    ]


# ---------------------------------------------------------------- pure policies


def test_history_agrees_when_the_client_holds_the_sessions_tail() -> None:
    stored = ["a", "b", "c"]

    def said(*texts: str) -> list[ClientMessage]:
        return [ClientMessage("user", t) for t in texts]

    assert history_conflict([], stored) is None
    assert history_conflict(said("a", "b", "c"), stored) is None
    assert history_conflict(said("b", "c"), stored) is None  # a shorter window
    assert history_conflict([*said("c"), ClientMessage("assistant", "x")], stored) is None
    assert history_conflict(said("/help", "c"), stored) is None  # commands are not stored
    assert history_conflict(said("a", "c"), stored) is not None
    assert history_conflict(said("z", "a", "b", "c"), stored) is not None
    assert history_conflict(said("x"), []) is not None


def test_parsing_refuses_what_it_cannot_serve() -> None:
    def refused(body: Any, header: str | None = None) -> OpenAIError:
        with pytest.raises(OpenAIError) as exc:
            parse_completion_request(json.dumps(body).encode(), header)
        return exc.value

    hi = [{"role": "user", "content": "hi"}]
    assert refused({"messages": hi}).param == "model"
    assert refused({"model": "m", "messages": []}).param == "messages"
    assert refused({"model": "m", "messages": hi, "n": 2}).param == "n"
    tool_result = [*hi, {"role": "tool", "content": "x", "tool_call_id": "1"}]
    assert refused({"model": "m", "messages": tool_result}).code == "tools_not_supported"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert "only text" in refused({"model": "m", "messages": image}).message
    assert refused([1, 2]).status == 400
    parsed = parse_completion_request(
        json.dumps({"model": "m", "messages": hi, "stream": True}).encode(), " work "
    )
    assert parsed.session_name == "work" and parsed.stream and not parsed.include_usage
    ide = Caller("ide", Route.OPENAI)
    assert resolve_session(ide, "x") == "api:ide:x"
    with pytest.raises(SessionRefused):
        resolve_session(ide, "bad\u202ename")


# ---------------------------------------------------------------- a kill mid-turn


@pytest.mark.kill
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["file", "postgresql"])
def test_a_retry_after_a_kill_mid_turn_gets_the_one_turns_reply(
    tmp_path: Path, mode: str, request: pytest.FixtureRequest
) -> None:
    """SIGKILL while the model writes the answer; the client's retry (same
    Idempotency-Key) reaches the restarted gateway: it gets the reply of the one turn
    the journal resumed, and the session holds the message once, answered once."""
    import threading

    from tests.gateway_process import GatewayProcess, base_env

    with FakeOpenAI.in_thread() as llm:
        env = base_env(tmp_path / "ws", llm) | {
            "GATEWAY_HTTP__PORT": "0",
            "GATEWAY_HTTP__TOKEN": TOKEN,
        }
        if mode == "postgresql":
            env["GATEWAY_STORAGE__URL"] = request.getfixturevalue("migrated_pg_url")
        ask: dict[str, Any] = {
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "survive the kill"}],
            "user": "durable",
            "extra_headers": {"Idempotency-Key": "kill-1"},
        }
        llm.hold(lambda body: True, count=1)
        first = GatewayProcess(env, tmp_path)
        outcome: list[BaseException] = []
        try:
            port = first.wait_ready()
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0
            )

            def doomed() -> None:
                try:
                    client.chat.completions.create(**ask)
                except BaseException as exc:  # the connection dies with the gateway
                    outcome.append(exc)

            thread = threading.Thread(target=doomed)
            thread.start()
            llm.wait_held(1, timeout=30)
            first.kill()
            thread.join(10)
        finally:
            first.stop()
        assert outcome and isinstance(outcome[0], openai.APIConnectionError)
        llm.release()
        second = GatewayProcess(env, tmp_path)
        try:
            port = second.wait_ready()
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=3
            )
            answer = client.chat.completions.create(**ask)
            again = client.chat.completions.create(**ask)
            assert second.terminate() == 0
        finally:
            second.stop()
        calls = [r for r in llm.chat_requests if r.last_user_text == "survive the kill"]
    assert answer.choices[0].message.content == "echo: survive the kill"
    assert again.choices[0].message.content == "echo: survive the kill"
    assert len(calls) == 2  # the killed call, and the resumed turn's: never a third
    if mode == "file":
        stored = tmp_path / "ws" / "sessions" / "api%3Adefault%3Adurable.jsonl"
        entries = [json.loads(line) for line in stored.read_text().splitlines()]
        said = [e["message"]["content"] for e in entries if e.get("type") == "message"]
        assert said == ["survive the kill", "echo: survive the kill"]
