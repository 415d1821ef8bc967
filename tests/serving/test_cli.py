"""serving.cli: flags become nested settings keys over the environment and the YAML file; a bad configuration
exits with status 2 and names the process."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import yaml
from pydantic import BaseModel

from engine_adapter.__main__ import ENGINE
from gateway.__main__ import GATEWAY
from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.servers import ROOT, served_process


def test_gateway_flags_set_their_keys() -> None:
    args = GATEWAY.parse_args(["--host", "0.0.0.0", "--port", "9", "--upstream", "http://u:1"])
    assert GATEWAY.overrides(args) == {"server": {"host": "0.0.0.0", "port": 9}, "upstream": {"url": "http://u:1"}}
    assert GATEWAY.overrides(GATEWAY.parse_args([])) == {}


def test_engine_flags_set_their_keys_and_take_no_upstream(capsys: pytest.CaptureFixture[str]) -> None:
    assert ENGINE.overrides(ENGINE.parse_args(["--port", "7"])) == {"server": {"port": 7}}
    with pytest.raises(SystemExit) as exit_info:
        ENGINE.parse_args(["--upstream", "http://u:1"])
    assert exit_info.value.code == 2
    assert "--upstream" in capsys.readouterr().err


def test_gateway_server_config_carries_the_http_limits(clean_mmgate_env: pytest.MonkeyPatch) -> None:
    settings = load_settings(GATEWAY.settings, None, {"server": {"port": 0, "max_headers": 7}})
    config = GATEWAY.server_config(GATEWAY.app(settings), settings)
    assert config.http.limits.max_headers == 7  # type: ignore[union-attr]
    assert config.port == 0


@pytest.mark.parametrize(("process", "label"), [(GATEWAY, "gateway"), (ENGINE, "engine")])
def test_a_config_error_exits_2_naming_the_process(
    process: object, label: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("server:\n  port: -1\n", encoding="utf-8")
    assert process.main(["--config", str(path)]) == 2  # type: ignore[attr-defined]
    [line] = capsys.readouterr().err.splitlines()
    logged = orjson.loads(line)
    assert (logged["level"], logged["logger"]) == ("error", "mmgate")
    assert logged["message"].startswith(f"mmgate {label}: invalid configuration")
    assert "server.port" in logged["message"]


def run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**clean, **(env or {})},
    )


def sources(output: str) -> dict[str, str]:
    """`dotted.key` → the source named in the comment of its line."""
    found: dict[str, str] = {}
    path: list[tuple[int, str]] = []
    for line in output.splitlines():
        indent = len(line) - len(line.lstrip())
        key = line.strip().split(":", 1)[0]
        while path and path[-1][0] >= indent:
            path.pop()
        if "  # " in line:
            found[".".join([*(name for _, name in path), key])] = line.rsplit("  # ", 1)[1]
        else:
            path.append((indent, key))
    return found


@pytest.mark.slow
def test_gateway_check_config_prints_every_value_with_its_source(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  host: 0.0.0.0\nlimits:\n  max_buffered_body_bytes: 1,000\n", encoding="utf-8")
    env = {
        "MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES": "67,108,864",
        "MMGATE_ENGINE__AUTH_TOKEN": "s3cret",
        "MMGATE_UPSTREAM__URL": "http://user:pa55@127.0.0.1:8001",
    }
    result = run("gateway", "--config", str(config), "--check-config", "--port", "9", "--log-level", "DEBUG", env=env)
    assert result.returncode == 0, result.stderr
    seen = sources(result.stdout)
    assert seen["server.port"] == "cli"
    assert seen["server.log_level"] == "cli"
    assert seen["limits.max_request_body_bytes"] == "env"
    assert seen["server.host"] == "yaml"
    assert seen["limits.max_buffered_body_bytes"] == "yaml"
    assert seen["limits.budget_mode"] == "default"
    assert set(seen) == {key for key, _ in flat(GatewaySettings())}
    assert "s3cret" not in result.stdout
    assert "pa55" not in result.stdout
    assert "  url: http://user:<hidden>@127.0.0.1:8001/  # env\n" in result.stdout
    printed = yaml.safe_load(result.stdout)
    assert printed["limits"]["max_request_body_bytes"] == "64MiB"
    assert printed["limits"]["max_buffered_body_bytes"] == 1000
    assert printed["server"]["log_level"] == "debug"
    # What it prints is a config file that gives the same settings (the token aside).
    printed["engine"]["auth_token"] = "s3cret"
    printed["upstream"]["url"] = "http://user:pa55@127.0.0.1:8001"
    again = tmp_path / "printed.yaml"
    again.write_text(yaml.safe_dump(printed), encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("MMGATE_")]:
            patch.delenv(name)
        patch.setenv("MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES", "67,108,864")
        patch.setenv("MMGATE_ENGINE__AUTH_TOKEN", "s3cret")
        patch.setenv("MMGATE_UPSTREAM__URL", "http://user:pa55@127.0.0.1:8001")
        expected = load_settings(GatewaySettings, config, {"server": {"port": 9, "log_level": "debug"}})
        for name in env:
            patch.delenv(name)
        assert load_settings(GatewaySettings, again) == expected


@pytest.mark.slow
def test_engine_check_config_reads_its_byte_sizes_from_the_environment() -> None:
    env = {"MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES": "67,108,864"}
    result = run("engine_adapter", "--check-config", env=env)
    assert result.returncode == 0, result.stderr
    assert "  max_resident_bytes: 64MiB  # env\n" in result.stdout
    assert sources(result.stdout)["server.port"] == "default"


@pytest.mark.parametrize(
    ("module", "variable", "key"),
    [
        ("gateway", "MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES", "limits.max_request_body_bytes"),
        ("engine_adapter", "MMGATE_ENGINE_ENCODER__MAX_RESIDENT_BYTES", "encoder.max_resident_bytes"),
    ],
)
@pytest.mark.slow
def test_a_byte_size_that_misparses_stops_start_up(module: str, variable: str, key: str) -> None:
    for check in ([], ["--check-config"]):
        result = run(module, "--port", "0", *check, env={variable: "1.5.3GiB"})
        assert result.returncode == 2
        assert f"{key} = '1.5.3GiB': Value error, not a byte size" in result.stderr
        assert result.stdout == ""


@pytest.mark.slow
def test_check_config_names_a_typo_and_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("limits:\n  max_request_bytes: 1\n", encoding="utf-8")
    result = run("gateway", "--config", str(config), "--check-config")
    assert result.returncode == 2
    assert "limits.max_request_bytes: unknown key; did you mean limits.max_request_body_bytes?" in result.stderr


@pytest.mark.parametrize(("module", "label"), [("gateway", "gateway"), ("engine_adapter", "engine")])
@pytest.mark.slow
def test_version(module: str, label: str) -> None:
    result = run(module, "--version")
    assert result.returncode == 0
    assert result.stdout == f"mmgate {label} {importlib.metadata.version('mmgate')}\n"


def test_log_level_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert ENGINE.overrides(ENGINE.parse_args(["--log-level", "WARNING"])) == {"server": {"log_level": "warning"}}
    with pytest.raises(SystemExit):
        GATEWAY.parse_args(["--log-level", "loud"])
    assert "--log-level" in capsys.readouterr().err


@pytest.mark.slow
def test_log_level_flag_quiets_the_gateways_start_up_lines(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  access_log: false\n", encoding="utf-8")
    said: dict[str, str] = {}
    for level in ("info", "warning"):
        log = tmp_path / f"{level}.log"
        with served_process("gateway", config, "--log-level", level, log=log):
            pass
        said[level] = log.read_text()
    assert "media budget 2GiB (budget_mode=bytes)" in said["info"]
    assert "media budget" not in said["warning"]


def flat(model: BaseModel, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            rows.extend(flat(value, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", value))
    return rows
