"""A process's config file written for a test, and the process's command line run for real on it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.servers import ROOT


def write_config(directory: Path, text: str) -> Path:
    """`text` as the YAML file `directory/config.yaml`; its path."""
    path = directory / "config.yaml"
    path.write_text(text)
    return path


def run_module(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m <module> [args]` from the repository root, to its exit (at most 60 s); its output as text."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)
