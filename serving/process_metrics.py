"""`process_*` series for a process tree: with `--workers N` prometheus-client's multiprocess collector exports no
`process_*` series, and one worker's own numbers would say nothing of the others. The worker answering a scrape
exports the supervisor's `process_*` series and, read from /proc at scrape time, the sums over the supervisor and
every worker (`mmgate_processes_*`): no pid label, and correct whichever worker answers."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_PROC = Path("/proc")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: the fields after it start at ") ".
    return text[text.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:  # field 4: ppid
                found.append(int(entry.name))
    return found


class ProcessTreeCollector(Collector):
    """Sums over `root()` and its children: resident memory, CPU seconds, open file descriptors, processes."""

    def __init__(self, root: Callable[[], int]) -> None:
        self.root = root

    def collect(self) -> Iterator[Metric]:
        root = self.root()
        rss = cpu = 0.0
        fds = processes = 0
        for pid in [root, *children(root)]:
            fields = _stat_fields(pid)
            if fields is None:
                continue  # exited since it was listed
            processes += 1
            # Fields 14 and 15 (utime, stime, clock ticks) and 24 (rss, pages), counted from field 3 here.
            cpu += (int(fields[11]) + int(fields[12])) / _TICKS
            rss += int(fields[21]) * _PAGE_BYTES
            with contextlib.suppress(OSError):
                fds += len(os.listdir(_PROC / str(pid) / "fd"))
        yield GaugeMetricFamily(
            "mmgate_processes_resident_memory_bytes",
            "Resident memory of the supervisor and all its worker processes, summed.",
            value=rss,
        )
        yield CounterMetricFamily(
            "mmgate_processes_cpu_seconds",
            "CPU time (user and system) of the supervisor and its live worker processes, summed.",
            value=cpu,
        )
        yield GaugeMetricFamily(
            "mmgate_processes_open_fds", "Open file descriptors of the supervisor and its workers.", value=fds
        )
        yield GaugeMetricFamily("mmgate_processes", "The supervisor and its live worker processes.", value=processes)
