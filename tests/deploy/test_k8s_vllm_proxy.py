"""docker/k8s/vllm-proxy: vLLM serving Qwen2.5-VL on localhost, loading images itself, with the gateway in proxy mode
as the pod's only door (the Kubernetes form of docker/compose.yaml's vllm-proxy profile). One manifest of each kind;
the generated config loads with the real settings model and is configs/vllm-proxy.yaml with the pod's address; the
gateway and vLLM are both scraped."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from gateway import memory_fit
from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.deploy.common import CONFIGS, DOCKER, K8S, interpolate, load_yaml, load_yaml_documents
from tests.deploy.test_k8s import (
    assert_gateway_probes,
    container,
    flag,
    generated_configmap,
    pod,
    prestop_sleep_s,
    quantity_bytes,
)
from tests.deploy.test_k8s_vllm import container_settings

PROXY_DIR = K8S / "vllm-proxy"


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(PROXY_DIR.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            assert {"apiVersion", "kind"} <= set(doc), f"{path.name}: {doc}"
            assert doc["kind"] not in found, f"two {doc['kind']} manifests"
            found[doc["kind"]] = doc
    assert set(found) == {"Deployment", "Service", "ServiceMonitor", "Kustomization"}
    assert sorted(found["Kustomization"]["resources"]) == ["deployment.yaml", "service.yaml"]
    found["ConfigMap"] = generated_configmap(PROXY_DIR, found["Kustomization"])
    return found


@pytest.fixture
def gateway(
    manifests: dict[str, dict[str, Any]], tmp_path: Path, clean_mmgate_env: pytest.MonkeyPatch
) -> GatewaySettings:
    return container_settings(manifests, "gateway", GatewaySettings, tmp_path, clean_mmgate_env)


def test_the_pod_is_vllm_and_the_gateway_without_an_engine(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings
) -> None:
    assert [item["name"] for item in pod(manifests)["containers"]] == ["gateway", "vllm"]
    assert gateway.engine.url is None, "proxy mode"
    assert gateway.media.processor == "qwen2_5_vl"


def test_gateway_is_the_only_door(manifests: dict[str, dict[str, Any]], gateway: GatewaySettings) -> None:
    assert_gateway_probes(container(manifests, "gateway"), gateway)
    assert "ports" not in container(manifests, "vllm")
    service = manifests["Service"]["spec"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    assert manifests["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"]: port for port in service["ports"]}
    assert set(ports) == {"http", "metrics"}
    assert all(port["targetPort"] == name for name, port in ports.items())
    # Neither of the other examples' Services selects this pod, nor this Service theirs.
    for other in (K8S / "service.yaml", K8S / "vllm" / "service.yaml"):
        theirs = load_yaml(other)
        assert not theirs["spec"]["selector"].items() <= labels.items(), other
        assert theirs["metadata"]["name"] != manifests["Service"]["metadata"]["name"], other
        (deployment,) = [d for d in load_yaml_documents(other.parent / "deployment.yaml") if d["kind"] == "Deployment"]
        assert not service["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items(), other


def test_gateway_forwards_to_vllm_on_localhost(manifests: dict[str, dict[str, Any]], gateway: GatewaySettings) -> None:
    vllm = container(manifests, "vllm")
    args = vllm["args"]
    assert args[0] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert flag(args, "--host") == "127.0.0.1"
    upstream = urlsplit(str(gateway.upstream.url))
    assert (upstream.hostname, upstream.port) == ("127.0.0.1", int(flag(args, "--port")))
    assert str(gateway.upstream.url) == str(GatewaySettings().upstream.url), "the default upstream.url"
    assert gateway.upstream.ready_path == "/health"
    for probe in ("startupProbe", "livenessProbe"):
        command = " ".join(vllm[probe]["exec"]["command"])
        assert f"http://127.0.0.1:{upstream.port}{gateway.upstream.ready_path}" in command, probe
    # vLLM loads the images itself: none of engine mode's embeds-only flags.
    assert "--enable-mm-embeds" not in args
    assert "--limit-mm-per-prompt" not in args
    resources = vllm["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
    # The same image and flags as compose's vllm-proxy profile.
    compose = interpolate(load_yaml(DOCKER / "compose.yaml"))["services"]["vllm-vision"]
    assert vllm["image"] == compose["image"]
    assert [a for a in compose["command"] if a.startswith("--")] == [a for a in args if a.startswith("--")]


def test_the_config_is_configs_vllm_proxy_yaml_with_the_pods_address(
    gateway: GatewaySettings, clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    documented = load_settings(GatewaySettings, CONFIGS / "vllm-proxy.yaml")
    assert gateway.server.host == "0.0.0.0"
    assert gateway.model_dump(exclude={"server": {"host", "log_level"}}) == documented.model_dump(
        exclude={"server": {"host", "log_level"}}
    )


def test_prometheus_scrapes_the_gateway_and_vllm_through_it(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings
) -> None:
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == gateway.server.metrics_port
    assert annotations["prometheus.io/path"] == gateway.server.metrics_path
    monitor = manifests["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= manifests["Service"]["metadata"]["labels"].items()
    jobs: dict[str, tuple[str, str]] = {}
    for endpoint in monitor["endpoints"]:
        (relabel,) = endpoint["relabelings"]
        assert relabel["targetLabel"] == "job"
        jobs[relabel["replacement"]] = (endpoint["port"], endpoint["path"])
    assert jobs == {"mmgate-gateway": ("metrics", gateway.server.metrics_path), "vllm": ("http", "/metrics")}
    assert set(jobs) <= {job["job_name"] for job in load_yaml(CONFIGS / "prometheus.yml")["scrape_configs"]}
    # The http port forwards /metrics to vLLM only while the gateway's own metrics are on their listener.
    assert gateway.server.metrics_port is not None
    assert "/metrics" in gateway.upstream.allowed_paths, "vLLM's /metrics is no public API: opened"
    assert not any("/metrics".startswith(path) for path in gateway.upstream.blocked_paths)


def test_termination_lets_vllm_outlive_the_gateway_drain(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings
) -> None:
    grace = pod(manifests)["terminationGracePeriodSeconds"]
    gateway_sleep = prestop_sleep_s(container(manifests, "gateway"))
    vllm_sleep = prestop_sleep_s(container(manifests, "vllm"))
    drain = gateway.server.drain_timeout_s
    assert gateway_sleep > 0
    assert grace > gateway_sleep + drain
    assert vllm_sleep >= gateway_sleep + drain
    assert grace > vllm_sleep


def test_gateway_memory_holds_what_its_bounds_admit_and_runs_non_root(
    manifests: dict[str, dict[str, Any]], gateway: GatewaySettings
) -> None:
    resources = container(manifests, "gateway")["resources"]
    needed = memory_fit.required_bytes(gateway)
    assert needed is not None
    assert quantity_bytes(resources["requests"]["memory"]) >= needed
    assert quantity_bytes(resources["limits"]["memory"]) >= quantity_bytes(resources["requests"]["memory"])
    assert gateway.limits.budget_backend.value == "local", "each pod's gateway protects its own vLLM"
    context = container(manifests, "gateway")["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == 10001  # USER 10001 in docker/gateway.Dockerfile
    assert context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"]
