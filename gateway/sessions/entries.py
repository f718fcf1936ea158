"""Transcript entries: one frozen dataclass per line type of a session file.

Each entry serialises to one JSON object whose first keys are always ``id``,
``parent_id``, ``timestamp`` and ``type`` in that order (the loader relies on the order
for its fast path; any other order still loads, just more slowly). `entry_from_dict` is
the one parser: it raises `EntryFormatError` naming the problem for an unknown type or a
missing/mistyped field, and ignores unknown extra fields so newer writers stay readable.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, get_args

from gateway.llm import LLMMessage
from gateway.llm.types import Role
from gateway.sessions.errors import EntryFormatError, UnsupportedVersionError

FORMAT_VERSION = 1
_ROLES = frozenset(get_args(Role))


def new_entry_id() -> str:
    """A short random id (12 hex chars); the store retries on the rare clash.

    Not secret, so the process PRNG is enough (it is reseeded in forked children).
    """
    return f"{random.getrandbits(48):012x}"


# -- field readers: each raises EntryFormatError with the field name -----------------


def _fail(data: Mapping[str, Any], name: str, want: str) -> EntryFormatError:
    kind = data.get("type", "?")
    if name not in data:
        return EntryFormatError(f"{kind} entry is missing field {name!r}")
    return EntryFormatError(f"{kind} entry field {name!r} must be {want}")


def _str(data: Mapping[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str):
        raise _fail(data, name, "a string")
    return value


def _opt_str(data: Mapping[str, Any], name: str, *, required: bool = False) -> str | None:
    if required and name not in data:
        raise _fail(data, name, "a string or null")
    value = data.get(name)
    if value is not None and not isinstance(value, str):
        raise _fail(data, name, "a string or null")
    return value


def _opt_dict(data: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = data.get(name)
    if value is not None and not isinstance(value, dict):
        raise _fail(data, name, "an object or null")
    return value


def _base(data: Mapping[str, Any]) -> tuple[str, str | None, float]:
    eid = data.get("id")
    if not isinstance(eid, str) or not eid:
        raise _fail(data, "id", "a non-empty string")
    parent = _opt_str(data, "parent_id", required=True)
    ts = data.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise _fail(data, "timestamp", "a number (epoch seconds)")
    return eid, parent, float(ts)


# -- entry types --------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entry:
    """Fields every entry has; ``parent_id`` links it to the entry it follows."""

    type: ClassVar[str]
    id: str
    parent_id: str | None
    timestamp: float

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "parent_id": self.parent_id,
            "timestamp": self.timestamp,
            "type": self.type,
        }


@dataclass(frozen=True, slots=True)
class ParentSessionRef:
    """The back-link of a forked session: where it was forked from."""

    key: str
    session_id: str
    entry_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "session_id": self.session_id, "entry_id": self.entry_id}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParentSessionRef:
        if not isinstance(data, Mapping):
            raise EntryFormatError("session_header field 'parent_session' must be an object")
        d = {"type": "session_header.parent_session", **data}
        return cls(
            key=_str(d, "key"), session_id=_str(d, "session_id"), entry_id=_opt_str(d, "entry_id")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionHeader(_Entry):
    """First line of every file: the session id (``id``) and the key it belongs to."""

    type: ClassVar[str] = "session_header"
    key: str
    version: int = FORMAT_VERSION
    parent_session: ParentSessionRef | None = None
    previous_session: str | None = None

    @property
    def session_id(self) -> str:
        return self.id

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["key"] = self.key
        d["version"] = self.version
        if self.parent_session is not None:
            d["parent_session"] = self.parent_session.to_dict()
        if self.previous_session is not None:
            d["previous_session"] = self.previous_session
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SessionHeader:
        eid, parent, ts = _base(data)
        if parent is not None:
            raise EntryFormatError("session_header field 'parent_id' must be null")
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise _fail(data, "version", "an integer")
        if version > FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"session file format version {version} is newer than this gateway "
                f"understands ({FORMAT_VERSION}); upgrade the gateway to open it"
            )
        ps = data.get("parent_session")
        return cls(
            id=eid,
            parent_id=None,
            timestamp=ts,
            key=_str(data, "key"),
            version=version,
            parent_session=None if ps is None else ParentSessionRef.from_dict(ps),
            previous_session=_opt_str(data, "previous_session"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageEntry(_Entry):
    """One chat message; ``meta`` carries small facts about it (e.g. ``{"cached": true}``)."""

    type: ClassVar[str] = "message"
    message: LLMMessage
    meta: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["message"] = self.message.to_dict()
        if self.meta is not None:
            d["meta"] = self.meta
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MessageEntry:
        eid, parent, ts = _base(data)
        raw = data.get("message")
        if not isinstance(raw, dict):
            raise _fail(data, "message", "an object")
        if raw.get("role") not in _ROLES:
            raise EntryFormatError(f"message entry has an unknown role {raw.get('role')!r}")
        try:
            content = raw.get("content")
            if len(raw) == 2 and isinstance(content, str):
                message = LLMMessage(raw["role"], content)  # the common plain message, faster
            else:
                message = LLMMessage.from_dict(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EntryFormatError(f"message entry holds a malformed message: {exc!r}") from None
        return cls(
            id=eid, parent_id=parent, timestamp=ts, message=message, meta=_opt_dict(data, "meta")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactionEntry(_Entry):
    """A summary of everything before ``first_kept_entry_id`` (None: keep nothing before)."""

    type: ClassVar[str] = "compaction"
    summary: str
    first_kept_entry_id: str | None
    tokens_before: int | None = None
    details: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["summary"] = self.summary
        d["first_kept_entry_id"] = self.first_kept_entry_id
        if self.tokens_before is not None:
            d["tokens_before"] = self.tokens_before
        if self.details is not None:
            d["details"] = self.details
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompactionEntry:
        eid, parent, ts = _base(data)
        tokens = data.get("tokens_before")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise _fail(data, "tokens_before", "an integer or null")
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            summary=_str(data, "summary"),
            first_kept_entry_id=_opt_str(data, "first_kept_entry_id", required=True),
            tokens_before=tokens,
            details=_opt_dict(data, "details"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BranchEntry(_Entry):
    """Return to ``from_id`` (its parent) carrying a summary of the branch left behind."""

    type: ClassVar[str] = "branch"
    from_id: str
    summary: str

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["from_id"] = self.from_id
        d["summary"] = self.summary
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BranchEntry:
        eid, parent, ts = _base(data)
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            from_id=_str(data, "from_id"),
            summary=_str(data, "summary"),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LeafEntry(_Entry):
    """A durable navigation pointer: loading it sets the leaf to ``target_id``.

    ``target_id`` None moves the leaf before the first entry (an empty context).
    """

    type: ClassVar[str] = "leaf"
    target_id: str | None

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["target_id"] = self.target_id
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LeafEntry:
        eid, parent, ts = _base(data)
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            target_id=_opt_str(data, "target_id", required=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LabelEntry(_Entry):
    """Attach ``label`` to ``target_id``; a null label removes it."""

    type: ClassVar[str] = "label"
    target_id: str
    label: str | None

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["target_id"] = self.target_id
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LabelEntry:
        eid, parent, ts = _base(data)
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            target_id=_str(data, "target_id"),
            label=_opt_str(data, "label", required=True),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelChangeEntry(_Entry):
    """The model used from here on along this branch."""

    type: ClassVar[str] = "model_change"
    model: str

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["model"] = self.model
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelChangeEntry:
        eid, parent, ts = _base(data)
        return cls(id=eid, parent_id=parent, timestamp=ts, model=_str(data, "model"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ThinkingLevelChangeEntry(_Entry):
    """The reasoning effort used from here on along this branch."""

    type: ClassVar[str] = "thinking_level_change"
    thinking_level: str

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["thinking_level"] = self.thinking_level
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThinkingLevelChangeEntry:
        eid, parent, ts = _base(data)
        return cls(
            id=eid, parent_id=parent, timestamp=ts, thinking_level=_str(data, "thinking_level")
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfoEntry(_Entry):
    """A human name for the session (None clears it)."""

    type: ClassVar[str] = "session_info"
    name: str | None

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["name"] = self.name
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SessionInfoEntry:
        eid, parent, ts = _base(data)
        return cls(
            id=eid, parent_id=parent, timestamp=ts, name=_opt_str(data, "name", required=True)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CustomInfoEntry(_Entry):
    """Extension metadata (any JSON value); never part of the LLM context."""

    type: ClassVar[str] = "custom_info"
    custom_type: str
    data: Any

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["custom_type"] = self.custom_type
        d["data"] = self.data
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CustomInfoEntry:
        eid, parent, ts = _base(data)
        if "data" not in data:
            raise _fail(data, "data", "present")
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            custom_type=_str(data, "custom_type"),
            data=data["data"],
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CustomMessageEntry(_Entry):
    """An extension-written message: part of the LLM context; ``display`` is for UIs."""

    type: ClassVar[str] = "custom_message"
    custom_type: str
    content: str
    display: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = self._head()
        d["custom_type"] = self.custom_type
        d["content"] = self.content
        d["display"] = self.display
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CustomMessageEntry:
        eid, parent, ts = _base(data)
        display = data.get("display")
        if not isinstance(display, bool):
            raise _fail(data, "display", "true or false")
        return cls(
            id=eid,
            parent_id=parent,
            timestamp=ts,
            custom_type=_str(data, "custom_type"),
            content=_str(data, "content"),
            display=display,
        )


Entry: TypeAlias = (
    SessionHeader
    | MessageEntry
    | CompactionEntry
    | BranchEntry
    | LeafEntry
    | LabelEntry
    | ModelChangeEntry
    | ThinkingLevelChangeEntry
    | SessionInfoEntry
    | CustomInfoEntry
    | CustomMessageEntry
)

ENTRY_TYPES: dict[str, Callable[[Mapping[str, Any]], Entry]] = {
    cls.type: cls.from_dict
    for cls in (
        SessionHeader,
        MessageEntry,
        CompactionEntry,
        BranchEntry,
        LeafEntry,
        LabelEntry,
        ModelChangeEntry,
        ThinkingLevelChangeEntry,
        SessionInfoEntry,
        CustomInfoEntry,
        CustomMessageEntry,
    )
}


def entry_from_dict(data: object) -> Entry:
    """Parse one decoded JSON line into its entry type (`EntryFormatError` if invalid)."""
    if not isinstance(data, dict):
        raise EntryFormatError("an entry must be a JSON object")
    kind = data.get("type")
    parse = ENTRY_TYPES.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise EntryFormatError(
            f"unknown entry type {kind!r}; known types: {', '.join(sorted(ENTRY_TYPES))}"
        )
    return parse(data)
