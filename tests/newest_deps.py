"""The HTTP-limits and Redis tests against the newest uvicorn and redis-py releases: `make newest-deps` (CI runs it
after `make test`).

    .venv/bin/python -m tests.newest_deps [--uvicorn SPEC] [--redis SPEC]

pyproject.toml caps uvicorn and redis-py at the newest release tested, because serving/uvicorn_private.py and
gateway/budget/redis_private.py reach into their internals. This installs the newest releases (or the ones SPEC
names, e.g. `uvicorn[standard]==0.30.0`) with their own dependencies into a scratch venv, which takes everything
else from .venv, runs the tests that exercise those reaches, and prints one line starting `newest-deps:` that says
what it found. It exits 0 whatever it finds: a release that breaks the tests, or a package index out of reach, is
reported, not a CI failure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PREFIX = "newest-deps:"
# What runs the code of serving/uvicorn_private.py and gateway/budget/redis_private.py.
TEST_GLOBS = (
    "tests/serving/test_http_limits*.py",
    "tests/serving/test_uvicorn_private.py",
    "tests/gateway/budget/test_redis*.py",
    "tests/gateway/budget/redis/test_*.py",
)
# Backstops: a pip that waits on an index which does not answer, a test run that hangs.
INSTALL_TIMEOUT_S = 180
TESTS_TIMEOUT_S = 900


def files_to_test() -> dict[str, list[str]]:
    """The files of each of `TEST_GLOBS`, by pattern."""
    return {pattern: [str(path.relative_to(REPO)) for path in sorted(REPO.glob(pattern))] for pattern in TEST_GLOBS}


def version_specifiers(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """Each dependency's version specifier in pyproject.toml, by distribution name (`uvicorn`: `<=0.55.0,>=0.30`)."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {(req := Requirement(line)).name: str(req.specifier) for line in dependencies}


def verdict(versions: dict[str, str], specifiers: dict[str, str], passed: bool) -> str:
    """The line that says what the run found, for versions of the distributions tested."""
    named = []
    beyond = []
    for name, version in versions.items():
        specifier = specifiers.get(name, "")
        admitted = Requirement(f"{name}{specifier}").specifier.contains(Version(version), prereleases=True)
        named.append(f"{name} {version}" + ("" if admitted else f" (pyproject.toml: {specifier})"))
        if not admitted:
            beyond.append(name)
    tested = ", ".join(named)
    if not passed:
        return (
            f"{PREFIX} BROKEN: {tested} fail the HTTP-limits or Redis tests (the failures are above); "
            "pyproject.toml's upper bounds keep the releases tested"
        )
    if beyond:
        return (
            f"{PREFIX} {tested} pass the HTTP-limits and Redis tests: the upper bound of {', '.join(beyond)} may rise"
        )
    return f"{PREFIX} {tested} pass the HTTP-limits and Redis tests; pyproject.toml admits them"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def run(specs: list[str], tests: list[str], *, scratch: Path) -> str:
    """Install `specs` into a venv at `scratch`, run `tests` with it, and say what happened."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(scratch)], check=True)
    python = scratch / "bin" / "python"
    # An index that does not answer costs a couple of 20-second socket timeouts, not pip's default minutes.
    install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--retries", "1"]
    install += ["--timeout", "20"]
    try:
        subprocess.run(
            [*install, *specs], check=True, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, cwd=REPO
        )
    except subprocess.CalledProcessError as exc:
        return f"{PREFIX} SKIPPED: could not install {' '.join(specs)} (is the package index reachable?): " + (
            _last_line(exc.stderr)
        )
    except subprocess.TimeoutExpired:
        return f"{PREFIX} SKIPPED: installing {' '.join(specs)} took over {INSTALL_TIMEOUT_S} s"
    # Everything else comes from .venv (this interpreter's), after the scratch venv's own packages.
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(python), "-c", where], check=True, capture_output=True, text=True).stdout.strip())
    (site / "mmgate_newest_deps.pth").write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    # What the tests will import, found without importing it (a release that fails to import fails the tests).
    probe = (
        "import importlib.metadata, importlib.util, sys\n"
        "for name in sys.argv[1:]:\n"
        "    print(name, importlib.metadata.version(name), importlib.util.find_spec(name).origin)\n"
    )
    names = [Requirement(spec).name for spec in specs]
    found = subprocess.run([str(python), "-c", probe, *names], check=True, capture_output=True, text=True, cwd=REPO)
    versions = {}
    for line in found.stdout.splitlines():
        name, version, origin = line.split(" ", 2)
        if not Path(origin).is_relative_to(site):
            raise RuntimeError(f"{name} would be imported from {origin}, not from the scratch venv")
        versions[name] = version
    print(f"{PREFIX} testing {', '.join(f'{name} {version}' for name, version in versions.items())}", flush=True)
    try:
        result = subprocess.run(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO, timeout=TESTS_TIMEOUT_S
        )
        passed = result.returncode == 0
    except subprocess.TimeoutExpired:
        print(f"{PREFIX} the tests did not finish in {TESTS_TIMEOUT_S} s", flush=True)
        passed = False
    return verdict(versions, version_specifiers(), passed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.newest_deps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uvicorn", default="uvicorn[standard]", help="what to install of uvicorn (pip's form)")
    parser.add_argument("--redis", default="redis[hiredis]", help="what to install of redis-py (pip's form)")
    parser.add_argument("tests", nargs="*", help="the tests to run (default: the HTTP-limits and Redis tests)")
    args = parser.parse_args(argv)
    tests = args.tests or [name for files in files_to_test().values() for name in files]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mmgate-newest-deps-") as scratch:
        line = run([args.uvicorn, args.redis], tests, scratch=Path(scratch) / "venv")
    print(f"{line} ({time.monotonic() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
