"""Every YAML file in configs/ is a config of a known kind, and each gateway or engine config loads with the real
settings model (a new config that is not listed here fails the first test)."""

from __future__ import annotations

import pytest

from engine_adapter.config import EngineSettings
from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.deploy.common import CONFIGS

GATEWAY_CONFIGS = ["gateway.yaml", "demo.yaml", "compose-gateway.yaml", "compose-gateway-cpu.yaml", "vllm-proxy.yaml"]
ENGINE_CONFIGS = ["engine.yaml", "compose-engine.yaml"]
# trtllm-serve's LlmArgs, Prometheus' scrape config and its alert rules: checked in test_compose.py, test_k8s.py and
# test_alerts.py.
OTHER_CONFIGS = ["compose-trtllm.yaml", "prometheus.yml", "alerts.yml"]


def test_every_config_is_of_a_known_kind() -> None:
    found = {path.name for pattern in ("*.yaml", "*.yml") for path in CONFIGS.glob(pattern)}
    assert found == {*GATEWAY_CONFIGS, *ENGINE_CONFIGS, *OTHER_CONFIGS}


@pytest.mark.parametrize("name", GATEWAY_CONFIGS)
def test_gateway_configs_load(name: str, clean_mmgate_env: pytest.MonkeyPatch) -> None:
    load_settings(GatewaySettings, CONFIGS / name)


@pytest.mark.parametrize("name", ENGINE_CONFIGS)
def test_engine_configs_load(name: str, clean_mmgate_env: pytest.MonkeyPatch) -> None:
    load_settings(EngineSettings, CONFIGS / name)
