"""OpenAIProvider against the fake OpenAI server, through the real `openai` client."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from gateway.llm import (
    ContextOverflow,
    LLMConfigError,
    LLMError,
    LLMMessage,
    LLMProvider,
    StreamDelta,
    TokenUsage,
    ToolCall,
    ToolSpec,
)
from gateway.llm.openai_provider import (
    PLACEHOLDER_API_KEY,
    OpenAIProvider,
    check_credentials,
    decode_arguments,
    to_openai_message,
)
from tests.fakes.openai_server import FakeOpenAI, Reply

WEATHER = ToolSpec(
    name="get_weather",
    description="Current weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
HELLO = [LLMMessage(role="system", content="Be brief."), LLMMessage(role="user", content="hello")]

MakeProvider = Callable[..., OpenAIProvider]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with FakeOpenAI() as server:
        yield server


@pytest.fixture
async def make_provider(fake: FakeOpenAI) -> AsyncIterator[MakeProvider]:
    """Providers on the fake: model "primary", no retries, 5 s timeout unless overridden."""
    made: list[OpenAIProvider] = []

    def make(**overrides: Any) -> OpenAIProvider:
        options: dict[str, Any] = {
            "base_url": fake.base_url,
            "api_key": fake.api_key,
            "model": "primary",
            "timeout": 5.0,
            "max_retries": 0,
            **overrides,
        }
        provider = OpenAIProvider(**options)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.aclose()


async def collect(stream: AsyncIterator[StreamDelta]) -> tuple[list[str], StreamDelta]:
    texts: list[str] = []
    last = StreamDelta()
    async for delta in stream:
        if delta.response is None:
            texts.append(delta.text)
        last = delta
    return texts, last


# -- replies --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_plain_reply_carries_usage_and_model(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider()
    assert isinstance(provider, LLMProvider)
    fake.add_reply("Hi! How can I help?")

    response = await provider.chat(HELLO)

    assert response.message.role == "assistant"
    assert response.message.content == "Hi! How can I help?"
    assert response.model == response.message.model == "primary"
    assert response.finish_reason == "stop"
    assert response.usage is not None
    assert response.usage.completion_tokens == 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 5
    assert fake.last_request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]


@pytest.mark.anyio
async def test_temperature_and_max_tokens_defaults_are_sent(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(default_temperature=0.2, default_max_tokens=50)
    await provider.chat(HELLO)
    await provider.chat(HELLO, temperature=0.9, max_tokens=7, model="other")
    first, second = (r.body for r in fake.chat_requests)
    assert (first["temperature"], first["max_tokens"], first["model"]) == (0.2, 50, "primary")
    assert (second["temperature"], second["max_tokens"], second["model"]) == (0.9, 7, "other")
    assert "tools" not in first and "tool_choice" not in first


@pytest.mark.anyio
async def test_a_configured_tool_choice_goes_with_requests_that_offer_tools(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    # llama-cpp-python's chatml-function-calling ignores tools sent without a tool_choice.
    provider = make_provider(default_tool_choice="auto")

    await provider.chat(HELLO, tools=[WEATHER])
    assert fake.last_request.body["tool_choice"] == "auto"
    await provider.chat(HELLO, tools=[WEATHER], tool_choice="none")
    assert fake.last_request.body["tool_choice"] == "none"
    await provider.chat(HELLO)
    assert "tool_choice" not in fake.last_request.body  # the API refuses it without tools
    # llama-cpp-python answers a streamed "auto" with HTTP 500 when the model picks a tool.
    async for _ in provider.stream(HELLO, tools=[WEATHER]):
        pass
    assert fake.last_request.stream and "tool_choice" not in fake.last_request.body
    await make_provider().chat(HELLO, tools=[WEATHER])
    assert "tool_choice" not in fake.last_request.body


def test_a_tool_call_without_text_goes_with_an_empty_content() -> None:
    # llama.cpp's server answers "content": null, or none, with HTTP 500; OpenAI takes "".
    call = ToolCall(id="call_1", function_name="get_weather", arguments={})
    wire = to_openai_message(LLMMessage(role="assistant", tool_calls=(call,)))
    assert wire["content"] == "" and wire["tool_calls"][0]["id"] == "call_1"
    with_text = LLMMessage(role="assistant", content="Checking.", tool_calls=(call,))
    assert to_openai_message(with_text)["content"] == "Checking."


@pytest.mark.anyio
async def test_tool_call_round_trip(fake: FakeOpenAI, make_provider: MakeProvider) -> None:
    provider = make_provider()
    fake.add_tool_call("get_weather", {"city": "Zürich"}, call_id="call_1")

    first = await provider.chat(HELLO, tools=[WEATHER], tool_choice="auto")

    assert first.finish_reason == "tool_calls"
    assert first.message.tool_calls == (
        ToolCall(id="call_1", function_name="get_weather", arguments={"city": "Zürich"}),
    )
    assert fake.last_request.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": WEATHER.description,
                "parameters": WEATHER.parameters,
            },
        }
    ]
    assert fake.last_request.body["tool_choice"] == "auto"

    # The fake rejects (HTTP 400) a history whose tool call is not answered or whose
    # arguments are not a JSON string, so a reply proves the wire format is right.
    fake.add_reply("It is sunny in Zürich.")
    history = [
        *HELLO,
        first.message,
        LLMMessage(role="tool", content="sunny, 24°C", tool_call_id="call_1"),
    ]
    second = await provider.chat(history, tools=[WEATHER])

    assert second.message.content == "It is sunny in Zürich."
    assistant, tool = fake.last_request.messages[2:]
    assert assistant["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Zürich"}',
    }
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24°C"}


@pytest.mark.anyio
async def test_malformed_tool_arguments_are_kept_raw_and_sent_back_verbatim(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider()
    fake.add_tool_call("get_weather", '{"city": "Par', call_id="call_bad")

    response = await provider.chat(HELLO, tools=[WEATHER])

    (call,) = response.message.tool_calls
    assert call.arguments == {"_raw": '{"city": "Par'}
    history = [
        *HELLO,
        response.message,
        LLMMessage(role="tool", content="error: bad arguments", tool_call_id="call_bad"),
    ]
    await provider.chat(history, tools=[WEATHER])
    sent = fake.last_request.messages[2]["tool_calls"][0]["function"]["arguments"]
    assert sent == '{"city": "Par'


def test_decode_arguments() -> None:
    assert decode_arguments('{"a": [1, 2]}') == {"a": [1, 2]}
    assert decode_arguments("") == {}
    assert decode_arguments(None) == {}
    assert decode_arguments("[1]") == {"_raw": "[1]"}
    assert decode_arguments("{oops") == {"_raw": "{oops"}


def test_message_names_are_made_acceptable_to_the_api() -> None:
    user = to_openai_message(LLMMessage(role="user", content="hi", name="Jürgen Smith"))
    assert user == {"role": "user", "content": "hi", "name": "J_rgen_Smith"}
    assert "name" not in to_openai_message(LLMMessage(role="user", content="hi", name="日本"))
    tool = to_openai_message(
        LLMMessage(role="tool", content="r", tool_call_id="c1", name="get_weather")
    )
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "r"}
    with pytest.raises(LLMError):
        to_openai_message(LLMMessage(role="tool", content="r"))


# -- streaming ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stream_yields_text_then_the_assembled_response(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider()
    fake.add_reply("Streaming works, word by word.")

    texts, last = await collect(provider.stream(HELLO))

    assert len(texts) == 5
    assert "".join(texts) == "Streaming works, word by word."
    assert last.response is not None
    assert last.response.message.content == "Streaming works, word by word."
    assert last.response.model == "primary"
    assert last.response.finish_reason == "stop"
    assert last.response.usage is not None and last.response.usage.completion_tokens == 8
    assert fake.last_request.body["stream_options"] == {"include_usage": True}


@pytest.mark.anyio
async def test_stream_assembles_tool_calls_by_index(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider()
    long_city = {"city": "Llanfairpwllgwyngyll", "units": "metric", "days": 3}
    fake.add_tool_calls([("get_weather", long_city), ("get_weather", {"city": "Oslo"})])

    texts, last = await collect(provider.stream(HELLO, tools=[WEATHER]))

    assert texts == []
    assert last.response is not None
    message = last.response.message
    assert message.content is None
    assert [c.arguments for c in message.tool_calls] == [long_city, {"city": "Oslo"}]
    assert all(c.function_name == "get_weather" and c.id for c in message.tool_calls)
    assert last.response.finish_reason == "tool_calls"
    assert last.response.usage is not None and last.response.usage.total_tokens > 0


@pytest.mark.anyio
async def test_stream_falls_back_before_the_first_token(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(fallback_models=["backup"])
    fake.fail_model("primary", 503)
    fake.add_reply("from backup")

    texts, last = await collect(provider.stream(HELLO))

    assert "".join(texts) == "from backup"
    assert last.response is not None and last.response.model == "backup"


@pytest.mark.anyio
async def test_stream_broken_after_text_raises_without_fallback(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(fallback_models=["backup"])
    fake.add(Reply(text="partial answer that breaks", break_after=3))

    seen: list[str] = []
    with pytest.raises(LLMError) as caught:
        async for delta in provider.stream(HELLO):
            seen.append(delta.text)

    assert seen == ["partial ", "answer "]
    assert "cut off" in caught.value.user_message
    assert [r.model for r in fake.chat_requests] == ["primary"]


# -- retries and fallbacks ------------------------------------------------------------------


@pytest.mark.anyio
async def test_rate_limit_with_retry_after_is_retried(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=2)
    fake.add_error(429, retry_after=0.2)
    fake.add_reply("after the wait")

    started = time.monotonic()
    response = await provider.chat(HELLO)

    assert time.monotonic() - started >= 0.2
    assert response.message.content == "after the wait"
    assert [r.retry_count for r in fake.chat_requests] == [0, 1]


@pytest.mark.anyio
async def test_server_errors_are_retried_with_backoff(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=2)
    fake.add_error(500)
    fake.add_error(500)
    fake.add_reply("third time lucky")

    response = await provider.chat(HELLO)

    assert response.message.content == "third time lucky"
    assert len(fake.chat_requests) == 3


@pytest.mark.anyio
async def test_persistently_failing_primary_falls_back(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=1, fallback_models=["backup"])
    fake.fail_model("primary", 500, retry_after=0.01)
    fake.add_reply("backup here", model="backup")

    response = await provider.chat(HELLO)

    assert response.model == response.message.model == "backup"
    assert response.message.content == "backup here"
    assert [r.model for r in fake.chat_requests] == ["primary", "primary", "backup"]


@pytest.mark.anyio
async def test_unknown_model_falls_back_in_order(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=2, fallback_models=["gone-too", "backup"])
    fake.fail_model("primary", 404)
    fake.fail_model("gone-too", 404)

    response = await provider.chat(HELLO)

    assert response.model == "backup"
    assert [r.model for r in fake.chat_requests] == ["primary", "gone-too", "backup"]


@pytest.mark.anyio
async def test_all_models_failing_raises_a_safe_error(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(fallback_models=["backup"])
    fake.fail_model("primary", 500, f"upstream broke for key {fake.api_key}")
    fake.fail_model("backup", 503)

    with pytest.raises(LLMError) as caught:
        await provider.chat(HELLO)

    detail = str(caught.value)
    assert "'primary'" in detail and "'backup'" in detail
    assert "HTTP 500" in detail and "HTTP 503" in detail
    assert fake.api_key and fake.api_key not in detail
    assert caught.value.user_message == "The model is not answering right now. Please try again."


@pytest.mark.anyio
async def test_timeout_raises_llm_error(fake: FakeOpenAI, make_provider: MakeProvider) -> None:
    provider = make_provider(timeout=0.2)
    fake.add_delay(10)

    started = time.monotonic()
    with pytest.raises(LLMError) as caught:
        await provider.chat(HELLO)

    assert time.monotonic() - started < 2
    assert "too long" in caught.value.user_message
    assert "no answer in time" in str(caught.value)


@pytest.mark.anyio
async def test_rejected_key_is_reported_without_trying_fallbacks(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(api_key="sk-wrong-secret-123", fallback_models=["backup"])
    fake.add_error(401, "Incorrect API key provided: sk-wrong-secret-123.", code="invalid_api_key")

    with pytest.raises(LLMConfigError) as caught:
        await provider.chat(HELLO)

    assert "API key" in caught.value.user_message
    assert "OPENAI_API_KEY" in caught.value.user_message
    assert "sk-wrong-secret-123" not in str(caught.value)
    assert "HTTP 401" in str(caught.value)
    assert [r.model for r in fake.chat_requests] == ["primary"]


@pytest.mark.anyio
async def test_bad_request_is_not_retried_on_other_models(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=2, fallback_models=["backup"])
    fake.add_error(
        400, "This model's maximum context length is 8192 tokens.", code=("context_length_exceeded")
    )

    with pytest.raises(ContextOverflow) as caught:
        await provider.chat(HELLO)

    # What the server said of its window goes to the agent loop, which knows whether
    # the conversation or the message is too long: the provider does not guess "/new".
    assert caught.value.context_tokens == 8192 and caught.value.prompt_tokens is None
    assert "/new" not in caught.value.user_message
    assert len(fake.chat_requests) == 1


@pytest.mark.anyio
async def test_unreachable_server_raises_llm_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = OpenAIProvider(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=None, model="m", max_retries=0
    )
    try:
        with pytest.raises(LLMError) as caught:
            await provider.chat(HELLO)
    finally:
        await provider.aclose()
    assert "cannot reach" in str(caught.value)


# -- credentials ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "base_url",
    [
        None,
        "https://api.openai.com/v1",
        "https://eu.api.openai.com/v1",
        "https://my-resource.openai.azure.com/openai",
    ],
)
@pytest.mark.parametrize("api_key", [None, "", "  \n"])
def test_missing_key_for_hosted_openai_says_what_to_set(
    base_url: str | None, api_key: str | None
) -> None:
    with pytest.raises(LLMConfigError) as caught:
        check_credentials(base_url, api_key)
    assert "OPENAI_API_KEY" in str(caught.value)
    assert "OPENAI_BASE_URL" in str(caught.value)
    assert "http://127.0.0.1:11434/v1" in str(caught.value)


@pytest.mark.parametrize(
    "base_url",
    [
        "http://localhost:11434/v1",
        "http://127.0.0.1:8000/v1",
        "http://127.1.2.3:8080/v1",
        "http://[::1]:8080/v1",
        "http://gpu-box.local:8000/v1",
        "https://llm.internal.example.com/v1",
    ],
)
def test_key_is_optional_for_local_and_custom_servers(base_url: str) -> None:
    check_credentials(base_url, None)


def test_a_key_satisfies_hosted_openai_and_bad_urls_are_rejected() -> None:
    check_credentials(None, "sk-x")
    check_credentials("https://api.openai.com/v1", "sk-x")
    with pytest.raises(LLMConfigError, match="http"):
        check_credentials("localhost:11434", None)


def test_provider_refuses_to_start_without_a_key() -> None:
    with pytest.raises(LLMConfigError, match="OPENAI_API_KEY"):
        OpenAIProvider(base_url=None, api_key=None, model="gpt-4o-mini")


@pytest.fixture
def keyless_fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAI.in_thread(api_key=None) as server:
        yield server


@pytest.mark.anyio
async def test_local_server_gets_a_placeholder_key(keyless_fake: FakeOpenAI) -> None:
    provider = OpenAIProvider(base_url=keyless_fake.base_url, api_key=None, model="llama3")
    try:
        response = await provider.chat(HELLO)
    finally:
        await provider.aclose()
    assert response.message.content == "echo: hello"
    assert keyless_fake.last_request.bearer_token == PLACEHOLDER_API_KEY


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_request_bodies_are_what_the_clients_own_transform_would_send(
    fake: FakeOpenAI, make_provider: MakeProvider, stream: bool
) -> None:
    """The provider posts its body through the client's low-level `post` (create()'s
    transform was half the CPU of a turn). That is only right while the transform would
    not change the body: this fails on an `openai` release where it starts to."""
    from openai._utils._transform import async_maybe_transform
    from openai.types.chat import completion_create_params as params

    provider = make_provider(default_temperature=0.3, default_max_tokens=99)
    fake.add_tool_call("get_weather", {"city": "Zürich"}, call_id="call_1")
    first = await provider.chat(HELLO, tools=[WEATHER], tool_choice="auto")
    history = [
        *HELLO,
        first.message,
        LLMMessage(role="tool", content="sunny", tool_call_id="call_1"),
        LLMMessage(role="user", content="and tomorrow?", name="Ada Lovelace"),
    ]
    fake.add_reply("Rain.")
    if stream:
        await collect(provider.stream(history, tools=[WEATHER]))
        shape: Any = params.CompletionCreateParamsStreaming
    else:
        await provider.chat(history, tools=[WEATHER], tool_choice="required")
        shape = params.CompletionCreateParamsNonStreaming
    sent = fake.last_request.body

    assert sent["messages"][2]["tool_calls"][0]["id"] == "call_1"
    assert sent["temperature"] == 0.3 and sent["max_tokens"] == 99
    assert await async_maybe_transform(sent, shape) == sent


#: Answers of real servers' shapes: fields of their own, a tool call without an id
#: (some local servers), content null beside tool calls, no usage at all.
WIRE_ANSWERS = [
    {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served-name",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Grüezi", "reasoning_content": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
        "timings": {"predicted_ms": 12.5},
        "system_fingerprint": "fp_x",
    },
    {
        "model": "m",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'},
                        },
                        {
                            "id": "c2",
                            "type": "function",
                            "function": {"name": "f", "arguments": ""},
                        },
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
    },
]


@pytest.mark.anyio
@pytest.mark.parametrize("answer", WIRE_ANSWERS)
async def test_an_answer_is_read_from_the_wire_as_the_sdk_model_reads_it(
    fake: FakeOpenAI, make_provider: MakeProvider, answer: dict[str, Any]
) -> None:
    """The provider reads the JSON itself (the SDK's model construction was a tenth of a
    turn's CPU): what it reads must be what `ChatCompletion` reads."""
    from openai.types.chat import ChatCompletion

    fake.add(Reply(raw=json.dumps(answer).encode()))
    response = await make_provider().chat(HELLO)

    sdk = ChatCompletion.construct(**answer)  # how the client's `cast_to` reads it
    choice = sdk.choices[0]
    assert response.model == sdk.model
    assert response.finish_reason == choice.finish_reason
    # Content null beside tool calls stays null (the API's own shape); alone it is "".
    expected = choice.message.content
    assert response.message.content == (
        "" if expected is None and not choice.message.tool_calls else expected
    )
    assert [(c.function_name, c.arguments) for c in response.message.tool_calls] == [
        (c.function.name, decode_arguments(c.function.arguments))
        for c in choice.message.tool_calls or ()
    ]
    assert all(c.id.startswith("call_") or c.id == "c2" for c in response.message.tool_calls)
    if sdk.usage is None:
        assert response.usage is None
    else:
        assert response.usage == TokenUsage(
            sdk.usage.prompt_tokens, sdk.usage.completion_tokens, sdk.usage.total_tokens
        )


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"<html>502 Bad Gateway</html>", "answer unreadable: not JSON"),
        (b'{"choices": "none"}', "answer unreadable: choices is str, not list"),
        (b'{"choices": [{"message": {"content": 5}}]}', "content is int, not str"),
        (b'{"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}', "no function name"),
        (b'{"choices": []}', "answer had no choices"),
    ],
)
async def test_an_unreadable_answer_falls_back_and_says_what_is_wrong(
    fake: FakeOpenAI, make_provider: MakeProvider, raw: bytes, detail: str
) -> None:
    provider = make_provider(fallback_models=["backup"])
    fake.add(Reply(raw=raw, model="primary"))
    fake.add_reply("backup here", model="backup")
    assert (await provider.chat(HELLO)).message.content == "backup here"

    fake.add(Reply(raw=raw, model="primary"))
    fake.add(Reply(raw=raw, model="backup"))
    with pytest.raises(LLMError) as caught:
        await provider.chat(HELLO)
    assert detail in str(caught.value)
    assert caught.value.user_message == "The model is not answering right now. Please try again."


@pytest.mark.anyio
async def test_odd_bookkeeping_fields_do_not_cost_the_answer(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    """The answer's text must be text; the model name, finish reason and token counts
    around it fall back when a server sends them oddly (12.0 tokens, a null model)."""
    answer = {
        "model": None,
        "choices": [{"message": {"content": "fine"}, "finish_reason": 7}],
        "usage": {"prompt_tokens": 12.0, "completion_tokens": "3", "total_tokens": True},
    }
    fake.add(Reply(raw=json.dumps(answer).encode()))
    response = await make_provider().chat(HELLO)
    assert response.message.content == "fine"
    assert response.model == "primary" and response.finish_reason is None
    assert response.usage == TokenUsage(12, 0, 0)


# -- what a failure says, for the failover -----------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("status", "code"), [(402, None), (429, "insufficient_quota")], ids=["402", "429-quota"]
)
async def test_an_account_out_of_credit_is_said_as_such_without_trying_fallbacks(
    fake: FakeOpenAI, make_provider: MakeProvider, status: int, code: str | None
) -> None:
    provider = make_provider(fallback_models=["backup"])
    fake.add_error(status, "You exceeded your current quota.", code=code)

    with pytest.raises(LLMConfigError) as caught:
        await provider.chat(HELLO)

    assert caught.value.kinds == ("quota",)
    assert "out of credit" in caught.value.user_message
    assert [r.model for r in fake.chat_requests] == ["primary"]


@pytest.mark.anyio
async def test_a_rate_limit_says_the_retry_after_it_was_given(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider()
    fake.add_error(429, retry_after=0.25)

    with pytest.raises(LLMError) as caught:
        await provider.chat(HELLO)

    assert caught.value.kinds == ("rate_limited",) and caught.value.retry_after == 0.25


@pytest.mark.anyio
async def test_a_retry_after_past_the_bound_is_not_waited_out_by_the_client(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(max_retries=2, long_retry_after=10.0)
    fake.add_error(429, retry_after=30)
    fake.add_error(429, retry_after=2)  # under the bound: waited out
    fake.add_reply("after two seconds")

    started = time.monotonic()
    with pytest.raises(LLMError) as caught:
        await provider.chat(HELLO)
    assert time.monotonic() - started < 1
    assert caught.value.retry_after == 30 and len(fake.chat_requests) == 1
    answer = await provider.chat(HELLO)
    assert answer.message.content == "after two seconds"
    assert [r.retry_count for r in fake.chat_requests[1:]] == [0, 1]


@pytest.mark.anyio
async def test_a_server_that_cannot_be_reached_is_not_asked_for_other_models() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = OpenAIProvider(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key=None,
        model="m",
        fallback_models=["other", "third"],
        max_retries=0,
    )
    try:
        with pytest.raises(LLMError) as caught:
            await provider.chat(HELLO)
    finally:
        await provider.aclose()
    assert "'m'" in str(caught.value) and "'other'" not in str(caught.value)
    assert caught.value.kinds == ("unavailable",)


@pytest.mark.anyio
async def test_without_falling_back_to_its_model_a_provider_tries_only_what_was_asked(
    fake: FakeOpenAI, make_provider: MakeProvider
) -> None:
    provider = make_provider(falls_back_to_model=False, fallback_models=["backup"])
    fake.fail_model("chosen", 500)

    answer = await provider.chat(HELLO, model="chosen")

    assert [r.model for r in fake.chat_requests] == ["chosen", "backup"]
    assert answer.model == "backup"


class ForwardProxy:
    """A plain HTTP forward proxy on 127.0.0.1 (RFC 9110: requests in absolute form, sent
    on to their origin), counting what went through it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.port = 0

    async def __aenter__(self) -> ForwardProxy:
        from aiohttp import ClientSession, web

        async def forward(request: web.Request) -> web.Response:
            self.seen.append(str(request.url))
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
            async with (
                ClientSession() as session,
                session.request(request.method, request.url, data=body, headers=headers) as answer,
            ):
                return web.Response(
                    status=answer.status,
                    body=await answer.read(),
                    content_type=answer.content_type,
                )

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


@pytest.mark.anyio
async def test_the_proxy_the_environment_names_carries_the_model_requests(
    fake: FakeOpenAI, make_provider: MakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP(S)_PROXY is honoured as the openai client's transport honours it, and
    NO_PROXY exempts a host: an operator behind a proxy reaches a hosted model."""
    async with ForwardProxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        answer = await make_provider().chat(HELLO)
        assert answer.message.content == "echo: hello"
        assert proxy.seen == [f"{fake.base_url}/chat/completions"]

        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        answer = await make_provider().chat(HELLO)
        assert answer.message.content == "echo: hello" and len(proxy.seen) == 1
