"""Big tool results (issue 33, part 3): stored whole beside their session in both storage
modes, a preview with a handle in the context, `read_tool_output` and `search_tool_output`
reaching every character from the conversation that made them only, and old tool results
leaving the context first, as a stub that says how to read them again."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.agent.context import fit_context
from gateway.agent.tool_outputs import (
    READ_TOOL,
    SEARCH_TOOL,
    FoldedText,
    fold_case,
    preview,
    read_slice,
    search_text,
    stored_output,
    stub_for,
)
from gateway.agent.tools import Tool, ToolContext
from gateway.config import ConfigError, Settings
from gateway.daemon import Gateway
from gateway.llm.types import LLMMessage, ToolSpec
from gateway.messages import InboundMessage
from gateway.plumbing.fence import Fence, FencedOut, fenced
from gateway.sessions import SessionManager
from gateway.sessions.keys import encode_key
from gateway.sessions.outputs import HANDLE, OUTPUTS_DIR
from tests.fakes.openai_server import FakeOpenAI, FakeToolCall, Reply
from tests.llm_messages import assistant, call, result, user

KEY = "telegram:4242"
HANDLE_IN = re.compile(r"out_[0-9a-f]{12}")


def big_text(size: int = 200_000) -> str:
    """`size` characters of lines, non-ASCII and a NUL included, with a unique marker at
    the start, in the middle and at the end."""
    body: list[str] = ["START-MARKER-7f3a"]
    n = 0
    while sum(map(len, body)) < size:
        body.append(f"row {n}: value={n * 7 % 1000} Grüße \x00 {'x' * (n % 50)}")
        n += 1
    half = len(body) // 2
    lines = [*body[:half], "MIDDLE-MARKER-91c4", *body[half:]]
    return "\n".join([*lines, "END-MARKER-c0de"])


# -- the formats the model reads (pure) --------------------------------------------------


def shown_parts(text: str, shown: str) -> list[tuple[int, int]]:
    header = shown.split("\n", 1)[0]
    match = re.search(r"Shown: characters (\d+)-(\d+)(?: and (\d+)-(\d+))?\.", header)
    assert match is not None, header
    numbers = [int(g) for g in match.groups() if g is not None]
    return list(zip(numbers[::2], numbers[1::2], strict=True))


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=3000)
    | st.lists(st.text(max_size=80), min_size=1, max_size=100).map("\n".join),
    preview_chars=st.integers(min_value=1, max_value=4000),
)
def test_a_preview_shows_what_it_says_and_names_its_output(text: str, preview_chars: int) -> None:
    shown = preview(text, "out_0123456789ab", preview_chars)
    assert stored_output(shown) is not None
    ref = stored_output(shown)
    assert ref is not None and (ref.handle, ref.chars) == ("out_0123456789ab", len(text))
    ranges = shown_parts(text, shown)
    body = shown.split("\n", 1)[1]
    # The ranges it names are what it shows, in order, head from 0 and tail to the end.
    assert ranges[0][0] == 0 and ranges[-1][1] == len(text)
    assert body.startswith(text[ranges[0][0] : ranges[0][1]])
    assert body.endswith(text[ranges[-1][0] : ranges[-1][1]])
    assert sum(b - a for a, b in ranges) <= max(preview_chars, 0) or len(ranges) == 1
    if len(ranges) == 2:
        assert f"[... characters {ranges[0][1]}-{ranges[1][0]} not shown ...]" in body


def test_a_result_kept_whole_is_no_preview() -> None:
    assert stored_output("plain output") is None
    assert stored_output("[tool output out_xyz: 5 characters") is None
    stub = stub_for(LLMMessage(role="tool", content="abc" * 100, name="web_fetch"))
    assert stub.startswith("[this web_fetch result (300 characters)") and "\n" not in stub
    stored = preview(big_text(), "out_00000000abcd", 2000)
    line = stub_for(LLMMessage(role="tool", content=stored, name="web_fetch"))
    assert "out_00000000abcd" in line and READ_TOOL in line and "\n" not in line


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abcAB\n é", max_size=400),
    query=st.text(alphabet="abAB é", min_size=1, max_size=3),
)
def test_every_search_match_is_at_the_offset_it_gives(text: str, query: str) -> None:
    found = search_text(text, "out_0123456789ab", query)
    offsets = [int(m) for m in re.findall(r"^offset (\d+) ", found, re.MULTILINE)]
    for offset in offsets:
        assert text[offset : offset + len(query)].lower() == query.lower()
    if query.lower() in text.lower():
        assert offsets and offsets[0] == text.lower().index(query.lower())
    else:
        assert "no match" in found


def matches(found: str) -> list[tuple[int, int, int, str]]:
    """(offset, line, line start, snippet) of each match a search shows."""
    shown = re.findall(r"^offset (\d+) \(line (\d+), from (\d+)\): (.*)$", found, re.MULTILINE)
    return [(int(o), int(n), int(f), snippet) for o, n, f, snippet in shown]


@pytest.mark.parametrize(
    ("text", "query", "at"),
    [
        # Issue 37, item 7: one İ (a Turkish place name) made the whole output exact-case.
        ("flight to İzmir\nERROR: gate closed", "error", 16),
        ("İZMİR then İzmir", "i\u0307zmi\u0307r", 0),  # İ folds to i with a dot above
        ("Fuß ERROR", "error", 4),
        ("die Straße", "STRASSE", 4),  # ß is ss
        ("GROẞ", "groß", 0),
        ("ﬁle not found", "FILE", 0),  # the ligature is fi
        ("ΟΔΟΣ 3", "οδος", 0),
        ("λόγος", "ΛΌΓΟΣ", 0),  # the final sigma is a sigma
        ("KIZ kulesi", "k\u0131z", 0),  # the dotless i is i: its capital is I
        ("cafe\u0301 au lait", "CAFE\u0301", 0),  # combining marks stay where they are
        ("ǰ ΐ ΰ և ẖ then Needle", "NEEDLE", 15),  # each folds to two or three
    ],
)
def test_a_search_is_case_insensitive_on_any_text(text: str, query: str, at: int) -> None:
    found = matches(search_text(text, "out_0123456789ab", query))
    assert found and found[0][0] == at, found
    line_start = text.rfind("\n", 0, at) + 1
    assert found[0][1:] == (
        text.count("\n", 0, at) + 1,
        line_start,
        text[line_start:].split("\n")[0],
    )


def test_search_offsets_and_pages_count_the_original_characters() -> None:
    text = "ßß İ\n" * 30 + "ﬁx\n" + "x ERROR\n" * 40
    first = search_text(text, "out_0123456789ab", "error")
    shown = matches(first)
    assert [o for o, *_ in shown] == [m.start() for m in re.finditer("ERROR", text)][:20]
    more = re.search(r"offset=(\d+) for the next", first)
    assert more is not None and text[int(more.group(1)) :].startswith("ERROR")
    page = matches(search_text(text, "out_0123456789ab", "ERROR", int(more.group(1))))
    assert [o for o, *_ in page] == [m.start() for m in re.finditer("ERROR", text)][20:40]
    # Two matches inside one character are one match, at that character.
    assert [o for o, *_ in matches(search_text("aßb", "h", "s"))] == [1]


#: Characters that fold to several (ß, İ, ligatures, ǰ ...), the i's and sigmas, marks.
FOLDING = "ßẞİﬁﬀﬃﬅŉǰΐΰևẖﬓᾈ" + "\u0131IiΣ\u03c3ς" + "\u0307\u0301\u030ce\n"
unicode_text = st.text(alphabet=st.characters() | st.sampled_from(FOLDING), max_size=60)
casings = st.sampled_from([str.upper, str.lower, str.swapcase, str.casefold, str.title])


@settings(max_examples=300, deadline=None)
@given(before=unicode_text, needle=unicode_text.filter(bool), after=unicode_text, casing=casings)
def test_a_needle_is_found_where_it_was_put_in_any_casing(
    before: str, needle: str, after: str, casing: Callable[[str], str]
) -> None:
    """A needle put at a random place in random text is found there, whatever its case
    in the query; the line and the snippet shown are the original text's."""
    text = before + needle + after
    found = matches(search_text(text, "out_0123456789ab", casing(needle), len(before)))
    assert found, (text, casing(needle))
    offset, line, line_start, snippet = found[0]
    assert offset == len(before)
    assert line == text.count("\n", 0, offset) + 1
    assert line_start == text.rfind("\n", 0, offset) + 1
    assert text.startswith(snippet, line_start) and line_start + len(snippet) >= offset


@settings(max_examples=300, deadline=None)
@given(text=unicode_text)
def test_folded_offsets_map_back_per_character(text: str) -> None:
    folded = FoldedText.of(text)
    assert folded.folded == fold_case(text)
    for i in range(len(text) + 1):
        start = len(fold_case(text[:i]))
        assert folded.to_folded(i) == start
        if i < len(text):  # every folded character of text[i] maps back to it
            for f in range(start, start + len(fold_case(text[i]))):
                assert folded.to_original(f) == i


def test_a_search_pages_through_many_matches() -> None:
    text = "\n".join(f"item {i} needle" for i in range(100))
    seen: list[int] = []
    offset = 0
    while True:
        page = search_text(text, "out_0123456789ab", "NEEDLE", offset)
        seen += [int(m) for m in re.findall(r"^offset (\d+) ", page, re.MULTILINE)]
        more = re.search(r"offset=(\d+) for the next", page)
        if more is None:
            break
        offset = int(more.group(1))
    assert seen == [m.start() for m in re.finditer("needle", text)]


def test_reads_say_their_range_and_refuse_what_is_out_of_range() -> None:
    text = "0123456789"
    assert read_slice(text, "h", 2, 3) == "[h: characters 2-5 of 10; continue with offset=5]\n234"
    assert read_slice(text, "h", 8, 100).endswith("this is the end]\n89")
    assert read_slice(text, "h", 10, 1).startswith("error: offset 10 is past the end")
    assert read_slice(text, "h", -1, 1).startswith("error: offset must be")


# -- pruning: old tool results go first --------------------------------------------------


def test_old_tool_results_become_stubs_before_any_conversation_text_goes() -> None:
    outputs = [preview(big_text(30_000), f"out_00000000000{i}", 2000) for i in range(6)]
    history: list[LLMMessage] = []
    for i, shown in enumerate(outputs):
        history += [user(f"question {i} about the page"), call(f"c{i}")]
        history += [result(f"c{i}", shown), assistant(f"answer {i} from the page")]
    history.append(user("and now?"))
    results = range(2, len(history), 4)
    roomy = fit_context(system_prompt="s", history=history, context_window=8000)
    assert not roomy.trimmed and not roomy.pruned
    tight = fit_context(system_prompt="s", history=history, context_window=3200)
    assert not tight.over_budget and not tight.pruned  # nothing dropped...
    assert not [t for t in tight.trimmed if t.target != "tool_stub"]  # ...nor cut
    stubs = [t.index for t in tight.trimmed]
    assert stubs == list(results)[: len(stubs)] and 0 < len(stubs) < 6  # the oldest first
    tools = [m.content or "" for m in tight.messages if m.role == "tool"]
    for index, content in zip(results, tools, strict=True):
        if index in stubs:
            ref = stored_output(history[index].content)
            assert ref is not None and ref.handle in content and "\n" not in content
        else:
            assert content == history[index].content
    # Every conversation message is there as it was.
    said = [m.content for m in tight.messages if m.role in ("user", "assistant") and m.content]
    assert said == [m.content for m in history if m.role in ("user", "assistant") and m.content]


# -- the stores, in each storage mode ----------------------------------------------------

OpenManager = Callable[[], SessionManager]


@pytest.fixture(params=["files", "postgres", "memory"])
def open_manager(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OpenManager]:
    managers: list[SessionManager] = []
    pools: list[Any] = []
    if request.param == "files":

        def make() -> SessionManager:
            managers.append(SessionManager(tmp_path / "sessions", fsync="never"))
            return managers[-1]
    elif request.param == "memory":
        shared = SessionManager.in_memory()

        def make() -> SessionManager:
            return shared
    else:
        from gateway.plumbing.postgres import sync_pool
        from gateway.sessions.pg_store import PostgresSessions

        url = request.getfixturevalue("migrated_pg_url")

        def make() -> SessionManager:
            pool = sync_pool(url, max_size=2)
            pool.open(wait=True)
            pools.append(pool)
            managers.append(SessionManager.shared(PostgresSessions(pool)))
            return managers[-1]

    yield make
    for manager in managers:
        manager.close()
    for pool in pools:
        pool.close()


def test_an_output_comes_back_whole_to_its_conversation_only(open_manager: OpenManager) -> None:
    manager = open_manager()
    session = manager.get_or_create(KEY)
    session.add_message(user("fetch it"))
    text = big_text()
    handle = manager.outputs.put(KEY, session.session_id, text)
    assert HANDLE.fullmatch(handle)
    again = open_manager()  # another process or replica
    assert again.outputs.get(KEY, handle) == text
    assert again.outputs.get("telegram:4243", handle) is None  # another conversation's
    for forged in ("../../etc/passwd", "out_0123", handle.upper(), f"{handle}/../x", ""):
        assert again.outputs.get(KEY, forged) is None
    with pytest.raises(ValueError, match="lone surrogates"):
        manager.outputs.put(KEY, session.session_id, "bad \ud800 text")


def test_delete_takes_the_outputs_and_new_keeps_them_with_the_archive(
    open_manager: OpenManager,
) -> None:
    manager = open_manager()
    session = manager.get_or_create(KEY)
    session.add_message(user("first conversation"))
    first = manager.outputs.put(KEY, session.session_id, "first " * 2000)
    manager.reset(KEY)  # /new: the old session is archived with its outputs
    session.add_message(user("second conversation"))
    second = manager.outputs.put(KEY, session.session_id, "second " * 2000)
    other = manager.get_or_create("telegram:1")
    other.add_message(user("someone else"))
    theirs = manager.outputs.put("telegram:1", other.session_id, "theirs " * 2000)
    assert manager.outputs.get(KEY, first) == "first " * 2000

    assert manager.delete(KEY)
    fresh = open_manager()
    assert fresh.outputs.get(KEY, second) is None  # the deleted session's
    assert fresh.outputs.get(KEY, first) == "first " * 2000  # the archived one keeps its
    assert fresh.outputs.get("telegram:1", theirs) == "theirs " * 2000


def test_a_fork_reads_the_outputs_of_what_it_copied(open_manager: OpenManager) -> None:
    manager = open_manager()
    session = manager.get_or_create(KEY)
    session.add_message(user("fetch it"))
    handle = manager.outputs.put(KEY, session.session_id, "page " * 3000)
    forked = manager.fork(KEY, new_key="cli:fork")
    assert forked is not None
    assert open_manager().outputs.get("cli:fork", handle) == "page " * 3000
    assert manager.delete("cli:fork")
    assert open_manager().outputs.get(KEY, handle) == "page " * 3000  # the source's stays


def test_file_outputs_are_private_plain_text_files(tmp_path: Path) -> None:
    manager = SessionManager(tmp_path / "sessions")
    session = manager.get_or_create(KEY)
    session.add_message(user("fetch it"))
    handle = manager.outputs.put(KEY, session.session_id, "Grüße\x00 " * 1000)
    folder = tmp_path / "sessions" / OUTPUTS_DIR / encode_key(KEY) / session.session_id
    path = folder / f"{handle}.txt"
    assert path.read_bytes() == ("Grüße\x00 " * 1000).encode()
    assert os.listdir(folder) == [path.name]  # no temp file left beside it
    assert path.stat().st_mode & 0o777 == 0o600
    for level in (folder, folder.parent, folder.parent.parent):
        assert level.stat().st_mode & 0o777 == 0o700
    # Not a session: listings and the file mode ignore the folder.
    assert [i.key for i in manager.list_sessions()] == [KEY]
    manager.close()


def test_an_output_written_after_the_lease_moved_on_is_not_stored(
    migrated_pg_url: str,
) -> None:
    from gateway.plumbing.postgres import sync_pool
    from gateway.sessions.pg_store import PostgresSessions
    from tests.test_fencing import count, expire, take_lease

    with sync_pool(migrated_pg_url, max_size=2) as pool:
        manager = SessionManager.shared(PostgresSessions(pool))
        session = manager.get_or_create(KEY)
        old = take_lease(migrated_pg_url, "a")
        assert old is not None
        with fenced(Fence(KEY, old)):
            session.add_message(user("fetch it"))
            kept = manager.outputs.put(KEY, session.session_id, "kept " * 2000)
        expire(migrated_pg_url)
        assert take_lease(migrated_pg_url, "b") is not None
        with fenced(Fence(KEY, old)), pytest.raises(FencedOut):
            manager.outputs.put(KEY, session.session_id, "late " * 2000)
        assert count(migrated_pg_url, "SELECT count(*) FROM gw_tool_outputs") == 1
        assert manager.outputs.get(KEY, kept) == "kept " * 2000
        manager.close()


@pytest.mark.anyio
async def test_preview_must_be_shorter_than_what_is_stored(
    make_settings: Callable[..., Settings], fake_openai: FakeOpenAI
) -> None:
    with pytest.raises(ConfigError, match="tool_output_preview_chars"):
        make_settings(
            fake_openai, agent__tool_output_inline_chars=1000, agent__tool_output_preview_chars=1000
        )
    off = make_settings(fake_openai, agent__tool_output_inline_chars=0)
    assert off.agent.tool_output_inline_chars == 0


# -- the agent loop, in each storage mode ------------------------------------------------


def inbound(text: str, key: str = "cli:test") -> InboundMessage:
    return InboundMessage(channel="cli", chat_id="test", text=text, session_key_override=key)


def dump_tool(text: str) -> Tool:
    async def dump(args: dict[str, Any], context: ToolContext) -> str:
        return text

    spec = ToolSpec(
        name="big_dump",
        description="A large export.",
        parameters={"type": "object", "properties": {}, "additionalProperties": False},
    )
    return Tool(spec, dump)


class Reader:
    """A scripted model that calls `big_dump`, then reads its output to the end through
    `read_tool_output`, then searches for the middle marker, then answers."""

    def __init__(self, read_length: int) -> None:
        self.read_length = read_length
        self.previews: list[str] = []
        self.slices: list[str] = []
        self.searches: list[str] = []
        self.handle = ""

    def __call__(self, body: dict[str, Any]) -> Reply | str:
        last = body["messages"][-1]
        if last["role"] == "user":
            return Reply(tool_calls=(FakeToolCall("big_dump", {}, "dump"),))
        content = last["content"]
        if last["tool_call_id"] == "dump":
            self.previews.append(content)
            self.handle = HANDLE_IN.findall(content)[0]
            return self.read(0)
        if last["tool_call_id"].startswith("read"):
            header, _, data = content.partition("\n")
            self.slices.append(data)
            more = re.search(r"continue with offset=(\d+)", header)
            if more is not None:
                return self.read(int(more.group(1)))
            args = {"handle": self.handle, "query": "middle-marker"}
            return Reply(tool_calls=(FakeToolCall(SEARCH_TOOL, args, "search"),))
        self.searches.append(content)
        return "I have read all of it."

    def read(self, offset: int) -> Reply:
        args = {"handle": self.handle, "offset": offset, "length": self.read_length}
        return Reply(tool_calls=(FakeToolCall(READ_TOOL, args, f"read{offset}"),))


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["files", "postgres"])
async def test_the_model_reaches_every_character_of_a_200_kB_output(
    fake_openai: FakeOpenAI,
    make_settings: Callable[..., Settings],
    request: pytest.FixtureRequest,
    mode: str,
) -> None:
    overrides: dict[str, Any] = {"agent__max_tool_iterations": 40}
    if mode == "postgres":
        overrides["storage__url"] = request.getfixturevalue("migrated_pg_url")
    settings = make_settings(fake_openai, **overrides)
    text = big_text()
    reader = Reader(read_length=settings.agent.tool_output_read_chars)
    fake_openai.responder = reader
    gw = Gateway.build(settings)
    gw.agent.tools.register(dump_tool(text))
    try:
        reply = await gw.agent.handle(inbound("export everything"))
        handle = reader.handle
        # Another conversation cannot read it, whatever it knows of the handle.
        fake_openai.responder = lambda body: (
            Reply(tool_calls=(FakeToolCall(READ_TOOL, {"handle": handle}, "steal"),))
            if body["messages"][-1]["role"] == "user"
            else "done"
        )
        await gw.agent.handle(inbound("read theirs", key="cli:other"))
        stolen = fake_openai.chat_requests[-1].messages[-1]["content"]
        stored = await anyio.to_thread.run_sync(gw.sessions.outputs.get, "cli:test", handle)
        session = await anyio.to_thread.run_sync(gw.sessions.get, "cli:test")
        assert session is not None
        entries = json.loads("[" + ",".join(session.export_jsonl().strip().splitlines()[1:]) + "]")
    finally:
        await gw.aclose()

    assert reply.text == "I have read all of it."
    assert stored == text
    # The context had a preview with its size and handle, not the output.
    (shown,) = reader.previews
    assert len(shown) < 2 * settings.agent.tool_output_preview_chars
    assert shown.startswith(f"[tool output {handle}: {len(text)} characters")
    assert "START-MARKER-7f3a" in shown and "END-MARKER-c0de" in shown
    assert "MIDDLE-MARKER-91c4" not in shown
    # Read back through the tool, every character, in slices of the length asked.
    assert "".join(reader.slices) == text
    assert len(reader.slices) == -(-len(text) // settings.agent.tool_output_read_chars)
    (found,) = reader.searches
    middle = text.index("MIDDLE-MARKER-91c4")
    assert f"offset {middle} " in found
    assert stolen.startswith(f"error: there is no tool output '{handle}' in this conversation")
    # The session holds the preview, its entry naming the stored output.
    tool_entries = [e for e in entries if e.get("message", {}).get("role") == "tool"]
    assert tool_entries[0]["message"]["content"] == shown
    assert tool_entries[0]["meta"] == {"tool_output": {"handle": handle, "chars": len(text)}}
    assert all("meta" not in e for e in tool_entries[1:])  # reads are never stored again


@pytest.mark.anyio
async def test_an_output_that_cannot_be_stored_is_cut_and_the_turn_goes_on(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    text = big_text(50_000)
    fake_openai.add_tool_call("big_dump", {}, "dump")
    fake_openai.add_reply("done")
    gw = Gateway.build(settings)
    gw.agent.tools.register(dump_tool(text))
    # Where the outputs go is a file: nothing can be stored there.
    outputs_dir = settings.sessions_dir / OUTPUTS_DIR
    outputs_dir.write_text("not a folder")
    try:
        reply = await gw.agent.handle(inbound("export everything"))
    finally:
        await gw.aclose()
    assert reply.text == "done" and not reply.is_error
    sent = fake_openai.chat_requests[1].messages[-1]["content"]
    first, _, rest = sent.partition("\n")
    assert "the whole output could not be stored" in first
    assert rest.startswith("START-MARKER-7f3a") and rest.endswith("END-MARKER-c0de")
    assert len(sent) < settings.agent.tool_output_inline_chars + 200


@pytest.mark.anyio
async def test_small_results_and_a_gateway_without_tools_are_as_before(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    fake_openai.add_tool_call("current_time", {}, "t")
    fake_openai.add_reply("now")
    gw = Gateway.build(make_settings(fake_openai))
    try:
        await gw.agent.handle(inbound("time?"))
    finally:
        await gw.aclose()
    offered = [t["function"]["name"] for t in fake_openai.chat_requests[0].tools]
    assert {"current_time", READ_TOOL, SEARCH_TOOL} <= set(offered)
    assert "T" in fake_openai.chat_requests[1].messages[-1]["content"]  # kept whole
    bare = Gateway.build(make_settings(fake_openai, agent__tools="[]", memory__enabled="false"))
    try:
        await bare.agent.handle(inbound("hi", key="cli:bare"))
    finally:
        await bare.aclose()
    assert not fake_openai.chat_requests[-1].tools  # a model without tools gets none


@pytest.mark.anyio
async def test_an_output_is_in_place_before_the_entry_that_names_it(
    fake_openai: FakeOpenAI, make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings(fake_openai)
    text = big_text(30_000)
    fake_openai.add_tool_call("big_dump", {}, "dump")
    fake_openai.add_reply("done")
    gw = Gateway.build(settings)
    gw.agent.tools.register(dump_tool(text))
    store = gw.sessions.outputs
    seen: list[tuple[bytes, str]] = []
    real_put = store.put

    def put(key: str, session_id: str, output: str) -> str:
        handle = real_put(key, session_id, output)
        folder = settings.sessions_dir / OUTPUTS_DIR / encode_key(key) / session_id
        session_file = settings.sessions_dir / f"{encode_key(key)}.jsonl"
        seen.append(((folder / f"{handle}.txt").read_bytes(), session_file.read_text()))
        return handle

    store.put = put  # type: ignore[method-assign]
    try:
        await gw.agent.handle(inbound("export everything"))
    finally:
        await gw.aclose()
    ((stored, session_then),) = seen
    assert stored == text.encode()  # whole when put returned...
    assert "out_" not in session_then and "big_dump" in session_then  # ...before the entry
    session_now = (settings.sessions_dir / f"{encode_key('cli:test')}.jsonl").read_text()
    assert '"tool_output":{"handle":"out_' in session_now


def test_the_delete_command_takes_the_outputs_of_the_deleted_session(tmp_path: Path) -> None:
    from tests.test_cli_e2e import base_env, run_gateway

    sessions_dir = tmp_path / "ws" / "sessions"
    manager = SessionManager(sessions_dir)
    session = manager.get_or_create(KEY)
    session.add_message(user("old conversation"))
    kept = manager.outputs.put(KEY, session.session_id, "archived " * 2000)
    manager.reset(KEY)
    session.add_message(user("new conversation"))
    gone = manager.outputs.put(KEY, session.session_id, "current " * 2000)
    manager.close()
    deleted = run_gateway(["sessions", "delete", KEY, "--yes"], base_env(tmp_path), tmp_path)
    assert deleted.returncode == 0, deleted.stderr
    again = SessionManager(sessions_dir)
    assert again.outputs.get(KEY, gone) is None
    assert again.outputs.get(KEY, kept) == "archived " * 2000
    folder = sessions_dir / OUTPUTS_DIR / encode_key(KEY)
    assert [p.name for p in folder.iterdir()] == [again.list_archived(KEY)[0].session_id]
