"""docker/compose.yaml: parses, every file it mounts or builds from exists, the gateway and engine configs it mounts
load with the real settings models and point at the services that exist, trtllm reserves a GPU, and the cpu profile
runs without one. Variables are read with their defaults, as `docker compose` does on a bare machine."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from engine_adapter.config import EngineSettings
from engine_adapter.models.presets import PRESETS
from gateway import memory_fit
from gateway.config import GatewaySettings
from serving.settings_loader import PROCESS_ENV_PREFIXES, load_settings
from tests.deploy.common import (
    CONFIGS,
    DOCKER,
    REPO,
    compose_variables,
    interpolate,
    load_healthcheck,
    load_yaml,
    promtool,
    required_compose_variables,
    run_promtool,
)

COMPOSE_FILE = DOCKER / "compose.yaml"
GATEWAY_CONFIG = "/etc/mmgate/gateway.yaml"
ENGINE_CONFIG = "/etc/mmgate/engine.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = interpolate(load_yaml(COMPOSE_FILE))
    assert isinstance(data, dict)
    return data


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    assert name in compose["services"], f"no service {name}"
    return compose["services"][name]


def volume_specs(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each short-syntax volume."""
    specs = []
    for volume in svc.get("volumes", []):
        assert isinstance(volume, str), f"long-syntax volume not handled: {volume}"
        source, target, *_ = volume.split(":")
        specs.append((source, target))
    return specs


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def mounted_file(svc: dict[str, Any], target: str) -> Path:
    sources = [source for source, mount in volume_specs(svc) if mount == target]
    assert len(sources) == 1, f"{target} mounted {len(sources)} times"
    assert is_bind(sources[0])
    return (DOCKER / sources[0]).resolve()


def container_port(svc: dict[str, Any]) -> int:
    (published,) = svc["ports"]
    return int(str(published).rsplit(":", 1)[1])


def stop_grace_s(svc: dict[str, Any]) -> float:
    match = re.fullmatch(r"(\d+)s", svc["stop_grace_period"])
    assert match, svc["stop_grace_period"]
    return float(match.group(1))


def gateway_settings(svc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    """The settings the gateway container starts with: the mounted YAML plus the service's MMGATE_* environment."""
    for name, value in (svc.get("environment") or {}).items():
        monkeypatch.setenv(name, str(value))
    return load_settings(GatewaySettings, mounted_file(svc, GATEWAY_CONFIG))


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_bind_mount_and_build_input_exists(compose: dict[str, Any]) -> None:
    named = set(compose.get("volumes", {}))
    for name, svc in compose["services"].items():
        for source, _ in volume_specs(svc):
            if is_bind(source):
                assert (DOCKER / source).resolve().exists(), f"{name}: {source} does not exist"
                assert (DOCKER / source).resolve().is_relative_to(REPO), f"{name}: {source} is outside the repository"
            else:
                assert source in named, f"{name}: named volume {source} is not declared"
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert context == REPO, f"{name}: the images build from the repository root"
            assert (context / svc["build"]["dockerfile"]).is_file(), name


def test_every_variable_is_explained_in_the_header() -> None:
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    header = text[: text.index("\nservices:")]
    for name in compose_variables(text):
        assert re.search(rf"^#\s+{name}\s", header, re.MULTILINE), f"${{{name}}} is not explained in the header"


def test_no_compose_variable_is_in_a_process_settings_namespace() -> None:
    """The shell that runs compose may run a gateway or an engine too, which would read an MMGATE_* variable as a
    setting and refuse one that names no key."""
    names = compose_variables(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert names, "the compose file reads variables"
    assert not [name for name in names if any(name.startswith(prefix) for prefix in PROCESS_ENV_PREFIXES)]


def test_every_image_is_pinned_by_tag(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        image = svc["image"]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
        assert tag, f"{name}: {image} has no tag"
        assert tag != "latest", f"{name}: {image}"


def test_profiles_split_the_gpu_stack_from_the_cpu_stack(compose: dict[str, Any]) -> None:
    profiles = {name: tuple(svc.get("profiles", ())) for name, svc in compose["services"].items()}
    assert profiles == {
        "trtllm": ("gpu",),
        "gateway": ("gpu",),
        "gateway-2": ("gpu",),
        "redis": ("gpu",),
        "engine": ("cpu",),
        "gateway-cpu": ("cpu",),
        "model-download": ("vllm",),
        "vllm": ("vllm",),
        "engine-gpu": ("vllm",),
        "gateway-vllm": ("vllm",),
        "vllm-vision": ("vllm-proxy",),
        "gateway-vllm-proxy": ("vllm-proxy",),
        "prometheus": (),
        "grafana": (),
    }
    # `--profile cpu` must start nothing that reserves a GPU.
    for name, svc in compose["services"].items():
        if "cpu" in profiles[name] or not profiles[name]:
            assert "reservations" not in svc.get("deploy", {}).get("resources", {}), f"{name} would need a GPU"


def test_trtllm_reserves_a_gpu_and_serves_qwen2_5_vl_on_8001(compose: dict[str, Any]) -> None:
    trtllm = service(compose, "trtllm")
    assert re.fullmatch(r"nvcr\.io/nvidia/tensorrt-llm/release:\d+\.\d+\.\d+\S*", trtllm["image"])
    devices = trtllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)
    command = trtllm["command"]
    assert command[:2] == ["trtllm-serve", "Qwen/Qwen2.5-VL-7B-Instruct"]
    assert flag(command, "--host") == "0.0.0.0"
    assert flag(command, "--port") == "8001"
    assert "ports" not in trtllm, "clients must go through the gateway"
    options = load_yaml(mounted_file(trtllm, flag(command, "--extra_llm_api_options")))
    assert options["return_perf_metrics"] is True, "serves /prometheus/metrics, which Prometheus scrapes"
    assert options["kv_cache_config"]["enable_block_reuse"] is False


def test_gpu_gateway_forwards_to_trtllm(compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch) -> None:
    gateway = service(compose, "gateway")
    settings = gateway_settings(gateway, clean_mmgate_env)
    trtllm_command = service(compose, "trtllm")["command"]
    upstream = urlsplit(str(settings.upstream.url))
    assert upstream.hostname == "trtllm"
    assert upstream.port == int(flag(trtllm_command, "--port"))
    assert settings.upstream.ready_path == "/health"
    assert settings.media.processor == "qwen2_5_vl", "the model is Qwen2.5-VL"
    assert settings.engine.url is None
    assert settings.limits.max_multimodal_cpu_bytes_per_request == 512 << 20  # from the service's environment


def test_cpu_gateway_runs_in_engine_mode(compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch) -> None:
    gateway = service(compose, "gateway-cpu")
    settings = gateway_settings(gateway, clean_mmgate_env)
    engine = load_settings(EngineSettings, mounted_file(service(compose, "engine"), ENGINE_CONFIG))
    assert settings.engine.url is not None
    engine_url = urlsplit(str(settings.engine.url))
    assert engine_url.hostname == "engine"
    assert engine_url.port == engine.server.port
    # The gateway resizes for the geometry the engine's tower expects.
    assert settings.media.processor == PRESETS[engine.model.preset].geometry_name
    assert gateway["depends_on"]["engine"]["condition"] == "service_healthy"


def test_cpu_engine_is_the_embedded_default_stack(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    engine_svc = service(compose, "engine")
    engine = load_settings(EngineSettings, mounted_file(engine_svc, ENGINE_CONFIG))
    assert engine.model.preset == "tiny"
    assert engine.model.device == "cpu"
    assert engine.handoff.backend.value == "reference"
    assert "ports" not in engine_svc, "the engine's internal API is never published"
    assert engine_svc["expose"] == [str(engine.server.port)]
    cpu_gateway = gateway_settings(service(compose, "gateway-cpu"), clean_mmgate_env)
    per_request = cpu_gateway.limits.max_multimodal_cpu_bytes_per_request
    assert per_request is not None
    assert engine.server.max_request_body_bytes >= per_request, "a request the gateway admits fits one engine submit"


@pytest.mark.parametrize("name", ["gateway", "gateway-2", "gateway-vllm-proxy", "gateway-cpu"])
def test_gateways_listen_where_compose_publishes_and_drain_before_compose_kills(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch, name: str
) -> None:
    gateway = service(compose, name)
    settings = gateway_settings(gateway, clean_mmgate_env)
    assert container_port(gateway) == settings.server.port
    assert settings.server.host == "0.0.0.0"
    assert stop_grace_s(gateway) > settings.server.drain_timeout_s
    assert gateway["build"]["dockerfile"] == "docker/gateway.Dockerfile"


def test_trtllm_and_engine_outlive_the_gateway_drain(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    drain = gateway_settings(service(compose, "gateway"), clean_mmgate_env).server.drain_timeout_s
    assert stop_grace_s(service(compose, "trtllm")) > drain
    engine = load_settings(EngineSettings, mounted_file(service(compose, "engine"), ENGINE_CONFIG))
    assert stop_grace_s(service(compose, "engine")) > engine.server.drain_timeout_s


# Every service that serves Prometheus metrics, with the port and path it serves them on.
METRICS_SERVICES = {
    "gateway": (9100, "/metrics"),
    "gateway-2": (9100, "/metrics"),
    "gateway-vllm": (9100, "/metrics"),
    "gateway-vllm-proxy": (9100, "/metrics"),
    "gateway-cpu": (9100, "/metrics"),
    "engine": (8100, "/metrics"),
    "engine-gpu": (8100, "/metrics"),
    "trtllm": (8001, "/prometheus/metrics"),
    "vllm": (8001, "/metrics"),
    "vllm-vision": (8001, "/metrics"),
}
GATEWAYS = ["gateway", "gateway-2", "gateway-vllm", "gateway-vllm-proxy", "gateway-cpu"]


@pytest.mark.parametrize("name", GATEWAYS)
def test_gateways_serve_health_and_metrics_on_a_listener_of_their_own(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch, name: str
) -> None:
    """The API port answers 503 past server.max_connections: the image's HEALTHCHECK and the scrape use the metrics
    listener, which serves /healthz and the metrics path."""
    gateway = service(compose, name)
    settings = gateway_settings(gateway, clean_mmgate_env)
    assert settings.server.metrics_port is not None
    assert METRICS_SERVICES[name] == (settings.server.metrics_port, settings.server.metrics_path)
    environ = {key: str(value) for key, value in (gateway.get("environment") or {}).items()}
    config = str(mounted_file(gateway, GATEWAY_CONFIG))
    probed = load_healthcheck().probe_port(config, "MMGATE_", settings.server.port, "/healthz", environ)
    assert probed == settings.server.metrics_port
    assert all(not spec.endswith(f":{settings.server.metrics_port}") for spec in gateway["ports"]), "not published"


def test_prometheus_discovers_the_running_profiles_services_only(compose: dict[str, Any]) -> None:
    """A static target of a profiled service is down whenever another profile runs; DNS discovery of the compose
    service names gives a target only for the containers that exist."""
    prometheus = service(compose, "prometheus")
    config_path = mounted_file(prometheus, "/etc/prometheus/prometheus.yml")
    assert config_path == (CONFIGS / "prometheus.yml").resolve()
    assert mounted_file(prometheus, "/etc/prometheus/alerts.yml") == (CONFIGS / "alerts.yml").resolve()
    discovered: dict[str, tuple[int, str]] = {}
    for job in load_yaml(config_path)["scrape_configs"]:
        assert "static_configs" not in job, f"{job['job_name']}: static targets of profiled services are always down"
        for sd in job["dns_sd_configs"]:
            assert sd["type"] == "A"
            for name in sd["names"]:
                assert name in compose["services"], f"{job['job_name']}: {name} is not a compose service"
                assert service(compose, name).get("profiles"), f"{name}: unprofiled services need no discovery"
                discovered[name] = (int(sd["port"]), job["metrics_path"])
    assert discovered == METRICS_SERVICES


def test_prometheus_config_passes_promtool() -> None:
    if promtool() is None:
        pytest.skip("promtool not installed")
    result = run_promtool("check", "config", str(CONFIGS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def published(svc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(host address, host port, container port) of each published port, with the variables unset."""
    found = []
    for spec in svc.get("ports", []):
        parts = str(spec).split(":")
        assert len(parts) == 3, f"{spec}: no host address, so docker publishes on every interface"
        found.append((parts[0], parts[1], parts[2]))
    return found


def test_published_ports_listen_on_localhost_unless_told_otherwise(compose: dict[str, Any]) -> None:
    text = (DOCKER / "compose.yaml").read_text(encoding="utf-8")
    raw = load_yaml(DOCKER / "compose.yaml")["services"]
    publishing = [name for name, svc in compose["services"].items() if svc.get("ports")]
    assert {*GATEWAYS, "prometheus", "grafana"} <= set(publishing)
    for name in publishing:
        for address, _host_port, _container_port in published(service(compose, name)):
            assert address == "127.0.0.1", name
        for spec in raw[name]["ports"]:
            assert str(spec).startswith("${PUBLISH_ADDRESS:-127.0.0.1}:"), f"{name}: {spec}"
    assert "PUBLISH_ADDRESS" in text.split("\nname:", 1)[0], "the header explains PUBLISH_ADDRESS"


def test_grafana_admin_password_is_required_with_no_default() -> None:
    raw = load_yaml(DOCKER / "compose.yaml")["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert required_compose_variables(raw) == {"GRAFANA_ADMIN_PASSWORD"}
    assert "admin" not in interpolate(raw)


def memory_limit_bytes(svc: dict[str, Any]) -> int:
    value = str(svc["deploy"]["resources"]["limits"]["memory"])
    match = re.fullmatch(r"(\d+)([kmg])", value)
    assert match, value
    return int(match.group(1)) * {"k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


@pytest.mark.parametrize("name", GATEWAYS)
def test_gateways_have_a_memory_limit_that_holds_what_their_bounds_admit(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch, name: str
) -> None:
    """The media budget, the bodies and the process's baseline (gateway/memory_fit.py): within the container's
    limit, or the gateway would refuse to start in it."""
    gateway = service(compose, name)
    needed = memory_fit.required_bytes(gateway_settings(gateway, clean_mmgate_env))
    assert needed is not None
    assert memory_limit_bytes(gateway) >= needed


@pytest.mark.parametrize("name", ["engine", "engine-gpu"])
def test_engines_have_a_memory_limit_above_their_budgets(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch, name: str
) -> None:
    engine_svc = service(compose, name)
    service_env(engine_svc, clean_mmgate_env)
    engine = load_settings(EngineSettings, mounted_file(engine_svc, ENGINE_CONFIG))
    resident = engine.encoder.max_resident_bytes
    assert resident is not None
    assert memory_limit_bytes(engine_svc) > resident + engine.server.max_request_body_bytes


def test_trtllm_runs_the_pytorch_backend(compose: dict[str, Any]) -> None:
    assert flag(service(compose, "trtllm")["command"], "--backend") == "pytorch"


def test_grafana_is_provisioned_with_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = service(compose, "grafana")
    provisioning = mounted_file(grafana, "/etc/grafana/provisioning")
    assert provisioning == (CONFIGS / "grafana" / "provisioning").resolve()
    (datasource,) = load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert urlsplit(datasource["url"]).hostname == "prometheus"
    assert datasource["type"] == "prometheus"
    (provider,) = load_yaml(provisioning / "dashboards" / "mmgate.yaml")["providers"]
    dashboard_dir = provider["options"]["path"]
    assert mounted_file(grafana, f"{dashboard_dir}/mmgate.json") == (CONFIGS / "grafana" / "mmgate.json").resolve()


def service_env(svc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (svc.get("environment") or {}).items():
        monkeypatch.setenv(name, str(value))


def test_vllm_profile_engine_hands_off_to_vllm_with_the_flags_its_parser_needs(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    vllm = service(compose, "vllm")
    command = vllm["command"]
    assert re.fullmatch(r"vllm/vllm-openai:v0\.(1[3-9]|[2-9]\d)\.\d+", vllm["image"]), "vLLM >= 0.13.0"
    assert "--enable-mm-embeds" in command
    assert flag(command, "--limit-mm-per-prompt") == '{"image": 0, "video": 0}'
    assert "ports" not in vllm
    engine_svc = service(compose, "engine-gpu")
    service_env(engine_svc, clean_mmgate_env)
    engine = load_settings(EngineSettings, mounted_file(engine_svc, ENGINE_CONFIG))
    assert engine.handoff.backend.value == "openai"
    assert engine.handoff.format.value == "vllm"
    handoff = urlsplit(engine.handoff.base_url)
    assert handoff.hostname == "vllm"
    assert handoff.port == int(flag(command, "--port"))
    assert engine.model.device == "cuda"
    # The tower is the LLM's: its rows have the LLM's width and dtype, or the engine refuses to start.
    assert PRESETS[engine.model.preset].out_hidden_size == engine.handoff.expected_hidden_size == 3584
    assert engine.model.dtype == engine.handoff.expected_dtype == "bfloat16"
    assert engine.model.checkpoint == command[0], "the engine reads the checkpoint vLLM serves"
    for svc in (vllm, engine_svc):
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)
    assert "ports" not in engine_svc
    assert engine_svc["build"]["args"]["BASE"].startswith("nvidia/cuda:")
    assert stop_grace_s(engine_svc) > engine.server.drain_timeout_s


def test_vllm_profile_gateway_runs_in_engine_mode_against_the_gpu_engine(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    gateway = service(compose, "gateway-vllm")
    settings = gateway_settings(gateway, clean_mmgate_env)
    assert settings.engine.url is not None
    assert urlsplit(str(settings.engine.url)).hostname == "engine-gpu"
    upstream = urlsplit(str(settings.upstream.url))
    assert (upstream.hostname, upstream.port) == ("vllm", 8001)
    assert settings.upstream.ready_path == "/health"
    engine_svc = service(compose, "engine-gpu")
    assert settings.media.processor == PRESETS[engine_svc["environment"]["MMGATE_ENGINE_MODEL__PRESET"]].geometry_name
    assert gateway["depends_on"]["engine-gpu"]["condition"] == "service_healthy"
    assert container_port(gateway) == settings.server.port
    assert stop_grace_s(gateway) > settings.server.drain_timeout_s


def test_the_gpu_gateways_share_one_media_budget_in_the_redis_service(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    replicas = [name for name in ("gateway", "gateway-2") if name in compose["services"]]
    assert len(replicas) == 2
    redis = service(compose, "redis")
    assert redis["profiles"] == service(compose, "gateway")["profiles"]
    assert "ports" not in redis, "the budget's Redis is reachable on the compose network only"
    for name in replicas:
        settings = gateway_settings(service(compose, name), clean_mmgate_env)
        assert settings.limits.budget_backend.value == "redis", name
        url = urlsplit(settings.redis.url)
        assert (url.hostname, url.port or 6379) == ("redis", int(redis["expose"][0])), name
        assert settings.redis.expected_replicas == len(replicas), name
        assert service(compose, name)["depends_on"]["redis"]["condition"] == "service_healthy", name
    # One prefix and one URL: one budget, not one per replica.
    keys = {
        (s.redis.url, s.redis.key_prefix)
        for s in (gateway_settings(service(compose, name), clean_mmgate_env) for name in replicas)
    }
    assert len(keys) == 1
    assert [container_port(service(compose, name)) for name in replicas] == [8000, 8000]
    host_ports = [published(service(compose, name))[0][1] for name in replicas]
    assert len(set(host_ports)) == 2, "the replicas publish different host ports"


def test_vllm_proxy_profile_gateway_is_configs_vllm_proxy_yaml_in_front_of_vllm(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    gateway = service(compose, "gateway-vllm-proxy")
    assert mounted_file(gateway, GATEWAY_CONFIG) == (CONFIGS / "vllm-proxy.yaml").resolve()
    settings = gateway_settings(gateway, clean_mmgate_env)
    assert settings.engine.url is None, "proxy mode: no engine"
    vllm = service(compose, "vllm-vision")
    upstream = urlsplit(str(settings.upstream.url))
    assert (upstream.hostname, upstream.port) == ("vllm-vision", int(flag(vllm["command"], "--port")))
    assert settings.upstream.ready_path == "/health"
    assert settings.media.processor == "qwen2_5_vl"
    assert settings.errors.openai_envelope.value == "openai"
    assert gateway["depends_on"] == {"vllm-vision": {"condition": "service_started"}}


def test_vllm_proxy_profile_vllm_loads_images_itself(
    compose: dict[str, Any], clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    vllm = service(compose, "vllm-vision")
    command = vllm["command"]
    assert vllm["image"] == service(compose, "vllm")["image"]
    assert command[0] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert flag(command, "--host") == "0.0.0.0"
    # Engine mode's embeds-only flags would switch off vLLM's own image loading.
    assert "--enable-mm-embeds" not in command
    assert "--limit-mm-per-prompt" not in command
    assert "ports" not in vllm, "clients go through the gateway"
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any(device["driver"] == "nvidia" and "gpu" in device["capabilities"] for device in devices)
    drain = gateway_settings(service(compose, "gateway-vllm-proxy"), clean_mmgate_env).server.drain_timeout_s
    assert stop_grace_s(vllm) > drain, "vLLM keeps generating for the streams the gateway drains"


def test_configs_vllm_proxy_yaml_runs_the_gateway_alone_in_front_of_local_vllm(
    clean_mmgate_env: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(GatewaySettings, CONFIGS / "vllm-proxy.yaml")
    assert str(settings.upstream.url) == str(GatewaySettings().upstream.url) == "http://127.0.0.1:8001/"
    assert settings.engine.url is None
    assert settings.media.processor == "qwen2_5_vl"
    assert settings.errors.openai_envelope.value == "openai", "vLLM's clients read the nested error form"
    assert settings.server.metrics_port is not None, "the main port forwards /metrics to vLLM"
    # Every key the file sets carries a comment, on its line or the one above (as configs/gateway.yaml does).
    lines = (CONFIGS / "vllm-proxy.yaml").read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^\s+[a-z_]+: \S", line):
            commented = "#" in line or lines[number - 1].lstrip().startswith("#")
            assert commented, f"configs/vllm-proxy.yaml:{number + 1}: {line.strip()} has no comment"


def read_only(svc: dict[str, Any], target: str) -> bool:
    (volume,) = [v for v in svc.get("volumes", []) if v.split(":")[1] == target]
    return volume.split(":")[2:] == ["ro"]


def test_the_model_download_writes_the_volume_vllm_and_the_engine_read(compose: dict[str, Any]) -> None:
    download = service(compose, "model-download")
    script = " ".join(download["command"])
    assert "huggingface-cli download" in script
    assert "--local-dir" in script
    assert not read_only(download, "/models"), "the download writes into the models volume"
    assert ("models", "/models") in volume_specs(download)
    assert download["environment"]["MODEL_DIR"] == service(compose, "vllm")["command"][0]
    assert download["image"] == service(compose, "vllm")["image"], "an image with huggingface-cli"
    for name in ("vllm", "engine-gpu"):
        svc = service(compose, name)
        assert read_only(svc, "/models"), name
        assert svc["depends_on"]["model-download"] == {"condition": "service_completed_successfully"}, name
    # No command in the header downloads through a service that mounts the volume read-only.
    header = COMPOSE_FILE.read_text(encoding="utf-8").split("\nname:", 1)[0]
    for match in re.finditer(r"run --rm .*?(\S+) *\\?\n#\s+download", header):
        assert not read_only(service(compose, match.group(1)), "/models"), match.group(0)
