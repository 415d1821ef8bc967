"""The gateway's routing table (gateway/app.py): what it answers itself on each of its ports, and what goes upstream."""

from __future__ import annotations

import httpx

from tests.conftest import GatewayFactory
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread, free_port

OWN = ("/healthz", "/readyz", "/metrics")
OPENED = {"allowed_paths": list(OWN)}


def test_the_main_port_answers_get_and_head_of_its_own_paths_and_forwards_other_methods(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    app, upstream = stub
    with make_gateway(upstream, upstream=OPENED) as (_, url), httpx.Client() as client:
        for path in OWN:
            for method in ("GET", "HEAD"):
                assert client.request(method, url + path).status_code == 200, (method, path)
        assert not set(OWN) & set(app.state.paths())
        for path in OWN:
            for method in ("POST", "PUT", "DELETE", "OPTIONS"):
                echoed = client.request(method, url + path).json()  # the upstream's echo of what it received
                assert (echoed["method"], echoed["path"]) == (method, path)


def test_a_metrics_path_that_is_a_probe_path_leaves_the_main_port_its_probe_and_the_listener_its_metrics(
    stub: tuple[StubUpstream, str], make_gateway: GatewayFactory
) -> None:
    _, upstream = stub
    port = free_port()
    server = {"metrics_path": "/healthz", "metrics_port": port}
    with make_gateway(upstream, server=server) as (gateway, url), httpx.Client() as client:
        assert client.get(url + "/healthz").json() == {"status": "ok"}
        # The same app on the metrics port, as `server.metrics_port` serves it: it tells the ports apart by the scope.
        with ServerThread(gateway, bind=("127.0.0.1", port), lifespan="off") as listener:
            scraped = client.get(listener.url + "/healthz")
            assert "mmgate_requests_total" in scraped.text
            assert client.get(listener.url + "/readyz").json()["upstream"] == f"{upstream}/health: 200"
            refused = client.post(listener.url + "/healthz")
            assert refused.status_code == 404
            assert "serves only /healthz, /healthz and /readyz" in refused.text
            assert client.get(listener.url + "/metrics").status_code == 404
