"""Big tool results: kept whole beside the session, a preview with a handle in the context,
and the tools that read the rest (`read_tool_output`, `search_tool_output`).

The promise: a tool result longer than `OutputLimits.inline_chars` loses nothing. It is
stored whole (`gateway.sessions.outputs`) before the session entry that shows its preview
is appended; the preview names its handle, size and the ranges shown; and the two tools
reach every character of it, from this conversation only (a handle is looked up under
the conversation's session key). A result that cannot be stored (a full disk, the
database gone) is cut in the middle as before, saying so, and the turn goes on.

The text formats here are the model's interface and `fit_context`'s: `stored_output`
reads the preview's first line back, `stub_for` is the one line that replaces an old
tool result when the context has no room for it.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from loguru import logger

from gateway.agent.tools import Tool, ToolContext
from gateway.llm.types import LLMMessage, ToolSpec
from gateway.plumbing.fence import FencedOut

if TYPE_CHECKING:
    from gateway.sessions.outputs import ToolOutputStore

READ_TOOL = "read_tool_output"
SEARCH_TOOL = "search_tool_output"
#: Their results are never stored again (a read is already a bounded slice).
OUTPUT_TOOLS = frozenset({READ_TOOL, SEARCH_TOOL})
#: The tool group `/status` shows them in.
OUTPUT_GROUP = "tool_outputs"

_SURROGATES = re.compile(r"[\ud800-\udfff]")
_PREVIEW_HEAD = re.compile(r"\[tool output (out_[0-9a-f]{12}): (\d+) characters")
#: Matches shown by one search; more are paged with `offset`.
SEARCH_RESULTS = 20
#: Characters of a long line shown around a match.
SNIPPET_CHARS = 240


@dataclass(frozen=True, slots=True)
class OutputLimits:
    """The `[agent] tool_output_*` settings."""

    #: A result longer than this is stored and previewed (0: never; cut as before).
    inline_chars: int = 6_000
    #: Characters of a stored result shown in its preview (head and tail).
    preview_chars: int = 2_000
    #: The most characters one `read_tool_output` call returns.
    read_chars: int = 8_000
    #: The longest result stored; beyond it the middle is cut (`ToolRegistry.execute`).
    max_chars: int = 5_000_000


@dataclass(frozen=True, slots=True)
class StoredRef:
    """What a preview says of its output: the handle and the whole output's length."""

    handle: str
    chars: int


def stored_output(content: str | None) -> StoredRef | None:
    """The output a tool result's preview stands for, or None for a result kept whole."""
    if not content or not content.startswith("[tool output out_"):
        return None
    match = _PREVIEW_HEAD.match(content)
    return StoredRef(match.group(1), int(match.group(2))) if match else None


def _snap_back(text: str, end: int, floor: int) -> int:
    """`end` moved back to just after a newline at or after `floor`, if there is one."""
    at = text.rfind("\n", floor, end)
    return at + 1 if at >= 0 else end


def _snap_forward(text: str, start: int, ceiling: int) -> int:
    """`start` moved on to just after a newline before `ceiling`, if there is one."""
    at = text.find("\n", start, ceiling)
    return at + 1 if at >= 0 else start


def preview(text: str, handle: str, preview_chars: int) -> str:
    """What the context holds of a stored output: a first line naming its handle, size
    and the ranges shown and how to read the rest, then its head and tail (two thirds
    and one third of `preview_chars`, ending and starting at a line break when one is
    near)."""
    total = len(text)
    head_end = min(total, max(0, preview_chars * 2 // 3))
    tail_start = max(head_end, total - max(0, preview_chars - head_end))
    if 0 < head_end < tail_start:
        head_end = _snap_back(text, head_end, head_end * 3 // 4)
    if tail_start < total:
        tail_start = _snap_forward(text, tail_start, tail_start + (total - tail_start) // 4)
    lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
    whole = tail_start <= head_end
    shown = f"{0}-{total}" if whole else f"0-{head_end} and {tail_start}-{total}"
    first = (
        f"[tool output {handle}: {total} characters in {lines} lines, stored in full. "
        f'Shown: characters {shown}. Read any part with {READ_TOOL}(handle="{handle}", '
        f'offset, length) or find text in it with {SEARCH_TOOL}(handle="{handle}", query).]'
    )
    if whole:
        return f"{first}\n{text}"
    gap = f"\n[... characters {head_end}-{tail_start} not shown ...]\n"
    return f"{first}\n{text[:head_end]}{gap}{text[tail_start:]}"


def stub_for(message: LLMMessage) -> str:
    """The one line that stands for an old tool result the context has no room for."""
    ref = stored_output(message.content)
    if ref is not None:
        return (
            f"[tool output {ref.handle} ({ref.chars} characters) was taken out of the "
            f'context to make room; {READ_TOOL}(handle="{ref.handle}") or {SEARCH_TOOL} '
            "reads it again]"
        )
    name = message.name or "tool"
    return (
        f"[this {name} result ({len(message.content or '')} characters) was taken out of "
        f"the context to make room; call {name} again if it is needed]"
    )


def read_slice(text: str, handle: str, offset: int, length: int) -> str:
    """`length` characters of `text` from `offset`, headed by the range and the total."""
    total = len(text)
    if offset < 0:
        return "error: offset must be 0 or more"
    if offset >= total and total:
        return f"error: offset {offset} is past the end; {handle} has {total} characters"
    end = min(total, offset + max(1, length))
    after = f"; continue with offset={end}" if end < total else "; this is the end"
    return f"[{handle}: characters {offset}-{end} of {total}{after}]\n{text[offset:end]}"


def fold_case(text: str) -> str:
    """`text` as a case-insensitive search compares it: Unicode's full case folding
    (`str.casefold`: ß and ẞ as ss, the ligature ﬁ as fi, the final sigma as sigma, İ as
    i with a dot above), and the dotless i (U+0131) as i, since its capital is I. Every
    casing of a text folds alike, and each character folds on its own (to one character
    or more, never to none)."""
    return text.casefold().replace("\u0131", "i")


@dataclass(frozen=True, slots=True)
class FoldedText:
    """A text case-folded (`fold_case`) with the way between its offsets and the
    original's: most characters fold to one, a few to several (ß to ss, İ to i̇), which
    move the folded offsets after them. `wide_at` holds the original offset of each
    of those few, `wide_from` its folded offset, `wide_size` how many it folds to."""

    folded: str
    wide_at: tuple[int, ...] = ()
    wide_from: tuple[int, ...] = ()
    wide_size: tuple[int, ...] = ()

    @classmethod
    def of(cls, text: str) -> FoldedText:
        folded = fold_case(text)
        if len(folded) == len(text):  # no character folded to more than one
            return cls(folded)
        sizes = {c: len(fold_case(c)) for c in set(text) if len(fold_case(c)) > 1}
        wide = re.compile("|".join(map(re.escape, sizes)))
        at: list[int] = []
        starts: list[int] = []
        shift = 0
        for match in wide.finditer(text):
            at.append(match.start())
            starts.append(match.start() + shift)
            shift += sizes[match.group()] - 1
        return cls(folded, tuple(at), tuple(starts), tuple(sizes[text[i]] for i in at))

    def _shift_after(self, k: int) -> int:
        """How far the folded offsets run ahead after the `k`th wide character."""
        return self.wide_from[k] + self.wide_size[k] - self.wide_at[k] - 1

    def to_folded(self, offset: int) -> int:
        """The folded offset where the original character at `offset` begins."""
        k = bisect.bisect_left(self.wide_at, offset)
        return offset if k == 0 else offset + self._shift_after(k - 1)

    def to_original(self, offset: int) -> int:
        """The original character the folded character at `offset` comes from."""
        k = bisect.bisect_right(self.wide_from, offset) - 1
        if k < 0:
            return offset
        if offset < self.wide_from[k] + self.wide_size[k]:
            return self.wide_at[k]
        return offset - self._shift_after(k)


def search_text(text: str, handle: str, query: str, offset: int = 0) -> str:
    """Where `query` occurs in `text` (case-insensitive, `fold_case`) from `offset` on:
    each match's offset and line number with its line (or `SNIPPET_CHARS` around it in a
    long line), at most `SEARCH_RESULTS`, with the total and the offset to go on from.
    Offsets are the original text's, whatever folding did to lengths (ß, İ, ligatures)."""
    if not query:
        return "error: give the text to search for"
    folded, needle = FoldedText.of(text), fold_case(query)
    spans: list[tuple[int, int]] = []  # (start, end) of each match in `text`
    at = folded.folded.find(needle, folded.to_folded(max(0, offset)))
    while at >= 0:
        start = folded.to_original(at)
        end = folded.to_original(at + len(needle) - 1) + 1
        if not spans or start >= spans[-1][1]:  # two in one character (s in ß) are one
            spans.append((start, end))
        at = folded.folded.find(needle, at + len(needle))
    starts = [start for start, _ in spans]
    if not starts:
        where = f" after offset {offset}" if offset else ""
        return f"[{handle}: no match for {query!r}{where} in {len(text)} characters]"
    lines: list[str] = []
    line_no, counted_to = 1, 0
    i = 0
    while i < len(starts) and len(lines) < SEARCH_RESULTS:
        start, end = spans[i]
        line_no += text.count("\n", counted_to, start)
        counted_to = start
        line_start = text.rfind("\n", 0, start) + 1
        line_end = text.find("\n", start)
        line_end = len(text) if line_end < 0 else line_end
        if line_end - line_start > SNIPPET_CHARS:
            line_start = max(line_start, start - SNIPPET_CHARS // 2)
            line_end = min(line_end, max(line_start + SNIPPET_CHARS, end))
        snippet = text[line_start:line_end]
        lines.append(f"offset {start} (line {line_no}, from {line_start}): {snippet}")
        i += 1
        while i < len(starts) and starts[i] < line_end:
            i += 1  # shown in this snippet already
    tail = ""
    if i < len(starts):
        tail = f"\n[more matches; search again with offset={starts[i]} for the next ones]"
    head = f"[{handle}: {len(starts)} matches for {query!r} in {len(text)} characters]"
    return head + "\n" + "\n".join(lines) + tail


def _int_arg(args: dict[str, Any], name: str, default: int) -> int | str:
    value = args.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return f"error: {name} must be a whole number"
    try:
        return int(value)
    except ValueError:
        return f"error: {name} must be a whole number, not {value!r}"


class ToolOutputs:
    """Stores big tool results (`shelve`) and offers the tools that read them (`tools`).
    Outputs never change once stored, so the last ones read are kept in memory
    (`cache_chars` characters at most) for the next reads of the same output."""

    def __init__(
        self, store: ToolOutputStore, limits: OutputLimits, *, cache_chars: int = 8_000_000
    ) -> None:
        self.store = store
        self.limits = limits
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._cached_chars = 0
        self._cache_chars = cache_chars
        self._lock = threading.Lock()

    @property
    def on(self) -> bool:
        return self.limits.inline_chars > 0

    def _remember(self, key: str, handle: str, text: str) -> None:
        with self._lock:
            if (key, handle) in self._cache or len(text) > self._cache_chars:
                return
            self._cache[(key, handle)] = text
            self._cached_chars += len(text)
            while self._cached_chars > self._cache_chars:
                _, old = self._cache.popitem(last=False)
                self._cached_chars -= len(old)

    def _cached(self, key: str, handle: str) -> str | None:
        with self._lock:
            text = self._cache.get((key, handle))
            if text is not None:
                self._cache.move_to_end((key, handle))
            return text

    async def shelve(
        self, key: str, session_id: str, tool: str, result: str
    ) -> tuple[str, dict[str, Any] | None]:
        """What the session and the context get for a tool result: the result itself
        when it is short (or a read of a stored one), else a preview of it once it is
        stored whole, with the entry meta that names its handle. `FencedOut` (the
        session moved to another replica) is raised; any other failure to store cuts
        the result in the middle instead (it says so) and logs why."""
        if not self.on or len(result) <= self.limits.inline_chars or tool in OUTPUT_TOOLS:
            return result, None
        text = _SURROGATES.sub("\ufffd", result)
        try:
            handle = await anyio.to_thread.run_sync(self.store.put, key, session_id, text)
        except FencedOut:
            raise
        except Exception as exc:
            logger.error("the {} result could not be stored ({}); it is cut instead", tool, exc)
            half = self.limits.inline_chars // 2
            cut = len(text) - 2 * half
            first = f"[{len(text)} characters; the whole output could not be stored, so the "
            first += f"middle {cut} are cut]\n"  # first: a cut in the context keeps it
            return first + text[:half] + "\n[... cut ...]\n" + text[-half:], None
        self._remember(key, handle, text)
        logger.info("{} result stored as {} ({} characters)", tool, handle, len(text))
        meta = {"tool_output": {"handle": handle, "chars": len(text)}}
        return preview(text, handle, self.limits.preview_chars), meta

    async def _load(self, key: str, args: dict[str, Any]) -> tuple[str, str] | str:
        """(handle, text) of the output the call names, or the error the model reads."""
        handle = args.get("handle")
        if not isinstance(handle, str) or not handle.strip():
            return "error: give the handle of a stored tool output (out_...)"
        handle = handle.strip().strip('"')
        text = self._cached(key, handle)
        if text is None:
            text = await anyio.to_thread.run_sync(self.store.get, key, handle)
            if text is None:
                return (
                    f"error: there is no tool output {handle!r} in this conversation; use a "
                    "handle shown in this conversation (out_ and 12 hex digits)"
                )
            self._remember(key, handle, text)
        return handle, text

    async def _read(self, args: dict[str, Any], context: ToolContext) -> str:
        loaded = await self._load(context.session_key, args)
        if isinstance(loaded, str):
            return loaded
        handle, text = loaded
        offset = _int_arg(args, "offset", 0)
        length = _int_arg(args, "length", self.limits.read_chars)
        if isinstance(offset, str):
            return offset
        if isinstance(length, str):
            return length
        return read_slice(text, handle, offset, min(length, self.limits.read_chars))

    async def _search(self, args: dict[str, Any], context: ToolContext) -> str:
        loaded = await self._load(context.session_key, args)
        if isinstance(loaded, str):
            return loaded
        handle, text = loaded
        query = args.get("query")
        if not isinstance(query, str) or not query:
            return "error: give the text to search for (query)"
        offset = _int_arg(args, "offset", 0)
        if isinstance(offset, str):
            return offset
        return await anyio.to_thread.run_sync(search_text, text, handle, query, offset)

    def tools(self) -> list[Tool]:
        """`read_tool_output` and `search_tool_output`, reading this store."""
        handle = {"type": "string", "description": "The handle, e.g. out_0123456789ab."}
        read = ToolSpec(
            name=READ_TOOL,
            description=(
                "Read part of a tool output that was too long to show in full (its preview "
                "names the handle). Returns the characters from offset, at most "
                f"{self.limits.read_chars} at a time, with the range and the total."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "handle": handle,
                    "offset": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "First character to read (0 = the start).",
                    },
                    "length": {
                        "type": "integer",
                        "minimum": 1,
                        "maximum": self.limits.read_chars,
                        "description": "How many characters to read.",
                    },
                },
                "required": ["handle"],
                "additionalProperties": False,
            },
        )
        search = ToolSpec(
            name=SEARCH_TOOL,
            description=(
                "Find text in a stored tool output (case-insensitive): the matching lines "
                f"with their offsets, at most {SEARCH_RESULTS}; read around an offset with "
                f"{READ_TOOL}."
            ),
            parameters={
                "type": "object",
                "properties": {
                    "handle": handle,
                    "query": {"type": "string", "description": "The text to find."},
                    "offset": {
                        "type": "integer",
                        "minimum": 0,
                        "description": "Search from this character on (for the next matches).",
                    },
                },
                "required": ["handle", "query"],
                "additionalProperties": False,
            },
        )
        return [Tool(read, self._read, timeout=30.0), Tool(search, self._search, timeout=30.0)]
