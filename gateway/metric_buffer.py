"""Per-request metric updates kept in plain numbers on the event loop and folded into their prometheus-client series
in one step: at each scrape of this process, and with several worker processes also at the end of every loop turn
in which one changed (each worker's series live in files that whichever worker answers a scrape reads).

An update made through prometheus-client takes a lock and several calls (with several workers, a write to a shared
file too), and a small request makes about a dozen; here it is an addition. A buffered series must only be updated
on the event loop's thread, which is also where it is folded; series updated on media threads are not buffered.
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram


class _Buffered(Protocol):
    def _fold(self) -> None: ...


class MetricBuffer:
    """`each_turn`: fold at the end of every loop turn with an update (several workers), not only when scraped."""

    def __init__(self, *, each_turn: bool = False) -> None:
        self.each_turn = each_turn
        self._changed: list[_Buffered] = []
        self._scheduled = False
        # One buffered series per series, however many callers update it.
        self._series: dict[Counter | Gauge | Histogram, _Buffered] = {}

    def counter(self, metric: Counter) -> BufferedCounter:
        series = self._series.get(metric)
        if not isinstance(series, BufferedCounter):
            series = self._series[metric] = BufferedCounter(self, metric)
        return series

    def gauge(self, metric: Gauge) -> BufferedGauge:
        series = self._series.get(metric)
        if not isinstance(series, BufferedGauge):
            series = self._series[metric] = BufferedGauge(self, metric)
        return series

    def histogram(self, metric: Histogram) -> BufferedHistogram:
        series = self._series.get(metric)
        if not isinstance(series, BufferedHistogram):
            series = self._series[metric] = BufferedHistogram(self, metric)
        return series

    def flush(self) -> None:
        """Fold every update made since the last flush into its series."""
        self._scheduled = False
        changed, self._changed = self._changed, []
        for series in changed:
            series._fold()

    def _changing(self, series: _Buffered) -> None:
        """`series` holds its first update since the last flush."""
        self._changed.append(series)
        if self.each_turn and not self._scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop, no turn to end: the update waits for the next flush
                return
            self._scheduled = True
            loop.call_soon(self.flush)


class BufferedCounter:
    __slots__ = ("_buffer", "_metric", "_pending")

    def __init__(self, buffer: MetricBuffer, metric: Counter) -> None:
        self._buffer = buffer
        self._metric = metric
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        if not self._pending:
            self._buffer._changing(self)
        self._pending += amount

    def _fold(self) -> None:
        pending, self._pending = self._pending, 0.0
        if pending:
            self._metric.inc(pending)


class BufferedGauge:
    """A gauge's value is this process's own (it is set here only), so the buffer holds the value itself."""

    __slots__ = ("_buffer", "_changed", "_metric", "_value")

    def __init__(self, buffer: MetricBuffer, metric: Gauge) -> None:
        self._buffer = buffer
        self._metric = metric
        self._value = 0.0
        self._changed = False

    def set(self, value: float) -> None:
        self._value = value
        if not self._changed:
            self._changed = True
            self._buffer._changing(self)

    def inc(self, amount: float = 1) -> None:
        self.set(self._value + amount)

    def dec(self, amount: float = 1) -> None:
        self.set(self._value - amount)

    def _fold(self) -> None:
        self._changed = False
        self._metric.set(self._value)


class BufferedHistogram:
    """Observations counted per bucket as `Histogram.observe` counts them (the first bucket whose bound is at least
    the amount), then added to the histogram's own bucket and sum values."""

    __slots__ = ("_bounds", "_buffer", "_counts", "_metric", "_observed", "_sum")

    def __init__(self, buffer: MetricBuffer, metric: Histogram) -> None:
        self._buffer = buffer
        self._metric = metric
        # prometheus-client keeps a histogram's bounds (+Inf last), one value per bucket and one for the sum under
        # these names; no public call adds several observations at once.
        self._bounds: list[float] = list(metric._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._observed = False

    def observe(self, amount: float) -> None:
        if amount != amount:  # NaN is in no bucket and makes the sum NaN, as Histogram.observe has it
            self._metric.observe(amount)
            return
        if not self._observed:
            self._observed = True
            self._buffer._changing(self)
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def _fold(self) -> None:
        self._observed = False
        counts, total = self._counts, self._sum
        self._counts, self._sum = [0] * len(counts), 0.0
        metric = self._metric
        metric._sum.inc(total)
        for value, count in zip(metric._buckets, counts, strict=True):
            if count:
                value.inc(count)
