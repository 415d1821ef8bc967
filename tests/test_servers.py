"""tests/servers.py: a served process is the one listening on its port, even where another server took it first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests import servers
from tests.gateway.stub_upstream import StubUpstream
from tests.servers import ServerThread, served_process


def _other_server() -> Starlette:
    """Another run's server: it answers /healthz too."""
    return Starlette(routes=[Route("/healthz", lambda request: PlainTextResponse("other"))])


@pytest.fixture
def stub() -> Iterator[str]:
    with ServerThread(StubUpstream()) as server:
        yield server.url


@pytest.mark.slow
def test_a_port_taken_before_the_server_binds_it_is_given_up_for_another(
    stub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  drain_timeout_s: 1\n")
    with ServerThread(_other_server()) as taken:
        ports = iter([taken.port])
        real_free_port = servers.free_port
        monkeypatch.setattr(servers, "free_port", lambda: next(ports, None) or real_free_port())
        with served_process("gateway", config, "--upstream", stub) as served:
            assert served.url != taken.url
            assert servers._listens(served.process.pid, int(served.url.rsplit(":", 1)[1]))
            assert not servers._listens(served.process.pid, taken.port)
            assert httpx.get(taken.url + "/healthz").text == "other"
            response = httpx.post(served.url + "/v1/chat/completions", json={"model": "m", "messages": []})
            assert response.status_code == 200
