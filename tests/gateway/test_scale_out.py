"""Scale-out through real processes: `python -m gateway` replicas sharing one media budget on a real redis-server,
and `--workers 2` serving one port with one `/metrics` that adds up.

Every gateway here runs in `slots` mode, so each request with media reserves exactly one per-request share and the
cap is a number of concurrent requests with media: the upstream (a stub in this process, answering only after
`hold_s`, or holding requests at its gate until the test lets them through one by one) sees at most that many at
once, which the tests check besides sampling Redis's own count. Three replicas are started once for the tests that
leave them running (cap, FIFO order, a client leaving the queue); the others start the processes they stop or kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubState, StubUpstream
from tests.observe import metric_in, until, wait_until
from tests.redis_server import RedisServer
from tests.servers import ROOT, ServedProcess, ServerThread, free_port, served_process

# Every test here starts processes of its own.
pytestmark = pytest.mark.slow

SHARE = 1 << 20  # limits.max_multimodal_cpu_bytes_per_request: what one request with media reserves
IMAGE = data_url(image_bytes(16, 16))
MEDIA = chat_body(IMAGE)
TEXT = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
ROUTE = "/v1/chat/completions"
# The replicas here front one stub upstream: one budget, named so.
SCOPE = "stub"


def budget_key(prefix: str, name: str) -> str:
    """The shared budget's key `name` (gateway/budget/redis/scripts.py) under `prefix` and `SCOPE`."""
    return "{" + prefix + ":" + SCOPE + "}:" + name


def write_config(directory: Path, upstream: str, *, slots: int, redis: dict[str, Any] | None, **limits: Any) -> Path:
    config: dict[str, Any] = {
        "server": {"access_log": False, "log_level": "warning", "drain_timeout_s": 10},
        "upstream": {"url": upstream, "ready_cache_s": 0},
        "media": {"processor": None},  # the stub serves no known model: charges are decoded pixels
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
        config["redis"] = {"lease_ttl_s": 1.0, "socket_timeout_s": 0.5, "scope": SCOPE, **redis}
    path = directory / f"gateway-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


class RedisSampler:
    """Samples the shared budget's `used` key as fast as it can; `most` is the largest value seen."""

    def __init__(self, server: RedisServer, prefix: str) -> None:
        self.server, self.key = server, budget_key(prefix, "used")
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
        return int(client.zcard(budget_key(prefix, "queue")))


def used_bytes(server: RedisServer, prefix: str) -> int:
    with server.client() as client:
        return int(client.get(budget_key(prefix, "used")) or 0)


# -- replicas sharing one Redis ------------------------------------------------------------------------------------

CLUSTER_SLOTS = 4


@dataclass
class Cluster:
    """Three gateway replicas sharing one budget of `CLUSTER_SLOTS` slots on the module's Redis, in front of one
    stub upstream; started once for the tests that leave them running."""

    stub: StubUpstream
    replicas: list[ServedProcess]
    redis: RedisServer
    prefix: str


def start_replicas(stack: ExitStack, config: Path, count: int) -> list[ServedProcess]:
    """`count` gateway processes on one config, started side by side (each start is mostly imports)."""
    managers = [served_process("gateway", config) for _ in range(count)]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
    for manager, future in zip(managers, futures, strict=True):
        if future.exception() is None:
            stack.push(manager.__exit__)
    return [future.result() for future in futures]


@pytest.fixture(scope="module")
def cluster_processes(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    stub = StubUpstream()
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    with ServerThread(stub) as upstream, ExitStack() as stack:
        redis = {"url": redis_server.url, "key_prefix": prefix}
        config = write_config(tmp_path_factory.mktemp("cluster"), upstream.url, slots=CLUSTER_SLOTS, redis=redis)
        yield Cluster(stub, start_replicas(stack, config, 3), redis_server, prefix)


@pytest.fixture
def cluster(cluster_processes: Cluster) -> Cluster:
    """The module's replicas with a fresh stub state and nothing held or queued in the shared budget."""
    cluster_processes.stub.state = StubState()
    assert used_bytes(cluster_processes.redis, cluster_processes.prefix) == 0
    assert queue_length(cluster_processes.redis, cluster_processes.prefix) == 0
    return cluster_processes


def marked(text: str) -> bytes:
    """A small media request that the upstream's records tell apart by its text."""
    return chat_body(IMAGE, text=text)


def marks(stub: StubUpstream, prefix: str) -> list[str]:
    """The texts of the requests that reached the upstream, in arrival order, that start with `prefix`."""
    with stub.state.lock:
        bodies = [seen.body for seen in stub.state.requests]
    texts = [orjson.loads(body)["messages"][0]["content"][0]["text"] for body in bodies]
    return [text for text in texts if text.startswith(prefix)]


def test_three_replicas_never_pass_the_global_cap_under_200_concurrent_media_requests(cluster: Cluster) -> None:
    stub = cluster.stub
    stub.state.hold_s = 0.03
    bodies = [marked(f"burst {i}") for i in range(200)]
    urls = [replica.url for replica in cluster.replicas]

    async def burst() -> list[tuple[int, bytes]]:
        async def one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, bytes]:
            async with session.post(url + ROUTE, data=body, headers={"content-type": "application/json"}) as response:
                return response.status, await response.read()

        connector = aiohttp.TCPConnector(limit=len(bodies))
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            return list(await asyncio.gather(*(one(session, urls[i % len(urls)], b) for i, b in enumerate(bodies))))

    with RedisSampler(cluster.redis, cluster.prefix) as sampler:
        responses = asyncio.run(burst())
    settled = used_bytes(cluster.redis, cluster.prefix)
    # Every request was answered by the upstream, with the body it was sent.
    assert [status for status, _ in responses] == [200] * len(bodies)
    for body, (_, answer) in zip(bodies, responses, strict=True):
        assert orjson.loads(answer)["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert sorted(marks(stub, "burst ")) == sorted(f"burst {i}" for i in range(len(bodies)))
    # The cap held, as Redis counted it (sampled all along) and as the upstream saw it ...
    assert sampler.most <= CLUSTER_SLOTS * SHARE
    assert stub.state.max_active <= CLUSTER_SLOTS
    # ... while it was the bottleneck: a cap per process (3 x 4) would have let 12 through at once.
    assert stub.state.max_active == CLUSTER_SLOTS
    assert sampler.most == CLUSTER_SLOTS * SHARE
    assert sampler.samples > 100
    assert settled == 0


def test_the_queue_is_fifo_across_replicas(cluster: Cluster) -> None:
    """Replica A holds the whole cap at the upstream's gate; requests queue on B and C in turn, each one in the
    cluster's queue before the next is sent; then slots free one at a time, and each freed slot must go to the
    request queued earliest, whichever replica holds it."""
    stub, (a, b, c) = cluster.stub, cluster.replicas
    stub.state.gated = True
    queued_count = 6

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            holders = [
                asyncio.ensure_future(client.post(a.url + ROUTE, content=marked(f"holder {i}")))
                for i in range(CLUSTER_SLOTS)
            ]
            await until(lambda: stub.state.at_gate == CLUSTER_SLOTS, 10.0, "A's requests hold every slot")
            assert used_bytes(cluster.redis, cluster.prefix) == CLUSTER_SLOTS * SHARE
            queued = []
            for i in range(queued_count):
                replica = (b, c)[i % 2]
                queued.append(asyncio.ensure_future(client.post(replica.url + ROUTE, content=marked(f"queued {i}"))))
                in_queue = i + 1
                await until(
                    lambda: queue_length(cluster.redis, cluster.prefix) == in_queue,  # noqa: B023 (awaited here)
                    what=f"queued {i} in the queue",
                )
            total = CLUSTER_SLOTS + queued_count
            for passed in range(1, total + 1):
                # One request through the gate frees one slot; the request granted it must reach the gate before
                # the next slot frees, so the arrival order at the upstream is the grant order.
                stub.state.open_gate()
                arrived = min(CLUSTER_SLOTS + passed, total)
                await until(lambda: stub.state.at_gate >= arrived, 10.0, "the next grant")  # noqa: B023 (awaited here)
            return list(await asyncio.gather(*holders, *queued))

    responses = asyncio.run(scenario())
    assert [response.status_code for response in responses] == [200] * (CLUSTER_SLOTS + queued_count)
    assert marks(stub, "queued ") == [f"queued {i}" for i in range(queued_count)]
    assert used_bytes(cluster.redis, cluster.prefix) == 0


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
        survivor_metrics = httpx.get(survivor.url + "/metrics", timeout=10).text
        holder.join(5)
    assert response.status_code == 200
    # Admitted once the dead replica's lease expired unrenewed (its TTL is 1 s) and the survivor reaped it. The time
    # is a backstop with room for a loaded machine, far below the 20 s admission timeout.
    assert metric_in(survivor_metrics, "mmgate_budget_lease_expiries_total", kind="lease") == 1
    assert elapsed < 10, f"admitted {elapsed:.2f} s after the kill"


@pytest.mark.slow
def test_gateways_share_a_budget_only_in_front_of_the_same_server_and_say_who_shares_it(
    upstream: tuple[StubUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Three gateways on one Redis and one `redis.key_prefix`, no `redis.scope`: two in front of one model server
    share its cap of one request (the second waits), the third, in front of another server, has a cap of its own
    (it admits at once). Each says at start-up which gateway processes share its budget."""
    stub, upstream_url = upstream
    other = StubUpstream()
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    redis = {"url": redis_server.url, "key_prefix": prefix, "scope": None}
    logs = [tmp_path / f"gateway-{i}.log" for i in range(3)]
    with ServerThread(other) as other_server, ExitStack() as stack:
        configs = [
            write_config(tmp_path, url, slots=1, redis=redis) for url in (upstream_url, upstream_url, other_server.url)
        ]
        for config in configs:  # the start-up lines are at level info
            config.write_text(config.read_text().replace("log_level: warning", "log_level: info"))
        first, second, elsewhere = (
            stack.enter_context(served_process("gateway", config, log=log))
            for config, log in zip(configs, logs, strict=True)
        )
        stub.state.gated = other.state.gated = True
        with ThreadPoolExecutor(3) as pool:
            held = pool.submit(httpx.post, first.url + ROUTE, content=MEDIA, timeout=30)
            wait_until(lambda: stub.state.at_gate == 1, 10, "the first gateway's request holds its server's slot")
            queued = pool.submit(httpx.post, second.url + ROUTE, content=MEDIA, timeout=30)
            apart = pool.submit(httpx.post, elsewhere.url + ROUTE, content=MEDIA, timeout=30)
            wait_until(lambda: other.state.at_gate == 1, 10, "the other server's gateway admits at once")
            time.sleep(0.5)
            waited = stub.state.at_gate
            stub.state.open_gate(2)
            other.state.open_gate(1)
            statuses = [future.result().status_code for future in (held, queued, apart)]
    assert waited == 1, "the second gateway in front of the same server waited for the shared slot"
    assert statuses == [200, 200, 200]
    host = socket.gethostname()
    same = f"{prefix}:{host}:{upstream_url.rsplit(':', 1)[1]}"
    said = logs[1].read_text()
    assert f"shared media budget {{{same}}}" in said
    assert "2 gateway processes share it now (this one included)" in said
    assert f"{host} pid {first.process.pid} -> {host}:{upstream_url.rsplit(':', 1)[1]}" in said
    assert f"1 gateway process shares it now (this one included): {host} pid {elsewhere.process.pid}" in (
        logs[2].read_text()
    )


def _post_ignoring_errors(url: str) -> None:
    with contextlib.suppress(httpx.TransportError):
        httpx.post(url + ROUTE, content=MEDIA, timeout=30)


def test_a_client_that_leaves_while_queued_frees_its_ticket(cluster: Cluster) -> None:
    stub, (a, b, _) = cluster.stub, cluster.replicas
    stub.state.gated = True

    async def scenario() -> float:
        async with httpx.AsyncClient(timeout=30) as client:
            holders = [
                asyncio.ensure_future(client.post(a.url + ROUTE, content=marked(f"holder {i}")))
                for i in range(CLUSTER_SLOTS)
            ]
            await until(lambda: stub.state.at_gate == CLUSTER_SLOTS, 10.0, "A's requests hold every slot")
            leaver = asyncio.ensure_future(
                client.post(b.url + ROUTE, content=marked("leaver"), timeout=httpx.Timeout(10, read=1.0))
            )
            await until(lambda: queue_length(cluster.redis, cluster.prefix) == 1, 10.0, "the request queued")
            with pytest.raises(httpx.ReadTimeout):
                await leaver
            left = time.monotonic()
            await until(lambda: queue_length(cluster.redis, cluster.prefix) == 0, 2, "the ticket left")
            freed_after = time.monotonic() - left
            # The holders still hold: the ticket left because its client did, not because it was granted.
            assert used_bytes(cluster.redis, cluster.prefix) == CLUSTER_SLOTS * SHARE
            stub.state.open_gate(CLUSTER_SLOTS)
            codes = [response.status_code for response in await asyncio.gather(*holders)]
            assert codes == [200] * CLUSTER_SLOTS
            return freed_after

    freed_after = asyncio.run(scenario())
    # At once, not when the ticket's lease would have run out (redis.lease_ttl_s=1).
    assert freed_after < 0.5
    # Slots freed after the client left were never granted to its ticket.
    assert marks(cluster.stub, "leaver") == []
    assert used_bytes(cluster.redis, cluster.prefix) == 0


def test_a_redis_restart_under_load_never_lets_more_than_the_cap_through(
    upstream: tuple[StubUpstream, str], own_redis: RedisServer, tmp_path: Path
) -> None:
    """Two replicas under load, the cap full and requests queued; redis-server is killed and restarted empty.
    The requests in flight keep their bytes and re-assert them: the upstream never sees more than the cap."""
    stub, upstream_url = upstream
    stub.state.hold_s = 0.3
    prefix = f"t:{uuid.uuid4().hex[:8]}"
    redis = {"url": own_redis.url, "key_prefix": prefix, "on_unavailable": "reject"}
    config = write_config(tmp_path, upstream_url, slots=4, redis=redis, release_on="complete")
    before: list[int] = []
    after: list[int] = []

    async def load(urls: list[str]) -> None:
        restarted = asyncio.Event()
        stop = asyncio.Event()

        async def client_loop(url: str) -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                while not stop.is_set():
                    status = (await client.post(url + ROUTE, content=MEDIA)).status_code
                    (after if restarted.is_set() else before).append(status)

        clients = [asyncio.ensure_future(client_loop(urls[i % 2])) for i in range(12)]
        await until(lambda: stub.state.active == 4 and len(before) >= 8, 30.0, "the cap full, requests queued")
        await asyncio.to_thread(own_redis.kill)
        await asyncio.to_thread(own_redis.start)
        restarted.set()
        await until(lambda: after.count(200) >= 24, 60.0, "requests served after the restart")
        stop.set()
        await asyncio.gather(*clients)

    with ExitStack() as stack:
        replicas = start_replicas(stack, config, 2)
        asyncio.run(load([replica.url for replica in replicas]))
    assert stub.state.max_active <= 4, f"{stub.state.max_active} requests at the upstream at once, cap 4"
    assert set(before) == {200}
    # Calls that met the server down were refused (redis.on_unavailable=reject); nothing else failed.
    assert set(after) <= {200, 503}


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
    assert metric_in(degraded_metrics, "mmgate_budget_backend_errors_total") >= 1
    if on_unavailable == "reject":
        assert during.status_code == 503
        # The client is told what failed and which setting applies, not where Redis is (the log has it).
        assert "the shared media budget does not answer (redis.on_unavailable=reject)" in during.text
        assert "redis://" not in during.text
        assert "unavailable" in ready["budget"]
    else:
        assert during.status_code == 200
        assert "degraded" in ready["budget"]
        assert metric_in(degraded_metrics, "mmgate_budget_backend_degraded") == 1
        assert metric_in(degraded_metrics, "mmgate_budget_backend_fallbacks_total") == 1
        # The local share: 4 slots // (2 replicas x 1 worker).
        assert metric_in(degraded_metrics, "mmgate_budget_capacity_bytes") == 2 * SHARE
        assert metric_in(recovered_metrics, "mmgate_budget_backend_degraded") == 0
    assert metric_in(recovered_metrics, "mmgate_budget_backend_seconds_count", op="reserve") >= 2


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


@pytest.mark.parametrize("workers", ["1", "2"])
def test_redis_unreachable_at_start_is_one_json_line_and_status_3(
    upstream: tuple[StubUpstream, str], tmp_path: Path, workers: str
) -> None:
    _, upstream_url = upstream
    config = write_config(tmp_path, upstream_url, slots=4, redis={"url": f"redis://127.0.0.1:{free_port()}/0"})
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "--config", str(config), "--port", str(free_port()), "--workers", workers],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    lines = [orjson.loads(line) for line in result.stderr.splitlines()]
    about = [line for line in lines if "Redis" in line["message"]]
    # Each worker says it once; the first worker's failure stops the others, which may not have got that far.
    assert 1 <= len(about) <= int(workers), about
    for line in about:
        assert (line["level"], line["logger"]) == ("error", "mmgate")
        assert line["message"].startswith("start-up failed: cannot reach the shared media budget's Redis at redis://")


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
        # A worker counts the requests that ended within gateway.access_log.SETTLE_S of each other together.
        wait_until(lambda: sum(per_worker_requests(metrics_dir).values()) >= sent, what="every request counted")
        counts = per_worker_requests(metrics_dir)
        text = httpx.get(gateway.url + "/metrics").text
        capacity = metric_in(text, "mmgate_budget_capacity_bytes")
        parent = gateway.process
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(20) == 0
    assert not metrics_dir.exists(), "the parent removes the metrics directory"
    # Both workers served, and whichever answered the scrape counted them all.
    assert len([count for count in counts.values() if count > 0]) == 2
    assert metric_in(text, "mmgate_requests_total", route=ROUTE, code="200") == sent == sum(counts.values())
    # Each worker's local share (4 slots // 2) adds up to the configured cap.
    assert capacity == 4 * SHARE


def test_sigterm_drains_every_worker(upstream: tuple[StubUpstream, str], tmp_path: Path) -> None:
    """Every worker drains its requests, and from the first signal the port refuses new connections: a
    connection the kernel completed for a worker that no longer accepts would hang, then be reset."""
    stub, upstream_url = upstream
    stub.state.hold_s = 5.0
    config = write_config(tmp_path, upstream_url, slots=4, redis=None)

    def refused_while_draining(port: int) -> bool:
        """Whether a connect to `port` is refused before the held requests have left the upstream."""
        while stub.state.active:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except ConnectionRefusedError:
                return True
            time.sleep(0.05)
        return False

    async def slow_requests(gateway: ServedProcess, count: int) -> tuple[list[int], bool]:
        async def one() -> int:
            async with httpx.AsyncClient(timeout=30) as client:
                return (await client.post(gateway.url + ROUTE, content=TEXT)).status_code

        tasks = [asyncio.ensure_future(one()) for _ in range(count)]
        deadline = time.monotonic() + 10
        while stub.state.active < count:  # all of them in flight at the upstream
            assert time.monotonic() < deadline, f"{stub.state.active} of {count} requests reached the upstream"
            await asyncio.sleep(0.01)
        gateway.process.send_signal(signal.SIGTERM)
        port = int(gateway.url.rsplit(":", 1)[1])
        refused = await asyncio.to_thread(refused_while_draining, port)
        return list(await asyncio.gather(*tasks)), refused

    with served_process("gateway", config, "--workers", "2") as gateway:
        codes, refused = asyncio.run(slow_requests(gateway, 12))
        assert gateway.process.wait(20) == 0
    assert refused, "connections were still taken while the workers drained"
    assert codes == [200] * 12


def test_a_gateway_with_another_cap_on_the_prefix_refuses_to_start(
    upstream: tuple[StubUpstream, str], redis_server: RedisServer, tmp_path: Path
) -> None:
    _, upstream_url = upstream
    redis = {"url": redis_server.url, "key_prefix": f"t:{uuid.uuid4().hex[:8]}"}
    with served_process("gateway", write_config(tmp_path, upstream_url, slots=4, redis=redis)):
        other = write_config(tmp_path, upstream_url, slots=8, redis=redis)
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "--config", str(other), "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert result.returncode == 3
    assert f"has a cap of {4 * SHARE:,} bytes and this gateway {8 * SHARE:,}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_fails_the_start_with_one_message(workers: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                str(port),
                "--workers",
                workers,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert result.returncode == 3
    [line] = result.stderr.splitlines()
    logged = orjson.loads(line)
    assert (logged["level"], logged["logger"]) == ("error", "mmgate")
    assert logged["message"] == f"mmgate gateway: cannot listen on 127.0.0.1:{port}: address already in use"
