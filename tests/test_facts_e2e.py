"""Seeing, correcting and forgetting remembered facts through the whole gateway: the real
openai client against the fake server, consolidation citing the message a fact came
from, /memory, /correct and /forget in the person mode, and `gateway memory
facts|correct|forget` on the command line."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.agent.context import MEMORY_PREFIX
from gateway.config import Settings
from gateway.daemon import Gateway
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply
from tests.test_cli_e2e import llm_env, run_gateway

pytestmark = pytest.mark.anyio


def consolidate_citing(facts: list[tuple[str, int]]) -> Callable[[dict[str, Any]], Reply | str]:
    """Consolidation requests get `facts` (text, cited message number); chat turns prose."""

    def respond(body: dict[str, Any]) -> Reply | str:
        if body.get("tool_choice"):
            arguments = {
                "facts": [
                    {"category": "learned_fact", "text": text, "message": number}
                    for text, number in facts
                ],
                "summary": "The user told me a few things about themselves.",
            }
            return Reply(tool_calls=(FakeToolCall("save_consolidation", arguments),))
        return "Noted."

    return respond


def dm(chat: str, text: str, *, group: bool = False, sender: str | None = None) -> InboundMessage:
    return InboundMessage(
        channel="telegram",
        chat_id=chat,
        sender_id=sender or chat,
        text=text,
        metadata={"is_group": group},
    )


def memory_block(fake: FakeOpenAI) -> str:
    """The memory the last chat turn was given (system messages holding it)."""
    chat = [r for r in fake.chat_requests if not r.body.get("tool_choice")]
    return "\n".join(
        str(m.get("content"))
        for m in chat[-1].messages
        if m.get("role") == "system" and MEMORY_PREFIX in str(m.get("content"))
    )


async def test_a_fact_is_shown_with_its_source_corrected_and_forgotten_by_its_person(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.responder = consolidate_citing(
        [("Alice's locker code is 4711", 3), ("Alice cycles to work", 99)]
    )
    settings = make_settings(fake_openai, memory__scope="person", agent__memory_window=2)
    gw = Gateway.build(settings)
    assert gw.agent.people is not None
    gw.agent.people.link(["telegram:42", "slack:U0ALICE"])
    said = ["Hello there", "My locker code is 4711", "I cycle to work", "Thanks"]
    try:
        for text in said:
            assert not (await gw.agent.handle(dm("42", text))).is_error
        compacted = await gw.agent.handle(dm("42", "/compact"))
        assert compacted.text.startswith("Compacted:"), compacted.text
        request = next(r for r in fake_openai.chat_requests if r.body.get("tool_choice"))
        assert "[3] User: My locker code is 4711" in json.dumps(request.messages)

        session = gw.sessions.get("telegram:42")
        assert session is not None
        ctx = session.build_context()
        branch = session.get_branch()
        said_in = [e for e in branch if getattr(e, "message", None) is not None]
        entry_of = {e.message.content: e.id for e in said_in if e.message.role == "user"}
        cut = next(e.first_kept_entry_id for e in branch if hasattr(e, "first_kept_entry_id"))
        last_summarized = said_in[[e.id for e in said_in].index(cut) - 1].id
        listed = (await gw.agent.handle(dm("42", "/memory"))).text
        facts = {f.text: f for f in gw.memory.for_session("telegram:42").list_facts()}  # type: ignore[union-attr]
        code, cycling = facts["Alice's locker code is 4711"], facts["Alice cycles to work"]
        # The cited message's entry; a citation that is not there: the range's last entry.
        assert code.origin is not None and cycling.origin is not None
        assert code.origin.entry_id == entry_of["My locker code is 4711"]
        assert cycling.origin.entry_id == last_summarized
        assert (
            f"{code.id}  [learned_fact] Alice's locker code is 4711  "
            f"(from telegram:42 entry {code.origin.entry_id})" in listed
        )
        assert listed.startswith("Remembered facts (2):")
        assert ctx.summary is not None

        # Bob cannot forget or correct Alice's fact by its id, nor see it.
        bob = await gw.agent.handle(dm("77", f"/forget {code.id}"))
        assert bob.is_error and bob.text == f"no fact {code.id} in your memory"
        bob = await gw.agent.handle(dm("77", f"/correct {code.id} nothing"))
        assert bob.is_error and bob.text.startswith(f"no fact {code.id} in your memory")
        assert "4711" not in (await gw.agent.handle(dm("77", "/memory"))).text
        # Nor does a group Alice writes in (its memory is the group's own).
        group = await gw.agent.handle(dm("-100", "/memory", group=True, sender="42"))
        assert "4711" not in group.text

        # A forget of a fact that does not exist changes nothing.
        before = gw.memory.for_session("telegram:42").read_memory()  # type: ignore[union-attr]
        missing = await gw.agent.handle(dm("42", "/forget 0badc0de"))
        assert missing.is_error
        assert missing.text == "no fact 0badc0de in your memory (/memory lists them with their ids)"
        assert (await gw.agent.handle(dm("42", "/forget"))).is_error
        two = await gw.agent.handle(dm("42", "/forget alice"))  # words two facts hold
        assert two.is_error and "2 facts match 'alice'; say which one by its id" in two.text
        assert gw.memory.for_session("telegram:42").read_memory() == before  # type: ignore[union-attr]

        # The same person on Slack sees the fact, and corrects it there.
        slack = InboundMessage(
            channel="slack",
            chat_id="D0ALICE",
            sender_id="U0ALICE",
            text=f"/correct {code.id} Alice's locker code is 4712",
            metadata={"is_group": False},
        )
        fixed = await gw.agent.handle(slack)
        assert fixed.text == (
            f"Corrected: [learned_fact] Alice's locker code is 4712 (fact {code.id})"
        )
        await gw.agent.handle(dm("42", "what is my locker code?"))
        block = memory_block(fake_openai)
        assert "4712" in block and "4711" not in block
        listed = (await gw.agent.handle(dm("42", "/facts"))).text
        assert "corrected " in listed and "by slack:U0ALICE (/correct)" in listed

        gone = await gw.agent.handle(dm("42", "/forget locker"))  # one fact holds the word
        assert gone.text == (
            f"Forgotten: [learned_fact] Alice's locker code is 4712 (fact {code.id})"
        )
        await gw.agent.handle(dm("42", "what is my locker code?"))
        assert "locker" not in memory_block(fake_openai)
        assert "Alice cycles to work" in memory_block(fake_openai)
        memory = gw.memory.for_session("telegram:42")  # type: ignore[union-attr]
        assert "locker" not in memory.read_memory()
        assert [e.content for e in memory.knowledge] == ["Alice cycles to work"]
    finally:
        await gw.aclose()


async def test_a_remembered_fact_points_at_the_message_of_its_turn(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    gw = Gateway.build(make_settings(fake_openai))
    fake_openai.add(Reply(tool_calls=(FakeToolCall("remember", {"content": "Plays the cello"}),)))
    try:
        await gw.agent.handle(dm("5", "Remember that I play the cello"))
        session = gw.sessions.get("telegram:5")
        assert session is not None
        user_entry = next(
            e.id for e in session.get_branch() if getattr(e, "message", None) is not None
        )
        listed = (await gw.agent.handle(dm("5", "/memory"))).text
    finally:
        await gw.aclose()
    assert f"[learned_fact] Plays the cello  (from telegram:5 entry {user_entry})" in listed


def test_operator_sees_corrects_and_forgets_facts(
    tmp_path: Path, fake_openai_thread: FakeOpenAI
) -> None:
    env = llm_env(tmp_path, fake_openai_thread)
    fake_openai_thread.add(
        Reply(tool_calls=(FakeToolCall("remember", {"content": "Has two cats"}),))
    )
    told = run_gateway(["chat", "-m", "I have two cats"], env, tmp_path)
    assert told.returncode == 0, told.stderr

    def memory(*args: str) -> Any:
        return run_gateway(["memory", *args], env, tmp_path)

    listed = memory("facts", "cli:direct")
    assert listed.returncode == 0, listed.stderr
    ident = listed.stdout.split()[0]
    assert "[learned_fact] Has two cats  (from cli:direct entry " in listed.stdout
    fixed = memory("correct", "cli:direct", ident, "Has", "three", "cats")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.startswith(f"corrected: {ident}  [learned_fact] Has three cats")
    assert "by operator" in fixed.stdout
    missing = memory("forget", "cli:direct", "0badc0de")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "no fact 0badc0de in the memory of cli:direct" in missing.stderr
    bad = memory("forget", "cli:direct", "not-an-id")
    assert bad.returncode == 2 and "no fact not-an-id" in bad.stderr
    other = memory("forget", "cli:other", ident)  # another conversation's memory
    assert other.returncode == 1 and "it has none" in other.stderr
    gone = memory("forget", "cli:direct", ident)
    assert gone.returncode == 0, gone.stderr
    assert gone.stdout.startswith(f"forgotten: {ident}  [learned_fact] Has three cats")
    assert memory("facts", "cli:direct").stdout.strip() == "no remembered facts for cli:direct yet"
    workspace = tmp_path / "ws"
    memory_dir = next((workspace / "memory").iterdir())
    for path in memory_dir.iterdir():
        assert b"cats" not in path.read_bytes(), path.name
