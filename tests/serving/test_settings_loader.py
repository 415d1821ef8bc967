"""serving.settings_loader: an environment variable of this process that names no key stops start-up naming the
variable and the closest key; the variables of the other process sharing the shell are left to it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pydantic_settings import SettingsConfigDict

from engine_adapter.__main__ import ENGINE
from engine_adapter.config import EngineSettings
from gateway.__main__ import GATEWAY
from gateway.config import GatewaySettings
from serving.settings_loader import (
    PROCESS_ENV_PREFIXES,
    ConfigError,
    LayeredSettings,
    env_owner,
    load_settings,
    unknown_env_variables,
)
from serving.settings_types import Section
from tests.servers import ROOT


class Limits(Section):
    max_bytes: int = 1


class Outer(LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="MMGATE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    limits: Limits = Limits()
    engine: Limits = Limits()


class Inner(LayeredSettings):
    model_config = SettingsConfigDict(
        env_prefix="MMGATE_ENGINE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    model: Limits = Limits()


def test_the_processes_prefixes_are_the_ones_their_settings_use() -> None:
    assert {GatewaySettings.model_config["env_prefix"], EngineSettings.model_config["env_prefix"]} == set(
        PROCESS_ENV_PREFIXES
    )


@pytest.mark.parametrize(
    ("name", "owner"),
    [
        ("MMGATE_LIMITS__MAX_BYTES", "MMGATE_"),
        ("MMGATE_ENGINE__URL", "MMGATE_"),  # the gateway's engine section
        ("MMGATE_ENGINE_MODEL__PRESET", "MMGATE_ENGINE_"),
        ("mmgate_engine_model__preset", "MMGATE_ENGINE_"),  # names are read ignoring case
        ("MMGATE_ENGINE_", "MMGATE_"),  # nothing follows the engine's prefix: a gateway key named ENGINE_
        ("MMGATE_", None),
        ("MMGATE__X", None),
        ("OTHER_LIMITS__X", None),
    ],
)
def test_a_variable_belongs_to_the_longest_prefix_a_key_follows(name: str, owner: str | None) -> None:
    assert env_owner(name, PROCESS_ENV_PREFIXES) == owner


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "MMGATE_LIMIT__MAX_BYTES",
            "MMGATE_LIMIT__MAX_BYTES: unknown key limit; did you mean MMGATE_LIMITS__MAX_BYTES?",
        ),
        (
            "MMGATE_LIMITS_MAX_BYTES",
            "MMGATE_LIMITS_MAX_BYTES: unknown key limits_max_bytes; did you mean MMGATE_LIMITS__MAX_BYTES?",
        ),
        (
            "MMGATE_ZZZ",
            "MMGATE_ZZZ: unknown key zzz; its top-level keys are limits, engine (MMGATE_<KEY>__<NESTED KEY>)",
        ),
    ],
)
def test_an_unknown_first_segment_stops_loading_naming_the_variable_and_the_closest_key(
    clean_mmgate_env: pytest.MonkeyPatch, name: str, message: str
) -> None:
    clean_mmgate_env.setenv(name, "redis://:hunter2@host/0")
    with pytest.raises(ConfigError) as raised:
        load_settings(Outer)
    assert f"environment variable {message}" in str(raised.value)
    assert "hunter2" not in str(raised.value), "a misspelt variable's value may be a credential"


def test_every_unknown_variable_is_named_at_once() -> None:
    environ = {"MMGATE_LIMIT__MAX_BYTES": "1", "MMGATE_ENGIN__MAX_BYTES": "2", "MMGATE_LIMITS__MAX_BYTES": "3"}
    lines = unknown_env_variables(Outer, environ)
    assert [line.split(":")[0] for line in lines] == [
        "environment variable MMGATE_ENGIN__MAX_BYTES",
        "environment variable MMGATE_LIMIT__MAX_BYTES",
    ]
    assert "did you mean MMGATE_ENGINE__MAX_BYTES?" in lines[0]


def test_each_process_leaves_the_other_processes_variables_alone(clean_mmgate_env: pytest.MonkeyPatch) -> None:
    clean_mmgate_env.setenv("MMGATE_LIMITS__MAX_BYTES", "3")
    clean_mmgate_env.setenv("MMGATE_ENGINE__MAX_BYTES", "4")
    clean_mmgate_env.setenv("MMGATE_ENGINE_MODEL__MAX_BYTES", "5")
    outer, inner = load_settings(Outer), load_settings(Inner)
    assert (outer.limits.max_bytes, outer.engine.max_bytes, inner.model.max_bytes) == (3, 4, 5)
    # A typo in the engine's section is the engine's error, not the outer process's.
    clean_mmgate_env.setenv("MMGATE_ENGINE_MODL__MAX_BYTES", "6")
    assert load_settings(Outer).limits.max_bytes == 3
    with pytest.raises(ConfigError, match=r"MMGATE_ENGINE_MODL__MAX_BYTES: unknown key modl; did you mean "):
        load_settings(Inner)


def test_a_known_section_with_an_unknown_nested_key_is_still_the_sections_error(
    clean_mmgate_env: pytest.MonkeyPatch,
) -> None:
    clean_mmgate_env.setenv("MMGATE_LIMITS__MAX_BYTE", "1")
    with pytest.raises(
        ConfigError,
        match=r"environment variable MMGATE_LIMITS__MAX_BYTE: limits\.max_byte: unknown key; "
        r"did you mean limits\.max_bytes \(MMGATE_LIMITS__MAX_BYTES\)\?",
    ):
        load_settings(Outer)


@pytest.mark.parametrize(
    ("process", "label", "variable", "suggestion"),
    [
        (GATEWAY, "gateway", "MMGATE_LIMIT__MAX_REQUEST_BODY_BYTES", "MMGATE_LIMITS__MAX_REQUEST_BODY_BYTES"),
        (ENGINE, "engine", "MMGATE_ENGINE_ENCODERS__MAX_NUM_ITEMS", "MMGATE_ENGINE_ENCODER__MAX_NUM_ITEMS"),
    ],
)
def test_start_up_and_check_config_exit_2_naming_the_variable(
    clean_mmgate_env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    process: object,
    label: str,
    variable: str,
    suggestion: str,
) -> None:
    clean_mmgate_env.setenv(variable, "8")
    for argv in ([], ["--check-config"]):
        assert process.main(argv) == 2  # type: ignore[attr-defined]
        err = capsys.readouterr().err
        if not argv:  # starting: the one JSON log line
            err = orjson.loads(err)["message"]
        assert err.startswith(f"mmgate {label}: invalid configuration")
        assert f"environment variable {variable}: " in err
        assert f"did you mean {suggestion}?" in err


@pytest.mark.slow
def test_one_shell_configures_both_processes() -> None:
    """The real commands, in one environment holding both processes' variables (and the gateway's engine section,
    whose names start with the engine's prefix)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    env |= {
        "MMGATE_LIMITS__BUDGET_MODE": "slots",
        "MMGATE_ENGINE__AUTH_TOKEN": "gateway-side",
        "MMGATE_ENGINE_MODEL__PRESET": "tiny",
        "MMGATE_ENGINE_SERVER__PORT": "8123",
    }
    results = {
        module: subprocess.run(
            [sys.executable, "-m", module, "--check-config"], cwd=ROOT, env=env, capture_output=True, text=True
        )
        for module in ("gateway", "engine_adapter")
    }
    for module, result in results.items():
        assert result.returncode == 0, f"{module}: {result.stderr}"
    assert "budget_mode: slots  # env" in results["gateway"].stdout
    assert "port: 8123  # env" in results["engine_adapter"].stdout
    env["MMGATE_LIMTS__BUDGET_MODE"] = "slots"
    broken = subprocess.run(
        [sys.executable, "-m", "gateway", "--check-config"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert broken.returncode == 2
    assert "environment variable MMGATE_LIMTS__BUDGET_MODE: unknown key limts; did you mean" in broken.stderr


def run_process(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m <module> [args]` with `env` as its only MMGATE_* variables."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("value", "printed"),
    [
        ("/release_memory,/update_weights", "[/release_memory, /update_weights]"),
        (" /release_memory , /update_weights ", "[/release_memory, /update_weights]"),
        ('["/release_memory", "/update,weights"]', "[/release_memory, '/update,weights']"),
        ("", "[]"),
    ],
)
@pytest.mark.slow
def test_a_list_key_takes_a_comma_separated_or_a_json_list_from_the_environment(value: str, printed: str) -> None:
    result = run_process("gateway", "--check-config", env={"MMGATE_UPSTREAM__BLOCKED_PATHS": value})
    assert result.returncode == 0, result.stderr
    assert f"  blocked_paths: {printed}  # env\n" in result.stdout


def test_a_list_key_from_the_environment_loads_its_items(clean_mmgate_env: pytest.MonkeyPatch) -> None:
    clean_mmgate_env.setenv("MMGATE_MEDIA__FETCH__ALLOWED_NETWORKS", "10.0.0.0/8, 192.168.0.0/16")
    clean_mmgate_env.setenv("MMGATE_LIMITS__ADMISSION_ROUTES", '["/v1/chat/completions"]')
    settings = load_settings(GatewaySettings)
    assert [str(network) for network in settings.media.fetch.allowed_networks] == ["10.0.0.0/8", "192.168.0.0/16"]
    assert settings.limits.admission_routes == ("/v1/chat/completions",)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ('["/release_memory",', "this is not valid JSON"),
        ('{"path": "/release_memory"}', "this is a JSON dict, not a list"),
        ('"/release_memory"', "this is a JSON str, not a list"),
        ("[1, 2]", "upstream.blocked_paths.0 = 1: Input should be a valid string"),
    ],
)
@pytest.mark.slow
def test_a_bad_json_list_in_the_environment_exits_2_naming_the_variable_and_the_key(value: str, problem: str) -> None:
    for check in (["--check-config"], []):
        result = run_process("gateway", "--port", "0", *check, env={"MMGATE_UPSTREAM__BLOCKED_PATHS": value})
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr
        message = result.stderr if check else orjson.loads(result.stderr)["message"]
        assert message.startswith("mmgate gateway: invalid configuration:\n")
        assert "environment variable MMGATE_UPSTREAM__BLOCKED_PATHS: upstream.blocked_paths" in message
        assert problem in message


@pytest.mark.parametrize(
    ("module", "variable", "closest"),
    [
        ("gateway", "MMGATE_ENGINE__AUTH_TOKE", "engine.auth_token (MMGATE_ENGINE__AUTH_TOKEN)"),
        ("engine_adapter", "MMGATE_ENGINE_SERVER__AUTH_TOKE", "server.auth_token (MMGATE_ENGINE_SERVER__AUTH_TOKEN)"),
    ],
)
@pytest.mark.slow
def test_a_misspelt_credential_variable_is_named_without_its_value(module: str, variable: str, closest: str) -> None:
    for check in (["--check-config"], []):
        result = run_process(module, "--port", "0", *check, env={variable: "supersecret"})
        assert result.returncode == 2, result.stderr
        assert "supersecret" not in result.stderr + result.stdout
        assert f"environment variable {variable}: " in result.stderr
        assert f"unknown key; did you mean {closest}?" in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("engine:\n  auth_toke: supersecret\n", "engine.auth_toke: unknown key; did you mean engine.auth_token?"),
        ("engine:\n  auth_token: [supersecret]\n", "engine.auth_token: Input should be a valid string"),
        ("redis:\n  url: http://user:supersecret@cache:6379\n", "redis.url = 'http://user:<hidden>@cache:6379'"),
        ("engine:\n  auth_token: supersecret: x\n", "not valid YAML: mapping values are not allowed here at line 2"),
    ],
)
def test_no_message_shows_a_credential_from_the_config_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_settings(GatewaySettings, path)
    assert message in str(raised.value)
    assert "supersecret" not in str(raised.value)
