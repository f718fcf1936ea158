"""A memory search answers from everything its scope holds, or says it did not.

The shape that once answered from the newest 64 kB alone (issue 31, item 3): 20,000
history lines appended to one scope (the default bound, so HISTORY.md rotates many
times), then a word that only line 17 holds, searched at once, after a reopen with and
without the saved index, with and without recency decay, in both storage modes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from loguru import logger

from gateway.agent.memory_tools import memory_texts, memory_tools, relevant_memory
from gateway.agent.tools import ToolContext
from gateway.config import Settings
from gateway.daemon import Daemon, Gateway
from gateway.memory import MemoryStore
from gateway.memory.protocol import MemoryBackend, MemoryScope
from gateway.messages import InboundMessage
from tests.fakes.openai_server import FakeOpenAI
from tests.gateway_process import base_env
from tests.terminal import Terminal
from tests.test_cli_e2e import run_gateway
from tests.test_daemon import TOKEN, daemon_settings, running
from tests.test_metrics import parse_exposition

LINES = 20_000
EARLY = 17  # the only line holding WORD
WORD = "quetzalcoatl"
KEY = "telegram:1"
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
DECAYS = (0.0, 0.001)


class Clock:
    """A settable clock the backends read for timestamps."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def entry(i: int) -> str:
    extra = f" and {WORD}" if i == EARLY else ""
    return f"turn {i}: we talked about the weather, the trains and the plans for the week{extra}"


def fill(memory: MemoryScope, clock: Clock) -> str:
    """Append the `LINES` entries, a minute apart and ending at T0; the line `EARLY` as
    written."""
    start = T0 - timedelta(minutes=LINES)
    written = ""
    for i in range(LINES):
        clock.now = start + timedelta(minutes=i)
        line = memory.append_history(entry(i))
        written = line if i == EARLY else written
    clock.now = T0
    return written


Make = Callable[[], MemoryBackend]


@pytest.fixture(params=["files", "postgres"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make(mode: str, request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[Make]:
    """Opens a backend over one store, as a restarted gateway (or another replica) does."""
    made: list[MemoryBackend] = []

    def files() -> MemoryBackend:
        made.append(MemoryStore(tmp_path / "ws", clock=clock))
        return made[-1]

    def postgres() -> MemoryBackend:
        from gateway.memory.pg_store import PostgresMemoryStore

        made.append(PostgresMemoryStore(pools(), clock=clock))
        return made[-1]

    if mode == "postgres":
        pools: Any = request.getfixturevalue("pg_pools")
        yield postgres
    else:
        yield files
    for backend in made:
        backend.close()


def scope_dir(tmp_path: Path) -> Path:
    return tmp_path / "ws" / "memory" / "telegram%3A1"


def test_a_word_only_an_early_line_holds_is_found_at_once_and_after_a_reopen(
    mode: str, make: Make, clock: Clock, tmp_path: Path
) -> None:
    backend = make()
    line = fill(backend.for_session(KEY), clock)
    assert line.endswith(
        f"turn {EARLY}: we talked about the weather, the trains and the "
        f"plans for the week and {WORD}"
    )
    if mode == "files":
        assert len(list(scope_dir(tmp_path).glob("HISTORY.archive.*.md"))) >= 5

    def check(memory: MemoryScope, *, at_once: bool) -> None:
        for decay in DECAYS:
            found = memory.search_history(WORD, 5, decay_rate=decay)
            assert found == [line] and found.complete, decay
            # With nothing to build, even a search that cannot wait is complete.
            if at_once:
                found = memory.search_history(WORD, 5, decay_rate=decay, wait=0)
                assert found == [line] and found.complete, decay

    check(backend.for_session(KEY), at_once=True)  # in the process that appended
    backend.close()
    check(make().for_session(KEY), at_once=True)  # after a restart (files: the saved index)
    if mode == "files":
        for saved in scope_dir(tmp_path).glob("*.index"):
            saved.unlink()
    check(make().for_session(KEY), at_once=mode == "postgres")  # files: no saved index


def test_appends_keep_the_saved_index_current_though_nobody_searched(
    tmp_path: Path, clock: Clock
) -> None:
    store = MemoryStore(tmp_path / "ws", clock=clock)
    memory = store.for_session(KEY)
    line = fill(memory, clock)
    for i in range(300):
        memory.append_facts(
            [("learned_fact", f"fact {i} of many" + (f" {WORD}" if i == 7 else ""))]
        )
    folder = scope_dir(tmp_path)
    # Saved as the appends went: a crash now would leave only the newest lines to catch up.
    assert (folder / "HISTORY.md.index").exists()
    store.close()
    saved = {
        name: (folder / name).stat().st_mtime_ns for name in ("HISTORY.md.index", "MEMORY.md.index")
    }
    again = MemoryStore(tmp_path / "ws", clock=clock).for_session(KEY)
    # The saved indexes cover every line: nothing to build, so nothing to wait for.
    found = again.search_history(WORD, 5, wait=0)
    assert found == [line] and found.complete
    facts = again.search_memory(WORD, wait=0)
    assert facts == [f"- [learned_fact] fact 7 of many {WORD}"] and facts.complete
    again.close()
    assert {name: (folder / name).stat().st_mtime_ns for name in saved} == saved  # not rebuilt


def big_memory(tmp_path: Path, clock: Clock) -> tuple[MemoryStore, str]:
    """A scope whose MEMORY.md of `LINES` facts was written whole, as an import writes
    it: no saved index. Its fact `EARLY` holds WORD; the fact is returned."""
    store = MemoryStore(tmp_path / "ws", clock=clock)
    path = store.for_session(KEY).memory_path  # opens nothing: no append, no search yet
    facts = [
        f"- [learned_fact] fact {i}: likes the weather and the trains"
        + (f" and {WORD}" if i == EARLY else "")
        for i in range(LINES)
    ]
    path.write_text("### Consolidated 2025-03-01\n" + "\n".join(facts) + "\n")
    return store, facts[EARLY]


def test_a_recall_that_cannot_wait_answers_from_the_newest_facts_and_says_so(
    tmp_path: Path, clock: Clock
) -> None:
    store, fact = big_memory(tmp_path, clock)
    recall = memory_texts(store, KEY, f"{WORD} fact {LINES - 1}", wait=0)
    assert not recall.complete
    assert WORD not in "\n".join(recall) and f"fact {LINES - 1}:" in recall[0]
    # A tool's search waits for the build; so does `load_indexes`.
    found = relevant_memory(store.for_session(KEY), WORD)
    assert found.complete and found == [f"[learned_fact] {fact.removeprefix('- [learned_fact] ')}"]
    recall = memory_texts(store, KEY, WORD, wait=0)
    assert recall.complete and WORD in recall[0]


def test_load_indexes_tells_how_a_build_goes(tmp_path: Path, clock: Clock) -> None:
    store, _ = big_memory(tmp_path, clock)
    told: list[tuple[str, int, int]] = []
    store.for_session(KEY).load_indexes(progress=lambda *step: told.append(step))
    assert told and {name for name, _, _ in told} == {"MEMORY.md"}
    size = (scope_dir(tmp_path) / "MEMORY.md").stat().st_size
    assert all(0 <= done <= total == size for _, done, total in told)
    assert store.for_session(KEY).search_memory(WORD, wait=0).complete


def test_the_history_tool_waits_for_the_build(tmp_path: Path, clock: Clock) -> None:
    store = MemoryStore(tmp_path / "ws", clock=clock)
    line = fill(store.for_session(KEY), clock)
    store.close()
    for saved in scope_dir(tmp_path).glob("*.index"):
        saved.unlink()
    again = MemoryStore(tmp_path / "ws", clock=clock)
    tools = {tool.spec.name: tool for tool in memory_tools(again)}
    context = ToolContext(session_key=KEY)
    answer = anyio.run(tools["history_search"].handler, {"query": WORD}, context)
    assert answer == line


# -- the turn's recall and the command line ---------------------------------------------


@pytest.mark.anyio
async def test_a_turn_recalls_what_it_has_after_its_wait_logs_it_and_counts_it(
    tmp_path: Path, fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = daemon_settings(
        make_settings, fake_openai, memory__recall_wait_seconds=0, memory__auto_consolidate=False
    )
    key = "api:work"
    store = MemoryStore(settings.workspace_path)
    store.for_session(key).memory_path.write_text(
        "".join(f"- [learned_fact] fact {i}: the trains\n" for i in range(LINES))
        + f"- [learned_fact] the newest fact, about {WORD} too\n",
    )
    warned: list[Any] = []
    sink = logger.add(warned.append, level="WARNING", filter=lambda r: "recall" in r["message"])
    daemon = Daemon(Gateway.build(settings), interactive=False)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with running(daemon) as url, aiohttp.ClientSession() as http:
            body = {"session": "work", "text": f"what do you know about {WORD}?"}
            async with http.post(f"{url}/api/chat", json=body, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
            async with http.get(f"{url}/metrics") as resp:
                families = parse_exposition(await resp.text())
    finally:
        logger.remove(sink)
    assert families["gateway_memory_search_incomplete_total"].value() == 1
    (record,) = [m.record for m in warned]
    assert record["extra"]["session"] == key and "0 s" in record["message"]
    # What it had: the newest facts, not a silent nothing.
    sent = json.dumps(fake_openai.chat_requests[-1].messages)
    assert f"the newest fact, about {WORD} too" in sent


@pytest.mark.anyio
async def test_a_turn_waits_for_the_build_within_its_bound(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(
        fake_openai, memory__recall_wait_seconds=120, memory__auto_consolidate=False
    )
    key = "api:work"
    folder = MemoryStore(settings.workspace_path).for_session(key).dir
    facts = [f"- [learned_fact] fact {i}: the trains" for i in range(LINES)]
    facts[EARLY] += f" and {WORD}"
    (folder / "MEMORY.md").write_text("\n".join(facts) + "\n")
    gw = Gateway.build(settings)
    try:
        reply = await gw.agent.handle(
            InboundMessage(channel="api", chat_id="work", sender_id="1", text=f"and {WORD}?")
        )
        assert not reply.is_error and reply.session_key == key
    finally:
        await gw.aclose()
    assert gw.agent.incomplete_recalls == 0
    assert f"fact {EARLY}: the trains and {WORD}" in json.dumps(
        fake_openai.chat_requests[-1].messages
    )


def test_the_command_line_waits_for_the_build_and_shows_how_it_goes(
    tmp_path: Path, clock: Clock, fake_openai_thread: FakeOpenAI
) -> None:
    store = MemoryStore(tmp_path / "ws", clock=clock)
    line = fill(store.for_session(KEY), clock)
    store.close()
    for saved in scope_dir(tmp_path).glob("*.index"):
        saved.unlink()
    env = base_env(tmp_path / "ws", fake_openai_thread)
    terminal = Terminal(
        [sys.executable, "-m", "gateway.cli", "memory", "history", KEY, WORD], env, tmp_path
    )
    try:
        terminal.expect("building the search index of HISTORY.md")
        terminal.expect(line)
        assert terminal.wait() == 0
    finally:
        terminal.close()
    for saved in scope_dir(tmp_path).glob("*.index"):
        saved.unlink()
    piped = run_gateway(["memory", "history", KEY, WORD], env, tmp_path)  # not a terminal
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.strip() == line and "building" not in piped.stderr
