from __future__ import annotations

import socket

import httpx

from tests.conftest import (
    GatewayFactory,
)
from tests.gateway.stub_upstream import StubUpstream


def test_healthz_is_alive_even_without_upstream(make_gateway: GatewayFactory) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with make_gateway(dead) as (_, url):
        health = httpx.get(url + "/healthz")
        ready = httpx.get(url + "/readyz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 503
    assert ready.json()["status"] == "not_ready"


def test_readyz_follows_the_upstream_and_caches_its_answer(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"ready_cache_s": 30}) as (gateway, url):
        first = httpx.get(url + "/readyz")
        second = httpx.get(url + "/readyz")
        gateway.start_draining()
        draining = httpx.get(url + "/readyz")
    assert first.status_code == 200
    assert first.json() == {
        "status": "ready",
        "upstream": "200",  # the public port names no internal address
        "budget": "local 2GiB: 0 bytes in use, 0 waiting",
    }
    assert second.status_code == 200
    assert app.state.paths().count("/health") == 1  # the second answer came from the cache
    assert draining.status_code == 503
    assert draining.json() == {"status": "draining"}


def test_readyz_probes_again_after_the_cache_expires(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream={"ready_cache_s": 0}) as (_, url):
        for _ in range(3):
            assert httpx.get(url + "/readyz").status_code == 200
    assert app.state.paths().count("/health") == 3


def test_metrics_path_can_move_so_the_upstreams_own_stays_reachable(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    moved = {"server": {"metrics_path": "/mmgate/metrics"}, "upstream": {"allowed_paths": ["/metrics"]}}
    with make_gateway(upstream, **moved) as (_, url):
        ours = httpx.get(url + "/mmgate/metrics")
        theirs = httpx.get(url + "/metrics")
    assert ours.status_code == 200
    assert ours.headers["content-type"].startswith("text/plain")
    assert "mmgate_inflight_requests" in ours.text
    assert theirs.json()["path"] == "/metrics"  # the upstream answered
    assert "/metrics" in app.state.paths()


def test_readyz_names_what_it_checked_with_expose_internal(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    """(The metrics listener's `/readyz` names it too: tests/gateway/test_operator_metrics.py.)"""
    _, upstream = stub
    with make_gateway(upstream, errors={"expose_internal": True}) as (_, url):
        internal = httpx.get(url + "/readyz").json()
    assert internal["upstream"] == f"{upstream}/health: 200"
