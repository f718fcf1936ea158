"""Prometheus metrics without a dependency: counters, gauges and histograms rendered in
the text exposition format 0.0.4, and the gateway's own series declared in one place.

Invariants, each tested in tests/test_metrics.py:
- `render()` is always valid exposition text: one `# HELP` and one `# TYPE` line per
  family, before its samples; label values escaped (backslash, double quote, newline);
  histogram buckets cumulative, ending in `le="+Inf"` equal to `_count`.
- A counter never goes down through `inc()`; only `set_total()` (mirroring a cumulative
  source such as the cache's own hit counter) may move it, and only as that source does.
- Every method is safe to call from any thread or task; a family's lock is held only for
  arithmetic, never while a gauge callback or a scrape refresher runs.
- A failing gauge callback or scrape refresher costs its own sample, never the scrape.

`/proc/self/statm` is read at scrape time: procfs is served from kernel memory, so the
read does not block the event loop the way disk I/O would.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import anyio
from loguru import logger

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from 5 ms (a cache hit) to 60 s (a slow model with tools), in seconds.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")

GaugeCallback = Callable[[], float | None]
Refresher = Callable[[], Awaitable[None]]


def escape_label_value(value: str) -> str:
    """A label value as it goes between double quotes in the exposition format."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    """HELP text escaping: backslash and newline only (quotes stay as they are)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers without a fraction, `+Inf`/`-Inf`/`NaN` spelled out."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _format_bound(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(
        f'{name}="{escape_label_value(value)}"' for name, value in zip(names, values, strict=True)
    )
    return "{" + pairs + "}"


# --------------------------------------------------------------------------- children


class CounterChild:
    """One labelled series of a counter."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0 or math.isnan(amount):
            raise ValueError(f"a counter only goes up; inc({amount}) is not allowed")
        with self._lock:
            self._value += amount

    def set_total(self, value: float) -> None:
        """Set the running total from a cumulative source (e.g. the cache's own hit
        count). Use only for such mirrors: the source's resets become counter resets."""
        if value < 0 or math.isnan(value):
            raise ValueError(f"a counter total cannot be {value}")
        with self._lock:
            self._value = float(value)

    @property
    def value(self) -> float:
        with self._lock:
            return self._value

    def _samples(self, name: str, labels: str) -> list[str]:
        return [f"{name}{labels} {format_value(self.value)}"]


class GaugeChild:
    """One labelled series of a gauge: set directly, or read from a callback at scrape."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._value = 0.0
        self._callback: GaugeCallback | None = None

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)
            self._callback = None

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value -= amount

    def set_function(self, callback: GaugeCallback) -> None:
        """Read the value from `callback` at each scrape (it must be cheap and must not
        block); returning None leaves the sample out of that scrape."""
        with self._lock:
            self._callback = callback

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count the block as in progress for as long as it runs."""
        self.inc()
        try:
            yield
        finally:
            self.dec()

    @property
    def value(self) -> float | None:
        with self._lock:
            callback, value = self._callback, self._value
        if callback is None:
            return value
        try:
            result = callback()
        except Exception as exc:
            logger.warning("metrics: a gauge callback failed: {}: {}", type(exc).__name__, exc)
            return None
        return None if result is None else float(result)

    def _samples(self, name: str, labels: str) -> list[str]:
        value = self.value
        return [] if value is None else [f"{name}{labels} {format_value(value)}"]


class HistogramChild:
    """One labelled series of a histogram."""

    def __init__(self, lock: threading.Lock, bounds: tuple[float, ...]) -> None:
        self._lock = lock
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self._sum = 0.0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            raise ValueError("a histogram cannot observe NaN")
        index = bisect_left(self._bounds, value)  # first bound >= value: `le` semantics
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the block's duration in seconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - start)

    def snapshot(self) -> tuple[list[int], float]:
        """(cumulative bucket counts including +Inf, sum)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, total

    def _samples(self, name: str, labels: str) -> list[str]:
        cumulative, total = self.snapshot()
        inner = labels[1:-1] + "," if labels else ""
        lines = [
            f'{name}_bucket{{{inner}le="{_format_bound(bound)}"}} {count}'
            for bound, count in zip((*self._bounds, math.inf), cumulative, strict=True)
        ]
        lines.append(f"{name}_sum{labels} {format_value(total)}")
        lines.append(f"{name}_count{labels} {cumulative[-1]}")
        return lines


ChildT = TypeVar("ChildT", CounterChild, GaugeChild, HistogramChild)


# --------------------------------------------------------------------------- families


class _Family(Generic[ChildT]):
    kind: ClassVar[str]

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not _METRIC_NAME.match(name):
            raise ValueError(f"metric name {name!r} is not valid in Prometheus")
        for label in labelnames:
            if not _LABEL_NAME.match(label) or label.startswith("__"):
                raise ValueError(f"{name}: label name {label!r} is not valid in Prometheus")
        if len(set(labelnames)) != len(labelnames):
            raise ValueError(f"{name}: label names repeat: {list(labelnames)}")
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], ChildT] = {}
        if not self.labelnames:
            self._children[()] = self._new_child()

    def _new_child(self) -> ChildT:
        raise NotImplementedError

    def sample_names(self) -> tuple[str, ...]:
        return (self.name,)

    def labels(self, *values: str, **by_name: str) -> ChildT:
        """The series for these label values (positional, or all by name), created at
        first use."""
        if values and by_name:
            raise ValueError(f"{self.name}: give label values by position or by name, not both")
        if by_name:
            if set(by_name) != set(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {list(self.labelnames)}")
            values = tuple(by_name[label] for label in self.labelnames)
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {list(self.labelnames)}")
        key = tuple(str(value) for value in values)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
        return child

    def _only(self) -> ChildT:
        if self.labelnames:
            raise ValueError(f"{self.name} has labels {list(self.labelnames)}; use .labels()")
        return self._children[()]

    def render_into(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {escape_help(self.help)}")
        lines.append(f"# TYPE {self.name} {self.kind}")
        with self._lock:
            children = sorted(self._children.items())
        for values, child in children:
            lines.extend(child._samples(self.name, _label_text(self.labelnames, values)))


class Counter(_Family[CounterChild]):
    """A count that only goes up (requests, errors); its name ends in `_total`."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r}: by convention a counter's name ends in _total")
        super().__init__(name, help, labelnames)

    def _new_child(self) -> CounterChild:
        return CounterChild(self._lock)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def set_total(self, value: float) -> None:
        self._only().set_total(value)

    @property
    def value(self) -> float:
        return self._only().value


class Gauge(_Family[GaugeChild]):
    """A value that goes up and down (queue depth, memory), set or read at scrape."""

    kind = "gauge"

    def _new_child(self) -> GaugeChild:
        return GaugeChild(self._lock)

    def set(self, value: float) -> None:
        self._only().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._only().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._only().dec(amount)

    def set_function(self, callback: GaugeCallback) -> None:
        self._only().set_function(callback)

    def track(self) -> AbstractContextManager[None]:
        return self._only().track()

    @property
    def value(self) -> float | None:
        return self._only().value


class Histogram(_Family[HistogramChild]):
    """A distribution of observations (latencies) in cumulative buckets."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be strictly increasing, got {list(buckets)}")
        if "le" in labelnames:
            raise ValueError(f"{name}: `le` is reserved for histogram buckets")
        self.buckets = bounds
        super().__init__(name, help, labelnames)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._lock, self.buckets)

    def sample_names(self) -> tuple[str, ...]:
        return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")

    def observe(self, value: float) -> None:
        self._only().observe(value)

    def time(self) -> AbstractContextManager[None]:
        return self._only().time()


# --------------------------------------------------------------------------- registry

_FamilyT = TypeVar("_FamilyT", Counter, Gauge, Histogram)


class Registry:
    """A set of metric families with unique sample names, rendered together."""

    def __init__(self, *, refresh_timeout: float = 2.0) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family[Any]] = {}
        self._sample_names: set[str] = set()
        self._refreshers: dict[str, Refresher] = {}
        self.refresh_timeout = refresh_timeout

    def _register(self, family: _FamilyT) -> _FamilyT:
        with self._lock:
            taken = {family.name, *family.sample_names()} & (
                self._sample_names | set(self._families)
            )
            if taken:
                raise ValueError(f"metric {family.name!r} clashes with existing {sorted(taken)}")
            self._families[family.name] = family
            self._sample_names.update(family.sample_names())
        return family

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        return self._register(Counter(name, help, labelnames))

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self._register(Gauge(name, help, labelnames))

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return self._register(Histogram(name, help, labelnames, buckets))

    def on_scrape(self, name: str, refresh: Refresher) -> None:
        """Run `refresh` (async) before each scrape to update values that live elsewhere,
        e.g. the cache's counters. Registering the same name again replaces it."""
        with self._lock:
            self._refreshers[name] = refresh

    async def refresh(self) -> None:
        """Run every scrape refresher concurrently, each bounded by `refresh_timeout`;
        one that fails or times out is logged and its series keep their last values."""
        with self._lock:
            refreshers = list(self._refreshers.items())

        async def run_one(name: str, refresh: Refresher) -> None:
            try:
                with anyio.fail_after(self.refresh_timeout):
                    await refresh()
            except Exception as exc:
                logger.warning(
                    "metrics: refreshing {} failed: {}: {}", name, type(exc).__name__, exc
                )

        async with anyio.create_task_group() as tg:
            for name, refresh in refreshers:
                tg.start_soon(run_one, name, refresh)

    def render(self) -> str:
        """Every family in the text exposition format 0.0.4, in registration order."""
        with self._lock:
            families = list(self._families.values())
        lines: list[str] = []
        for family in families:
            family.render_into(lines)
        return "\n".join(lines) + "\n"

    async def collect(self) -> str:
        """Refresh, then render: what a scrape returns."""
        await self.refresh()
        return self.render()


# --------------------------------------------------------------------------- the gateway's series


class CacheCounts(Protocol):
    """What `SemanticCache.stats()` returns, as far as metrics care."""

    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def entries(self) -> int: ...
    @property
    def bytes(self) -> int: ...


class CacheStatsSource(Protocol):
    async def stats(self) -> CacheCounts: ...


def _page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4096


def resident_memory_bytes(statm: str = "/proc/self/statm") -> float | None:
    """Resident set size from /proc/self/statm (second field, in pages); None off Linux."""
    try:
        with open(statm, encoding="ascii") as fh:
            fields = fh.read().split()
        return float(int(fields[1]) * _page_size())
    except (OSError, IndexError, ValueError):
        return None


def process_start_time(stat: str = "/proc/self/stat", proc_stat: str = "/proc/stat") -> float:
    """Seconds since the epoch when this process started (from procfs where available,
    else the moment this was first called)."""
    try:
        with open(stat, encoding="ascii", errors="replace") as fh:
            # The command name (field 2) may hold spaces and parentheses: split after it.
            after_name = fh.read().rsplit(")", 1)[1].split()
        ticks = int(after_name[19])  # field 22 overall: start time in clock ticks after boot
        with open(proc_stat, encoding="ascii", errors="replace") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError, StopIteration, AttributeError):
        return _IMPORT_TIME


_IMPORT_TIME = time.time()


class Metrics(Registry):
    """The gateway's series, declared once so every part records into the same names.

    Suggested label values (keep them from small fixed sets; never user text):
    outcome of a turn: ok | error | cached | command; llm error kind: timeout |
    rate_limit | server | auth | other; drop reason: access_denied | too_long |
    queue_full | shutdown; consolidation outcome: ok | failed | skipped.
    """

    def __init__(self, *, version: str = "", refresh_timeout: float = 2.0) -> None:
        super().__init__(refresh_timeout=refresh_timeout)
        self.turns = self.counter(
            "gateway_turns_total", "Turns answered, by channel and outcome.", ("channel", "outcome")
        )
        self.turn_seconds = self.histogram(
            "gateway_turn_seconds", "Time from dequeue to reply, in seconds.", ("channel",)
        )
        self.llm_errors = self.counter(
            "gateway_llm_errors_total", "Failed LLM requests, by kind.", ("kind",)
        )
        self.cache_hits = self.counter(
            "gateway_cache_hits_total", "Semantic cache lookups answered from the cache."
        )
        self.cache_misses = self.counter(
            "gateway_cache_misses_total", "Semantic cache lookups that found nothing."
        )
        self.cache_entries = self.gauge("gateway_cache_entries", "Live semantic cache entries.")
        self.cache_bytes = self.gauge("gateway_cache_bytes", "Bytes held by the semantic cache.")
        self.queue_depth = self.gauge(
            "gateway_queue_depth", "Inbound messages waiting in the dispatcher."
        )
        self.inflight_turns = self.gauge("gateway_inflight_turns", "Turns being answered now.")
        self.dropped_messages = self.counter(
            "gateway_dropped_messages_total",
            "Inbound messages refused or dropped, by channel and reason.",
            ("channel", "reason"),
        )
        self.duplicates = self.counter(
            "gateway_duplicates_total",
            "Inbound messages ignored as platform redeliveries.",
            ("channel",),
        )
        self.channel_up = self.gauge(
            "gateway_channel_up", "1 while a channel is connected, else 0.", ("channel",)
        )
        self.consolidations = self.counter(
            "gateway_consolidations_total", "Memory consolidations, by outcome.", ("outcome",)
        )
        self.http_requests = self.counter(
            "gateway_http_requests_total",
            "HTTP requests, by method, route pattern and status.",
            ("method", "route", "status"),
        )
        self.http_request_seconds = self.histogram(
            "gateway_http_request_seconds", "HTTP request latency, in seconds.", ("route",)
        )
        self.build_info = self.gauge(
            "gateway_build_info", "Always 1; the gateway's version as a label.", ("version",)
        )
        self.build_info.labels(version or "unknown").set(1)
        self.process_start_time = self.gauge(
            "process_start_time_seconds", "Start time of the process since the epoch, in seconds."
        )
        self.process_start_time.set(process_start_time())
        self.process_memory = self.gauge(
            "process_resident_memory_bytes", "Resident memory size in bytes."
        )
        self.process_memory.set_function(resident_memory_bytes)

    def observe_turn(self, channel: str, outcome: str, seconds: float) -> None:
        """Record one finished turn: its count by outcome and its duration."""
        self.turns.labels(channel, outcome).inc()
        self.turn_seconds.labels(channel).observe(seconds)

    def watch_cache(self, cache: CacheStatsSource) -> None:
        """Mirror the cache's own counters at each scrape. On Redis they are shared by
        all replicas: aggregate them across instances with max(), not sum()."""

        async def refresh() -> None:
            stats = await cache.stats()
            self.cache_hits.set_total(stats.hits)
            self.cache_misses.set_total(stats.misses)
            self.cache_entries.set(stats.entries)
            self.cache_bytes.set(stats.bytes)

        self.on_scrape("cache", refresh)
