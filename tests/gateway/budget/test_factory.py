"""Choosing the media budget from `limits.budget_backend` and `server.workers`."""

from __future__ import annotations

import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from gateway.budget.factory import budget_name, budget_scope, build_budget, describe
from gateway.budget.local import LocalBudget, UnlimitedBudget
from gateway.budget.redis import RedisBudget
from gateway.config import GatewaySettings
from gateway.metrics import GatewayMetrics

GIB = 1 << 30


def settings(**sections: object) -> GatewaySettings:
    return GatewaySettings(**sections)  # type: ignore[arg-type]


def gauge(metrics: GatewayMetrics, name: str) -> float:
    """The sum of the samples named `name` (over every label set)."""
    values = [
        sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == name
    ]
    assert values, f"{name} not exported"
    return sum(values)


def test_local_backend_splits_the_cap_between_workers() -> None:
    config = settings(
        server={"workers": 4},
        limits={"max_multimodal_cpu_bytes": 8 * GIB, "max_multimodal_cpu_bytes_per_request": 1 * GIB},
    )
    metrics = GatewayMetrics()
    budget = build_budget(config, metrics)
    assert isinstance(budget, LocalBudget)
    assert budget.capacity == 2 * GIB
    assert "each worker holds limits.max_multimodal_cpu_bytes // server.workers = 2GiB of 8GiB" in describe(config)
    assert isinstance(build_budget(settings(limits={"max_multimodal_cpu_bytes": None}), metrics), UnlimitedBudget)


def test_workers_whose_local_share_is_below_the_per_request_cap_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"server.workers=8 with limits.budget_backend=local"):
        settings(server={"workers": 8})  # 2 GiB // 8 < 512 MiB
    # The shared backend has no per-worker share.
    assert settings(server={"workers": 8}, limits={"budget_backend": "redis"}).server.workers == 8


def test_redis_section_is_validated() -> None:
    with pytest.raises(ValidationError, match="redis://"):
        settings(redis={"url": "http://127.0.0.1:6379"})
    with pytest.raises(ValidationError, match="socket_timeout_s"):
        settings(redis={"socket_timeout_s": 0})
    config = settings(server={"workers": 3}, redis={"expected_replicas": 2})
    assert config.budget_processes == 6


def test_redis_backend_builds_a_shared_budget_with_the_per_process_fallback_share() -> None:
    config = settings(
        server={"workers": 2},
        limits={"budget_backend": "redis", "max_multimodal_cpu_bytes": 8 * GIB},
        redis={"url": "redis://127.0.0.1:1/0", "expected_replicas": 2, "on_unavailable": "local", "lease_ttl_s": 3},
    )
    budget = build_budget(config, GatewayMetrics(shared_budget=True))
    assert isinstance(budget, RedisBudget)
    assert budget.capacity == 8 * GIB
    assert budget.fallback_capacity == 2 * GIB  # 8 GiB // (2 replicas x 2 workers)
    assert budget.lease_ttl_s == 3
    assert "redis" in describe(config)


def test_the_shared_budget_is_named_after_the_server_it_protects() -> None:
    """Gateways share a budget when they front the same server: `<redis.key_prefix>:<scope>`, the scope from the
    server's host:port. A server on loopback is this host's own (every pod's sidecar reaches its own at 127.0.0.1),
    so its scope carries this host's name: sidecars on different hosts never share a cap."""
    shared = {"limits": {"budget_backend": "redis"}}
    trtllm = settings(**shared, upstream={"url": "http://trtllm:8001"})
    assert budget_scope(trtllm) == ("trtllm:8001", "upstream.url")
    assert budget_name(trtllm) == "mmgate:budget:trtllm:8001"
    assert "budget 'mmgate:budget:trtllm:8001', which protects trtllm:8001 (redis.scope, from upstream.url)" in (
        describe(trtllm)
    )
    host = socket.gethostname()
    for url in ("http://127.0.0.1:8001", "http://localhost:8001", "http://[::1]:8001"):
        sidecar = settings(**shared, upstream={"url": url})
        assert budget_scope(sidecar) == (f"{host}:8001", "upstream.url on loopback: this host's server")
    engine = settings(**shared, engine={"url": "http://engine-gpu:8100"}, media={"processor": "qwen2_5_vl"})
    assert budget_scope(engine) == ("engine-gpu:8100", "engine.url")
    named = settings(**shared, redis={"key_prefix": "prod", "scope": "node-7"})
    assert budget_name(named) == "prod:node-7"
    assert budget_name(settings()) == ""  # the local backend is this process's own
    with pytest.raises(ValidationError, match=r"redis\.scope"):
        settings(redis={"scope": "two words"})


def test_the_redis_budget_lives_under_its_scope() -> None:
    config = settings(limits={"budget_backend": "redis"}, upstream={"url": "http://vllm:8001"})
    budget = build_budget(config, GatewayMetrics(shared_budget=True))
    assert isinstance(budget, RedisBudget)
    assert budget.keys["meta"] == "{mmgate:budget:vllm:8001}:meta"
    assert budget.member.endswith(" -> vllm:8001")
