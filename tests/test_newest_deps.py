"""`tests/newest_deps.py` (`make newest-deps`): what it reports, and that it never fails CI."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from tests.newest_deps import PREFIX, REPO, files_to_test, verdict, version_specifiers


@pytest.mark.parametrize("name", ["uvicorn", "redis"])
def test_the_libraries_whose_internals_are_used_have_an_upper_bound(name: str) -> None:
    specifier = Requirement(f"{name}{version_specifiers()[name]}").specifier
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in specifier), specifier


def test_releases_the_bounds_admit_that_pass_are_reported_as_such() -> None:
    line = verdict({"uvicorn": "0.55.0", "redis": "8.2.0"}, {"uvicorn": "<=0.55.0,>=0.30", "redis": "<=8.2.0"}, True)
    assert (
        line == f"{PREFIX} uvicorn 0.55.0, redis 8.2.0 pass the HTTP-limits and Redis tests; pyproject.toml admits them"
    )


def test_a_newer_release_that_passes_names_the_bound_to_raise() -> None:
    line = verdict({"uvicorn": "0.56.0", "redis": "8.2.0"}, {"uvicorn": "<=0.55.0,>=0.30", "redis": "<=8.2.0"}, True)
    assert line.startswith(f"{PREFIX} uvicorn 0.56.0 (pyproject.toml: <=0.55.0,>=0.30), redis 8.2.0 pass "), line
    assert line.endswith("the upper bound of uvicorn may rise"), line


def test_a_release_that_breaks_the_tests_is_reported_broken() -> None:
    line = verdict({"uvicorn": "0.55.0", "redis": "9.0.0"}, {"uvicorn": "<=0.55.0", "redis": "<=8.2.0"}, False)
    assert line.startswith(f"{PREFIX} BROKEN: uvicorn 0.55.0, redis 9.0.0 (pyproject.toml: <=8.2.0) fail "), line


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.newest_deps", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_package_index_out_of_reach_is_reported_and_the_step_succeeds() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # nothing listens there once the socket closes
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    # No pip configuration (its local indexes and wheel folders), and an index that refuses connections.
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"http://127.0.0.1:{closed}/simple/")
    result = run_script(env=env)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{PREFIX} SKIPPED: could not install uvicorn[standard] redis[hiredis]"), result.stdout


def test_every_pattern_of_the_tests_it_runs_names_files() -> None:
    """A test module that moves must not silently drop out of the step."""
    for pattern, files in files_to_test().items():
        assert files, pattern
