"""Pure cache policy: what may be cached, under which scope, and under which key.

Everything here is a pure function of its arguments, so the rules that keep one user's
answer away from another user read top to bottom and are tested without any storage.

The invariant kept here: **an answer is never served to a session it would be wrong or
private for.** A *shared* entry is only ever written for a standalone question (no prior
turns on the branch, no memory/knowledge, no user-specific data, no tool calls); every
other entry's key contains the session key, the sender and the digest of the
conversation context the answer depended on, so it can only be hit again from the same
session with the same context. Both kinds of key also contain the model, the system
prompt and the tool set.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gateway.llm.types import LLMMessage, ToolSpec

KEY_VERSION = "gateway-cache-v1"
SHARED_SCOPE = "shared"
SESSION_SCOPE_PREFIX = "session:"
# OpenAI-compatible servers sample at temperature 1.0 when the request names none.
PROVIDER_DEFAULT_TEMPERATURE = 1.0
# Chosen for the wordllama embedder with the guard on the tuning part of the public pairs
# (tests/public_pairs.py) and checked on tests/data/cache_pairs.json: the guard decides,
# the threshold only keeps dissimilar candidates from reaching it (see neardup).
DEFAULT_NEAR_DUPLICATE_THRESHOLD = 0.70
#: The embedding model the near-duplicate layer runs (`near_duplicate_model`): wordllama
#: (the cache-neardup extra) or all-MiniLM-L6-v2 (the embedding extra, gateway/embedding.py).
NEAR_DUPLICATE_MODELS = ("wordllama", "minilm")
#: MiniLM's threshold, chosen with the guard on the tuning part of the public pairs plus
#: generated hard negatives (bench/embeddings.py): the lowest at which no wrong answer
#: was served. MiniLM scores "from A to B" against "from B to A" up to 0.983.
MINILM_NEAR_DUPLICATE_THRESHOLD = 0.985
#: MiniLM's candidate floor: a stored question at least this similar (and accepted by the
#: guard) but below its entry's threshold is not served; the model's answer to it is
#: compared with the stored one, a label for the thresholds (gateway/cache/verified.py).
MINILM_CANDIDATE_FLOOR = 0.90

_WHITESPACE = re.compile(r"\s+")
_TRAILING_QUESTION_MARKS = re.compile(r"\s*\?+$")
_NOCACHE_PREFIX = re.compile(r"^\s*/nocache(?:@\w+)?(?:\s+|$)", re.IGNORECASE)


class CacheMode(StrEnum):
    """Where an answer may live: nowhere, in the shared space, or in one session's space."""

    BYPASS = "bypass"
    SHARED = "shared"
    SCOPED = "scoped"


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """Cache configuration, validated on construction.

    `max_temperature` is inclusive: at or below it a model answers almost
    deterministically, so replaying a stored answer is what the user would get anyway;
    above it a user who asks again ("tell me a joke") expects a fresh sample. 0.3 keeps
    the usual "precise" settings (0-0.3) cacheable and the usual chat default (0.7) not.
    """

    enabled: bool = True
    ttl_seconds: float = 3600.0
    max_entries: int = 10_000
    max_temperature: float = 0.3
    max_response_bytes: int = 256 * 1024
    near_duplicates: bool = False
    near_duplicate_model: str = "wordllama"
    #: None: the model's own (`DEFAULT_NEAR_DUPLICATE_THRESHOLD`, `MINILM_...`).
    near_duplicate_threshold: float | None = None
    #: The share of served near-duplicate hits allowed to be wrong (gateway/cache/verified.py).
    near_duplicate_max_error: float = 0.01
    #: The share of servable near-duplicates answered by the model for a label instead.
    near_duplicate_audit_rate: float = 0.05
    #: How alike (cosine) two answers must be for a stored one to count as right.
    near_duplicate_answer_agreement: float = 0.92

    def __post_init__(self) -> None:
        if self.ttl_seconds <= 0:
            raise ValueError("cache ttl_seconds must be positive (disable the cache instead)")
        if self.max_entries < 1:
            raise ValueError("cache max_entries must be at least 1")
        if self.max_temperature < 0:
            raise ValueError("cache max_temperature must be >= 0")
        if self.max_response_bytes < 1:
            raise ValueError("cache max_response_bytes must be at least 1")
        threshold = self.near_duplicate_threshold
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError("cache near_duplicate_threshold must be in (0, 1]")
        if not 0.0 < self.near_duplicate_max_error < 1.0:
            raise ValueError("cache near_duplicate_max_error must be in (0, 1)")
        if not 0.0 <= self.near_duplicate_audit_rate < 1.0:
            raise ValueError("cache near_duplicate_audit_rate must be in [0, 1)")
        if self.near_duplicate_model not in NEAR_DUPLICATE_MODELS:
            raise ValueError(
                f"cache near_duplicate_model must be one of {', '.join(NEAR_DUPLICATE_MODELS)}"
            )

    @property
    def near_duplicate_cutoff(self) -> float:
        """The threshold in force: the one set, or the model's own."""
        if self.near_duplicate_threshold is not None:
            return self.near_duplicate_threshold
        if self.near_duplicate_model == "minilm":
            return MINILM_NEAR_DUPLICATE_THRESHOLD
        return DEFAULT_NEAR_DUPLICATE_THRESHOLD

    @property
    def near_duplicate_floor(self) -> float:
        """The least similarity of a candidate: labelled when not served."""
        if self.near_duplicate_model == "minilm":
            return min(MINILM_CANDIDATE_FLOOR, self.near_duplicate_cutoff)
        return self.near_duplicate_cutoff


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheContext:
    """Everything a cached answer's validity depends on, for one turn.

    - `query`: the user's text as sent to the model (after `strip_nocache`).
    - `system_prompt`: the full system message as sent, including any injected memory.
    - `tools`: the tool specs offered to the model, in the order offered.
    - `context_digest`: `digest_messages(...)` of every message sent before `query`
      other than the system prompt (summary, branch tail); None when there are none.
    - `memory_injected`: memory or knowledge-base content went into the prompt.
    - `user_specific`: any other data about this user went into the prompt.
    - `tool_calls_made`: the answer involved tool calls (known only when storing).
    - `temperature`: as sent to the provider; None means the provider default (1.0).
      Required, so a caller cannot forget that a hot sample must not be replayed.
    - `session_key`: the session asking; `sender_id` the person in it (group chats).
    """

    query: str
    model: str
    temperature: float | None
    session_key: str = ""
    system_prompt: str = ""
    tools: tuple[ToolSpec, ...] = ()
    context_digest: str | None = None
    memory_injected: bool = False
    user_specific: bool = False
    tool_calls_made: bool = False
    streaming: bool = False
    nocache: bool = False
    sender_id: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.tools, tuple):
            object.__setattr__(self, "tools", tuple(self.tools))


@dataclass(frozen=True, slots=True)
class Decision:
    """The policy's verdict: `mode`, why, and the scope id entries are filed under."""

    mode: CacheMode
    reason: str
    scope: str = ""

    @property
    def cacheable(self) -> bool:
        return self.mode is not CacheMode.BYPASS


def normalize_query(text: str) -> str:
    """NFKC, casefold, whitespace collapsed and stripped, trailing question marks dropped.

    Only a trailing run of `?` goes: "what is 5!" and "what is 5" stay different.
    """
    folded = unicodedata.normalize("NFKC", text).casefold()
    collapsed = _WHITESPACE.sub(" ", folded).strip()
    return _TRAILING_QUESTION_MARKS.sub("", collapsed)


def strip_nocache(text: str) -> tuple[str, bool]:
    """Remove a leading `/nocache` (or `/nocache@botname`): `"/nocache hi" -> ("hi", True)`."""
    match = _NOCACHE_PREFIX.match(text)
    if match is None:
        return text, False
    return text[match.end() :], True


def session_scope(session_key: str) -> str:
    """The scope id of one session's entries (distinct from `SHARED_SCOPE` for any key)."""
    return SESSION_SCOPE_PREFIX + session_key


def _sha256_json(value: object) -> str:
    raw = json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def fingerprint_system_prompt(system_prompt: str) -> str:
    return hashlib.sha256(system_prompt.encode("utf-8")).hexdigest()


def fingerprint_tools(tools: Sequence[ToolSpec]) -> str:
    """Digest of the tool names, descriptions and JSON schemas, in the order offered.

    Remembered per sequence of spec objects (a registry hands out the same ones every
    turn; the memo keeps them alive, so their ids stay theirs). Specs are immutable
    descriptions: build a new one rather than editing a schema in place."""
    ident = tuple(map(id, tools))
    hit = _TOOL_FINGERPRINTS.get(ident)
    if hit is None:
        if len(_TOOL_FINGERPRINTS) >= 64:
            _TOOL_FINGERPRINTS.clear()
        digest = _sha256_json([[t.name, t.description, t.parameters] for t in tools])
        hit = _TOOL_FINGERPRINTS[ident] = (tuple(tools), digest)
    return hit[1]


_TOOL_FINGERPRINTS: dict[tuple[int, ...], tuple[tuple[ToolSpec, ...], str]] = {}


def digest_messages(messages: Sequence[LLMMessage]) -> str | None:
    """Digest of the conversation context an answer depends on; None for no messages.

    Covers what the model sees (role, content, tool calls and their ids), not the
    bookkeeping (`usage`, `model`) that differs between otherwise equal histories.
    """
    if not messages:
        return None
    return _sha256_json(
        [
            [
                m.role,
                m.content,
                [[tc.id, tc.function_name, tc.arguments] for tc in m.tool_calls],
                m.tool_call_id,
                m.name,
            ]
            for m in messages
        ]
    )


def partition_id(ctx: CacheContext) -> str:
    """Entries that answer under the same model, system prompt and tools share a partition;
    near-duplicate matching only ever compares queries inside one partition."""
    return _sha256_json(
        [
            KEY_VERSION,
            ctx.model,
            fingerprint_system_prompt(ctx.system_prompt),
            fingerprint_tools(ctx.tools),
        ]
    )


def cache_policy(ctx: CacheContext, settings: CacheSettings) -> Decision:
    """Decide whether and where an answer for `ctx` may be looked up and stored.

    Bypass: cache disabled, `/nocache`, streaming, temperature above the bound, an empty
    query, or tool calls. Answers that involved tool calls are never stored, not even
    scoped: a tool may have had an effect ("send the report") that a replay would
    silently skip, or fetched data that is stale by the next turn.
    Shared: a standalone question. Scoped to the session: everything else.
    """
    if not settings.enabled:
        return Decision(CacheMode.BYPASS, "cache disabled")
    if ctx.nocache:
        return Decision(CacheMode.BYPASS, "/nocache")
    if ctx.streaming:
        return Decision(CacheMode.BYPASS, "streaming reply")
    temperature = PROVIDER_DEFAULT_TEMPERATURE if ctx.temperature is None else ctx.temperature
    if temperature > settings.max_temperature:
        return Decision(CacheMode.BYPASS, f"temperature {temperature} > {settings.max_temperature}")
    if ctx.tool_calls_made:
        return Decision(CacheMode.BYPASS, "answer involved tool calls")
    if not normalize_query(ctx.query):
        return Decision(CacheMode.BYPASS, "empty query")
    depends_on_context = ctx.context_digest is not None or ctx.memory_injected or ctx.user_specific
    if not depends_on_context:
        return Decision(CacheMode.SHARED, "standalone question", SHARED_SCOPE)
    if not ctx.session_key:
        return Decision(CacheMode.BYPASS, "context-dependent question without a session key")
    return Decision(CacheMode.SCOPED, "depends on session context", session_scope(ctx.session_key))


def cache_key(ctx: CacheContext, decision: Decision) -> str:
    """SHA-256 hex key over the normalized query and everything that makes the answer valid.

    A shared key leaves out the session and sender (that is what makes it shared); a
    scoped key contains them, plus the context digest and the injected-data flags.
    """
    if decision.mode is CacheMode.BYPASS:
        raise ValueError("a bypassed context has no cache key")
    scoped = decision.mode is CacheMode.SCOPED
    return _sha256_json(
        [
            KEY_VERSION,
            normalize_query(ctx.query),
            ctx.model,
            fingerprint_system_prompt(ctx.system_prompt),
            fingerprint_tools(ctx.tools),
            ctx.context_digest or "",
            decision.scope,
            ctx.sender_id if scoped else "",
            [ctx.memory_injected, ctx.user_specific] if scoped else [],
        ]
    )
