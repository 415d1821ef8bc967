"""The start-up check of the gateway's bounds against its container's memory limit (gateway/memory_fit.py), with a
real gateway process put in a real memory cgroup of this machine: past the limit it refuses to start, naming the keys
and the limit; within it, it serves."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
import yaml

from gateway import memory_fit
from gateway.config import GatewaySettings
from serving.cgroup import MemoryLimit
from serving.settings_loader import ConfigError
from tests.servers import ROOT, served_process

GIB = 1 << 30


def own_memory_cgroup() -> tuple[Path, str] | None:
    """This process's memory cgroup directory and the name of its limit file (v1, or v2 with the memory controller
    delegated to children), where this process may make a child; None otherwise."""
    cgroups = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    for line in cgroups:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            directory = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (directory / "memory.limit_in_bytes").exists() and os.access(directory, os.W_OK):
                return directory, "memory.limit_in_bytes"
    for line in cgroups:
        if line.startswith("0::"):
            directory = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            subtree = directory / "cgroup.subtree_control"
            if subtree.exists() and "memory" in subtree.read_text() and os.access(directory, os.W_OK):
                return directory, "memory.max"
    return None


@contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A child memory cgroup limited to `limit` bytes (removed afterwards); skips where none can be made."""
    found = own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup this process may make a child of (cgroup v1, or v2 with memory delegated)")
    parent, name = found
    child = parent / f"mmgate-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / name).write_text(str(limit))
    except OSError as exc:
        with suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent}: {exc}")
    try:
        yield child
    finally:
        with suppress(OSError):
            child.rmdir()


def in_cgroup(child: Path) -> list[str]:
    """`python -m gateway` started inside `child` (its arguments follow)."""
    return ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh", sys.executable, "-m", "gateway"]


def config(tmp_path: Path, **limits: object) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"server": {"access_log": False}, "limits": limits}), encoding="utf-8")
    return path


def clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("MMGATE_")}


@pytest.mark.slow
def test_bounds_past_the_containers_memory_limit_stop_the_start_naming_the_keys_and_the_limit(tmp_path: Path) -> None:
    """The defaults (a 2 GiB media budget, 2 GiB of bodies) in a 3 GiB container: status 2 and one line that says
    what adds up to what, against which limit."""
    with memory_cgroup(3 * GIB) as child:
        result = subprocess.run(
            [*in_cgroup(child), "--config", str(config(tmp_path)), "--port", "0"],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "limits.max_multimodal_cpu_bytes=2GiB + limits.max_buffered_body_bytes=2GiB" in last
    assert "= 4352MiB, over the cgroup limit of 3GiB" in last
    assert str(child) in last


@pytest.mark.slow
def test_bounds_within_the_limit_start_and_serve(tmp_path: Path) -> None:
    with memory_cgroup(3 * GIB) as child:
        path = config(tmp_path, max_multimodal_cpu_bytes="1GiB", max_buffered_body_bytes="1GiB")
        log = tmp_path / "gateway.log"
        with served_process("gateway", path, env=clean_env(), command=in_cgroup(child), log=log) as gateway:
            assert httpx.get(gateway.url + "/healthz", timeout=5).status_code == 200
            assert str(gateway.process.pid) in (child / "cgroup.procs").read_text().split()
        assert "fit the cgroup limit of 3GiB" in log.read_text()


def test_workers_add_a_baseline_each_and_the_supervisor_one() -> None:
    limits = {"max_multimodal_cpu_bytes": "1GiB", "max_multimodal_cpu_bytes_per_request": "128MiB"}
    one = GatewaySettings(limits={**limits, "max_buffered_body_bytes": "1GiB"})
    four = GatewaySettings(server={"workers": 4}, limits={**limits, "max_buffered_body_bytes": "1GiB"})
    overhead = memory_fit.PROCESS_OVERHEAD_BYTES
    assert memory_fit.required_bytes(one) == 2 * GIB + overhead
    assert memory_fit.required_bytes(four) == 2 * GIB + 5 * overhead
    limit = MemoryLimit(2 * GIB + 2 * overhead, Path("/sys/fs/cgroup/memory.max"))
    memory_fit.check(one, limit)
    with pytest.raises(ConfigError, match=r"5 process\(es\) x 256MiB \(server.workers=4\)"):
        memory_fit.check(four, limit)
    memory_fit.check(GatewaySettings(server={"workers": 4, "check_memory_limit": False}, limits=limits), limit)
    memory_fit.check(four, None)  # no limit: nothing to check
