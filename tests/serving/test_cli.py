"""serving.cli: flags become nested settings keys over the environment and the YAML file; a bad configuration
exits with status 2 and names the process."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_adapter.__main__ import ENGINE
from gateway.__main__ import GATEWAY
from serving.settings_loader import load_settings


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
    err = capsys.readouterr().err
    assert err.startswith(f"mmgate {label}: invalid configuration")
    assert "server.port" in err
