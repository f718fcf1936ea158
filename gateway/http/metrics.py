"""The gateway's Prometheus series on `prometheus_client`, one registry per daemon.

The library owns the registry, the exposition formats (text 0.0.4 and OpenMetrics,
chosen from the scraper's Accept header), escaping and the process collector. Ours are
only what it cannot know: `MirroredCounter` for counts kept elsewhere (the dispatcher's,
the agent's, the consolidator's, the cache's) and async scrape refreshers for sources
that must be awaited (the cache may live in Redis).

Each `Metrics` has its own `CollectorRegistry`, never the library's global one: two
daemons (or two tests) in one process do not share or clash over series.

Label values come from small fixed sets, never user text; a scrape shows each one from
the start (at 0), so a rate or an alert has a series before the first event. A model
name is what the model server answered, so every scrape goes through the settings'
redactor (`gateway.redaction`) on its way out. The sets (checked against a scrape in
tests/test_metrics.py):

- turn outcome: ok | error | cached | command
- drop reason: lane_full | draining | access_denied
- llm error kind: LLMError | LLMConfigError
- consolidation outcome: ok | failed | skipped
- connection drop reason: header_timeout | body_timeout | over_limit | idle_evicted

A chat platform adds its own series, named ``gateway_<channel>_<name>``, through
`ChannelSeries` (its `ChannelSpec.build` gets one: `gateway.registry.ChannelMetrics`); their
labels are the channel's own fixed sets, documented in its module.

Token usage (`gateway_llm_calls_total`, `gateway_llm_tokens_total`,
`gateway_llm_cost_usd_total`) appears per channel and model once used: its `kind` is
turn, heartbeat, consolidation or transcription (voice notes), its `type` prompt or
completion, and `model` a configured model name (or one an owner set with /model).
Transcribed audio is `gateway_transcription_audio_seconds_total` per channel and model.

Model providers (`gateway.llm.failover`), one series each per configured provider from
the start: `gateway_llm_provider_requests_total` (requests sent to it),
`gateway_llm_provider_failures_total` (failures that count against it),
`gateway_llm_provider_skipped_total` (requests not sent while its breaker was open),
`gateway_llm_breaker_opens_total` and `gateway_llm_breaker_state` (0 closed, 1
half-open, 2 open). Each replica has its own breakers: compare them per instance.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Protocol

import anyio
import prometheus_client
from loguru import logger
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.llm.breaker import STATE_VALUES, BreakerStatus
from gateway.messages import OutboundMessage
from gateway.redaction import Redactor
from gateway.usage.protocol import UsageRow

# `*_created` series double every counter and histogram in the text format and no
# dashboard of ours reads them. The switch is process-wide in the library; the gateway
# is the only user of prometheus_client in its process.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

#: Why the HTTP server closed a connection itself (gateway.http.limits).
HTTP_DROP_REASONS = ("header_timeout", "body_timeout", "over_limit", "idle_evicted")

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

TURN_OUTCOMES = ("ok", "error", "cached", "command")
DROP_REASONS = ("lane_full", "draining", "access_denied")
LLM_ERROR_KINDS = ("LLMError", "LLMConfigError")
CONSOLIDATION_OUTCOMES = ("ok", "failed", "skipped")

Refresher = Callable[[], Awaitable[None]]


def turn_outcome(reply: OutboundMessage) -> str:
    """The `outcome` label of a finished turn, from its reply."""
    if reply.is_error:
        return "error"
    if reply.metadata.get("cached"):
        return "cached"
    if reply.metadata.get("command"):
        return "command"
    return "ok"


class MirroredCounter(Collector):
    """A counter whose running totals live elsewhere (e.g. the dispatcher's own counts),
    copied in by `set_total` before a scrape. The source's resets become counter
    resets, which Prometheus' rate() handles; never use it for counts we make here."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name.removesuffix("_total")
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def set_total(self, value: float, *labelvalues: str) -> None:
        if len(labelvalues) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected labels {list(self.labelnames)}")
        if not value >= 0:  # also refuses NaN
            raise ValueError(f"{self.name}: a counter total cannot be {value}")
        with self._lock:
            self._totals[tuple(labelvalues)] = float(value)

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            totals = sorted(self._totals.items())
        for labelvalues, value in totals:
            family.add_metric(labelvalues, value)
        yield family

    def describe(self) -> Iterable[Metric]:
        # Names only: the registry checks for clashes without reading the source.
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)


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


class NearDuplicateCountsView(Protocol):
    """What `SemanticCache.near_counts` holds, as far as metrics care."""

    @property
    def hits(self) -> int: ...
    @property
    def explorations(self) -> int: ...
    @property
    def audits(self) -> int: ...
    @property
    def labels_correct(self) -> int: ...
    @property
    def labels_wrong(self) -> int: ...


class NearDuplicateSource(Protocol):
    @property
    def near_counts(self) -> NearDuplicateCountsView: ...


class Metrics:
    """The gateway's series, declared once so every part records into the same names,
    in a registry of their own. `collect` is what a scrape returns."""

    def __init__(
        self,
        *,
        version: str = "",
        refresh_timeout: float = 2.0,
        redactor: Redactor | None = None,
    ) -> None:
        """`redactor` is the settings' (None: token shapes only)."""
        self.redactor = redactor or Redactor()
        self.registry = CollectorRegistry()
        self.refresh_timeout = refresh_timeout
        self._refreshers: dict[str, Refresher] = {}
        self._lock = threading.Lock()
        self._channels: set[str] = set()
        registry = self.registry
        self.turns = Counter(
            "gateway_turns_total",
            "Turns answered, by channel and outcome.",
            ("channel", "outcome"),
            registry=registry,
        )
        self.turn_seconds = Histogram(
            "gateway_turn_seconds",
            "Time from dequeue to reply, in seconds.",
            ("channel",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.llm_errors = self._mirror(
            "gateway_llm_errors_total", "Failed LLM requests, by kind.", ("kind",)
        )
        self.cache_hits = self._mirror(
            "gateway_cache_hits_total", "Semantic cache lookups answered from the cache."
        )
        self.cache_misses = self._mirror(
            "gateway_cache_misses_total", "Semantic cache lookups that found nothing."
        )
        self.cache_near_duplicates = self._mirror(
            "gateway_cache_near_duplicates_total",
            "Near-duplicate candidates of this process, by outcome: hit (served), explore "
            "(below its threshold: the model answered) or audit (servable, answered by the "
            "model for a label). Sum over replicas.",
            ("outcome",),
        )
        self.cache_near_duplicate_labels = self._mirror(
            "gateway_cache_near_duplicate_labels_total",
            "Candidates not served whose stored answer the model's answer confirmed "
            "(correct) or contradicted (wrong), in this process.",
            ("label",),
        )
        self.cache_entries = Gauge(
            "gateway_cache_entries", "Live semantic cache entries.", registry=registry
        )
        self.cache_bytes = Gauge(
            "gateway_cache_bytes", "Bytes held by the semantic cache.", registry=registry
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Inbound messages waiting in the dispatcher.", registry=registry
        )
        self.inflight_turns = Gauge(
            "gateway_inflight_turns", "Turns being answered now.", registry=registry
        )
        self.dropped_messages = self._mirror(
            "gateway_dropped_messages_total",
            "Inbound messages refused or dropped, by channel and reason.",
            ("channel", "reason"),
        )
        self.duplicates = self._mirror(
            "gateway_duplicates_total",
            "Inbound messages ignored as platform redeliveries.",
            ("channel",),
        )
        self.channel_up = Gauge(
            "gateway_channel_up",
            "1 while a channel is connected, else 0.",
            ("channel",),
            registry=registry,
        )
        self.consolidations = self._mirror(
            "gateway_consolidations_total", "Memory consolidations, by outcome.", ("outcome",)
        )
        self.memory_search_incomplete = self._mirror(
            "gateway_memory_search_incomplete_total",
            "Turns whose memory recall answered from part of the memory: its search index "
            "was still being built when memory.recall_wait_seconds ran out.",
        )
        self.http_requests = Counter(
            "gateway_http_requests_total",
            "HTTP requests, by method, route pattern and status.",
            ("method", "route", "status"),
            registry=registry,
        )
        self.http_request_seconds = Histogram(
            "gateway_http_request_seconds",
            "HTTP request latency, in seconds.",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.http_connections_dropped = Counter(
            "gateway_http_connections_dropped_total",
            "HTTP connections the server closed itself, by reason (see gateway.http.limits).",
            ("reason",),
            registry=registry,
        )
        for reason in HTTP_DROP_REASONS:
            self.http_connections_dropped.labels(reason)
        self.component_healthy = Gauge(
            "gateway_component_healthy",
            "1 while a component /readyz checks is healthy (sessions, cache, channels), else 0.",
            ("component",),
            registry=registry,
        )
        self.llm_tokens = Counter(
            "gateway_llm_tokens_total",
            "Tokens the model servers reported, by channel, model, kind (turn, heartbeat, "
            "consolidation, transcription) and type (prompt, completion).",
            ("channel", "model", "kind", "type"),
            registry=registry,
        )
        self.llm_cost = Counter(
            "gateway_llm_cost_usd_total",
            "Cost of those tokens (and of transcribed audio) from usage.prices, in US "
            "dollars, by channel, model, kind.",
            ("channel", "model", "kind"),
            registry=registry,
        )
        self.llm_calls = Counter(
            "gateway_llm_calls_total",
            "Model calls counted in the usage ledger, by channel, model and kind (turn, "
            "heartbeat, consolidation, transcription).",
            ("channel", "model", "kind"),
            registry=registry,
        )
        self.transcribed_audio = Counter(
            "gateway_transcription_audio_seconds_total",
            "Seconds of audio the transcription server reported transcribing (servers that "
            "bill by tokens or report nothing add 0), by channel and model.",
            ("channel", "model"),
            registry=registry,
        )
        self.provider_requests = self._mirror(
            "gateway_llm_provider_requests_total",
            "Requests sent to each model provider (the client's own retries not counted).",
            ("provider",),
        )
        self.provider_failures = self._mirror(
            "gateway_llm_provider_failures_total",
            "Failures that count against a model provider: connection errors, time-outs, "
            "5xx, 429, refused keys, no credit.",
            ("provider",),
        )
        self.provider_skipped = self._mirror(
            "gateway_llm_provider_skipped_total",
            "Requests not sent to a model provider because its breaker was open.",
            ("provider",),
        )
        self.breaker_opens = self._mirror(
            "gateway_llm_breaker_opens_total",
            "Times a model provider's circuit breaker opened.",
            ("provider",),
        )
        self.breaker_state = Gauge(
            "gateway_llm_breaker_state",
            "A model provider's circuit breaker in this process: 0 closed, 1 half-open "
            "(one request tries it), 2 open (skipped).",
            ("provider",),
            registry=registry,
        )
        self.build_info = Gauge(
            "gateway_build_info",
            "Always 1; the gateway's version as a label.",
            ("version",),
            registry=registry,
        )
        self.build_info.labels(version or "unknown").set(1)
        # process_start_time_seconds, process_resident_memory_bytes, CPU, open files.
        ProcessCollector(registry=registry)
        for kind in LLM_ERROR_KINDS:
            self.llm_errors.set_total(0, kind)
        for outcome in CONSOLIDATION_OUTCOMES:
            self.consolidations.set_total(0, outcome)

    def _mirror(
        self, name: str, documentation: str, labelnames: Sequence[str] = ()
    ) -> MirroredCounter:
        counter = MirroredCounter(name, documentation, labelnames)
        self.registry.register(counter)
        return counter

    # ----------------------------------------------------------------- recording

    def observe_turn(self, reply: OutboundMessage, seconds: float) -> None:
        """Record one finished turn: its count by outcome and its duration. A channel's
        first turn brings in all its outcomes at 0, so an error rate exists before the
        first error."""
        channel, outcome = reply.channel, turn_outcome(reply)
        if channel not in self._channels:
            with self._lock:
                self._channels.add(channel)
            for each in TURN_OUTCOMES:
                self.turns.labels(channel, each)
        self.turns.labels(channel, outcome).inc()
        self.turn_seconds.labels(channel).observe(seconds)

    def observe_usage(self, row: UsageRow) -> None:
        """Count one model call's tokens and cost (`UsageMeter.on_record`)."""
        labels = (row.channel, row.model, row.kind)
        self.llm_calls.labels(*labels).inc(row.calls)
        self.llm_tokens.labels(*labels, "prompt").inc(row.prompt_tokens)
        self.llm_tokens.labels(*labels, "completion").inc(row.completion_tokens)
        self.llm_cost.labels(*labels).inc(row.cost)
        if row.kind == "transcription":
            self.transcribed_audio.labels(row.channel, row.model).inc(row.audio_seconds)

    def mirror_providers(self, statuses: Iterable[BreakerStatus]) -> None:
        """Copy each provider's breaker counts and state (before a scrape, and once at
        start so every provider has its series)."""
        for status in statuses:
            name = status.provider
            self.provider_requests.set_total(status.requests, name)
            self.provider_failures.set_total(status.failures, name)
            self.provider_skipped.set_total(status.skipped, name)
            self.breaker_opens.set_total(status.opened, name)
            self.breaker_state.labels(name).set(STATE_VALUES[status.state])

    def mirror_drops(self, channel: str, by_reason: Mapping[str, int]) -> None:
        for reason in DROP_REASONS:
            self.dropped_messages.set_total(by_reason.get(reason, 0), channel, reason)

    def for_channel(self, channel: str) -> ChannelSeries:
        """The series of chat platform `channel`, in this registry."""
        return ChannelSeries(self, channel)

    # ----------------------------------------------------------------- scraping

    def on_scrape(self, name: str, refresh: Refresher) -> None:
        """Run `refresh` (async) before each scrape to update values that live elsewhere,
        e.g. the cache's counters. Registering the same name again replaces it."""
        with self._lock:
            self._refreshers[name] = refresh

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

    def watch_near_duplicates(self, cache: NearDuplicateSource) -> None:
        """Mirror the near-duplicate layer's counters (this process's) at each scrape."""

        async def refresh() -> None:
            counts = cache.near_counts
            self.cache_near_duplicates.set_total(counts.hits, "hit")
            self.cache_near_duplicates.set_total(counts.explorations, "explore")
            self.cache_near_duplicates.set_total(counts.audits, "audit")
            self.cache_near_duplicate_labels.set_total(counts.labels_correct, "correct")
            self.cache_near_duplicate_labels.set_total(counts.labels_wrong, "wrong")

        self.on_scrape("cache-near-duplicates", refresh)

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

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The registry in the format the scraper's Accept header asks for (text 0.0.4
        without one), redacted: (body, content type)."""
        encode, content_type = choose_encoder(accept)
        body = self.redactor.redact(encode(self.registry).decode("utf-8"))
        return body.encode("utf-8"), content_type

    async def collect(self, accept: str = "") -> tuple[bytes, str]:
        """Refresh, then render: what a scrape returns."""
        await self.refresh()
        return self.render(accept)


class ChannelSeries:
    """One chat platform's own series (`gateway.registry.ChannelMetrics`), each named
    ``gateway_<channel>_<name>`` so that two channels never clash, refreshed before each
    scrape by the channel's `on_scrape`."""

    def __init__(self, metrics: Metrics, channel: str) -> None:
        self._metrics = metrics
        self._channel = channel

    def _name(self, name: str) -> str:
        return f"gateway_{self._channel}_{name}"

    def counter(
        self, name: str, documentation: str, labels: tuple[str, ...] = ()
    ) -> MirroredCounter:
        return self._metrics._mirror(self._name(name), documentation, labels)

    def gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(self._name(name), documentation, registry=self._metrics.registry)

    def on_scrape(self, refresh: Refresher) -> None:
        self._metrics.on_scrape(f"channel:{self._channel}", refresh)
