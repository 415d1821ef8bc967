"""What tests read off running servers: a metric from a Prometheus exposition, a condition polled until it
holds (with a generous bound as a backstop, never as the thing asserted), the objects a process still holds."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import httpx
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, dict[str, str], float]
# How often a condition is polled.
POLL_S = 0.01


def samples(text: str) -> list[Sample]:
    """Every sample of an exposition: (name, labels, value)."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def metric_in(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when there is none)."""
    return sum(
        value
        for sample, sample_labels, value in samples(text)
        if sample == name and all(sample_labels.get(k) == v for k, v in labels.items())
    )


def metric(url: str, name: str, **labels: str) -> float:
    """`metric_in` of the server's `/metrics`."""
    return metric_in(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Poll `condition` until it holds; an AssertionError naming `what` once `timeout_s` has passed without it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(POLL_S)


@contextmanager
def collector_off() -> Iterator[None]:
    """The cyclic garbage collector off for the block, after a collection: what the block leaves unreachable is
    freed by reference counting or not at all."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def live(kind: type) -> int:
    """The objects of exactly `kind` that the collector tracks, reachable or not."""
    return sum(1 for each in gc.get_objects() if type(each) is kind)


def assert_freed_with_each_request(send_request: Callable[[], object], kind: type, requests: int = 20) -> None:
    """Send `requests` requests with the collector off: every `kind` they make must be freed by reference counting
    (by when the server has finished them), not left for a collection."""
    with collector_off():
        held = live(kind)  # by what earlier tests left
        for _ in range(requests):
            send_request()
        wait_until(lambda: live(kind) <= held, what=f"the finished requests' {kind.__name__} objects freed")


async def until(condition: Callable[[], bool], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """`wait_until` for a test running on an event loop: the loop runs while the condition is polled."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


def process_memory(pid: int | str, field: str = "VmRSS") -> int:
    """A process's `VmRSS` or `VmHWM` (its peak) in bytes, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak(pid: int | str) -> int:
    """Reset a process's `VmHWM` to its current RSS (`clear_refs` 5); returns that RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as clear:
        clear.write("5")
    return process_memory(pid)


def cyclic_garbage() -> list[object]:
    """What a collection finds unreachable now: the objects only reference cycles held."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    return found


_PACKAGES = ("gateway", "serving", "engine_adapter", "encoder_scheduler")
# Where the project's code lives: a frame of it in cyclic garbage is a request path that made a cycle.
_PROJECT_CODE = tuple(str(Path(__file__).resolve().parent.parent / name) + "/" for name in _PACKAGES)


def request_garbage(found: list[object], *, min_bytes: int) -> list[str]:
    """What of `found` a request held: frames of the project's code, ASGI scopes, and buffers or strings of at
    least `min_bytes` that garbage refers to; one line each."""
    lines: list[str] = []
    for each in found:
        if isinstance(each, FrameType) and each.f_code.co_filename.startswith(_PROJECT_CODE):
            lines.append(f"frame {each.f_code.co_filename}:{each.f_lineno} {each.f_code.co_name}")
        elif isinstance(each, dict) and each.get("type") == "http" and "asgi" in each:
            lines.append(f"ASGI scope of {each.get('method')} {each.get('path')}")
        else:
            for referent in gc.get_referents(each):
                if isinstance(referent, bytes | bytearray | str | memoryview) and len(referent) >= min_bytes:
                    lines.append(f"{type(referent).__name__} of {len(referent):,} held by a {type(each).__name__}")
    return lines
