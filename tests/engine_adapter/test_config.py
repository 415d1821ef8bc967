"""Engine settings: precedence, byte sizes, validation naming the key, the shipped YAML, the CLI's exit status."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from encoder_scheduler import SchedulingPolicy
from engine_adapter.__main__ import ENGINE
from engine_adapter.config import EngineSettings
from engine_adapter.encoder import VisionEncoder
from serving.settings_loader import ConfigError, load_settings
from tests.config_cli import run_module, write_config
from tests.settings_keys import model_keys, yaml_keys

ROOT = Path(__file__).resolve().parents[2]


def test_precedence_cli_over_env_over_yaml_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(tmp_path, "server:\n  port: 7001\n  host: 0.0.0.0\nencoder:\n  max_num_items: 3\n")
    monkeypatch.setenv("MMGATE_ENGINE_SERVER__PORT", "7002")
    monkeypatch.setenv("MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES", "1.5GiB")
    settings = load_settings(EngineSettings, path, ENGINE.overrides(ENGINE.parse_args(["--port", "7003"])))
    assert settings.server.port == 7003  # CLI
    assert settings.encoder.max_resident_bytes == int(1.5 * (1 << 30))  # env
    assert settings.server.host == "0.0.0.0"  # YAML
    assert settings.encoder.max_num_items == 3  # YAML
    assert settings.encoder.max_num_tokens == 16384  # default
    assert load_settings(EngineSettings, path).server.port == 7002  # env beats YAML


def test_the_gateways_variables_do_not_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMGATE_SERVER__PORT", "9000")  # the gateway's port
    monkeypatch.setenv("MMGATE_ENGINE__URL", "http://127.0.0.1:8100")  # the gateway's engine section
    settings = load_settings(EngineSettings)
    assert settings.server.port == 8100


@pytest.mark.parametrize(
    ("text", "expected"),
    [("256MiB", 256 << 20), ("64MB", 64_000_000), ("1024", 1024), ("67,108,864", 67_108_864), ('"1,000"', 1000)],
)
def test_byte_sizes(tmp_path: Path, text: str, expected: int) -> None:
    settings = load_settings(EngineSettings, write_config(tmp_path, f"encoder:\n  max_resident_bytes: {text}\n"))
    assert settings.encoder.max_resident_bytes == expected


@pytest.mark.parametrize("text", ["1.5.3GiB", "1,0000", "256M", "0.1KiB"])
def test_a_byte_size_that_is_not_exactly_one_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=rf"encoder\.max_resident_bytes = '{re.escape(text)}'"):
        load_settings(EngineSettings, write_config(tmp_path, f"encoder:\n  max_resident_bytes: {text}\n"))


def test_byte_sizes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES", "67,108,864")
    assert load_settings(EngineSettings).encoder.max_resident_bytes == 67_108_864
    monkeypatch.setenv("MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES", "1,000.5")
    with pytest.raises(ConfigError, match=r"encoder\.max_resident_bytes = '1,000\.5'"):
        load_settings(EngineSettings)


def test_an_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"encoder\.max_resident: unknown key; did you mean encoder\.max_resident_bytes\?"
    ):
        load_settings(EngineSettings, write_config(tmp_path, "encoder:\n  max_resident: {a: 1}\n"))


def test_null_turns_limits_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = "encoder:\n  max_resident_bytes: null\nmodel:\n  max_pixels: null\n"
    assert load_settings(EngineSettings, write_config(tmp_path, text)).encoder.max_resident_bytes is None
    monkeypatch.setenv("MMGATE_ENGINE_ENCODER__MAX_PENDING_INPUT_BYTES", "null")
    assert load_settings(EngineSettings).encoder.max_pending_input_bytes is None


def test_policy_is_read_in_any_case(tmp_path: Path) -> None:
    settings = load_settings(EngineSettings, write_config(tmp_path, "encoder:\n  scheduling_policy: eager\n"))
    assert settings.encoder.scheduling_policy is SchedulingPolicy.EAGER


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("encoder:\n  max_resident_bytes: lots\n", "encoder.max_resident_bytes", "'lots'"),
        ("encoder:\n  max_num_items: 0\n", "encoder.max_num_items", "0"),
        ("encoder:\n  scheduling_policy: greedy\n", "encoder.scheduling_policy", "'greedy'"),
        ("server:\n  port: 99999\n", "server.port", "99999"),
        ("server:\n  log_level: loud\n", "server.log_level", "'loud'"),
        ("model:\n  preset: qwen9-vl\n", "model.preset", "'qwen9-vl'"),
        ("model:\n  processor: llava\n", "model.processor", "'llava'"),
        ("handoff:\n  backend: grpc\n", "handoff.backend", "'grpc'"),
        ("handoff:\n  format: sglang\n", "handoff.format", "'sglang'"),
        ("handoff:\n  max_concurrency: 0\n", "handoff.max_concurrency", "0"),
    ],
)
def test_bad_value_names_key_and_value(tmp_path: Path, text: str, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(EngineSettings, write_config(tmp_path, text))
    assert f"{key} = {value}" in str(raised.value)


def test_openai_backend_needs_a_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"handoff\.url is required when handoff\.backend is openai"):
        load_settings(EngineSettings, write_config(tmp_path, "handoff:\n  backend: openai\n"))


def test_pixel_overrides_must_be_ordered(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.min_pixels=9,000 is larger than model\.max_pixels=4,000"):
        load_settings(EngineSettings, write_config(tmp_path, "model:\n  min_pixels: 9000\n  max_pixels: 4000\n"))


def test_device_and_processor_problems_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model\.device"):
        VisionEncoder(EngineSettings(model={"device": "tpu"}).model)
    # Qwen3-VL's patches are 16 pixels; the tiny Qwen2-VL tower takes 14.
    with pytest.raises(ConfigError, match=r"model\.processor = 'qwen3_vl'"):
        VisionEncoder(EngineSettings(model={"processor": "qwen3_vl"}).model)
    with pytest.raises(ConfigError, match=r"model\.checkpoint"):
        VisionEncoder(EngineSettings(model={"checkpoint": "/nonexistent/checkpoint"}).model)


def test_shipped_config_documents_every_key_with_its_default() -> None:
    path = ROOT / "configs" / "engine.yaml"
    assert yaml_keys(yaml.safe_load(path.read_text())) == model_keys(EngineSettings)
    assert load_settings(EngineSettings, path) == EngineSettings()


@pytest.mark.slow
def test_cli_fails_start_up_naming_the_key(tmp_path: Path) -> None:
    path = write_config(tmp_path, "encoder:\n  max_resident_bytes: twelve\n")
    result = run_module("engine_adapter", "--config", str(path))
    assert result.returncode == 2
    assert "encoder.max_resident_bytes = 'twelve'" in result.stderr


@pytest.mark.slow
def test_cli_refuses_a_device_this_machine_lacks(tmp_path: Path) -> None:
    path = write_config(tmp_path, "model:\n  device: cuda:63\n")
    result = run_module("engine_adapter", "--config", str(path), "--port", "0")
    assert result.returncode == 2
    assert "model.device" in result.stderr
