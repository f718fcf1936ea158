"""The gateway's series on prometheus_client: a scrape parsed as Prometheus would, the
declared names and labels, mirrored counters, scrape refreshers, one registry per daemon."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from gateway.http import metrics as metrics_module
from gateway.http.metrics import LATENCY_BUCKETS, Metrics, MirroredCounter
from gateway.messages import OutboundMessage

# --------------------------------------------------------------------------- a tiny parser

_SAMPLE = re.compile(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)\Z")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"(,|\Z)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class Family:
    name: str
    help: str = ""
    type: str = ""
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def value(self, sample_name: str | None = None, **labels: str) -> float:
        wanted = sample_name or self.name
        for name, have, value in self.samples:
            if name == wanted and have == labels:
                return value
        raise KeyError(f"{wanted}{labels} not in {self.samples}")


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        assert match, f"bad label syntax at {text[pos:]!r}"
        name, raw = match.group(1), match.group(2)
        assert name not in labels, f"label {name} repeated"
        labels[name] = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], raw)
        pos = match.end()
    return labels


def _parse_value(text: str) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "NaN": math.nan}
    return special[text] if text in special else float(text)


def parse_exposition(text: str) -> dict[str, Family]:
    """Parse text format 0.0.4 strictly enough to catch what Prometheus would reject:
    HELP/TYPE once per family and before its samples, families not interleaved, sample
    names belonging to their family, no duplicate series, valid labels and values."""
    assert text.endswith("\n"), "exposition must end with a newline"
    families: dict[str, Family] = {}
    current: Family | None = None
    seen_series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, kind, name, rest = ([*line.split(" ", 3), ""])[:4]
            family = families.get(name)
            if family is None:
                assert current is None or current.name != name
                family = families[name] = Family(name)
            else:
                assert family is current, f"family {name} interleaved with another"
                assert not family.samples, f"{kind} for {name} after its samples"
            if kind == "HELP":
                assert not family.help, f"second HELP for {name}"
                family.help = rest
            else:
                assert not family.type, f"second TYPE for {name}"
                assert rest in {"counter", "gauge", "histogram", "summary", "untyped"}
                family.type = rest
            current = family
            continue
        assert not line.startswith("#"), f"unexpected comment {line!r}"
        match = _SAMPLE.match(line)
        assert match, f"bad sample line {line!r}"
        assert current is not None and current.type, f"sample before TYPE: {line!r}"
        name = match.group("name")
        allowed = {current.name}
        if current.type == "histogram":
            allowed = {f"{current.name}_bucket", f"{current.name}_sum", f"{current.name}_count"}
        assert name in allowed, f"sample {name} does not belong to family {current.name}"
        labels = _parse_labels(match.group("labels") or "")
        series = (name, tuple(sorted(labels.items())))
        assert series not in seen_series, f"duplicate series {series}"
        seen_series.add(series)
        current.samples.append((name, labels, _parse_value(match.group("value"))))
    return families


def check_histogram(family: Family) -> None:
    """Buckets cumulative, `+Inf` present and equal to `_count`, per label set."""
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for name, labels, value in family.samples:
        if name.endswith("_bucket"):
            rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            groups.setdefault(rest, []).append((_parse_value(labels["le"]), value))
        elif name.endswith("_count"):
            counts[tuple(sorted(labels.items()))] = value
    assert groups.keys() == counts.keys()
    for key, buckets in groups.items():
        bounds = [bound for bound, _ in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == math.inf
        values = [value for _, value in buckets]
        assert values == sorted(values), f"buckets not cumulative: {values}"
        assert values[-1] == counts[key]


def scrape(metrics: Metrics) -> dict[str, Family]:
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    return parse_exposition(body.decode())


def reply(
    channel: str = "telegram", *, is_error: bool = False, **metadata: object
) -> OutboundMessage:
    return OutboundMessage(
        channel=channel,
        chat_id="1",
        text="x",
        session_key=f"{channel}:1",
        is_error=is_error,
        metadata=dict(metadata),
    )


def test_parser_rejects_what_prometheus_rejects() -> None:
    with pytest.raises(AssertionError):
        parse_exposition('x{a="1} 1\n')  # unterminated label value
    with pytest.raises(AssertionError):
        parse_exposition("x 1\n")  # sample before TYPE
    with pytest.raises(AssertionError):
        parse_exposition("# TYPE x counter\nx 1\nx 2\n")  # duplicate series


EXPECTED_SERIES = {
    "gateway_turns_total": ("counter", {"channel", "outcome"}),
    "gateway_turn_seconds": ("histogram", {"channel"}),
    "gateway_llm_errors_total": ("counter", {"kind"}),
    "gateway_cache_hits_total": ("counter", set()),
    "gateway_cache_misses_total": ("counter", set()),
    "gateway_cache_entries": ("gauge", set()),
    "gateway_cache_bytes": ("gauge", set()),
    "gateway_queue_depth": ("gauge", set()),
    "gateway_inflight_turns": ("gauge", set()),
    "gateway_dropped_messages_total": ("counter", {"channel", "reason"}),
    "gateway_duplicates_total": ("counter", {"channel"}),
    "gateway_channel_up": ("gauge", {"channel"}),
    "gateway_consolidations_total": ("counter", {"outcome"}),
    "gateway_memory_search_incomplete_total": ("counter", set()),
    "gateway_http_requests_total": ("counter", {"method", "route", "status"}),
    "gateway_http_request_seconds": ("histogram", {"route"}),
    "gateway_build_info": ("gauge", {"version"}),
    "process_start_time_seconds": ("gauge", set()),
    "process_resident_memory_bytes": ("gauge", set()),
}


def test_every_series_of_before_keeps_its_name_type_and_labels() -> None:
    metrics = Metrics(version="1.2.3")
    metrics.observe_turn(reply(), 0.42)
    metrics.llm_errors.set_total(2, "LLMError")
    metrics.mirror_drops("all", {"lane_full": 3})
    metrics.duplicates.set_total(1, "all")
    metrics.channel_up.labels("telegram").set(1)
    metrics.http_requests.labels("GET", "/healthz", "200").inc()
    metrics.http_request_seconds.labels("/healthz").observe(0.001)
    metrics.queue_depth.set_function(lambda: 4)
    with metrics.inflight_turns.track_inprogress():
        families = scrape(metrics)
    for name, (kind, labelnames) in EXPECTED_SERIES.items():
        family = families[name]
        assert family.type == kind and family.help, name
        assert family.samples, name
        for sample_name, labels, _ in family.samples:
            assert set(labels) - {"le"} == labelnames, (sample_name, labels)
    assert not [name for name in families if name.endswith("_created")]
    assert families["gateway_turns_total"].value(channel="telegram", outcome="ok") == 1
    check_histogram(families["gateway_turn_seconds"])
    assert families["gateway_llm_errors_total"].value(kind="LLMError") == 2
    assert families["gateway_dropped_messages_total"].value(channel="all", reason="lane_full") == 3
    assert families["gateway_queue_depth"].value() == 4
    assert families["gateway_inflight_turns"].value() == 1
    assert families["gateway_build_info"].value(version="1.2.3") == 1


def test_a_channel_names_its_own_series_under_its_name() -> None:
    """A platform's series (`ChannelSpec.build` gets `for_channel`) are
    gateway_<channel>_<name>, refreshed before each scrape, and two channels may use the
    same short name without clashing."""
    metrics = Metrics()
    mail = metrics.for_channel("email").counter("mail_total", "Mail read.", ("outcome",))
    other = metrics.for_channel("example").counter("mail_total", "Another channel's.")
    held = metrics.for_channel("example").gauge("held_replies", "Replies held.")
    counts = {"taken": 0}

    async def refresh() -> None:
        mail.set_total(counts["taken"], "taken")

    metrics.for_channel("email").on_scrape(refresh)
    other.set_total(5)
    held.set(2)
    counts["taken"] = 3
    body, _ = anyio.run(metrics.collect)
    families = parse_exposition(body.decode())
    assert families["gateway_email_mail_total"].value(outcome="taken") == 3
    assert families["gateway_example_mail_total"].value() == 5
    assert families["gateway_example_held_replies"].value() == 2


def test_the_library_process_collector_reports_this_process() -> None:
    families = scrape(Metrics())
    if Path("/proc/self/stat").exists():
        assert families["process_resident_memory_bytes"].value() > 1_000_000
        assert families["process_cpu_seconds_total"].type == "counter"
        assert families["process_open_fds"].value() > 0
        start = families["process_start_time_seconds"].value()
        assert time.time() - 86400 * 365 < start <= time.time()


def test_each_metrics_has_its_own_registry() -> None:
    # With the library's global registry the second one would clash ("Duplicated
    # timeseries") and both would count the same turns.
    first, second = Metrics(), Metrics()
    first.observe_turn(reply(), 0.1)
    assert scrape(first)["gateway_turns_total"].value(channel="telegram", outcome="ok") == 1
    assert scrape(second)["gateway_turns_total"].samples == []


def test_turn_outcomes_come_from_the_reply() -> None:
    metrics = Metrics()
    metrics.observe_turn(reply(), 0.1)
    metrics.observe_turn(reply(is_error=True), 0.1)
    metrics.observe_turn(reply(cached=True), 0.01)
    metrics.observe_turn(reply(command="help"), 0.01)
    metrics.observe_turn(reply(command="help"), 0.01)
    turns = scrape(metrics)["gateway_turns_total"]
    assert {
        outcome: turns.value(channel="telegram", outcome=outcome)
        for outcome in ("ok", "error", "cached", "command")
    } == {"ok": 1, "error": 1, "cached": 1, "command": 2}


def test_a_channels_first_turn_shows_every_outcome_at_zero() -> None:
    metrics = Metrics()
    metrics.observe_turn(reply("slack"), 0.1)
    turns = scrape(metrics)["gateway_turns_total"]
    assert turns.value(channel="slack", outcome="error") == 0
    assert {labels["outcome"] for _, labels, _ in turns.samples} == set(
        metrics_module.TURN_OUTCOMES
    )


def test_histogram_buckets_span_5ms_to_60s_with_le_semantics() -> None:
    assert LATENCY_BUCKETS[0] == 0.005 and LATENCY_BUCKETS[-1] == 60.0
    metrics = Metrics()
    for value in (0.001, 0.005, 0.006, 0.3, 59.0, 61.0):
        metrics.http_request_seconds.labels("/api/chat").observe(value)
    family = scrape(metrics)["gateway_http_request_seconds"]
    check_histogram(family)
    bucket = "gateway_http_request_seconds_bucket"
    assert family.value(bucket, route="/api/chat", le="0.005") == 2  # 0.005 <= 0.005
    assert family.value(bucket, route="/api/chat", le="60.0") == 5
    assert family.value(bucket, route="/api/chat", le="+Inf") == 6


def test_mirrored_counter_follows_its_source_and_refuses_nonsense() -> None:
    counter = MirroredCounter("things_total", "Things.", ("kind",))
    counter.set_total(5, "a")
    counter.set_total(7, "a")
    (family,) = counter.collect()
    assert [(s.name, s.labels, s.value) for s in family.samples] == [
        ("things_total", {"kind": "a"}, 7.0)
    ]
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError):
            counter.set_total(bad, "a")
    with pytest.raises(ValueError, match="expected labels"):
        counter.set_total(1)


def test_a_name_taken_twice_is_refused() -> None:
    metrics = Metrics()
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.registry.register(MirroredCounter("gateway_turns_total", "again"))


def test_openmetrics_is_served_when_the_scraper_asks_for_it() -> None:
    body, content_type = Metrics().render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


# --------------------------------------------------------------------------- refreshers


@dataclass(frozen=True)
class FakeStats:
    hits: int
    misses: int
    entries: int
    bytes: int


class FakeCache:
    def __init__(self) -> None:
        self.stats_value = FakeStats(hits=3, misses=5, entries=2, bytes=1024)

    async def stats(self) -> FakeStats:
        return self.stats_value


@pytest.mark.anyio
async def test_cache_counters_are_mirrored_at_scrape() -> None:
    metrics = Metrics()
    cache = FakeCache()
    metrics.watch_cache(cache)
    body, _ = await metrics.collect()
    families = parse_exposition(body.decode())
    assert families["gateway_cache_hits_total"].value() == 3
    assert families["gateway_cache_misses_total"].value() == 5
    assert families["gateway_cache_entries"].value() == 2
    assert families["gateway_cache_bytes"].value() == 1024
    cache.stats_value = FakeStats(hits=4, misses=5, entries=3, bytes=2048)
    body, _ = await metrics.collect()
    assert parse_exposition(body.decode())["gateway_cache_hits_total"].value() == 4


@pytest.mark.anyio
async def test_a_failing_or_slow_refresher_does_not_break_the_scrape() -> None:
    metrics = Metrics(refresh_timeout=0.05)

    async def broken() -> None:
        raise RuntimeError("backend down")

    async def slow() -> None:
        await anyio.sleep(10)

    async def good() -> None:
        metrics.cache_entries.set(2)

    metrics.on_scrape("broken", broken)
    metrics.on_scrape("slow", slow)
    metrics.on_scrape("good", good)
    with anyio.fail_after(2):
        body, _ = await metrics.collect()
    assert parse_exposition(body.decode())["gateway_cache_entries"].value() == 2


# --------------------------------------------------------------------------- documented labels

# The docstring's label sets, by the metric and label each one names.
DOCUMENTED = {
    "turn outcome": ("gateway_turns_total", "outcome"),
    "drop reason": ("gateway_dropped_messages_total", "reason"),
    "llm error kind": ("gateway_llm_errors_total", "kind"),
    "consolidation outcome": ("gateway_consolidations_total", "outcome"),
    "connection drop reason": ("gateway_http_connections_dropped_total", "reason"),
}


def documented_label_values() -> dict[str, set[str]]:
    """`- turn outcome: ok | error | ...` lines of gateway/http/metrics.py's docstring."""
    found = {}
    for line in (metrics_module.__doc__ or "").splitlines():
        match = re.fullmatch(r"- ([a-z ]+): ([\w |]+)", line.strip())
        if match:
            found[match.group(1)] = {value.strip() for value in match.group(2).split("|")}
    return found


def scraped_label_values(families: dict[str, Family]) -> dict[str, set[str]]:
    return {
        what: {labels[label] for _, labels, _ in families[name].samples}
        for what, (name, label) in DOCUMENTED.items()
    }
