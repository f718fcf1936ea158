"""Memory through the whole gateway: a long conversation stays inside the context window
while background consolidation summarizes it, and the operator commands show the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from gateway.sessions.keys import encode_key
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply

ROOT = Path(__file__).resolve().parents[1]
CONTEXT_WINDOW = 2048


def consolidating_responder(body: dict[str, Any]) -> Reply | str:
    """Answers consolidation requests with a forced tool call, chat turns with prose."""
    if body.get("tool_choice"):
        turn = len(body["messages"])
        return Reply(
            tool_calls=(
                FakeToolCall(
                    "save_consolidation",
                    {
                        "facts": [
                            {"category": "user_preference", "text": f"prefers green tea ({turn})"},
                            {"category": "project_decision", "text": "the launch is on Friday"},
                        ],
                        "summary": f"The user talked about tea and the Friday launch ({turn}).",
                        "recent": f"Tea and the Friday launch came up again ({turn}).",
                    },
                ),
            )
        )
    last = body["messages"][-1].get("content") or ""
    return "Noted. " + ("Here is a longer answer. " * (3 + len(last) % 9))


@pytest.mark.anyio
async def test_long_conversation_stays_within_the_window(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.responder = consolidating_responder
    settings = make_settings(
        fake_openai,
        llm__context_window=CONTEXT_WINDOW,
        agent__reply_reserve_tokens=256,
        agent__memory_window=6,
    )
    gw = Gateway.build(settings)
    key = "telegram:long"
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(gw.run_services)
            for turn in range(300):
                size = (turn * 37) % 900  # short and long messages
                text = f"turn {turn}: I like green tea. " + "blah " * (size // 5)
                reply = await gw.agent.handle(
                    InboundMessage(channel="telegram", chat_id="long", sender_id="1", text=text)
                )
                assert not reply.is_error, reply.text
            await gw.consolidator.drain(10)  # type: ignore[union-attr]
            tg.cancel_scope.cancel()
    finally:
        await gw.aclose()

    chat = [r for r in fake_openai.chat_requests if not r.body.get("tool_choice")]
    assert len(chat) == 300
    for request in chat:
        chars = sum(len(json.dumps(m)) for m in request.messages)
        assert chars / 4 <= CONTEXT_WINDOW, f"a request of ~{chars // 4} tokens"
    consolidations = [r for r in fake_openai.chat_requests if r.body.get("tool_choice")]
    assert consolidations, "consolidation never ran"
    # The summary accumulates: a later consolidation request carries the previous one.
    assert any("The user talked about tea" in json.dumps(r.messages) for r in consolidations[1:])
    # Later turns carry the summary and the remembered facts.
    last = json.dumps(chat[-1].messages)
    assert "The user talked about tea" in last and "green tea" in last
    entries = [
        json.loads(line)
        for line in (settings.sessions_dir / f"{encode_key(key)}.jsonl").read_text().splitlines()
    ]
    assert sum(e["type"] == "compaction" for e in entries) >= 1
    assert sum(e["type"] == "message" for e in entries) == 600  # nothing was deleted


def test_memory_operator_commands(tmp_path: Path, fake_openai_thread: FakeOpenAI) -> None:
    fake_openai_thread.responder = consolidating_responder
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "OPENAI_"))}
    env |= {
        "PYTHONPATH": str(ROOT),
        "GATEWAY_WORKSPACE": str(tmp_path / "ws"),
        "OPENAI_BASE_URL": fake_openai_thread.base_url,
        "OPENAI_API_KEY": fake_openai_thread.api_key or "",
        "GATEWAY_AGENT__MEMORY_WINDOW": "2",
        "GATEWAY_MEMORY__AUTO_CONSOLIDATE": "false",  # this test compacts by hand
    }

    def gateway(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gateway.cli", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    for text in ("I like green tea", "The launch is on Friday", "Remind me later"):
        assert gateway("chat", "--session", "mem", "-m", text).returncode == 0
    empty = gateway("memory", "show", "cli:mem")
    assert "no remembered facts" in empty.stdout
    # The messages themselves are searchable before any consolidation.
    said = gateway("memory", "search", "cli:mem", "launch", "--messages")
    assert said.returncode == 0, said.stderr
    assert "cli:mem, user, entry " in said.stdout and "The launch is on Friday" in said.stdout
    compact = gateway("memory", "compact", "cli:mem")
    assert compact.returncode == 0, compact.stderr
    assert "Compacted" in compact.stdout
    shown = gateway("memory", "show", "cli:mem")
    assert "- [user_preference] prefers green tea" in shown.stdout
    found = gateway("memory", "search", "cli:mem", "launch friday")
    assert "the launch is on Friday" in found.stdout
    history = gateway("memory", "history", "cli:mem", "tea launch")
    # HISTORY.md logs what the new messages were about, not the cumulative summary.
    assert "Tea and the Friday launch came up again" in history.stdout
    assert "The user talked about tea" not in history.stdout
    knowledge = gateway("memory", "knowledge", "cli:mem", "--category", "project_decision")
    assert "[project_decision] the launch is on Friday" in knowledge.stdout
    other = gateway("memory", "show", "cli:someone-else")
    assert "green tea" not in other.stdout  # memory is per conversation
    missing = gateway("memory", "compact", "cli:nobody")
    assert missing.returncode == 1 and "no session" in missing.stderr
