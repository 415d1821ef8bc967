"""What the deployment examples give in media capacity, run for real: each pod's or service's gateway is a gateway
process started from the example's own config and environment, in front of a stub model server of its own (the
pod's trtllm-serve or vLLM), with the budget the example configures (a redis-server on loopback standing in for a
Redis Service). Only addresses change, and the cap, scaled down to 4 requests a budget (`budget_mode: slots`) so
that a budget is filled by small images.

A budget protects the memory of the model server behind it: N model-server pods, each with its own sidecar gateway,
give N times the capacity of one; gateway replicas in front of one server share its one budget.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.deploy.common import DOCKER, K8S, interpolate, load_yaml, load_yaml_documents
from tests.deploy.test_k8s import generated_configmap
from tests.gateway.media_factory import chat_body, data_url, image_bytes
from tests.gateway.stub_upstream import StubUpstream
from tests.observe import wait_until
from tests.redis_server import RedisServer
from tests.servers import ServerThread, free_port, served_process

# Every test here starts gateway processes.
pytestmark = pytest.mark.slow

SLOTS = 4  # requests with media one budget admits at once, here
SHARE = 64 << 20  # what each of them reserves
OFFERED = SLOTS + 2  # requests sent to each gateway: more than one budget admits
MEDIA = chat_body(data_url(image_bytes(16, 16)))


def scaled_down() -> dict[str, str]:
    """The cap of `SLOTS` requests, as environment over the example's config."""
    return {
        "MMGATE_LIMITS__BUDGET_MODE": "slots",
        "MMGATE_LIMITS__MAX_MULTIMODAL_CPU_BYTES": str(SLOTS * SHARE),
        "MMGATE_LIMITS__MAX_MULTIMODAL_CPU_BYTES_PER_REQUEST": str(SHARE),
        "MMGATE_LIMITS__MAX_BUFFERED_BODY_BYTES": str(256 << 20),
        "MMGATE_LIMITS__ADMISSION_TIMEOUT_S": "60",
    }


def on_loopback(config: Path, env: dict[str, str], upstream: str, redis: RedisServer | None) -> dict[str, str]:
    """The example's environment with loopback addresses: its own metrics port, the stub as its model server, the
    test's redis-server where the example names a Redis."""
    settings = _settings(config, env)
    local = {
        **{name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")},
        **env,
        **scaled_down(),
        "MMGATE_SERVER__HOST": "127.0.0.1",
        "MMGATE_UPSTREAM__URL": upstream,
        "MMGATE_SERVER__LOG_LEVEL": "warning",
    }
    if settings.server.metrics_port is not None:
        local["MMGATE_SERVER__METRICS_PORT"] = str(free_port())
    if settings.limits.budget_backend.value == "redis":
        assert redis is not None
        local["MMGATE_REDIS__URL"] = redis.url
    return local


def _settings(config: Path, env: dict[str, str]) -> GatewaySettings:
    saved = dict(os.environ)
    try:
        for name in [name for name in os.environ if name.startswith("MMGATE_")]:
            del os.environ[name]
        os.environ.update(env)
        return load_settings(GatewaySettings, config)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def redis_if_named(settings: list[GatewaySettings], tmp_path: Path) -> Iterator[RedisServer | None]:
    if not any(item.limits.budget_backend.value == "redis" for item in settings):
        yield None
        return
    server = RedisServer(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def admitted_at_once(
    gateways: list[tuple[str, dict[str, str]]], servers: list[StubUpstream], tmp_path: Path
) -> list[int]:
    """Start each (config, environment) gateway, offer each `OFFERED` requests with media at once while the model
    servers hold every request they get, and count how many reached each server before any was answered."""
    config_paths = [Path(config) for config, _ in gateways]
    for server in servers:
        server.state.gated = True
    with ExitStack() as stack:
        served = [
            stack.enter_context(served_process("gateway", path, env=env, log=tmp_path / f"gateway-{i}.log"))
            for i, (path, (_, env)) in enumerate(zip(config_paths, gateways, strict=True))
        ]
        expected = min(len(served) * OFFERED, len(servers) * SLOTS)
        with ThreadPoolExecutor(len(served) * OFFERED) as pool:
            futures = [
                pool.submit(httpx.post, gateway.url + "/v1/chat/completions", content=MEDIA, timeout=90)
                for gateway in served
                for _ in range(OFFERED)
            ]
            with suppress(AssertionError):  # fewer than expected: what was admitted is asserted below
                wait_until(
                    lambda: sum(server.state.at_gate for server in servers) >= expected,
                    30,
                    f"{expected} requests admitted at once",
                )
            time.sleep(1.0)  # anything a budget still had room for arrives in this time
            counts = [server.state.at_gate for server in servers]
            for server in servers:
                server.state.open_gate(len(futures))
            statuses = [future.result().status_code for future in futures]
    assert statuses == [200] * len(futures), statuses
    return counts


def k8s_pods(directory: Path, pods: int, tmp_path: Path) -> list[int]:
    """`pods` replicas of the example's Deployment: a model server and its gateway each."""
    kustomization = load_yaml(directory / "kustomization.yaml")
    data = generated_configmap(directory, kustomization)["data"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "gateway.yaml"
    config.write_text(data["gateway.yaml"], encoding="utf-8")
    (deployment,) = [doc for doc in load_yaml_documents(directory / "deployment.yaml") if doc["kind"] == "Deployment"]
    (gateway,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway"]
    env = {item["name"]: str(item["value"]) for item in gateway.get("env", [])}
    servers = [StubUpstream() for _ in range(pods)]
    with ExitStack() as stack:
        urls = [stack.enter_context(ServerThread(server)).url for server in servers]
        redis = stack.enter_context(redis_if_named([_settings(config, env)], tmp_path))
        gateways = [(str(config), on_loopback(config, env, url, redis)) for url in urls]
        return admitted_at_once(gateways, servers, tmp_path)


@pytest.mark.parametrize("example", ["trtllm", "vllm-proxy"])
def test_n_model_server_pods_give_n_times_the_media_capacity(example: str, tmp_path: Path) -> None:
    """docker/k8s (trtllm-serve) and docker/k8s/vllm-proxy at 1 and 3 replicas: each pod's gateway admits its
    budget's `SLOTS` requests, so 3 pods admit 3 times what 1 does. (docker/k8s/vllm, engine mode, runs the same
    gateway config shape: `test_k8s_vllm.py` checks its budget is the pod's own.)"""
    directory = K8S if example == "trtllm" else K8S / example
    one = k8s_pods(directory, 1, tmp_path / "one")
    three = k8s_pods(directory, 3, tmp_path / "three")
    print(f"\n{example}: 1 pod admits {sum(one)} x {SHARE >> 20} MiB, 3 pods admit {three} x {SHARE >> 20} MiB")
    assert one == [SLOTS]
    assert three == [SLOTS, SLOTS, SLOTS], "each pod's gateway protects its own model server"


def test_gateway_replicas_in_front_of_one_server_share_its_budget(tmp_path: Path) -> None:
    """docker/compose.yaml's gpu profile: gateway and gateway-2 in front of the one trtllm service share one budget
    through the redis service, so two replicas admit what one budget does, not twice that."""
    compose = interpolate(load_yaml(DOCKER / "compose.yaml"))
    server = StubUpstream()
    with ExitStack() as stack:
        url = stack.enter_context(ServerThread(server)).url
        replicas: list[tuple[Path, dict[str, str]]] = []
        for name in ("gateway", "gateway-2"):
            svc: dict[str, Any] = compose["services"][name]
            (mount,) = [v for v in svc["volumes"] if v.split(":")[1] == "/etc/mmgate/gateway.yaml"]
            config = (DOCKER / mount.split(":")[0]).resolve()
            env = {key: str(value) for key, value in (svc.get("environment") or {}).items()}
            replicas.append((config, env))
        settings = [_settings(config, env) for config, env in replicas]
        assert {str(item.upstream.url) for item in settings} == {"http://trtllm:8001/"}
        redis = stack.enter_context(redis_if_named(settings, tmp_path))
        gateways = [(str(config), on_loopback(config, env, url, redis)) for config, env in replicas]
        (admitted,) = admitted_at_once(gateways, [server], tmp_path)
    print(f"\ncompose gpu: 2 gateway replicas in front of one trtllm admit {admitted} x {SHARE >> 20} MiB")
    assert admitted == SLOTS
