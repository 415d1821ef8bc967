from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import yaml

from gateway.__main__ import GATEWAY
from gateway.app import Gateway
from gateway.config import DEFAULT_ADMISSION_ROUTES, BudgetMode, GatewaySettings
from serving.settings_loader import ConfigError, load_settings
from tests.config_cli import run_module
from tests.config_cli import write_config as write
from tests.settings_keys import model_keys, yaml_keys

ROOT = Path(__file__).resolve().parents[2]


def test_precedence_cli_over_env_over_yaml_over_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "server:\n  port: 7001\n  host: 0.0.0.0\nlimits:\n  admission_timeout_s: 3\n")
    monkeypatch.setenv("MMGATE_SERVER__PORT", "7002")
    monkeypatch.setenv("MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES", "1.5GiB")
    settings = load_settings(GatewaySettings, path, GATEWAY.overrides(GATEWAY.parse_args(["--port", "7003"])))
    assert settings.server.port == 7003  # CLI
    assert settings.limits.max_request_body_bytes == int(1.5 * (1 << 30))  # env
    assert settings.server.host == "0.0.0.0"  # YAML
    assert settings.limits.admission_timeout_s == 3  # YAML
    assert settings.limits.max_multimodal_cpu_bytes == 2 << 30  # default
    without_cli = load_settings(GatewaySettings, path)
    assert without_cli.server.port == 7002  # env beats YAML


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 << 20),
        ("64MB", 64_000_000),
        ("1024", 1024),
        ("2 GiB", 2 << 30),
        ("67,108,864", 67_108_864),  # how messages print byte counts
        ('"1,000"', 1000),
        ("64_000", 64_000),
    ],
)
def test_byte_sizes(tmp_path: Path, text: str, expected: int) -> None:
    settings = load_settings(GatewaySettings, write(tmp_path, f"limits:\n  max_request_body_bytes: {text}\n"))
    assert settings.limits.max_request_body_bytes == expected


def test_null_turns_a_limit_off_in_yaml_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = load_settings(GatewaySettings, write(tmp_path, "limits:\n  max_request_body_bytes: null\n"))
    assert settings.limits.max_request_body_bytes is None
    monkeypatch.setenv("MMGATE_LIMITS__ADMISSION_TIMEOUT_S", "null")
    assert load_settings(GatewaySettings).limits.admission_timeout_s is None


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("limits:\n  max_request_body_bytes: lots\n", "limits.max_request_body_bytes", "'lots'"),
        ("server:\n  port: 99999\n", "server.port", "99999"),
        ("limits:\n  budget_mode: weighted\n", "limits.budget_mode", "'weighted'"),
        ("media:\n  processor: llava\n", "media.processor", "'llava'"),
        ("media:\n  fetch:\n    max_redirects: -1\n", "media.fetch.max_redirects", "-1"),
        ("upstream:\n  url: not a url\n", "upstream.url", "'not a url'"),
    ],
)
def test_bad_value_names_key_and_value(tmp_path: Path, text: str, key: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(GatewaySettings, write(tmp_path, text))
    assert f"{key} = {value}" in str(raised.value)


@pytest.mark.parametrize("text", ["1.5.3GiB", "1,0000", "64M", "67,108,864 bytes", "0.1KiB", "1.5"])
def test_a_byte_size_that_is_not_exactly_one_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(GatewaySettings, write(tmp_path, f"limits:\n  max_request_body_bytes: {text}\n"))
    assert f"limits.max_request_body_bytes = {yaml.safe_load(text)!r}" in str(raised.value)


@pytest.mark.parametrize(("text", "expected"), [("67,108,864", 67_108_864), ("1,000", 1000), ("64MiB", 64 << 20)])
def test_byte_sizes_from_the_environment(clean_mmgate_env: pytest.MonkeyPatch, text: str, expected: int) -> None:
    clean_mmgate_env.setenv("MMGATE_LIMITS__MAX_OTHER_BODY_BYTES", text)
    assert load_settings(GatewaySettings).limits.max_other_body_bytes == expected


@pytest.mark.parametrize("text", ["1.5.3GiB", "1,0000", "1G"])
def test_a_bad_byte_size_in_the_environment_names_key_and_value(
    clean_mmgate_env: pytest.MonkeyPatch, text: str
) -> None:
    clean_mmgate_env.setenv("MMGATE_LIMITS__MAX_OTHER_BODY_BYTES", text)
    with pytest.raises(ConfigError, match=rf"limits\.max_other_body_bytes = '{re.escape(text)}'"):
        load_settings(GatewaySettings)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "limits:\n  max_request_bytes: 1\n",
            "limits.max_request_bytes: unknown key; did you mean limits.max_request_body_bytes?",
        ),
        ("limit:\n  budget_mode: bytes\n", "limit: unknown key; did you mean limits?"),
        ("media:\n  fetch:\n    max_byte: 1\n", "did you mean media.fetch.max_bytes?"),
        ("errors:\n  zzz: 1\n", "errors.zzz: unknown key; the keys of errors are openai_envelope"),
    ],
)
def test_an_unknown_key_suggests_the_closest(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(GatewaySettings, write(tmp_path, text))
    assert message in str(raised.value)
    assert "Extra inputs are not permitted" not in str(raised.value)


def test_an_unknown_key_in_the_environment_suggests_the_closest(clean_mmgate_env: pytest.MonkeyPatch) -> None:
    clean_mmgate_env.setenv("MMGATE_LIMITS__BUDGET_MOD", "slots")
    with pytest.raises(ConfigError) as raised:
        load_settings(GatewaySettings)
    assert (
        "environment variable MMGATE_LIMITS__BUDGET_MOD: limits.budget_mod: unknown key; "
        "did you mean limits.budget_mode (MMGATE_LIMITS__BUDGET_MODE)?"
    ) in str(raised.value)
    assert "slots" not in str(raised.value)


def test_defaults_do_not_serialize_media_requests() -> None:
    limits = GatewaySettings().limits
    assert limits.budget_mode is BudgetMode.BYTES
    assert limits.max_other_body_bytes == 64 << 20


def test_bad_env_value_names_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES", "abc")
    with pytest.raises(ConfigError, match=r"limits\.max_request_body_bytes = 'abc'"):
        load_settings(GatewaySettings)


def test_per_request_cap_above_total_is_refused(tmp_path: Path) -> None:
    text = "limits:\n  max_multimodal_cpu_bytes: 128MiB\n  max_multimodal_cpu_bytes_per_request: 256MiB\n"
    with pytest.raises(ConfigError, match=r"max_multimodal_cpu_bytes_per_request=268,435,456 is larger than"):
        load_settings(GatewaySettings, write(tmp_path, text))


def test_only_total_set_gives_one_slot(tmp_path: Path) -> None:
    settings = load_settings(GatewaySettings, write(tmp_path, "limits:\n  max_multimodal_cpu_bytes: 128MiB\n"))
    assert settings.limits.max_multimodal_cpu_bytes_per_request == 128 << 20
    assert settings.limits.budget_slots == 1
    assert GatewaySettings().limits.budget_slots == 4


def test_unreadable_or_non_mapping_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(GatewaySettings, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_settings(GatewaySettings, write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(GatewaySettings, write(tmp_path, "server: [\n"))


def test_shipped_config_documents_every_key_with_its_default() -> None:
    path = ROOT / "configs" / "gateway.yaml"
    assert yaml_keys(yaml.safe_load(path.read_text())) == model_keys(GatewaySettings)
    assert load_settings(GatewaySettings, path) == GatewaySettings()


@pytest.mark.slow
def test_cli_fails_start_up_naming_the_key(tmp_path: Path) -> None:
    path = write(tmp_path, "limits:\n  max_multimodal_cpu_bytes_per_request: twelve\n")
    result = run_module("gateway", "--config", str(path))
    assert result.returncode == 2
    assert "limits.max_multimodal_cpu_bytes_per_request = 'twelve'" in result.stderr


@pytest.mark.parametrize(
    "key",
    [
        "max_request_body_bytes",
        "max_multimodal_cpu_bytes",
        "max_image_pixels",
        "max_media_items_per_request",
        "admission_timeout_s",
        "max_queued_requests",
    ],
)
def test_every_nullable_limit_turns_off_with_null(tmp_path: Path, key: str) -> None:
    settings = load_settings(GatewaySettings, write(tmp_path, f"limits:\n  {key}: null\n"))
    assert getattr(settings.limits, key) is None


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        (
            "bytes",
            "media budget 2GiB (budget_mode=bytes): requests with media run at once while the bytes their headers "
            "predict fit (the full 512MiB per-request cap when they cannot be predicted, e.g. downloads)",
        ),
        (
            "slots",
            "media budget 2GiB (budget_mode=slots): 4 slots of 512MiB, so at most 4 requests with media at once, "
            "each holding a full slot however little it needs",
        ),
    ],
)
async def test_start_up_log_says_what_the_budget_mode_means(
    mode: str, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = Gateway(GatewaySettings(limits={"budget_mode": mode}))
    with caplog.at_level(logging.INFO, logger="mmgate.gateway"):
        await gateway.startup()
    await gateway.shutdown()
    lines = [record.getMessage() for record in caplog.records]
    assert said in lines
    assert (
        f"gateway forwarding to http://127.0.0.1:8001; body cap 64MiB on {', '.join(DEFAULT_ADMISSION_ROUTES)}, "
        "64MiB on every other request"
    ) in lines
    if mode == "bytes":
        assert not any("slot" in line for line in lines)


@pytest.mark.parametrize("level", ["verbose", "INFOO", ""])
def test_an_unknown_log_level_stops_start_up_naming_the_key(level: str) -> None:
    with pytest.raises(ValueError, match="log_level"):
        GatewaySettings(server={"log_level": level})


def test_log_level_is_case_insensitive() -> None:
    assert GatewaySettings(server={"log_level": "DEBUG"}).server.log_level == "debug"
