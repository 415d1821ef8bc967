"""docker/k8s: every manifest parses; the gateway is the pod's only door (liveness and scrape on its metrics listener,
readiness and the Service's API on its main port, trtllm-serve on localhost); the ConfigMap's gateway YAML loads with
the real settings model; and the termination budget covers the preStop sleeps and the gateway's drain, with trtllm
outliving the drain."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from gateway import memory_fit
from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.deploy.common import CONFIGS, DOCKER, K8S, interpolate, load_yaml, load_yaml_documents
from tests.servers import free_port, served_process

_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(value: str) -> int:
    match = _QUANTITY.match(str(value))
    assert match, f"not a memory quantity: {value}"
    return int(float(match.group(1)) * _UNITS[match.group(2)])


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    """kind -> the one manifest of that kind."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in load_yaml_documents(path):
            assert {"apiVersion", "kind"} <= set(doc), f"{path.name}: {doc}"
            if doc["kind"] != "Kustomization":
                assert doc.get("metadata", {}).get("name"), f"{path.name}: unnamed {doc['kind']}"
            assert doc["kind"] not in found, f"two {doc['kind']} manifests"
            found[doc["kind"]] = doc
    assert set(found) == {"Deployment", "Service", "ServiceMonitor", "Kustomization"}
    found["ConfigMap"] = generated_configmap(K8S, found["Kustomization"])
    return found


def generated_configmap(directory: Path, kustomization: dict[str, Any]) -> dict[str, Any]:
    """The ConfigMap the kustomization's configMapGenerator makes (before kustomize adds the hash to its name)."""
    (generator,) = kustomization["configMapGenerator"]
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.partition("=")
        data[key] = (directory / (path or key)).read_text(encoding="utf-8")
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}


def ci() -> bool:
    return bool(os.environ.get("CI"))


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a directory (skipped without kubectl, unless CI is set)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if ci():
            pytest.fail("kubectl is needed in CI to render the kustomizations")
        pytest.skip("kubectl not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.fixture
def settings(
    manifests: dict[str, dict[str, Any]], tmp_path: Path, clean_mmgate_env: pytest.MonkeyPatch
) -> GatewaySettings:
    gateway = container(manifests, "gateway")
    for item in gateway.get("env", []):
        clean_mmgate_env.setenv(item["name"], item["value"])
    path = tmp_path / "gateway.yaml"
    path.write_text(manifests["ConfigMap"]["data"]["gateway.yaml"], encoding="utf-8")
    return load_settings(GatewaySettings, path)


def pod(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    spec = manifests["Deployment"]["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def container(manifests: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [item for item in pod(manifests)["containers"] if item["name"] == name]
    assert isinstance(found, dict)
    return found


def prestop_sleep_s(item: dict[str, Any]) -> int:
    command = item["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep", command
    return int(command[1])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def named_port(item: dict[str, Any], name: str) -> int:
    (port,) = [port["containerPort"] for port in item.get("ports", []) if port["name"] == name]
    return int(port)


def assert_gateway_probes(gateway: dict[str, Any], settings: GatewaySettings) -> None:
    """The gateway container's ports are its settings' two listeners; liveness probes the metrics listener (the
    http port answers 503 past server.max_connections: liveness must not depend on it), readiness the http port
    (the metrics listener serves /healthz and the metrics path only)."""
    assert named_port(gateway, "http") == settings.server.port
    assert settings.server.metrics_port is not None
    assert named_port(gateway, "metrics") == settings.server.metrics_port
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}


def test_kustomization_lists_the_manifests_that_need_no_crd(manifests: dict[str, dict[str, Any]]) -> None:
    resources = manifests["Kustomization"]["resources"]
    assert sorted(resources) == ["deployment.yaml", "service.yaml"]
    for resource in resources:
        assert (K8S / resource).is_file()


def test_configmap_gateway_yaml_loads_with_the_settings_model(settings: GatewaySettings) -> None:
    assert settings.server.host == "0.0.0.0"
    assert settings.media.processor == "qwen2_5_vl"
    assert settings.engine.url is None


def test_liveness_probes_the_metrics_listener_and_readiness_the_api_port(
    manifests: dict[str, dict[str, Any]], settings: GatewaySettings
) -> None:
    assert_gateway_probes(container(manifests, "gateway"), settings)


@pytest.mark.slow
def test_liveness_answers_while_clients_hold_every_api_connection(
    manifests: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The ConfigMap's gateway, run for real (on loopback, with the local budget and a small connection cap): with
    every connection of the http port held, the probes see what the kubelet would, liveness 200 on the metrics port
    and readiness refused on the http port."""
    path = tmp_path / "gateway.yaml"
    path.write_text(manifests["ConfigMap"]["data"]["gateway.yaml"], encoding="utf-8")
    metrics_port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    env |= {
        "MMGATE_SERVER__HOST": "127.0.0.1",
        "MMGATE_SERVER__METRICS_PORT": str(metrics_port),
        "MMGATE_SERVER__MAX_CONNECTIONS": "4",
        "MMGATE_LIMITS__BUDGET_BACKEND": "local",  # no Redis here
    }
    liveness = container(manifests, "gateway")["livenessProbe"]["httpGet"]
    with served_process("gateway", path, env=env) as gateway:
        host, port = gateway.url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(4)]
        try:
            time.sleep(0.2)
            readiness = httpx.get(gateway.url + "/readyz", timeout=5)
            alive = httpx.get(f"http://127.0.0.1:{metrics_port}{liveness['path']}", timeout=5)
        finally:
            for sock in held:
                sock.close()
    assert readiness.status_code == 503
    assert "too many connections" in readiness.text
    assert alive.status_code == 200


def test_trtllm_listens_on_localhost_only_where_the_gateway_forwards(
    manifests: dict[str, dict[str, Any]], settings: GatewaySettings
) -> None:
    trtllm = container(manifests, "trtllm")
    args = trtllm["args"]
    assert trtllm["command"] == ["trtllm-serve"]
    assert args[0] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert flag(args, "--host") == "127.0.0.1"
    assert "ports" not in trtllm
    upstream = urlsplit(str(settings.upstream.url))
    assert upstream.hostname == "127.0.0.1"
    assert upstream.port == int(flag(args, "--port"))
    for probe in ("startupProbe", "livenessProbe"):
        command = " ".join(trtllm[probe]["exec"]["command"])
        assert f"http://127.0.0.1:{upstream.port}{settings.upstream.ready_path}" in command, probe


def test_termination_covers_the_prestop_sleeps_and_the_drain(
    manifests: dict[str, dict[str, Any]], settings: GatewaySettings
) -> None:
    grace = pod(manifests)["terminationGracePeriodSeconds"]
    gateway_sleep = prestop_sleep_s(container(manifests, "gateway"))
    trtllm_sleep = prestop_sleep_s(container(manifests, "trtllm"))
    drain = settings.server.drain_timeout_s
    assert gateway_sleep > 0, "endpoints must be removed before the gateway stops accepting"
    assert grace > drain
    assert grace > gateway_sleep + drain, "the gateway is killed before its drain ends"
    # trtllm gets SIGTERM only after its own preStop: it must keep generating for the streams the gateway drains.
    assert trtllm_sleep >= gateway_sleep + drain
    assert grace > trtllm_sleep, "trtllm needs time to shut down after its preStop"


def test_resources_gpu_for_trtllm_and_memory_that_holds_what_the_gateways_bounds_admit(
    manifests: dict[str, dict[str, Any]], settings: GatewaySettings
) -> None:
    trtllm = container(manifests, "trtllm")["resources"]
    assert trtllm["limits"]["nvidia.com/gpu"] == trtllm["requests"]["nvidia.com/gpu"] == 1
    gateway = container(manifests, "gateway")["resources"]
    needed = memory_fit.required_bytes(settings)
    assert needed is not None
    assert quantity_bytes(gateway["requests"]["memory"]) >= needed
    assert quantity_bytes(gateway["limits"]["memory"]) >= quantity_bytes(gateway["requests"]["memory"])
    for name in ("gateway", "trtllm"):
        assert container(manifests, name)["resources"]["requests"]["cpu"], name


def test_gateway_runs_as_the_images_non_root_user(manifests: dict[str, dict[str, Any]]) -> None:
    context = container(manifests, "gateway")["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    user = re.search(r"^USER (\d+)", (DOCKER / "gateway.Dockerfile").read_text(encoding="utf-8"), re.MULTILINE)
    assert user is not None
    assert context["runAsUser"] == int(user.group(1))


def test_configmap_volumes_mount_the_keys_the_commands_read(manifests: dict[str, dict[str, Any]]) -> None:
    data = manifests["ConfigMap"]["data"]
    volumes = {volume["name"]: volume for volume in pod(manifests)["volumes"]}
    files: dict[str, str] = {}  # path in a container -> ConfigMap key
    for item in pod(manifests)["containers"]:
        for mount in item.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "configMap" in volume:
                assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
                for key in volume["configMap"]["items"]:
                    assert key["key"] in data, key
                    files[f"{mount['mountPath']}/{key['path']}"] = key["key"]
    assert files["/etc/mmgate/gateway.yaml"] == "gateway.yaml"  # the image's CMD reads this path
    trtllm_options = flag(container(manifests, "trtllm")["args"], "--extra_llm_api_options")
    assert files[trtllm_options] == "trtllm.yaml"
    # The same trtllm-serve options as compose.
    assert yaml.safe_load(data["trtllm.yaml"]) == load_yaml(CONFIGS / "compose-trtllm.yaml")


def test_service_exposes_the_gateway_port_only(manifests: dict[str, dict[str, Any]]) -> None:
    service = manifests["Service"]["spec"]
    labels = manifests["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    assert manifests["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"]: port for port in service["ports"]}
    assert set(ports) == {"http", "metrics"}
    assert all(port["targetPort"] == name for name, port in ports.items())


def test_prometheus_scrapes_the_gateway_and_trtllm_through_it(
    manifests: dict[str, dict[str, Any]], settings: GatewaySettings
) -> None:
    annotations = manifests["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    # With server.metrics_port set, the main port forwards the metrics path upstream: the scrape goes to the listener.
    assert int(annotations["prometheus.io/port"]) == settings.server.metrics_port
    assert annotations["prometheus.io/path"] == settings.server.metrics_path
    monitor = manifests["ServiceMonitor"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= manifests["Service"]["metadata"]["labels"].items()
    endpoints = {endpoint["path"]: endpoint for endpoint in monitor["endpoints"]}
    assert set(endpoints) == {settings.server.metrics_path, "/prometheus/metrics"}
    assert endpoints[settings.server.metrics_path]["port"] == "metrics"
    assert endpoints["/prometheus/metrics"]["port"] == "http", "trtllm's metrics, forwarded by the main port"
    jobs = set()
    for endpoint in endpoints.values():
        (relabel,) = endpoint["relabelings"]
        assert relabel["targetLabel"] == "job"
        jobs.add(relabel["replacement"])
    assert jobs == {"mmgate-gateway", "trtllm"}, "the job names configs/prometheus.yml uses"
    # trtllm only serves /prometheus/metrics with return_perf_metrics on, and its queue and KV-cache gauges with
    # enable_iter_perf_stats beside it; the path is no public API, so the gateway opens it.
    options = yaml.safe_load(manifests["ConfigMap"]["data"]["trtllm.yaml"])
    assert options["return_perf_metrics"] is True
    assert options["enable_iter_perf_stats"] is True
    assert "/prometheus/metrics" in settings.upstream.allowed_paths


def test_trtllm_image_matches_compose(manifests: dict[str, dict[str, Any]]) -> None:
    compose = interpolate(load_yaml(DOCKER / "compose.yaml"))
    assert container(manifests, "trtllm")["image"] == compose["services"]["trtllm"]["image"]


def test_each_pods_gateway_protects_its_own_trtllm(settings: GatewaySettings) -> None:
    """One pod, one GPU, one trtllm-serve, one gateway: the local budget, so no Redis and no key shared by pods."""
    assert settings.limits.budget_backend.value == "local"
    assert not list(K8S.glob("redis*.yaml"))


KUSTOMIZATIONS = [K8S, K8S / "vllm", K8S / "vllm-proxy"]
KUSTOMIZATION_IDS = ["trtllm", "vllm", "vllm-proxy"]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_config_is_generated_so_a_change_rolls_the_pod(directory: Path, tmp_path: Path) -> None:
    for path in directory.glob("*.yaml"):
        kinds = {doc["kind"] for doc in load_yaml_documents(path)}
        assert "ConfigMap" not in kinds, f"{path.name}: a plain ConfigMap does not roll the pod when it changes"
    kustomization = load_yaml(directory / "kustomization.yaml")
    name = generated_configmap(directory, kustomization)["metadata"]["name"]
    assert kustomization.get("generatorOptions", {}).get("disableNameSuffixHash") is not True

    def configmap_names(docs: list[dict[str, Any]]) -> tuple[str, set[str]]:
        (configmap,) = [doc for doc in docs if doc["kind"] == "ConfigMap"]
        referenced = {
            volume["configMap"]["name"]
            for doc in docs
            if doc["kind"] == "Deployment"
            for volume in doc["spec"]["template"]["spec"].get("volumes", [])
            if "configMap" in volume
        }
        return configmap["metadata"]["name"], referenced

    before, referenced = configmap_names(kustomize_build(directory))
    assert before.startswith(f"{name}-")
    assert referenced == {before}
    copy = tmp_path / "k"
    shutil.copytree(directory, copy)
    gateway_yaml = copy / "config" / "gateway.yaml"
    gateway_yaml.write_text(gateway_yaml.read_text(encoding="utf-8") + "# changed\n", encoding="utf-8")
    after, referenced = configmap_names(kustomize_build(copy))
    assert after != before, "a changed config must change the pod template"
    assert referenced == {after}


def pod_specs(directory: Path) -> list[dict[str, Any]]:
    return [
        doc["spec"]["template"]["spec"]
        for path in sorted(directory.glob("*.yaml"))
        for doc in load_yaml_documents(path)
        if doc["kind"] == "Deployment"
    ]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_images_come_from_a_registry_and_the_kustomization_overrides_them(directory: Path) -> None:
    overrides = {entry["name"]: entry for entry in load_yaml(directory / "kustomization.yaml")["images"]}
    for spec in pod_specs(directory):
        for item in spec.get("initContainers", []) + spec["containers"]:
            image, _, tag = item["image"].rpartition(":")
            assert image in overrides, f"{item['name']}: {image} has no images: entry"
            assert overrides[image]["newTag"] == tag, item["name"]
            if item["name"] in ("gateway", "engine"):
                registry = image.split("/")[0]
                assert "." in registry or ":" in registry, f"{item['name']}: {image} names no registry"
                assert "newName" in overrides[image], "mmgate's own images need the registry set"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_every_pod_uses_the_runtime_default_seccomp_profile(directory: Path) -> None:
    specs = pod_specs(directory)
    assert specs
    for spec in specs:
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize(
    ("directory", "name"),
    [(K8S, "trtllm"), (K8S / "vllm", "vllm"), (K8S / "vllm-proxy", "vllm")],
    ids=KUSTOMIZATION_IDS,
)
def test_the_llm_server_runs_without_capabilities_or_privilege_escalation(directory: Path, name: str) -> None:
    (spec,) = [spec for spec in pod_specs(directory) if any(c["name"] == name for c in spec["containers"])]
    (item,) = [c for c in spec["containers"] if c["name"] == name]
    context = item["securityContext"]
    assert context["allowPrivilegeEscalation"] is False
    assert context.get("privileged", False) is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context.get("runAsUser") != 0


def test_trtllm_runs_the_pytorch_backend(manifests: dict[str, dict[str, Any]]) -> None:
    assert flag(container(manifests, "trtllm")["args"], "--backend") == "pytorch"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=KUSTOMIZATION_IDS)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(directory: Path) -> None:
    try:
        import kubernetes_validate  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        if ci():
            pytest.fail("kubernetes-validate is needed in CI")
        pytest.skip("kubernetes-validate not installed")
    docs = kustomize_build(directory)
    docs += [doc for path in directory.glob("servicemonitor.yaml") for doc in load_yaml_documents(path)]
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            continue  # a CRD: no schema in kubernetes-validate
        kubernetes_validate.validate(doc, "1.32", strict=True)
