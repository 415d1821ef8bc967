"""The benchmarks (run by hand) and the end-to-end tests (`make e2e`, not collected by `make test`) still import:
a module they use that moves or is renamed breaks them here, not first on the next real-vLLM run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(folder: str) -> list[str]:
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in (ROOT / folder).glob("*.py")
        if path.name != "__init__.py"
    )


def test_every_benchmark_and_end_to_end_module_imports() -> None:
    modules = _modules("tests/bench") + _modules("tests/e2e")
    assert len(modules) > 20
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    # A process of its own: the benchmarks put the repository on sys.path and import torch and vLLM's helpers.
    done = subprocess.run(
        [sys.executable, "-c", script, *modules], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
