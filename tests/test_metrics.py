"""The Prometheus registry: exposition format (checked by parsing it), counters, gauges,
histograms, scrape refreshers, the gateway's declared series, thread safety."""

from __future__ import annotations

import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from gateway.metrics import (
    LATENCY_BUCKETS,
    Counter,
    Metrics,
    Registry,
    escape_label_value,
    format_value,
    process_start_time,
    resident_memory_bytes,
)

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


# --------------------------------------------------------------------------- format


def test_parser_rejects_what_prometheus_rejects() -> None:
    with pytest.raises(AssertionError):
        parse_exposition('x{a="1} 1\n')  # unterminated label value
    with pytest.raises(AssertionError):
        parse_exposition("x 1\n")  # sample before TYPE
    with pytest.raises(AssertionError):
        parse_exposition("# TYPE x counter\nx 1\nx 2\n")  # duplicate series


def test_value_formatting() -> None:
    assert format_value(3.0) == "3"
    assert format_value(0.25) == "0.25"
    assert format_value(math.inf) == "+Inf"
    assert format_value(-math.inf) == "-Inf"
    assert format_value(math.nan) == "NaN"
    assert format_value(1e300) == "1e+300"


def test_label_values_are_escaped_and_round_trip() -> None:
    registry = Registry()
    counter = registry.counter(
        "odd_total", 'Help with a \\ backslash,\nnewline and "quotes".', ("v",)
    )
    hostile = 'a"b\\c\nd} e="f'
    counter.labels(hostile).inc()
    text = registry.render()
    assert escape_label_value(hostile) in text
    assert '# HELP odd_total Help with a \\\\ backslash,\\nnewline and "quotes".' in text
    family = parse_exposition(text)["odd_total"]
    assert family.value(v=hostile) == 1


def test_unlabelled_series_render_zero_and_labelled_families_render_headers_only() -> None:
    registry = Registry()
    registry.counter("plain_total", "A plain counter.")
    registry.counter("by_kind_total", "By kind.", ("kind",))
    families = parse_exposition(registry.render())
    assert families["plain_total"].value() == 0
    assert families["by_kind_total"].type == "counter"
    assert families["by_kind_total"].samples == []


# --------------------------------------------------------------------------- counters


def test_counter_only_goes_up_through_inc() -> None:
    counter = Counter("c_total", "c")
    counter.inc()
    counter.inc(2.5)
    assert counter.value == 3.5
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="only goes up"):
            counter.inc(bad)
    counter.set_total(10)  # mirroring a cumulative source
    assert counter.value == 10
    with pytest.raises(ValueError):
        counter.set_total(-1)


def test_labels_by_position_or_name_reach_the_same_series() -> None:
    registry = Registry()
    counter = registry.counter("t_total", "t", ("channel", "outcome"))
    counter.labels("telegram", "ok").inc()
    counter.labels(outcome="ok", channel="telegram").inc()
    assert (
        parse_exposition(registry.render())["t_total"].value(channel="telegram", outcome="ok") == 2
    )
    with pytest.raises(ValueError):
        counter.labels("telegram")
    with pytest.raises(ValueError):
        counter.labels(channel="telegram", kind="x")
    with pytest.raises(ValueError, match=r"use \.labels"):
        counter.inc()


@pytest.mark.parametrize(
    ("name", "labels"),
    [
        ("bad-name_total", ()),
        ("ok_total", ("bad-label",)),
        ("ok_total", ("__reserved",)),
        ("ok_total", ("a", "a")),
    ],
)
def test_invalid_names_are_refused(name: str, labels: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        Counter(name, "x", labels)


def test_counter_names_end_in_total_and_names_never_clash() -> None:
    registry = Registry()
    with pytest.raises(ValueError, match="_total"):
        registry.counter("requests", "x")
    registry.histogram("latency_seconds", "x")
    with pytest.raises(ValueError, match="clashes"):
        registry.gauge("latency_seconds_count", "x")
    with pytest.raises(ValueError, match="clashes"):
        registry.gauge("latency_seconds", "x")


# --------------------------------------------------------------------------- gauges


def test_gauge_set_inc_dec_and_track() -> None:
    registry = Registry()
    gauge = registry.gauge("depth", "d")
    gauge.set(5)
    gauge.inc()
    gauge.dec(2)
    assert gauge.value == 4
    with gauge.track():
        assert gauge.value == 5
    assert gauge.value == 4


def test_gauge_callback_is_read_at_scrape_and_failures_cost_only_that_sample() -> None:
    registry = Registry()
    depth = [3]
    registry.gauge("queue", "q").set_function(lambda: depth[0])
    registry.gauge("absent", "a").set_function(lambda: None)
    registry.gauge("broken", "b").set_function(lambda: 1 / 0)
    registry.gauge("fine", "f").set(1)
    families = parse_exposition(registry.render())
    assert families["queue"].value() == 3
    assert families["absent"].samples == [] and families["broken"].samples == []
    assert families["fine"].value() == 1
    depth[0] = 7
    assert parse_exposition(registry.render())["queue"].value() == 7


# --------------------------------------------------------------------------- histograms


def test_histogram_buckets_are_cumulative_with_le_semantics() -> None:
    registry = Registry()
    histogram = registry.histogram("lat_seconds", "l", ("route",))
    for value in (0.001, 0.005, 0.006, 0.3, 59.0, 61.0):
        histogram.labels("/api/chat").observe(value)
    family = parse_exposition(registry.render())["lat_seconds"]
    assert family.type == "histogram"
    check_histogram(family)
    bucket = "lat_seconds_bucket"
    assert family.value(bucket, route="/api/chat", le="0.005") == 2  # 0.005 <= 0.005
    assert family.value(bucket, route="/api/chat", le="0.01") == 3
    assert family.value(bucket, route="/api/chat", le="60.0") == 5
    assert family.value(bucket, route="/api/chat", le="+Inf") == 6
    assert family.value("lat_seconds_count", route="/api/chat") == 6
    assert family.value("lat_seconds_sum", route="/api/chat") == pytest.approx(120.312)


def test_latency_buckets_span_5ms_to_60s() -> None:
    assert LATENCY_BUCKETS[0] == 0.005 and LATENCY_BUCKETS[-1] == 60.0
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))


def test_histogram_time_and_bad_buckets() -> None:
    registry = Registry()
    histogram = registry.histogram("op_seconds", "o")
    with histogram.time():
        pass
    family = parse_exposition(registry.render())["op_seconds"]
    assert family.value("op_seconds_count") == 1
    with pytest.raises(ValueError):
        registry.histogram("bad_seconds", "b", buckets=(1.0, 0.5))
    with pytest.raises(ValueError):
        registry.histogram("le_seconds", "b", ("le",))
    with pytest.raises(ValueError):
        histogram.observe(math.nan)


# --------------------------------------------------------------------------- threads


def test_concurrent_updates_from_threads_are_not_lost() -> None:
    registry = Registry()
    counter = registry.counter("n_total", "n", ("worker",))
    histogram = registry.histogram("h_seconds", "h")
    threads_n, per_thread = 8, 2000

    def work(index: int) -> None:
        for _ in range(per_thread):
            counter.labels(str(index % 2)).inc()
            histogram.observe(0.01)
            if index == 0:
                registry.render()  # scraping while others write

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    families = parse_exposition(registry.render())
    total = sum(value for _, _, value in families["n_total"].samples)
    assert total == threads_n * per_thread
    assert families["h_seconds"].value("h_seconds_count") == threads_n * per_thread
    check_histogram(families["h_seconds"])


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
    families = parse_exposition(await metrics.collect())
    assert families["gateway_cache_hits_total"].value() == 3
    assert families["gateway_cache_misses_total"].value() == 5
    assert families["gateway_cache_entries"].value() == 2
    assert families["gateway_cache_bytes"].value() == 1024
    cache.stats_value = FakeStats(hits=4, misses=5, entries=3, bytes=2048)
    families = parse_exposition(await metrics.collect())
    assert families["gateway_cache_hits_total"].value() == 4


@pytest.mark.anyio
async def test_a_failing_or_slow_refresher_does_not_break_the_scrape() -> None:
    registry = Registry(refresh_timeout=0.05)
    gauge = registry.gauge("kept", "k")
    gauge.set(1)

    async def broken() -> None:
        raise RuntimeError("backend down")

    async def slow() -> None:
        await anyio.sleep(10)

    async def good() -> None:
        gauge.set(2)

    registry.on_scrape("broken", broken)
    registry.on_scrape("slow", slow)
    registry.on_scrape("good", good)
    with anyio.fail_after(2):
        text = await registry.collect()
    assert parse_exposition(text)["kept"].value() == 2


# --------------------------------------------------------------------------- the gateway's series


EXPECTED_SERIES = {
    "gateway_turns_total": ("counter", {"channel", "outcome"}),
    "gateway_turn_seconds": ("histogram", {"channel"}),
    "gateway_llm_errors_total": ("counter", {"kind"}),
    "gateway_cache_hits_total": ("counter", set()),
    "gateway_cache_misses_total": ("counter", set()),
    "gateway_queue_depth": ("gauge", set()),
    "gateway_inflight_turns": ("gauge", set()),
    "gateway_dropped_messages_total": ("counter", {"channel", "reason"}),
    "gateway_duplicates_total": ("counter", {"channel"}),
    "gateway_channel_up": ("gauge", {"channel"}),
    "gateway_consolidations_total": ("counter", {"outcome"}),
    "process_start_time_seconds": ("gauge", set()),
    "process_resident_memory_bytes": ("gauge", set()),
}


def test_gateway_series_are_declared_with_their_labels() -> None:
    metrics = Metrics(version="1.2.3")
    metrics.observe_turn("telegram", "ok", 0.42)
    metrics.llm_errors.labels("timeout").inc()
    metrics.dropped_messages.labels("slack", "access_denied").inc()
    metrics.duplicates.labels("telegram").inc()
    metrics.channel_up.labels("telegram").set(1)
    metrics.consolidations.labels("ok").inc()
    metrics.queue_depth.set_function(lambda: 4)
    with metrics.inflight_turns.track():
        families = parse_exposition(metrics.render())
    for name, (kind, labelnames) in EXPECTED_SERIES.items():
        family = families[name]
        assert family.type == kind and family.help, name
        for sample_name, labels, _ in family.samples:
            assert set(labels) - {"le"} == labelnames, (sample_name, labels)
    assert families["gateway_turns_total"].value(channel="telegram", outcome="ok") == 1
    check_histogram(families["gateway_turn_seconds"])
    assert families["gateway_queue_depth"].value() == 4
    assert families["gateway_inflight_turns"].value() == 1
    assert families["gateway_build_info"].value(version="1.2.3") == 1


def test_process_metrics_come_from_procfs(tmp_path: Path) -> None:
    metrics = Metrics()
    families = parse_exposition(metrics.render())
    if Path("/proc/self/statm").exists():
        assert families["process_resident_memory_bytes"].value() > 1_000_000
    start = families["process_start_time_seconds"].value()
    assert time.time() - 86400 * 365 < start <= time.time()
    statm = tmp_path / "statm"
    statm.write_text("1000 250 10 1 0 100 0\n")
    assert resident_memory_bytes(str(statm)) is not None
    assert resident_memory_bytes(str(tmp_path / "missing")) is None
    stat = tmp_path / "stat"
    # A command name with spaces and a parenthesis must not shift the fields.
    stat.write_text("42 (we ird) name) S" + " 0" * 18 + " 500 0 0\n")
    proc_stat = tmp_path / "procstat"
    proc_stat.write_text("cpu 1 2 3\nbtime 1700000000\n")
    expected = 1700000000 + 500 / os.sysconf("SC_CLK_TCK")
    assert process_start_time(str(stat), str(proc_stat)) == pytest.approx(expected)
