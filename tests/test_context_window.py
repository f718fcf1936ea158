"""The context window a model is used with, learned from its server (issue 26, item 1),
and the 404 of a base URL without /v1 (item 3): the gateway in-process against the fake
server speaking as llama.cpp, llama-cpp-python, Ollama and vLLM do, the real openai
client between them."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from loguru import logger

from gateway.agent.windows import ContextWindows, choose_window
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.llm import ContextOverflow, LLMConfigError, LLMMessage
from gateway.llm.openai_provider import OpenAIProvider
from gateway.llm.types import ServerWindow, WindowUnknown
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI, Flavor, estimate_prompt_tokens

pytestmark = pytest.mark.anyio

MODEL = "gpt-4o-mini"
HELLO = [LLMMessage(role="user", content="hello")]


def inbound(text: str, key: str = "cli:test") -> InboundMessage:
    return InboundMessage(channel="cli", chat_id="test", text=text, session_key_override=key)


def words(tokens: int, word: str = "abc") -> str:
    """Text of about `tokens` tokens as the fake and the gateway count (4 characters)."""
    return f"{word} " * tokens


def server(flavor: Flavor, **options: Any) -> FakeOpenAI:
    """A local server of `flavor` serving MODEL, without an API key (as local ones run)."""
    return FakeOpenAI(api_key=None, models=(MODEL,), flavor=flavor, **options)


@pytest.fixture
async def provider_for() -> AsyncIterator[Callable[[str], OpenAIProvider]]:
    made: list[OpenAIProvider] = []

    def make(base_url: str) -> OpenAIProvider:
        made.append(OpenAIProvider(base_url=base_url, api_key=None, model=MODEL, max_retries=0))
        return made[-1]

    yield make
    for provider in made:
        await provider.aclose()


def quiet(make_settings: Callable[..., Settings], fake: FakeOpenAI, **overrides: Any) -> Settings:
    """Settings for `fake` without background consolidation: every chat request the fake
    gets is a turn's."""
    return make_settings(fake, memory__auto_consolidate="false", **overrides)


def refused(fake: FakeOpenAI) -> list[int]:
    """The indexes of the chat requests the fake refused as longer than its window."""
    window = fake.context_window
    assert window is not None
    return [i for i, r in enumerate(fake.chat_requests) if estimate_prompt_tokens(r.body) >= window]


@pytest.mark.parametrize(("window", "tools_sent"), [(2048, False), (8192, True)])
async def test_tools_are_left_out_of_a_window_they_would_crowd(
    make_settings: Callable[..., Settings], window: int, tools_sent: bool
) -> None:
    """The tools' definitions (about a thousand tokens for the default ten) take more
    than a quarter of llama-server's 2,048: the request goes without them, and fits;
    a window of 8,192 carries them."""
    logged: list[str] = []
    sink = logger.add(lambda message: logged.append(str(message)), level="INFO")
    try:
        async with server("llama.cpp", context_window=window) as fake:
            gw = Gateway.build(quiet(make_settings, fake))
            try:
                assert gw.agent.tools.specs()  # the memory tools are on
                for n in range(2):
                    reply = await gw.agent.handle(inbound(f"hello {n}"))
                    assert reply.text == f"echo: hello {n}", reply.text
            finally:
                await gw.aclose()
    finally:
        logger.remove(sink)
    assert refused(fake) == []
    assert [bool(r.body.get("tools")) for r in fake.chat_requests] == [tools_sent] * 2
    warned = [line for line in logged if "too small for the tools" in line]
    assert len(warned) == (0 if tools_sent else 1)  # said once, not per turn


# -- asking the server --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flavor", "options", "expected"),
    [
        ("llama.cpp", {}, ServerWindow(2048, "llama.cpp /props n_ctx", "llama.cpp")),
        ("vllm", {}, ServerWindow(2048, "vLLM /v1/models max_model_len", "vllm")),
        (
            "ollama",
            {"ollama_modelfile_num_ctx": True},
            ServerWindow(2048, "Ollama /api/show num_ctx", "ollama"),
        ),
        (
            "ollama",
            {"context_window": 8192},
            ServerWindow(
                2048,
                "Ollama's smallest default, 2,048 (/api/show sets no num_ctx)",
                "ollama",
                settled=False,
            ),
        ),
        ("llama-cpp-python", {}, None),
        ("openai", {"context_window": 2048}, None),
    ],
)
async def test_each_server_is_asked_where_it_says_its_window(
    provider_for: Callable[[str], OpenAIProvider],
    flavor: Flavor,
    options: dict[str, Any],
    expected: ServerWindow | None,
) -> None:
    async with server(flavor, **({"context_window": 2048} | options)) as fake:
        said = await provider_for(fake.base_url).server_window(MODEL)
    assert said == expected


async def test_ollama_tells_the_loaded_models_context_once_it_answered(
    provider_for: Callable[[str], OpenAIProvider],
) -> None:
    async with server("ollama", context_window=8192) as fake:
        provider = provider_for(fake.base_url)
        before = await provider.server_window(MODEL)
        await provider.chat(HELLO)  # loads the model
        after = await provider.server_window(MODEL)
    assert before is not None and not before.settled and before.tokens == 2048
    assert after == ServerWindow(8192, "Ollama /api/ps context_length", "ollama")


async def test_a_server_that_does_not_answer_is_not_asked_for_long(
    provider_for: Callable[[str], OpenAIProvider],
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(WindowUnknown):
        await provider_for(f"http://127.0.0.1:{port}/v1").server_window(MODEL)


@pytest.mark.parametrize(
    ("flavor", "prompt_tokens"),
    [("llama.cpp", 3006), ("llama-cpp-python", 3006), ("vllm", 3006), ("openai", 3006)],
)
async def test_each_servers_overflow_error_names_its_window(
    provider_for: Callable[[str], OpenAIProvider], flavor: Flavor, prompt_tokens: int
) -> None:
    long = [LLMMessage(role="user", content=words(3000))]  # 3000 + 3 + 3 as the fake counts
    async with server(flavor, context_window=2048) as fake:
        with pytest.raises(ContextOverflow) as caught:
            await provider_for(fake.base_url).chat(long)
    assert caught.value.context_tokens == 2048
    assert caught.value.prompt_tokens == prompt_tokens
    assert caught.value.server == flavor


# -- the choice ---------------------------------------------------------------------------


def test_the_window_in_use_is_the_servers_within_what_the_operator_set() -> None:
    llama = ServerWindow(2048, "llama.cpp /props n_ctx", "llama.cpp")
    vllm = ServerWindow(131072, "vLLM /v1/models max_model_len", "vllm")
    assert choose_window(None, None).tokens == 32768
    assert choose_window(None, None).source == "the default; the server does not say"
    assert choose_window(8192, None).describe() == "8,192 tokens (from [llm] context_window)"
    # Unset: the server's, smaller or larger than the default.
    assert choose_window(None, llama).describe() == "2,048 tokens (from llama.cpp /props n_ctx)"
    assert choose_window(None, vllm).tokens == 131072
    # Set: an upper bound, never exceeded, and never more than the server holds.
    assert choose_window(32768, llama).tokens == 2048
    assert choose_window(32768, vllm).describe() == (
        "32,768 tokens (from [llm] context_window; the server holds 131,072)"
    )


async def test_asking_never_holds_a_turn_up_nor_fails_it() -> None:
    now = [0.0]
    calls: list[str] = []

    async def down(model: str) -> ServerWindow | None:
        calls.append(model)
        raise WindowUnknown("connection refused")

    windows = ContextWindows(configured=None, probe=down, retry_after=30, clock=lambda: now[0])
    assert (await windows.ensure("m")).tokens == 32768  # the default meanwhile
    assert (await windows.ensure("m")).tokens == 32768
    assert calls == ["m"]  # not asked again at once...
    now[0] = 31
    await windows.ensure("m")
    assert calls == ["m", "m"]  # ...but after retry_after

    async def silent(model: str) -> ServerWindow | None:
        await anyio.sleep(3600)
        return None

    slow = ContextWindows(configured=4096, probe=silent, timeout=0.2)
    with anyio.fail_after(2):
        assert (await slow.ensure("m")).describe() == "4,096 tokens (from [llm] context_window)"


async def test_turns_at_once_ask_the_server_once() -> None:
    calls: list[str] = []

    async def probe(model: str) -> ServerWindow | None:
        calls.append(model)
        await anyio.sleep(0.05)
        return ServerWindow(2048, "llama.cpp /props n_ctx", "llama.cpp")

    windows = ContextWindows(configured=None, probe=probe)
    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(windows.ensure, "m")
    assert calls == ["m"] and windows.known("m").tokens == 2048


# -- turns --------------------------------------------------------------------------------


async def test_a_brand_new_sessions_long_first_message_is_fitted_to_llama_cpp_2048(
    make_settings: Callable[..., Settings],
) -> None:
    """The first hour: a new conversation of a key with remembered facts, a long first
    message, llama-server's 2,048 tokens against the gateway's 32,768 default."""
    async with server("llama.cpp", context_window=2048) as fake:
        gw = Gateway.build(quiet(make_settings, fake))
        try:
            scope = gw.agent.memory.for_session("cli:test")  # type: ignore[union-attr]
            scope.append_facts(
                [("learned_fact", f"Garden note {i}: " + words(60, "tomato")) for i in range(8)]
            )
            assert (await gw.agent.handle(inbound("/new"))).text.startswith("Started a new")
            message = "Plan my garden with tomato beds. " + words(600, "soil")
            reply = await gw.agent.handle(inbound(message))
            status = await gw.agent.handle(inbound("/status"))
        finally:
            await gw.aclose()
    assert not reply.is_error, reply.text
    assert reply.text.startswith("echo: Plan my garden") and "/new" not in reply.text
    assert refused(fake) == []  # every request fitted the 2,048 tokens
    [turn] = [r for r in fake.chat_requests if r.last_user_text == message.strip()]
    memory = [m["content"] for m in turn.messages if "Garden note" in str(m["content"])]
    assert len(memory) == 1 and len(memory[0]) < 8 * len(words(60, "tomato"))  # trimmed
    assert "of 2,048 tokens" in status.text and "from llama.cpp /props n_ctx" in status.text


async def conversation(
    gw: Gateway, turns: int = 8, size: int = 300, key: str = "cli:test"
) -> list[Any]:
    """`turns` messages of about `size` tokens each (with their echoes, twice that)."""
    replies = []
    for i in range(turns):
        replies.append(await gw.agent.handle(inbound(f"turn {i} " + words(size), key)))
    return replies


@pytest.mark.parametrize(
    ("flavor", "options", "source"),
    [
        ("llama.cpp", {}, "llama.cpp /props n_ctx"),
        ("vllm", {}, "vLLM /v1/models max_model_len"),
        ("ollama", {"ollama_modelfile_num_ctx": True}, "Ollama /api/show num_ctx"),
    ],
)
async def test_a_conversation_past_the_servers_window_stays_within_it(
    make_settings: Callable[..., Settings], flavor: Flavor, options: dict[str, Any], source: str
) -> None:
    async with server(flavor, context_window=2048, **options) as fake:
        gw = Gateway.build(quiet(make_settings, fake))
        try:
            replies = await conversation(gw)
            status = await gw.agent.handle(inbound("/status"))
        finally:
            await gw.aclose()
        assert [r.is_error for r in replies] == [False] * 8, [r.text for r in replies]
        assert [r.text.split(" ")[:3] for r in replies][-1] == ["echo:", "turn", "7"]
        # Nothing refused, nothing cut silently (Ollama), one request per turn.
        assert refused(fake) == [] and fake.truncations == []
        assert len(fake.chat_requests) == 8
        assert "of 2,048 tokens" in status.text and f"from {source})" in status.text


async def test_ollamas_assumed_default_gives_way_to_what_api_ps_says(
    make_settings: Callable[..., Settings],
) -> None:
    async with server("ollama", context_window=4096) as fake:
        gw = Gateway.build(quiet(make_settings, fake))
        try:
            before = await gw.agent.handle(inbound("/status"))
            await gw.agent.handle(inbound("hello"))
            await gw.agent.handle(inbound("again"))  # asks /api/ps now the model is loaded
            after = await gw.agent.handle(inbound("/status"))
        finally:
            await gw.aclose()
    assert "of 2,048 tokens" in before.text and "Ollama's smallest default" in before.text
    assert "of 4,096 tokens" in after.text and "from Ollama /api/ps context_length" in after.text


@pytest.mark.parametrize("stream", [False, True])
async def test_the_window_is_learned_from_the_overflow_error_when_no_endpoint_says_it(
    make_settings: Callable[..., Settings], stream: bool
) -> None:
    shown: list[str] = []

    async def on_delta(text: str) -> None:
        shown.append(text)

    async with server("llama-cpp-python", context_window=2048) as fake:
        gw = Gateway.build(quiet(make_settings, fake, llm__stream=str(stream).lower()))
        try:
            replies = []
            for i in range(8):
                message = inbound(f"turn {i} " + words(300))
                replies.append(await gw.agent.handle(message, on_delta=on_delta))
            status = await gw.agent.handle(inbound("/status"))
        finally:
            await gw.aclose()
    assert [r.is_error for r in replies] == [False] * 8, [r.text for r in replies]
    assert all(r.stream for r in fake.chat_requests) is stream
    assert "".join(shown) == "".join(r.text for r in replies if stream)
    # One request was refused; it was fitted to the size the error named and sent again,
    # and every later turn was fitted to it at once.
    assert len(refused(fake)) == 1 and len(fake.chat_requests) == 9
    assert "of 2,048 tokens" in status.text
    assert "from the server's overflow error" in status.text


async def test_a_consolidation_the_server_refuses_is_cut_to_the_size_it_named(
    make_settings: Callable[..., Settings],
) -> None:
    async with server("llama-cpp-python", context_window=2048) as fake:
        gw = Gateway.build(quiet(make_settings, fake, agent__memory_window=2))
        try:
            session = gw.sessions.get_or_create("cli:test")
            for i in range(12):  # about 3,600 tokens, written without asking the model
                session.add_message(LLMMessage(role="user", content=f"note {i} " + words(300)))
                session.add_message(LLMMessage(role="assistant", content="noted"))
            assert gw.consolidator is not None
            first = await gw.consolidator.consolidate_now("cli:test", force=True, retry=False)
            second = await gw.consolidator.consolidate_now("cli:test", force=True, retry=False)
        finally:
            await gw.aclose()
    assert not first.ok and "context" in (first.error or "")
    # The second asked within the window the first's error named (and failed only
    # because the fake echoes instead of summarizing).
    assert refused(fake) == [0] and len(fake.chat_requests) == 2, second


@pytest.mark.parametrize(
    ("flavor", "setting"),
    [
        ("llama.cpp", "start llama-server with a larger --ctx-size (-c)"),
        ("llama-cpp-python", "start llama_cpp.server with a larger --n_ctx"),
        ("vllm", "start vLLM with a larger --max-model-len"),
        ("ollama", "raise Ollama's num_ctx"),
    ],
)
async def test_a_message_longer_than_the_window_says_so_and_which_setting_to_change(
    make_settings: Callable[..., Settings], flavor: Flavor, setting: str
) -> None:
    async with server(flavor, context_window=2048, ollama_modelfile_num_ctx=True) as fake:
        gw = Gateway.build(quiet(make_settings, fake))
        try:
            reply = await gw.agent.handle(inbound(words(3000)))
        finally:
            await gw.aclose()
    assert reply.is_error
    assert reply.text.startswith("Your message is too long for the model: the request came to ")
    assert "its context window holds 2,048 tokens" in reply.text
    assert setting in reply.text and "/new" not in reply.text
    assert fake.truncations == []  # Ollama would have cut it: it was not sent


async def test_a_configured_window_is_an_upper_bound_both_ways(
    make_settings: Callable[..., Settings],
) -> None:
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        async with server("llama.cpp", context_window=2048) as fake:
            larger = Gateway.build(quiet(make_settings, fake, llm__context_window=32768))
            try:
                replies = await conversation(larger, turns=4)
                status = await larger.agent.handle(inbound("/status"))
            finally:
                await larger.aclose()
        async with server("llama.cpp", context_window=8192) as fake:
            smaller = Gateway.build(quiet(make_settings, fake, llm__context_window=1024))
            try:
                await conversation(smaller, turns=3)
                bounded = await smaller.agent.handle(inbound("/status"))
            finally:
                await smaller.aclose()
            sent = [estimate_prompt_tokens(r.body) for r in fake.chat_requests]
    finally:
        logger.remove(sink)
    assert not any(r.is_error for r in replies)
    assert "of 2,048 tokens" in status.text and "llama.cpp /props n_ctx" in status.text
    said = [w for w in warnings if w.startswith("[llm] context_window is 32,768")]
    assert said == [
        "[llm] context_window is 32,768 but llama.cpp /props n_ctx says 2,048 for "
        "gpt-4o-mini: using 2,048"
    ]
    assert "of 1,024 tokens" in bounded.text
    assert "from [llm] context_window; the server holds 8,192" in bounded.text
    assert max(sent) < 1024 + 700  # the messages within 1,024 (the tools come on top)


# -- a base URL without /v1 ---------------------------------------------------------------


@pytest.mark.parametrize("flavor", ["ollama", "vllm", "openai"])
async def test_a_base_url_without_v1_is_said_to_miss_it(
    provider_for: Callable[[str], OpenAIProvider],
    make_settings: Callable[..., Settings],
    flavor: Flavor,
) -> None:
    async with server(flavor) as fake:
        with pytest.raises(LLMConfigError) as caught:
            await provider_for(fake.url).chat(HELLO)
        settings = make_settings(fake).model_copy(
            update={"llm": make_settings(fake).llm.model_copy(update={"base_url": fake.url})}
        )
        gw = Gateway.build(settings)
        try:
            reply = await gw.agent.handle(inbound("hello"))
        finally:
            await gw.aclose()
    assert str(caught.value).endswith(
        f"the server at {fake.url} answered 404 for /chat/completions; OpenAI-compatible "
        f"base URLs usually end in /v1 (try {fake.url}/v1)"
    )
    assert reply.is_error and "does not exist" not in reply.text
    assert reply.text.startswith("The model server answered 404 for /chat/completions")
    assert "usually end in /v1" in reply.text and "llm.base_url" in reply.text


@pytest.mark.parametrize("flavor", ["ollama", "vllm", "openai"])
async def test_a_model_that_does_not_exist_is_still_said_to_not_exist(
    provider_for: Callable[[str], OpenAIProvider], flavor: Flavor
) -> None:
    async with server(flavor) as fake:
        fake.fail_model(MODEL)
        with pytest.raises(LLMConfigError) as caught:
            await provider_for(fake.base_url).chat(HELLO)
    assert "configured model does not exist" in caught.value.user_message
    assert "usually end in /v1" not in str(caught.value) and MODEL in str(caught.value)
