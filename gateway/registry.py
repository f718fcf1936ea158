"""Channels as packages: what a platform declares (`ChannelSpec`), what the gateway hands
it when it builds it (`ChannelServices`), and where the declarations are found: the
``chat_gateway.channels`` entry-point group (SQLAlchemy's external dialects are the model).

A platform is one installed package with an entry point in that group::

    [project.entry-points."chat_gateway.channels"]
    foo = "gateway_channel_foo.spec:SPEC"

The built-in channels register exactly so, in this project's pyproject.toml. The core names
no platform: the daemon, `gateway doctor`, the configuration, the admin page, the metrics and
the failpoints learn each one from its spec (docs/channel-sdk.md says how to write one).

Promises kept here:
- A spec module is light: it imports its settings model, never the platform's library (the
  channel's extra, ``chat-gateway[foo]``). A section for a channel whose library is missing
  is therefore a one-line error naming the install command (`ChannelSpec.missing`), not an
  ImportError, and the settings of every installed channel can be read without it.
- A package that cannot be loaded (an ImportError in its spec module, an entry point that is
  no `ChannelSpec`, a spec named other than its entry point, two packages claiming one name)
  is recorded as `Broken`, with one line naming the package. It never stops the other
  channels from loading; only a section that names it reports it.
- The registry is read once per process (`installed`), in a stable order (by name).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Literal, Protocol

from gateway.access.rules import ChannelAccessPolicy

if TYPE_CHECKING:
    from gateway.channel import Channel
    from gateway.config.section import Section
    from gateway.messages import InboundMessage

#: The entry-point group every channel package registers in.
ENTRY_POINT_GROUP = "chat_gateway.channels"

#: A channel's name: the prefix of its session keys and its `[channels.<name>]` section.
NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")

#: Names the gateway keeps for its own doors (the terminal, scheduled jobs, the HTTP APIs).
RESERVED_NAMES = frozenset({"cli", "system", "api"})

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One line of `gateway doctor`: a status, what was found, and what to do about it."""

    status: Status
    what: str
    fix: str = ""

    def line(self) -> str:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}[self.status]
        return f"{mark}  {self.what}" + (f"\n      fix: {self.fix}" if self.fix else "")


async def remote_check(name: str, probe: Awaitable[str]) -> Finding:
    """A doctor line for a platform's credentials check: "ok" with what `probe` returned
    (who the bot is), or "fail" with its error, within 15 seconds."""
    import anyio

    try:
        with anyio.fail_after(15):
            who = await probe
    except Exception as exc:
        return Finding(
            "fail",
            f"{name} credentials were not accepted: {exc}",
            f"check the {name} token in the environment",
        )
    return Finding("ok", f"{name} credentials work: {who}")


def required_settings(name: str, wanted: list[tuple[str, str, object]]) -> list[Finding]:
    """A "fail" line for each (what, fix, value) whose value is empty: a doctor check's
    first step, before anything is asked of the platform."""
    return [
        Finding("fail", f"{name} is enabled without {what}", fix)
        for what, fix, value in wanted
        if not value
    ]


@dataclass(frozen=True, slots=True)
class Offers:
    """What a platform offers, for operators (`gateway channels`) and for the conformance
    kit, which skips what a channel cannot do."""

    #: Group conversations, where the bot answers only when addressed (mention gating).
    groups: bool = False
    #: Threads (or topics) inside a conversation, each its own session.
    threads: bool = False
    #: Sent messages can be edited: a reply can be shown while it is written.
    edits: bool = False
    #: Messages written while the gateway was down reach it after it starts (the platform
    #: keeps them, or the channel reads them back).
    catch_up: bool = False
    #: Events come to the gateway's HTTP port (a webhook), signed by the platform.
    webhooks: bool = False
    #: Files in and out (images, voice, documents).
    media: bool = False


@dataclass(frozen=True, slots=True)
class PersonIds:
    """How a person's id looks on a platform, for `gateway people link CHANNEL:ID`: a
    pattern the id must match and a hint shown when it does not. `dm_keyed` says a DM's
    session key is `<channel>:<person id>`, so a linked person's DMs share memory."""

    pattern: str
    hint: str
    dm_keyed: bool = True


class Mount(Protocol):
    """The gateway's HTTP server, where a channel mounts its webhook (before it runs)."""

    def mount(
        self,
        method: str,
        path: str,
        handler: Callable[[Any], Awaitable[Any]],
        *,
        require_ready: bool = True,
    ) -> None: ...


class ChannelStorage(Protocol):
    """The storage seam's parts a channel may use (`gateway.storage.seam.Storage`)."""

    def lead(self, role: str) -> Any:
        """Who reads a platform's stream and keeps its read position (`Lead`): this
        process with a cursor in the workspace, or the one replica holding `role`."""
        ...

    def leader(self, role: str) -> Any:
        """Runs a loop only on the replica holding `role`; None: this process runs it."""
        ...

    def relay(self, role: str) -> Any:
        """Requests to the replica holding `role` (None: this process holds it)."""
        ...

    def open(self, backends: Any) -> Any:
        """The channel's own store, of the storage mode (`gateway.plumbing.backends`)."""
        ...


class CounterMirror(Protocol):
    def set_total(self, value: float, *labels: str) -> None: ...


class GaugeLike(Protocol):
    def set(self, value: float) -> None: ...


class ChannelMetrics(Protocol):
    """Prometheus series of one channel, named ``gateway_<channel>_<name>``."""

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> CounterMirror:
        """A counter whose total the channel keeps (set at each scrape by `on_scrape`)."""
        ...

    def gauge(self, name: str, documentation: str) -> GaugeLike: ...

    def on_scrape(self, refresh: Callable[[], Awaitable[None]]) -> None:
        """Run `refresh` before each scrape of /metrics."""
        ...


class AdminHooks(Protocol):
    """What a channel may show on the admin page."""

    def undeliverable(self, source: Callable[[], Awaitable[list[Any]]]) -> None:
        """Replies the platform will not take (held, never dropped), listed for operators."""
        ...


@dataclass(frozen=True)
class ChannelServices:
    """What the gateway hands a channel's `ChannelSpec.build`. A channel never touches
    the journal, the sessions or the model: it translates and calls `submit`."""

    http: Mount
    storage: ChannelStorage
    metrics: ChannelMetrics
    admin: AdminHooks
    #: The access decision for a message (`AccessGate.check`), for what a channel decides
    #: before a message exists (Matrix: whether to join a room it is invited to).
    access_check: Callable[[InboundMessage], Awaitable[Any]]
    #: Several replicas share the storage (the shared mode).
    replicas: bool = False


def access_from_section(section: Any) -> ChannelAccessPolicy:
    """The access policy of a section built on `gateway.config.channels.AccessSection`
    (`dm_policy`, `allow_from`, `group_policy`, `require_mention`, `pairing_ttl_seconds`):
    the default of `ChannelSpec.access`."""
    return ChannelAccessPolicy(
        dm_policy=section.dm_policy,
        allow_from=frozenset(section.allow_from),
        group_policy=section.group_policy,
        require_mention=section.require_mention,
        pairing_ttl=section.pairing_ttl_seconds,
    )


@dataclass(frozen=True)
class ChannelSpec:
    """A platform's declaration: everything the core needs to know of it.

    `build(section, services)` makes the `Channel` from its validated settings (a
    `settings` instance) and may import the platform's library; it runs only for an
    enabled section whose `requires` are installed. `checks(section)` are its `gateway
    doctor` lines. `leader_roles` name the connections only one replica may hold (Telegram
    polling, a Discord Gateway session): with replicas, the storage seam elects a holder
    for each. `failpoints` are the names it passes to `gateway.failpoints.reach`.
    """

    name: str
    settings: type[Section]
    build: Callable[[Any, ChannelServices], Channel]
    summary: str
    #: Where its documentation is: a page of this project (docs/<name>.md) or a URL.
    docs: str
    offers: Offers = field(default_factory=Offers)
    #: Import names of the libraries `build` needs (checked with find_spec, not imported).
    requires: tuple[str, ...] = ()
    #: The chat-gateway extra that installs `requires` (built-in channels); else
    #: `distribution` is what to install.
    extra: str | None = None
    #: The package that provides it (filled in from the entry point when empty).
    distribution: str = ""
    checks: Callable[[Any], Awaitable[list[Finding]]] | None = None
    access: Callable[[Any], ChannelAccessPolicy] = access_from_section
    leader_roles: tuple[str, ...] = ()
    failpoints: tuple[str, ...] = ()
    people: PersonIds | None = None

    def enabled(self, section: Any) -> bool:
        return bool(getattr(section, "enabled", False))

    def missing(self) -> list[str]:
        """The modules of `requires` that cannot be imported here."""
        absent = []
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                absent.append(module)
        return absent

    def install_hint(self) -> str:
        """The command that installs what this channel needs."""
        if self.extra:
            return f"pip install 'chat-gateway[{self.extra}]'"
        return f"pip install {self.distribution or 'the package that provides it'}"

    def missing_line(self) -> str | None:
        """One line saying what is not installed and how to install it; None when all is."""
        absent = self.missing()
        if not absent:
            return None
        return (
            f"channels.{self.name} needs {', '.join(absent)}, which is not installed; "
            f"install it with: {self.install_hint()}"
        )


@dataclass(frozen=True, slots=True)
class Broken:
    """An entry point that did not give a usable spec: which package, and why."""

    name: str
    distribution: str
    problem: str

    def line(self) -> str:
        return (
            f"channels.{self.name}: the package {self.distribution} could not be loaded "
            f"({self.problem}); reinstall or upgrade it, or remove its section"
        )


@dataclass(frozen=True)
class Registry:
    """The channels installed here: usable specs and broken entry points, by name."""

    specs: Mapping[str, ChannelSpec]
    broken: Mapping[str, Broken]

    def names(self) -> list[str]:
        return sorted({*self.specs, *self.broken})


def _distribution_of(entry: metadata.EntryPoint) -> str:
    dist = getattr(entry, "dist", None)
    return str(getattr(dist, "name", "") or "an unknown package")


def load_entry_points(entries: list[metadata.EntryPoint]) -> Registry:
    """Load each entry point's spec; what fails is recorded, never raised."""
    specs: dict[str, ChannelSpec] = {}
    broken: dict[str, Broken] = {}
    for entry in sorted(entries, key=lambda e: (e.name, e.value)):
        distribution = _distribution_of(entry)
        name = entry.name
        problem = None
        spec = None
        if not NAME.fullmatch(name) or name in RESERVED_NAMES:
            problem = f"{name!r} is not a channel name the gateway can give out"
        else:
            try:
                spec = entry.load()
            except Exception as exc:  # a third party's code: anything can come out
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if not isinstance(spec, ChannelSpec):
                    problem = f"{entry.value} is a {type(spec).__name__}, not a ChannelSpec"
                elif spec.name != name:
                    problem = f"its spec is named {spec.name!r}, its entry point {name!r}"
                else:
                    problem = _settings_problem(spec)
        if name in specs or name in broken:
            first = specs[name].distribution if name in specs else broken[name].distribution
            specs.pop(name, None)
            problem = f"both {first} and {distribution} provide it"
        if problem is not None or spec is None:
            broken[name] = Broken(name, distribution, problem or "no spec")
            continue
        if not spec.distribution:
            spec = _with_distribution(spec, distribution)
        specs[name] = spec
    return Registry(specs, broken)


def _settings_problem(spec: ChannelSpec) -> str | None:
    """Why `spec.settings` cannot be a section: not a model with an `enabled` field whose
    every field has a default (the section exists, off, when gateway.toml omits it)."""
    fields = getattr(spec.settings, "model_fields", None)
    if not isinstance(fields, dict) or "enabled" not in fields:
        return "its settings model has no `enabled` field"
    try:
        spec.settings()
    except Exception as exc:
        return f"its settings model has a field without a default ({type(exc).__name__})"
    return None


def _with_distribution(spec: ChannelSpec, distribution: str) -> ChannelSpec:
    from dataclasses import replace

    return replace(spec, distribution=distribution)


@functools.cache
def installed() -> Registry:
    """The channels of every installed package (read once per process)."""
    return load_entry_points(list(metadata.entry_points(group=ENTRY_POINT_GROUP)))
