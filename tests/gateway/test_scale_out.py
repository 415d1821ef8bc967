"""Scale-out through real processes: `python -m gateway` replicas sharing one media budget on a real redis-server,
and `--workers 2` serving one port with one `/metrics` that adds up.

Every gateway here runs in `slots` mode, so each request with media reserves exactly one per-request share and the
cap is a number of concurrent requests with media: the upstream (a stub in this process, answering only after
`hold_s`) sees at most that many at once, which the tests check besides sampling Redis's own count.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.redis_server import RedisServer
from tests.servers import ROOT, ServedProcess, free_port, served_process

SHARE = 1 << 20  # limits.max_multimodal_cpu_bytes_per_request: what one request with media reserves
MEDIA = chat_body(data_url(image_bytes(16, 16)))
TEXT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
ROUTE = "/v1/chat/completions"


def write_config(directory: Path, upstream: str, *, slots: int, redis: dict[str, Any] | None, **limits: Any) -> Path:
    config: dict[str, Any] = {
        "server": {"access_log": False, "log_level": "warning", "drain_timeout_s": 10},
        "upstream": {"url": upstream, "ready_cache_s": 0},
        "limits": {
            "budget_mode": "slots",
            "max_multimodal_cpu_bytes": slots * SHARE,
            "max_multimodal_cpu_bytes_per_request": SHARE,
            "admission_timeout_s": 20,
            "budget_backend": "local" if redis is None else "redis",
            **limits,
        },
    }
    if redis is not None:
        config["redis"] = {"lease_ttl_s": 1.0, "socket_timeout_s": 0.5, **redis}
    path = directory / f"gateway-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until(predicate: Any, within: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < within, f"{what}: not within {within} s"
        time.sleep(0.01)
    return time.monotonic() - started


class RedisSampler:
    """Samples the shared budget's `used` key as fast as it can; `most` is the largest value seen."""

    def __init__(self, server: RedisServer, prefix: str) -> None:
        self.server, self.key = server, "{" + prefix + "}:used"
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.server.client() as client:
            while not self._stop.is_set():
                self.most = max(self.most, int(client.get(self.key) or 0))
                self.samples += 1
                time.sleep(0.0005)

    def __enter__(self) -> RedisSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def upstream(stub: tuple[StubUpstream, str]) -> tuple[StubUpstream, str]:
    return stub


def queue_length(server: RedisServer, prefix: str) -> int:
    with server.client() as client:
        return int(client.zcard("{" + prefix + "}:queue"))


def used_bytes(server: RedisServer, prefix: str) -> int:
    with server.client() as client:
        return int(client.get("{" + prefix + "}:used") or 0)


# -- replicas sharing one Redis ------------------------------------------------------------------------------------


def test_two_replicas_never_pass_the_global_cap_under_many_concurrent_media_requests(
    upstream: tuple[StubUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    stub, upstream_url = upstream
    stub.state.hold_s = 0.05
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, upstream_url, slots=4, redis={"url": redis_server.url, "key_prefix": prefix})

    async def burst(urls: list[str], count: int) -> list[int]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(timeout=30, limits=limits) as client:
            responses = await asyncio.gather(
                *(client.post(urls[i % len(urls)] + ROUTE, content=MEDIA) for i in range(count))
            )
        return [response.status_code for response in responses]

    with ExitStack() as stack:
        gateways = [stack.enter_context(served_process("gateway", config)) for _ in range(2)]
        with RedisSampler(redis_server, prefix) as sampler:
            codes = asyncio.run(burst([gateway.url for gateway in gateways], 80))
        settled = used_bytes(redis_server, prefix)
    assert codes == [200] * 80
    # The cap held, as Redis counted it and as the upstream saw it ...
    assert sampler.most <= 4 * SHARE
    assert stub.state.max_active <= 4
    # ... while it was the bottleneck: a cap per process (2 x 4) would have let 8 through at once.
    assert stub.state.max_active == 4
    assert sampler.most == 4 * SHARE
    assert sampler.samples > 50
    assert settled == 0


def test_a_killed_replicas_reservation_comes_back_within_the_lease_ttl(
    upstream: tuple[StubUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    stub, upstream_url = upstream
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, upstream_url, slots=1, redis={"url": redis_server.url, "key_prefix": prefix})
    with served_process("gateway", config) as victim, served_process("gateway", config) as survivor:
        stub.state.stall_headers_s = 30  # the victim's request holds the only slot until it dies
        holder = threading.Thread(target=_post_ignoring_errors, args=(victim.url,), daemon=True)
        holder.start()
        assert stub.state.stalling.wait(10)
        assert used_bytes(redis_server, prefix) == SHARE
        stub.state.stall_headers_s = 0
        victim.process.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        response = httpx.post(survivor.url + ROUTE, content=MEDIA, timeout=10)
        elapsed = time.monotonic() - killed
        holder.join(5)
    assert response.status_code == 200
    # The lease TTL is 1 s; a renewal at most TTL / 3 before the kill.
    assert 0.5 < elapsed < 1.0 + 0.8, f"admitted {elapsed:.2f} s after the kill"


def _post_ignoring_errors(url: str) -> None:
    with contextlib.suppress(httpx.TransportError):
        httpx.post(url + ROUTE, content=MEDIA, timeout=30)


def test_a_client_that_leaves_while_queued_frees_its_ticket(
    upstream: tuple[StubUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    stub, upstream_url = upstream
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    config = write_config(tmp_path, upstream_url, slots=1, redis={"url": redis_server.url, "key_prefix": prefix})
    with served_process("gateway", config) as first, served_process("gateway", config) as second:
        stub.state.stall_headers_s = 2.5
        holder = threading.Thread(target=_post_ignoring_errors, args=(first.url,), daemon=True)
        holder.start()
        assert stub.state.stalling.wait(10)
        queued_seen = threading.Event()

        def watch_queue() -> None:
            wait_until(lambda: queue_length(redis_server, prefix) == 1, 5, "the second request queued")
            queued_seen.set()

        watcher = threading.Thread(target=watch_queue, daemon=True)
        watcher.start()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(second.url + ROUTE, content=MEDIA, timeout=httpx.Timeout(10, read=1.0))
        left = time.monotonic()
        watcher.join(1)
        assert queued_seen.is_set()
        freed_after = wait_until(lambda: queue_length(redis_server, prefix) == 0, 2, "the ticket left the queue")
        since_leaving = time.monotonic() - left
        # The holder still holds: the ticket left because its client did, not because it was granted.
        assert used_bytes(redis_server, prefix) == SHARE
        stub.state.stall_headers_s = 0
        holder.join(10)
    assert freed_after < 0.5
    assert since_leaving < 0.5


@pytest.mark.parametrize("on_unavailable", ["reject", "local"])
def test_redis_stopped_mid_run_gives_the_configured_behaviour_and_recovers(
    upstream: tuple[StubUpstream, str], own_redis: RedisServer, tmp_path: Path, on_unavailable: str
) -> None:
    _, upstream_url = upstream
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    redis = {"url": own_redis.url, "key_prefix": prefix, "on_unavailable": on_unavailable, "expected_replicas": 2}
    config = write_config(tmp_path, upstream_url, slots=4, redis=redis)
    with served_process("gateway", config) as gateway:
        assert httpx.post(gateway.url + ROUTE, content=MEDIA, timeout=10).status_code == 200
        own_redis.stop()
        during = httpx.post(gateway.url + ROUTE, content=MEDIA, timeout=10)
        text = httpx.post(gateway.url + ROUTE, content=TEXT, timeout=10)
        ready = httpx.get(gateway.url + "/readyz", timeout=10).json()
        degraded_metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
        own_redis.start()

        def shared_again() -> bool:
            response = httpx.post(gateway.url + ROUTE, content=MEDIA, timeout=10)
            return response.status_code == 200 and "ok" in httpx.get(gateway.url + "/readyz").json()["budget"]

        wait_until(shared_again, 10, "the shared budget answers again")
        # The request that saw the budget back may have been admitted just before the switch: one more, shared.
        assert httpx.post(gateway.url + ROUTE, content=MEDIA, timeout=10).status_code == 200
        recovered_metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert text.status_code == 200, "requests without media need no budget"
    assert metric(degraded_metrics, "mmgate_budget_backend_errors_total") >= 1
    if on_unavailable == "reject":
        assert during.status_code == 503
        assert "redis://127.0.0.1" in during.text
        assert "unavailable" in ready["budget"]
    else:
        assert during.status_code == 200
        assert "degraded" in ready["budget"]
        assert metric(degraded_metrics, "mmgate_budget_backend_degraded") == 1
        assert metric(degraded_metrics, "mmgate_budget_backend_fallbacks_total") == 1
        # The local share: 4 slots // (2 replicas x 1 worker).
        assert metric(degraded_metrics, "mmgate_budget_capacity_bytes") == 2 * SHARE
        assert metric(recovered_metrics, "mmgate_budget_backend_degraded") == 0
    assert metric(recovered_metrics, "mmgate_budget_backend_seconds_count", op="reserve") >= 2


def test_start_up_stops_naming_the_url_when_redis_does_not_answer(
    upstream: tuple[StubUpstream, str], tmp_path: Path
) -> None:
    _, upstream_url = upstream
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"
    config = write_config(tmp_path, upstream_url, slots=4, redis={"url": url})
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0
    assert url.replace("hunter2", "***") in result.stderr
    assert "hunter2" not in result.stderr


# -- --workers ---------------------------------------------------------------------------------------------------


def per_worker_requests(metrics_dir: Path) -> dict[str, float]:
    """Requests each worker counted, read from its own multiprocess file."""
    counts: dict[str, float] = {}
    for file in metrics_dir.glob("counter_*.db"):
        alone = metrics_dir.parent / f"one-{file.stem}"
        alone.mkdir(exist_ok=True)
        shutil.copy(file, alone / file.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(alone))  # type: ignore[no-untyped-call]
        counts[file.stem] = sum(
            sample.value
            for family in registry.collect()
            for sample in family.samples
            if sample.name == "mmgate_requests_total" and sample.labels.get("route") == ROUTE
        )
    return counts


def test_two_workers_serve_one_port_and_metrics_count_both(upstream: tuple[StubUpstream, str], tmp_path: Path) -> None:
    stub, upstream_url = upstream
    stub.state.hold_s = 0.02
    config = write_config(tmp_path, upstream_url, slots=4, redis=None)
    temp = tmp_path / "tmp"
    temp.mkdir()

    async def burst(url: str, count: int) -> list[int]:
        async def one() -> int:
            # A connection each, so the two workers' accepts share them out.
            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.post(url + ROUTE, content=MEDIA)).status_code

        return list(await asyncio.gather(*(one() for _ in range(count))))

    env = {**os.environ, "TMPDIR": str(temp)}
    with served_process("gateway", config, "--workers", "2", env=env) as gateway:
        (metrics_dir,) = temp.glob("mmgate-metrics-*")
        sent = 0
        while True:
            codes = asyncio.run(burst(gateway.url, 40))
            sent += len(codes)
            assert codes == [200] * len(codes)
            counts = per_worker_requests(metrics_dir)
            if sum(1 for count in counts.values() if count > 0) >= 2 or sent >= 400:
                break
        text = httpx.get(gateway.url + "/metrics").text
        capacity = metric(text, "mmgate_budget_capacity_bytes")
        parent = gateway.process
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(20) == 0
    assert not metrics_dir.exists(), "the parent removes the metrics directory"
    # Both workers served, and whichever answered the scrape counted them all.
    assert len([count for count in counts.values() if count > 0]) == 2
    assert metric(text, "mmgate_requests_total", route=ROUTE, code="200") == sent == sum(counts.values())
    # Each worker's local share (4 slots // 2) adds up to the configured cap.
    assert capacity == 4 * SHARE


def test_sigterm_drains_every_worker(upstream: tuple[StubUpstream, str], tmp_path: Path) -> None:
    stub, upstream_url = upstream
    stub.state.hold_s = 2.0
    config = write_config(tmp_path, upstream_url, slots=4, redis=None)

    async def slow_requests(gateway: ServedProcess, count: int) -> list[int]:
        async def one() -> int:
            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.post(gateway.url + ROUTE, content=TEXT)).status_code

        tasks = [asyncio.ensure_future(one()) for _ in range(count)]
        deadline = time.monotonic() + 10
        while stub.state.active < count:  # all of them in flight at the upstream
            assert time.monotonic() < deadline, f"{stub.state.active} of {count} requests reached the upstream"
            await asyncio.sleep(0.01)
        gateway.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        with pytest.raises(httpx.TransportError):  # no new connections while draining
            async with httpx.AsyncClient(timeout=2) as client:
                await client.get(gateway.url + "/healthz")
        return list(await asyncio.gather(*tasks))

    with served_process("gateway", config, "--workers", "2") as gateway:
        codes = asyncio.run(slow_requests(gateway, 12))
        assert gateway.process.wait(20) == 0
    assert codes == [200] * 12
