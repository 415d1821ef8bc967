"""docker/k8s/vllm: the engine on a GPU handing off to vLLM, the gateway in engine mode as the pod's only door (the
Kubernetes form of docker/compose.yaml's vllm profile). One manifest of each kind; the generated configs load with the
real settings models and agree with each other and with vLLM's arguments; the gateway, vLLM and the engine are all
scraped, the engine through a relay that serves its /metrics and nothing else."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pytest

from engine_adapter.config import EngineSettings
from gateway import memory_fit
from gateway.config import GatewaySettings
from serving.settings_loader import LayeredSettings, load_settings
from tests.deploy.common import CONFIGS, DOCKER, K8S, interpolate, load_yaml, load_yaml_documents
from tests.deploy.test_k8s import (
    assert_gateway_probes,
    container,
    flag,
    generated_configmap,
    named_port,
    pod,
    prestop_sleep_s,
    quantity_bytes,
)
from tests.servers import free_port

VLLM_DIR = K8S / "vllm"
SettingsT = TypeVar("SettingsT", bound=LayeredSettings)


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(VLLM_DIR.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            assert {"apiVersion", "kind"} <= set(doc), f"{path.name}: {doc}"
            assert doc["kind"] not in found, f"two {doc['kind']} manifests"
            found[doc["kind"]] = doc
    assert set(found) == {"Deployment", "Service", "ServiceMonitor", "Kustomization"}
    assert sorted(found["Kustomization"]["resources"]) == ["deployment.yaml", "service.yaml"]
    found["ConfigMap"] = generated_configmap(VLLM_DIR, found["Kustomization"])
    return found


def env_of(item: dict[str, Any]) -> dict[str, str]:
    return {entry["name"]: entry["value"] for entry in item.get("env", []) if "value" in entry}


def config_file(manifests: dict[str, dict[str, Any]], item: dict[str, Any], path: str) -> str:
    """The ConfigMap key mounted at `path` in the container."""
    volumes = {v["name"]: v for v in pod(manifests)["volumes"]}
    (mount,) = [m for m in item["volumeMounts"] if m["mountPath"] == path]
    assert volumes[mount["name"]]["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    key = mount["subPath"]
    assert isinstance(key, str)
    return key


def container_settings(
    manifests: dict[str, dict[str, Any]],
    name: str,
    settings: type[SettingsT],
    directory: Path,
    env: pytest.MonkeyPatch,
) -> SettingsT:
    """The settings container `name` runs with: its env, and the ConfigMap key mounted where its image's command
    reads its config (/etc/mmgate/<name>.yaml)."""
    item = container(manifests, name)
    for variable, value in env_of(item).items():
        env.setenv(variable, value)
    path = directory / f"{name}.yaml"
    key = config_file(manifests, item, f"/etc/mmgate/{name}.yaml")
    path.write_text(manifests["ConfigMap"]["data"][key], encoding="utf-8")
    return load_settings(settings, path)


@pytest.fixture
def gateway(
    manifests: dict[str, dict[str, Any]], tmp_path: Path, clean_mmgate_env: pytest.MonkeyPatch
) -> GatewaySettings:
    return container_settings(manifests, "gateway", GatewaySettings, tmp_path, clean_mmgate_env)


@pytest.fixture
def engine(
    manifests: dict[str, dict[str, Any]], tmp_path: Path, clean_mmgate_env: pytest.MonkeyPatch
) -> EngineSettings:
    # The image sets MMGATE_ENGINE_SERVER__HOST=0.0.0.0 (docker/engine.Dockerfile); the container's env replaces it.
    clean_mmgate_env.setenv("MMGATE_ENGINE_SERVER__HOST", "0.0.0.0")
    return container_settings(manifests, "engine", EngineSettings, tmp_path, clean_mmgate_env)


def test_gateway_is_the_only_door(manifests: dict[str, dict[str, Any]], gateway: GatewaySettings) -> None:
    assert_gateway_probes(container(manifests, "gateway"), gateway)
    # The scrape goes to the metrics listener.
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == gateway.server.metrics_port
    for name in ("engine", "vllm"):
        assert "ports" not in container(manifests, name), name
    service = manifests["Service"]["spec"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    ports = {port["name"]: port for port in service["ports"]}
    # Besides the gateway's two ports, only the relay that answers GET /metrics alone.
    assert set(ports) == {"http", "metrics", "engine-metrics"}
    assert all(port["targetPort"] == name for name, port in ports.items())
    assert named_port(container(manifests, "engine-metrics"), "engine-metrics") == ports["engine-metrics"]["port"]
    # The trtllm example's Service must not select this pod.
    trtllm_service = load_yaml(K8S / "service.yaml")
    assert not trtllm_service["spec"]["selector"].items() <= labels.items()
    assert manifests["Service"]["metadata"]["name"] != trtllm_service["metadata"]["name"]


def test_gateway_runs_in_engine_mode_against_the_engine_on_localhost(
    gateway: GatewaySettings, engine: EngineSettings
) -> None:
    assert gateway.engine.url is not None
    url = urlsplit(str(gateway.engine.url))
    assert (url.hostname, url.port) == ("127.0.0.1", engine.server.port)
    assert engine.server.host == "127.0.0.1", "only the gateway reaches the engine"
    assert gateway.media.processor == "qwen2_5_vl"
    per_request = gateway.limits.max_multimodal_cpu_bytes_per_request
    assert per_request is not None
    assert engine.server.max_request_body_bytes >= per_request


def test_engine_on_a_gpu_hands_off_to_vllm_with_the_flags_its_parser_needs(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings, engine: EngineSettings
) -> None:
    vllm = container(manifests, "vllm")
    args = vllm["args"]
    assert "--enable-mm-embeds" in args
    assert flag(args, "--limit-mm-per-prompt") == '{"image": 0, "video": 0}'
    assert flag(args, "--host") == "127.0.0.1"
    vllm_port = int(flag(args, "--port"))
    assert engine.handoff.backend.value == "openai"
    assert engine.handoff.format.value == "vllm"
    handoff = urlsplit(engine.handoff.base_url)
    assert (handoff.hostname, handoff.port) == ("127.0.0.1", vllm_port)
    upstream = urlsplit(str(gateway.upstream.url))
    assert (upstream.hostname, upstream.port) == ("127.0.0.1", vllm_port)
    assert gateway.upstream.ready_path == "/health"
    assert engine.model.device == "cuda"
    assert engine.model.checkpoint == args[0], "the engine's tower reads the checkpoint vLLM serves"
    assert engine.handoff.expected_hidden_size == 3584
    for name in ("engine", "vllm"):
        resources = container(manifests, name)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1, name
    # The same image, flags and engine settings as compose's vllm profile.
    compose = interpolate(load_yaml(DOCKER / "compose.yaml"))["services"]
    assert vllm["image"] == compose["vllm"]["image"]
    assert [a for a in compose["vllm"]["command"] if a.startswith("--")] == [a for a in args if a.startswith("--")]
    compose_env = compose["engine-gpu"]["environment"]
    assert engine.model.preset == compose_env["MMGATE_ENGINE_MODEL__PRESET"]
    assert str(engine.handoff.expected_hidden_size) == compose_env["MMGATE_ENGINE_HANDOFF__EXPECTED_HIDDEN_SIZE"]


def test_termination_lets_the_engine_and_vllm_outlive_the_gateway_drain(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings, engine: EngineSettings
) -> None:
    grace = manifests["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    gateway_sleep = prestop_sleep_s(container(manifests, "gateway"))
    drain = gateway.server.drain_timeout_s
    assert gateway_sleep > 0
    assert grace > gateway_sleep + drain
    for name in ("engine", "vllm"):
        assert prestop_sleep_s(container(manifests, name)) >= gateway_sleep + drain, name
    assert grace > prestop_sleep_s(container(manifests, "engine")) + engine.server.drain_timeout_s


def test_gateway_memory_holds_what_its_bounds_admit_and_runs_non_root(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings
) -> None:
    resources = container(manifests, "gateway")["resources"]
    needed = memory_fit.required_bytes(gateway)
    assert needed is not None
    assert quantity_bytes(resources["requests"]["memory"]) >= needed
    assert quantity_bytes(resources["limits"]["memory"]) >= needed, "the gateway would refuse to start"
    assert gateway.limits.budget_backend.value == "local", "each pod's gateway protects its own pod"
    for name in ("gateway", "engine"):
        context = container(manifests, name)["securityContext"]
        assert context["runAsNonRoot"] is True, name
        assert context["runAsUser"] == 10001, name  # USER 10001 in both Dockerfiles
        assert context["capabilities"]["drop"] == ["ALL"], name


RELAY = VLLM_DIR / "config" / "metrics-relay.py"


def relay_args(manifests: dict[str, dict[str, Any]]) -> tuple[str, int, str]:
    """The relay container's script (as mounted), listen port and target."""
    command = container(manifests, "engine-metrics")["command"]
    assert command[0] == "python"
    return command[1], int(flag(command, "--port")), flag(command, "--target")


def test_prometheus_scrapes_the_gateway_vllm_and_the_engine(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings, engine: EngineSettings
) -> None:
    monitor = manifests["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= manifests["Service"]["metadata"]["labels"].items()
    service_ports = {port["name"] for port in manifests["Service"]["spec"]["ports"]}
    jobs: dict[str, tuple[str, str]] = {}
    for endpoint in monitor["endpoints"]:
        assert endpoint["port"] in service_ports, endpoint
        (relabel,) = endpoint["relabelings"]
        assert relabel["targetLabel"] == "job"
        jobs[relabel["replacement"]] = (endpoint["port"], endpoint["path"])
    # The job names configs/prometheus.yml scrapes under and configs/alerts.yml's down alerts watch.
    assert set(jobs) == {"mmgate-gateway", "vllm", "mmgate-engine"}
    assert set(jobs) <= {job["job_name"] for job in load_yaml(CONFIGS / "prometheus.yml")["scrape_configs"]}
    assert jobs["mmgate-gateway"] == ("metrics", gateway.server.metrics_path)
    # With server.metrics_port set the http port forwards the metrics path to the upstream: vLLM's /metrics.
    assert gateway.server.metrics_port is not None
    assert jobs["vllm"] == ("http", "/metrics")
    assert gateway.server.metrics_path == "/metrics"
    assert "/metrics" in gateway.upstream.allowed_paths, "vLLM's /metrics is no public API: opened"
    assert "/metrics" not in gateway.upstream.blocked_paths
    assert jobs["mmgate-engine"] == ("engine-metrics", "/metrics")
    script, port, target = relay_args(manifests)
    assert named_port(container(manifests, "engine-metrics"), "engine-metrics") == port
    url = urlsplit(target)
    assert (url.hostname, url.port, url.path) == ("127.0.0.1", engine.server.port, "/metrics")
    assert engine.server.auth_token is None, "the relay sends no token"
    mounts = {m["mountPath"]: m for m in container(manifests, "engine-metrics")["volumeMounts"]}
    assert manifests["ConfigMap"]["data"][mounts[script]["subPath"]] == RELAY.read_text(encoding="utf-8")


class _Engine(BaseHTTPRequestHandler):
    """What the engine answers: its metrics, and an internal API path the relay must not reach."""

    def do_GET(self) -> None:
        body = {"/metrics": b"mmgate_engine_queued_requests 0\n", "/internal/v1/status": b"{}"}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def relay_to(target: str) -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, str(RELAY), "--host", "127.0.0.1", "--port", str(port), "--target", target, "--timeout-s", "2"]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None, "the relay exited"
                threading.Event().wait(0.05)
        yield url
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0, "SIGTERM stops the relay"


def test_the_relay_serves_the_engines_metrics_and_nothing_else() -> None:
    engine = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{engine.server_address[1]}"
    try:
        with relay_to(base + "/metrics") as relay:
            metrics = httpx.get(relay + "/metrics", timeout=5)
            assert metrics.status_code == 200
            assert metrics.text == "mmgate_engine_queued_requests 0\n"
            assert metrics.headers["content-type"] == "text/plain; version=0.0.4"
            assert httpx.head(relay + "/metrics", timeout=5).status_code == 200
            for path in ("/internal/v1/status", "/internal/v1/requests", "/metrics/../internal/v1/status"):
                assert httpx.get(relay + path, timeout=5).status_code == 404, path
            assert httpx.post(relay + "/metrics", content=b"x", timeout=5).status_code == 501
    finally:
        engine.shutdown()
        engine.server_close()
    # The engine gone: 502, so the scrape fails and `up` is 0.
    with relay_to(base + "/metrics") as relay:
        assert httpx.get(relay + "/metrics", timeout=10).status_code == 502
