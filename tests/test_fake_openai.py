"""The fake OpenAI server is faithful: the real `openai` client parses what it sends."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from tests.fakes.openai_server import (
    FakeOpenAI,
    FakeToolCall,
    Reply,
    estimate_prompt_tokens,
    validate_chat_request,
)

USER_HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi there"}]
WEATHER_TOOL: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def client(fake: FakeOpenAI) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=fake.base_url, api_key=fake.api_key, max_retries=0, timeout=5
    ) as c:
        yield c


@pytest.mark.anyio
async def test_non_streaming_reply_parses_and_is_logged(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    fake.add_reply("Hello, world")

    completion = await client.chat.completions.create(model="gpt-x", messages=USER_HI)

    assert completion.object == "chat.completion"
    assert completion.model == "gpt-x"
    assert completion.choices[0].message.content == "Hello, world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    # ceil(len("hi there") / 4), 3 tokens framing the message, 3 starting the reply.
    assert completion.usage.prompt_tokens == 2 + 3 + 3
    assert completion.usage.completion_tokens == 3  # ceil(len("Hello, world") / 4)
    assert completion.usage.total_tokens == 11
    request = fake.last_request
    assert request.path == "/v1/chat/completions"
    assert request.model == "gpt-x"
    assert request.messages == USER_HI
    assert request.bearer_token == fake.api_key
    assert fake.chat_requests == [request]


@pytest.mark.anyio
async def test_prompt_tokens_count_each_message_framing_like_a_real_server(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    # llama.cpp's server counted 5 tokens around each ChatML message and 3 to start the
    # reply; the fake counted the text alone, below every real server.
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},  # 9 characters: 3 tokens
        {"role": "user", "content": "hello"},  # 2 tokens
    ]
    one = await client.chat.completions.create(model="m", messages=messages[1:])
    two = await client.chat.completions.create(model="m", messages=messages)

    assert one.usage is not None and two.usage is not None
    assert one.usage.prompt_tokens == 2 + 3 + 3
    assert two.usage.prompt_tokens == 3 + 2 + 2 * 3 + 3


@pytest.mark.anyio
async def test_default_reply_echoes_and_responder_is_pluggable(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    echoed = await client.chat.completions.create(model="m", messages=USER_HI)
    assert echoed.choices[0].message.content == "echo: hi there"

    fake.responder = lambda body: Reply(text=f"{len(body['messages'])} messages")
    custom = await client.chat.completions.create(model="m", messages=USER_HI)
    assert custom.choices[0].message.content == "1 messages"


@pytest.mark.anyio
async def test_tool_call_reply_parses(fake: FakeOpenAI, client: openai.AsyncOpenAI) -> None:
    fake.add_tool_calls(
        [("get_weather", {"city": "Paris"}), FakeToolCall("get_time", {}, call_id="call_t")]
    )

    completion = await client.chat.completions.create(
        model="m", messages=USER_HI, tools=[WEATHER_TOOL]
    )

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [c.type for c in calls] == ["function", "function"]
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    assert calls[1].id == "call_t"
    assert calls[0].id != calls[1].id


@pytest.mark.anyio
async def test_streamed_text_with_usage(fake: FakeOpenAI, client: openai.AsyncOpenAI) -> None:
    fake.add_reply("The quick  brown fox.\n")

    stream = await client.chat.completions.create(
        model="m", messages=USER_HI, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The quick  brown fox.\n"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) == 4
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.anyio
async def test_stream_without_include_usage_has_no_usage_chunk(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    stream = await client.chat.completions.create(model="m", messages=USER_HI, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(c.choices and c.usage is None for c in chunks)


@pytest.mark.anyio
async def test_streamed_tool_calls_assemble_with_the_sdk_helper(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    long_args = {"city": "Rio de Janeiro", "units": "metric", "days": 3}
    fake.add_tool_calls([("get_weather", long_args), ("get_weather", {"city": "Oslo"})])

    async with client.chat.completions.stream(
        model="m",
        messages=USER_HI,
        tools=[WEATHER_TOOL],
        stream_options={"include_usage": True},
    ) as stream:
        final = await stream.get_final_completion()

    calls = final.choices[0].message.tool_calls or []
    assert [json.loads(c.function.arguments) for c in calls] == [long_args, {"city": "Oslo"}]
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.usage is not None and final.usage.total_tokens > 0


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        (400, openai.BadRequestError),
        (403, openai.PermissionDeniedError),
        (404, openai.NotFoundError),
        (429, openai.RateLimitError),
        (500, openai.InternalServerError),
        (503, openai.InternalServerError),
    ],
)
async def test_error_statuses_map_to_openai_exceptions(
    fake: FakeOpenAI, client: openai.AsyncOpenAI, status: int, error_class: type[Exception]
) -> None:
    fake.add_error(status, "scripted failure")

    with pytest.raises(error_class) as caught:
        await client.chat.completions.create(model="m", messages=USER_HI)

    assert isinstance(caught.value, openai.APIStatusError)
    assert caught.value.status_code == status
    assert caught.value.message.endswith("scripted failure")
    assert isinstance(caught.value.body, dict) and "type" in caught.value.body


@pytest.mark.anyio
async def test_wrong_key_is_401_authentication_error(fake: FakeOpenAI) -> None:
    async with openai.AsyncOpenAI(base_url=fake.base_url, api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as caught:
            await c.chat.completions.create(model="m", messages=USER_HI)
    assert caught.value.code == "invalid_api_key"
    assert "sk-wrong" not in str(caught.value)


@pytest.mark.anyio
async def test_fake_without_key_accepts_any_client() -> None:
    async with (
        FakeOpenAI(api_key=None) as fake,
        openai.AsyncOpenAI(base_url=fake.base_url, api_key="anything") as c,
    ):
        completion = await c.chat.completions.create(model="m", messages=USER_HI)
    assert completion.choices[0].message.content == "echo: hi there"


@pytest.mark.anyio
async def test_retry_after_is_sent_and_honoured_by_the_client(fake: FakeOpenAI) -> None:
    fake.add_error(429, retry_after=0.3)
    async with openai.AsyncOpenAI(base_url=fake.base_url, api_key=fake.api_key, max_retries=1) as c:
        started = time.monotonic()
        await c.chat.completions.create(model="m", messages=USER_HI)
        elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 2
    assert [r.retry_count for r in fake.chat_requests] == [0, 1]


@pytest.mark.anyio
async def test_model_scoped_replies_and_failures(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    fake.add_reply("for b", model="b")
    fake.fail_model("broken", 404)

    a = await client.chat.completions.create(model="a", messages=USER_HI)
    b = await client.chat.completions.create(model="b", messages=USER_HI)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="broken", messages=USER_HI)

    assert a.choices[0].message.content == "echo: hi there"
    assert b.choices[0].message.content == "for b"
    assert caught.value.code == "model_not_found"
    assert fake.queued == 0


@pytest.mark.anyio
async def test_delay_causes_client_timeout_and_stop_is_prompt(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    fake.add_delay(30)
    with pytest.raises(openai.APITimeoutError):
        await client.with_options(timeout=0.2).chat.completions.create(model="m", messages=USER_HI)
    fake.add_delay(30)
    with anyio.move_on_after(0.2):
        await client.chat.completions.create(model="m", messages=USER_HI)
    started = time.monotonic()
    await fake.stop()
    assert time.monotonic() - started < 2


@pytest.mark.anyio
async def test_broken_stream_raises_connection_error(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    fake.add(Reply(text="one two three", break_after=2))
    stream = await client.chat.completions.create(model="m", messages=USER_HI, stream=True)
    seen: list[str] = []
    with pytest.raises(openai.APIConnectionError):
        async for chunk in stream:
            seen.append(chunk.choices[0].delta.content or "")
    assert "".join(seen) == "one "


def _chunked_body(raw: bytes) -> tuple[bytes, bool]:
    """The data of a chunked HTTP body as far as it came, and whether its last chunk
    (`0\\r\\n\\r\\n`, the end of a whole body) was among it."""
    data = b""
    while raw:
        size_line, sep, rest = raw.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return data, True
        if len(rest) < size + 2:
            return data + rest[:size], False
        data, raw = data + rest[:size], rest[size + 2 :]
    return data, False


@pytest.mark.anyio
async def test_a_broken_stream_is_cut_on_the_wire_like_a_dying_servers(fake: FakeOpenAI) -> None:
    """`break_after` closes the socket in the middle of the body, as the kernel does for a
    server killed mid-answer: the events before the cut arrive whole, then the
    connection ends, with no last chunk, no finish_reason and no `[DONE]`."""
    words = " ".join(f"w{i}" for i in range(40))
    fake.add(Reply(text=words, break_after=26))  # the role event, then 25 words
    body = json.dumps({"model": "m", "messages": USER_HI, "stream": True}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + f"Authorization: Bearer {fake.api_key}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    port = int(fake.url.rsplit(":", 1)[1])
    received = b""
    with anyio.fail_after(5):  # the server closes the connection: no hang
        async with await anyio.connect_tcp("127.0.0.1", port) as conn:
            await conn.send(request)
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                while True:
                    received += await conn.receive()
    head, _, rest = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head.lower()
    data, whole = _chunked_body(rest)
    assert not whole  # the body never ended: the connection did
    events = [e for e in data.decode().split("\n\n") if e]
    assert "data: [DONE]" not in events
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    assert len(chunks) == 26
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 26
    said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert said == words[: len(said)] and said.split() == words.split()[:25]


@pytest.mark.anyio
async def test_models_endpoint(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["gpt-4o-mini"]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")


@pytest.mark.anyio
async def test_invalid_conversation_is_rejected_like_the_real_api(
    client: openai.AsyncOpenAI,
) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    unanswered: list[Any] = [*USER_HI, {"role": "assistant", "tool_calls": [call]}, *USER_HI]
    with pytest.raises(openai.BadRequestError, match="did not have response messages: c1"):
        await client.chat.completions.create(model="m", messages=unanswered)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "tool", "tool_call_id": "x", "content": "r"}], "must be a response"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                }
            ],
            "expected a string",
        ),
        ([{"role": "user", "content": "x", "name": "Jürgen S"}], "does not match pattern"),
        ([{"role": "user"}], "content"),
        ([], "empty array"),
    ],
)
def test_validation_rules(messages: list[Any], problem: str) -> None:
    assert problem in (validate_chat_request({"model": "m", "messages": messages}) or "")


def test_valid_tool_round_trip_passes_validation() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *USER_HI,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "result"},
    ]
    assert validate_chat_request({"model": "m", "messages": messages}) is None


def test_thread_mode_serves_sync_clients_and_scripting_from_the_test_thread() -> None:
    with FakeOpenAI.in_thread() as fake:
        fake.add_reply("from the thread")
        client = openai.OpenAI(base_url=fake.base_url, api_key=fake.api_key, max_retries=0)
        with client:
            first = client.chat.completions.create(model="m", messages=USER_HI)
            second = client.chat.completions.create(model="m", messages=USER_HI)
        assert first.choices[0].message.content == "from the thread"
        assert second.choices[0].message.content == "echo: hi there"
        assert len(fake.wait_for_requests(2, timeout=1)) == 2
        with pytest.raises(TimeoutError):
            fake.wait_for_requests(3, timeout=0.05)


@pytest.mark.anyio
async def test_transcriptions_report_usage_as_the_real_api_does(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    from openai.types.audio.transcription import UsageDuration, UsageTokens

    audio = ("voice.ogg", b"OggS SPEECH:one two three four five six", "audio/ogg")
    by_minute = await client.audio.transcriptions.create(model="whisper-1", file=audio)
    assert by_minute.text == "one two three four five six"
    assert isinstance(by_minute.usage, UsageDuration) and by_minute.usage.seconds == 3

    fake.add_transcription("hello", seconds=4.5)
    by_token = await client.audio.transcriptions.create(model="gpt-4o-transcribe", file=audio)
    assert isinstance(by_token.usage, UsageTokens)
    assert (by_token.usage.input_tokens, by_token.usage.output_tokens) == (45, 2)
    assert by_token.usage.total_tokens == 47

    fake.transcription_usage = False  # a local Whisper server
    bare = await client.audio.transcriptions.create(model="whisper-1", file=audio)
    assert bare.usage is None and bare.text == "one two three four five six"


@pytest.mark.anyio
async def test_a_held_request_waits_for_release_and_others_go_on(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    """`hold`: the matching request (once) waits unanswered, as a busy model would,
    until `release`; other requests, and a later matching one, are answered meanwhile."""
    fake.hold(lambda body: body["messages"][-1]["content"] == "hold me")
    answers: list[str | None] = []

    async def ask(text: str) -> None:
        done = await client.chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": text}]
        )
        answers.append(done.choices[0].message.content)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "hold me")
        with anyio.fail_after(5):
            held = await fake.wait_held_async(1)
        assert held[0].last_user_text == "hold me"
        await ask("not me")
        await ask("hold me")  # the hold took one request: this one is answered
        assert answers == ["echo: not me", "echo: hold me"]
        fake.release()
    assert answers == ["echo: not me", "echo: hold me", "echo: hold me"]


# -- flavours: llama.cpp, llama-cpp-python, Ollama and vLLM where it matters --------------


def words(tokens: int) -> str:
    """Text the fake counts as `tokens` tokens (four characters each)."""
    return "abc " * tokens


async def get_json(url: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """The status and body of a plain HTTP request, as a client that is not OpenAI's makes
    it (the JSON decoded where it is JSON, else the text)."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        method = http.get(url) if body is None else http.post(url, json=body)
        async with method as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text


@pytest.mark.anyio
async def test_llama_cpp_flavour_says_n_ctx_and_refuses_a_prompt_that_fills_it() -> None:
    async with FakeOpenAI(api_key=None, flavor="llama.cpp", context_window=2048) as fake:
        status, props = await get_json(f"{fake.url}/props")
        assert status == 200 and props["default_generation_settings"]["n_ctx"] == 2048
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="x", max_retries=0)
        async with client:
            fits = [{"role": "user", "content": words(2000)}]
            answer = await client.chat.completions.create(model="m", messages=fits)
            assert answer.usage is not None and answer.usage.prompt_tokens < 2048
            too_long = [{"role": "user", "content": words(2045)}]  # 2045 + 3 + 3 = 2051
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", messages=too_long)
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["type"] == "exceed_context_size_error" and error["code"] == 400
        assert (error["n_prompt_tokens"], error["n_ctx"]) == (2051, 2048)
        assert error["message"] == (
            "request (2051 tokens) exceeds the available context size (2048 tokens), "
            "try increasing it"
        )
        # llama-server routes the OpenAI paths without /v1 too.
        bare = openai.AsyncOpenAI(base_url=fake.url, api_key="x", max_retries=0)
        async with bare:
            assert (await bare.chat.completions.create(model="m", messages=USER_HI)).choices


@pytest.mark.anyio
async def test_llama_cpp_python_flavour_says_its_window_only_in_the_overflow_error() -> None:
    async with FakeOpenAI(api_key=None, flavor="llama-cpp-python", context_window=512) as fake:
        assert await get_json(f"{fake.url}/props") == (404, {"detail": "Not Found"})
        listed = (await get_json(f"{fake.base_url}/models"))[1]["data"][0]
        assert listed["owned_by"] == "me" and "max_model_len" not in listed
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="x", max_retries=0)
        async with client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": words(600)}], max_tokens=48
                )
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.message.endswith(
        "This model's maximum context length is 512 tokens. However, you requested 654 tokens "
        "(606 in the messages, 48 in the completion). Please reduce the length of the "
        "messages or completion."
    )


@pytest.mark.anyio
async def test_vllm_flavour_lists_max_model_len_and_refuses_what_does_not_fit() -> None:
    async with FakeOpenAI(api_key=None, flavor="vllm", context_window=2048) as fake:
        listed = (await get_json(f"{fake.base_url}/models"))[1]["data"][0]
        assert listed["max_model_len"] == 2048 and listed["owned_by"] == "vllm"
        assert await get_json(f"{fake.url}/chat/completions", {}) == (
            404,
            {"detail": "Not Found"},
        )
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="x", max_retries=0)
        async with client:
            long = [{"role": "user", "content": words(2100)}]
            with pytest.raises(openai.BadRequestError) as no_cap:
                await client.chat.completions.create(model="m", messages=long)
            short = [{"role": "user", "content": words(1000)}]
            with pytest.raises(openai.BadRequestError) as capped:
                await client.chat.completions.create(model="m", messages=short, max_tokens=1500)
            assert (await client.chat.completions.create(model="m", messages=short)).choices
    assert no_cap.value.type == "BadRequestError" and no_cap.value.code == "400"
    assert "maximum context length is 2048 tokens. However, your request has 2106 input " in (
        no_cap.value.message
    )
    assert "'max_tokens' or 'max_completion_tokens' is too large: 1500." in capped.value.message
    assert "(1500 > 2048 - 1006)" in capped.value.message


@pytest.mark.anyio
async def test_ollama_flavour_cuts_silently_and_tells_num_ctx_where_it_does() -> None:
    async with FakeOpenAI(
        api_key=None, models=("llama3.2:latest",), flavor="ollama", context_window=1024
    ) as fake:
        status, shown = await get_json(f"{fake.url}/api/show", {"model": "llama3.2"})
        assert status == 200 and "num_ctx" not in shown["parameters"]
        assert shown["model_info"]["llama.context_length"] == 131072
        assert (await get_json(f"{fake.url}/api/show", {"model": "nope"}))[0] == 404
        assert await get_json(f"{fake.url}/api/ps") == (200, {"models": []})
        assert await get_json(f"{fake.url}/chat/completions", {}) == (404, "404 page not found")
        client = openai.AsyncOpenAI(base_url=fake.base_url, api_key="x", max_retries=0)
        history = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first " + words(900)},
            {"role": "assistant", "content": words(300)},
            {"role": "user", "content": "last question"},
        ]
        asked = estimate_prompt_tokens({"messages": history})
        seen = estimate_prompt_tokens({"messages": [history[0], *history[2:]]})
        assert asked > 1024 >= seen
        async with client:
            answer = await client.chat.completions.create(model="llama3.2", messages=history)
        # No error: the oldest message went, and the model saw the system one and the rest.
        assert answer.choices[0].message.content == "echo: last question"
        assert answer.usage is not None and answer.usage.prompt_tokens == seen
        assert fake.truncations == [(asked, seen)]
        running = (await get_json(f"{fake.url}/api/ps"))[1]["models"]
        assert [(m["name"], m["context_length"]) for m in running] == [("llama3.2:latest", 1024)]
    async with FakeOpenAI(
        models=("llama3.2",), flavor="ollama", context_window=8192, ollama_modelfile_num_ctx=True
    ) as fake:
        shown = (await get_json(f"{fake.url}/api/show", {"model": "llama3.2"}))[1]
        assert shown["parameters"].splitlines()[0].split() == ["num_ctx", "8192"]


@pytest.mark.anyio
async def test_an_unknown_path_is_a_404_without_a_model_code(
    fake: FakeOpenAI, client: openai.AsyncOpenAI
) -> None:
    bare = openai.AsyncOpenAI(base_url=fake.url, api_key=fake.api_key, max_retries=0)
    async with bare:
        with pytest.raises(openai.NotFoundError) as caught:
            await bare.chat.completions.create(model="m", messages=USER_HI)
    assert caught.value.code is None
    assert caught.value.message.endswith("Invalid URL (POST /chat/completions)")
    fake.fail_model("gone")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(model="gone", messages=USER_HI)
    assert missing.value.code == "model_not_found" and "`gone`" in missing.value.message
