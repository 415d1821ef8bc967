"""docker/*.Dockerfile: what the images install (no torch in the gateway's; only pinned, complete lock files), who
they run as, their HEALTHCHECK, the config path and MMGATE_* environment, and the engine's CUDA build arguments.
Parsed statically: building needs a Docker engine. docker/healthcheck.py runs against a loopback HTTP server."""

from __future__ import annotations

import http.server
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from engine_adapter.config import EngineSettings
from gateway.config import GatewaySettings
from serving.settings_loader import load_settings
from tests.deploy.common import CONFIGS, DOCKER, REPO, load_docker_script, load_healthcheck

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
TORCH_FAMILY = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-[a-z0-9-]+)$")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def parse_dockerfile(path: Path) -> list[list[Instruction]]:
    """Stages of instructions; comments dropped, continuation lines joined. Global ARGs form stage 0."""
    logical: list[str] = []
    pending = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue  # comments may sit between continuation lines too
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path.name} ends inside a continuation"
    stages: list[list[Instruction]] = [[]]
    for text in logical:
        keyword, _, args = text.strip().partition(" ")
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


def args_defaults(stages: list[list[Instruction]]) -> dict[str, str]:
    defaults = {}
    for stage in stages:
        for item in stage:
            if item.keyword == "ARG" and "=" in item.args:
                name, value = item.args.split("=", 1)
                defaults[name] = value
    return defaults


def expand(text: str, defaults: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m[1] or m[2], m[0]), text)


def all_of(stages: list[list[Instruction]], keyword: str) -> list[Instruction]:
    return [item for stage in stages for item in stage if item.keyword == keyword]


def final_stage(stages: list[list[Instruction]]) -> list[Instruction]:
    return stages[-1]


def exec_form(item: Instruction) -> list[str]:
    assert item.args.startswith("["), f"{item.keyword} should use the exec form: {item.args}"
    value = eval(item.args, {"__builtins__": {}})  # a JSON array of strings
    assert isinstance(value, list)
    return value


def pip_installs(stages: list[list[Instruction]]) -> list[list[str]]:
    """The argument lists of every `pip install` in RUN instructions."""
    installs = []
    for item in all_of(stages, "RUN"):
        lexer = shlex.shlex(item.args, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in {";", "&&", "||", "|"}:
                command.append(token)
                continue
            for index, word in enumerate(command[:-1]):
                if word.endswith("pip") and command[index + 1] == "install":
                    installs.append(command[index + 2 :])
            command = []
    return installs


def option_values(words: list[str], *names: str) -> list[str]:
    values = []
    for index, word in enumerate(words):
        for name in names:
            if word == name:
                values.append(words[index + 1])
            elif word.startswith(f"{name}="):
                values.append(word.split("=", 1)[1])
    return values


def positional(words: list[str]) -> list[str]:
    takes_value = {"-r", "--requirement", "-c", "--constraint", "--index-url", "-i", "--extra-index-url"}
    result, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in takes_value:
            skip = True
        elif not word.startswith("-"):
            result.append(word)
    return result


def lock(name: str) -> dict[str, str]:
    """canonical name -> pinned version of docker/requirements-<name>.txt; every line must be `name==version`."""
    pins = {}
    for line in (DOCKER / f"requirements-{name}.txt").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!_-]+)", line.strip())
        assert match, f"requirements-{name}.txt: not pinned: {line!r}"
        pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def closure(requirements: list[str]) -> set[str]:
    """Every distribution these requirements pull in on this interpreter (the image's Python minor version), by
    canonical name: docker/lock.sh's own closure (docker/dependency_closure.py)."""
    return set(load_docker_script("dependency_closure").closure(requirements))


GATEWAY = parse_dockerfile(DOCKER / "gateway.Dockerfile")
ENGINE = parse_dockerfile(DOCKER / "engine.Dockerfile")
IMAGES = {"gateway": GATEWAY, "engine": ENGINE}


def test_pyproject_base_dependencies_have_no_torch() -> None:
    base = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    assert not [req.name for req in base if TORCH_FAMILY.match(canonicalize_name(req.name))]
    engine = [Requirement(text) for text in PYPROJECT["project"]["optional-dependencies"]["engine"]]
    assert [req.name for req in engine] == ["torch"], "torch is the engine extra"


def test_gateway_image_installs_nothing_of_torch() -> None:
    installs = pip_installs(GATEWAY)
    assert installs, "no pip install found"
    for words in installs:
        for package in positional(words):
            assert not TORCH_FAMILY.match(canonicalize_name(package.split("==")[0])), words
        for requirements in option_values(words, "-r", "--requirement", "-c", "--constraint"):
            pins = lock(Path(requirements).stem.removeprefix("requirements-"))
            assert not [name for name in pins if TORCH_FAMILY.match(name)], f"{requirements} pulls torch"
        assert not option_values(words, "--index-url", "-i", "--extra-index-url"), "the gateway uses PyPI only"


def test_every_pip_install_is_pinned_and_pulls_nothing_else() -> None:
    for name, stages in IMAGES.items():
        for words in pip_installs(stages):
            files = option_values(words, "-r", "--requirement")
            if files or any(word.endswith(".whl") for word in words):
                # A lock file or our own wheel: --no-deps, so only what is listed can enter.
                assert "--no-deps" in words, f"{name}: {words}"
            else:
                # Only the engine's torch, pinned and constrained by the lock.
                assert name == "engine", words
                assert positional(words) == ["torch==${TORCH_VERSION}"], words
                assert option_values(words, "--constraint", "-c") == ["docker/requirements-engine.txt"], words
            if files:
                assert "--only-binary=:all:" in words, f"{name}: wheels only, nothing compiled: {words}"
                for requirements in files:
                    assert (REPO / requirements).is_file(), requirements


def test_gateway_lock_is_exactly_the_base_dependency_closure() -> None:
    # Fails when a dependency was added to pyproject.toml without running docker/lock.sh.
    expected = closure(PYPROJECT["project"]["dependencies"])
    assert set(lock("gateway")) == expected


def test_engine_lock_is_the_closure_with_torch_less_torch_itself() -> None:
    project = PYPROJECT["project"]
    expected = closure(project["dependencies"] + project["optional-dependencies"]["engine"]) - {"torch"}
    assert set(lock("engine")) == expected


def test_locked_versions_satisfy_pyproject() -> None:
    project = PYPROJECT["project"]
    for name, texts in (("gateway", project["dependencies"]), ("engine", project["dependencies"])):
        pins = lock(name)
        for text in texts:
            req = Requirement(text)
            assert req.specifier.contains(pins[canonicalize_name(req.name)]), f"{name}: {text} vs {pins}"
    build = lock("build")
    (backend,) = [Requirement(text) for text in PYPROJECT["build-system"]["requires"]]
    assert backend.specifier.contains(build[canonicalize_name(backend.name)])


def test_torch_version_argument_matches_the_engine_extra() -> None:
    (torch,) = [Requirement(text) for text in PYPROJECT["project"]["optional-dependencies"]["engine"]]
    assert str(torch.specifier) == f"=={args_defaults(ENGINE)['TORCH_VERSION']}"


def test_engine_builds_on_a_cuda_base_with_a_build_argument() -> None:
    defaults = args_defaults(ENGINE)
    global_args = [item.args.split("=")[0] for item in ENGINE[0] if item.keyword == "ARG"]
    assert "BASE" in global_args, "BASE must be declared before the first FROM"
    assert defaults["BASE"] == "python:3.11-slim-bookworm"
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    froms = [item.args.split()[0] for item in all_of(ENGINE, "FROM")]
    assert froms[0] == "${BASE}", "the base image comes from the build argument"
    header = (DOCKER / "engine.Dockerfile").read_text(encoding="utf-8")
    assert re.search(r"--build-arg BASE=nvidia/cuda:\S+-ubuntu24\.04", header), "document the CUDA build"
    assert re.search(r"--build-arg TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu\d+", header)


@pytest.mark.parametrize("name", ["gateway", "engine"])
def test_base_images_are_pinned_by_tag(name: str) -> None:
    stages = IMAGES[name]
    defaults = args_defaults(stages)
    stage_names = {item.args.split()[-1] for item in all_of(stages, "FROM") if " AS " in item.args.upper()}
    for item in all_of(stages, "FROM"):
        image = expand(item.args.split()[0], defaults)
        if image in stage_names:
            continue
        assert re.fullmatch(r"python:3\.11-slim-bookworm", image), f"{name}: {image}"


@pytest.mark.parametrize("name", ["gateway", "engine"])
def test_final_stage_runs_as_a_non_root_user(name: str) -> None:
    stage = final_stage(IMAGES[name])
    users = [item.args for item in stage if item.keyword == "USER"]
    assert users, f"{name}: no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid not in {"root", "0"}
    assert uid.isdigit(), "numeric, so that Kubernetes runAsNonRoot can check it"
    (useradd,) = [item.args for item in stage if item.keyword == "RUN" and "useradd" in item.args]
    assert f"--uid {uid}" in useradd
    # USER comes after every RUN of the final stage, and before CMD.
    keywords = [item.keyword for item in stage]
    assert keywords.index("USER") > max(i for i, keyword in enumerate(keywords) if keyword == "RUN")
    assert keywords.index("USER") < keywords.index("CMD")


@pytest.mark.parametrize(
    ("name", "settings_cls", "config"),
    [("gateway", GatewaySettings, "gateway.yaml"), ("engine", EngineSettings, "engine.yaml")],
)
def test_healthcheck_probes_healthz_on_the_configured_port(name: str, settings_cls: Any, config: str) -> None:
    stage = final_stage(IMAGES[name])
    (healthcheck,) = [item for item in stage if item.keyword == "HEALTHCHECK"]
    options, _, command = healthcheck.args.partition("CMD ")
    assert "--interval=" in options
    words = exec_form(Instruction("CMD", command))
    assert words[:2] == ["python", "/opt/mmgate/healthcheck.py"]
    copies = [item.args.split() for item in stage if item.keyword == "COPY"]
    assert ["docker/healthcheck.py", "/opt/mmgate/healthcheck.py"] in copies
    assert option_values(words, "--path") == ["/healthz"]
    assert option_values(words, "--config") == [f"/etc/mmgate/{config}"]
    assert option_values(words, "--env-prefix") == [settings_cls.model_config["env_prefix"]]
    default_port = settings_cls.model_fields["server"].default.port
    assert option_values(words, "--default-port") == [str(default_port)]
    assert [item.args for item in stage if item.keyword == "EXPOSE"] == [str(default_port)]


@pytest.mark.parametrize(
    ("name", "settings_cls", "module", "config"),
    [
        ("gateway", GatewaySettings, "gateway", "gateway.yaml"),
        ("engine", EngineSettings, "engine_adapter", "engine.yaml"),
    ],
)
def test_cmd_reads_the_documented_config_path_and_the_environment_opens_the_listener(
    name: str, settings_cls: Any, module: str, config: str, clean_mmgate_env: pytest.MonkeyPatch
) -> None:
    stage = final_stage(IMAGES[name])
    (cmd,) = [item for item in stage if item.keyword == "CMD"]
    assert exec_form(cmd) == ["mmgate", name, "--config", f"/etc/mmgate/{config}"]
    copies = [item.args.split() for item in stage if item.keyword == "COPY"]
    assert [f"configs/{config}", f"/etc/mmgate/{config}"] in copies, "a default config is baked in"
    # The image's ENV, applied to the baked-in config with the real settings model: it listens on every interface.
    for item in stage:
        if item.keyword == "ENV":
            for name_value in shlex.split(item.args):
                env_name, _, value = name_value.partition("=")
                if env_name.startswith("MMGATE_"):
                    clean_mmgate_env.setenv(env_name, value)
    settings = load_settings(settings_cls, CONFIGS / config)
    assert settings.server.host == "0.0.0.0"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rules: a path is out when the last pattern matching it or a parent is not `!`."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = "".join(
            ".*" if token == "**" else "[^/]*" if token == "*" else "[^/]" if token == "?" else re.escape(token)
            for token in re.split(r"(\*\*|\*|\?)", body)
        )
        regex = regex.replace(".*/", "(.*/)?")  # `**/x` also matches `x` at the root
        if any(re.fullmatch(regex, candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = dockerignore()
    for path in (".git/HEAD", ".venv/bin/python", "gateway/__pycache__/app.cpython-311.pyc", "tests/servers.py"):
        assert dockerignored(path, patterns), path
    assert not dockerignored("gateway/app.py", patterns)


@pytest.mark.parametrize("name", ["gateway", "engine"])
def test_every_copied_path_exists_and_is_in_the_build_context(name: str) -> None:
    patterns = dockerignore()
    for item in all_of(IMAGES[name], "COPY"):
        if item.args.startswith("--from="):
            continue
        *sources, _ = item.args.split()
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY {source}: not in the repository"
            assert not dockerignored(source, patterns), f"{name}: COPY {source}: excluded by .dockerignore"


def copied_code(stages: list[list[Instruction]]) -> set[str]:
    """The source paths the build copies from the context, less docker/ and configs/ files."""
    sources = {
        source
        for item in all_of(stages, "COPY")
        if not item.args.startswith("--from=")
        for source in item.args.split()[:-1]
    }
    return {source for source in sources if not source.startswith(("docker/", "configs/"))}


def test_gateway_image_copies_only_the_torch_free_packages() -> None:
    # engine_adapter/__init__.py, engine_adapter/client and processor_geometry import no torch (import-linter checks
    # the client and the geometry).
    assert copied_code(GATEWAY) == {
        "pyproject.toml",
        "README.md",
        "gateway",
        "serving",
        "processor_geometry",
        "engine_adapter/__init__.py",
        "engine_adapter/client",
    }
    assert (REPO / "engine_adapter/__init__.py").read_text(encoding="utf-8").strip() == ""
    run = " ".join(item.args for item in all_of(GATEWAY, "RUN"))
    assert "find_spec('torch') is not None" in run, "the build fails if torch got in anyway"
    assert "import gateway.app, gateway.__main__" in run, "the build fails if the gateway misses a module"


def test_engine_image_copies_the_packages_it_runs() -> None:
    assert {"engine_adapter", "encoder_scheduler", "serving", "processor_geometry"} <= copied_code(ENGINE)


# ---------------------------------------------------------------------------------------------- healthcheck.py


@pytest.fixture(scope="module")
def healthcheck() -> ModuleType:
    return load_healthcheck()


@pytest.fixture
def http_server() -> Iterator[tuple[int, dict[str, int]]]:
    status = {"/healthz": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status.get(self.path, 404))
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], status
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_port_environment_beats_yaml_beats_default(healthcheck: ModuleType, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  port: 9001\n", encoding="utf-8")
    assert healthcheck.listen_port(str(config), "MMGATE_", 8000, {}) == 9001
    assert healthcheck.listen_port(str(config), "MMGATE_", 8000, {"MMGATE_SERVER__PORT": "9002"}) == 9002
    # The engine's variables carry their own prefix: the gateway's do not move it.
    assert healthcheck.listen_port(str(config), "MMGATE_ENGINE_", 8100, {"MMGATE_SERVER__PORT": "9002"}) == 9001
    config.write_text("server:\n  host: 0.0.0.0\n", encoding="utf-8")
    assert healthcheck.listen_port(str(config), "MMGATE_", 8000, {}) == 8000
    assert healthcheck.listen_port(str(tmp_path / "missing.yaml"), "MMGATE_", 8000, {}) == 8000


def test_healthcheck_probes_healthz_on_the_metrics_listener_when_there_is_one(
    healthcheck: ModuleType, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("server:\n  port: 9001\n  metrics_port: 9100\n", encoding="utf-8")
    assert healthcheck.probe_port(str(config), "MMGATE_", 8000, "/healthz", {}) == 9100
    assert healthcheck.probe_port(str(config), "MMGATE_", 8000, "/readyz", {}) == 9001, "only /healthz is served there"
    environ = {"MMGATE_SERVER__METRICS_PORT": "9200"}
    assert healthcheck.probe_port(str(config), "MMGATE_", 8000, "/healthz", environ) == 9200
    environ = {"MMGATE_SERVER__METRICS_PORT": "null"}
    assert healthcheck.probe_port(str(config), "MMGATE_", 8000, "/healthz", environ) == 9001
    config.write_text("server:\n  port: 9001\n  metrics_port: null\n", encoding="utf-8")
    assert healthcheck.probe_port(str(config), "MMGATE_", 8000, "/healthz", {}) == 9001


def test_healthcheck_exit_status_follows_the_answer(
    healthcheck: ModuleType,
    http_server: tuple[int, dict[str, int]],
    tmp_path: Path,
    clean_mmgate_env: pytest.MonkeyPatch,
) -> None:
    port, status = http_server
    config = tmp_path / "gateway.yaml"
    config.write_text(f"server:\n  port: {port}\n", encoding="utf-8")
    argv = ["--config", str(config), "--env-prefix", "MMGATE_", "--default-port", "1", "--timeout", "2"]
    assert healthcheck.main(argv) == 0
    status["/healthz"] = 503
    assert healthcheck.main(argv) == 1
    assert healthcheck.main([*argv, "--path", "/elsewhere"]) == 1
    with socket_closed_port() as closed:
        config.write_text(f"server:\n  port: {closed}\n", encoding="utf-8")
        assert healthcheck.main(argv) == 1


class socket_closed_port:
    """A loopback port with nothing listening on it."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        port: int = self.sock.getsockname()[1]
        return port  # bound, not listening: connections are refused

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


@pytest.mark.slow
def test_what_the_gateway_image_runs_loads_no_torch() -> None:
    code = (
        "import sys, gateway.__main__, gateway.app, engine_adapter.client, processor_geometry, serving.cli;"
        "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'encoder_scheduler')) != [])"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60).returncode == 0
