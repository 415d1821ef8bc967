from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metric_buffer import MetricBuffer

BOUNDS = (0.001, 0.01, 0.1, 1.0, 10.0)


def exported(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    """What the registry exports, less the series' creation times (two series are never created at once)."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


def pair(kind: type[Counter] | type[Gauge] | type[Histogram]) -> tuple[CollectorRegistry, CollectorRegistry, list]:  # type: ignore[type-arg]
    """Two registries with the same labelled metric: one updated directly, one through a buffer."""
    direct, buffered = CollectorRegistry(), CollectorRegistry()
    extra = {"buckets": BOUNDS} if kind is Histogram else {}
    metrics = [kind("m", "help", ["route"], registry=registry, **extra) for registry in (direct, buffered)]
    return direct, buffered, metrics


@given(st.lists(st.one_of(st.sampled_from(BOUNDS), st.floats(-5, 50), st.just(0.0), st.just(1e9)), max_size=60))
def test_a_folded_histogram_exports_what_observing_each_amount_would(amounts: list[float]) -> None:
    direct, buffered, (plain, other) = pair(Histogram)
    buffer = MetricBuffer()
    child, series = plain.labels("a"), buffer.histogram(other.labels("a"))
    for amount in amounts:
        child.observe(amount)
        series.observe(amount)
    buffer.flush()
    assert repr(exported(buffered)) == repr(exported(direct))
    # Folding again adds nothing; later observations add to what was folded.
    buffer.flush()
    child.observe(0.5)
    series.observe(0.5)
    buffer.flush()
    assert repr(exported(buffered)) == repr(exported(direct))


def test_counters_and_gauges_hold_their_updates_until_the_flush() -> None:
    buffer = MetricBuffer()
    registry = CollectorRegistry()
    counter = Counter("c", "help", registry=registry)
    gauge = Gauge("g", "help", registry=registry)
    buffered_counter, buffered_gauge = buffer.counter(counter), buffer.gauge(gauge)
    buffered_counter.inc()
    buffered_counter.inc(2.5)
    buffered_gauge.inc(3)
    buffered_gauge.dec()
    assert registry.get_sample_value("c_total") == 0
    assert registry.get_sample_value("g") == 0
    buffer.flush()
    assert registry.get_sample_value("c_total") == 3.5
    assert registry.get_sample_value("g") == 2
    buffered_gauge.set(7)
    buffered_gauge.set(1)
    buffer.flush()
    assert registry.get_sample_value("g") == 1


def test_one_series_has_one_buffer_however_many_ask_for_it() -> None:
    buffer = MetricBuffer()
    registry = CollectorRegistry()
    gauge = Gauge("g", "help", registry=registry)
    first, second = buffer.gauge(gauge), buffer.gauge(gauge)
    assert first is second
    first.inc()
    second.inc()
    buffer.flush()
    assert registry.get_sample_value("g") == 2


def test_with_each_turn_updates_are_folded_when_the_loop_turn_ends() -> None:
    async def run() -> tuple[float | None, float | None]:
        buffer = MetricBuffer(each_turn=True)
        registry = CollectorRegistry()
        counter = buffer.counter(Counter("c", "help", registry=registry))
        counter.inc()
        counter.inc()
        during = registry.get_sample_value("c_total")
        await asyncio.sleep(0)
        return during, registry.get_sample_value("c_total")

    assert asyncio.run(run()) == (0, 2)


def test_a_nan_observation_is_exported_as_observe_exports_it() -> None:
    direct, buffered, (plain, other) = pair(Histogram)
    buffer = MetricBuffer()
    series = buffer.histogram(other.labels("a"))
    for amount in (0.5, float("nan"), 2.0):
        plain.labels("a").observe(amount)
        series.observe(amount)
    buffer.flush()
    assert repr(exported(buffered)) == repr(exported(direct))
