"""The peak resident growth of one call per image of `test_image_decode.peak_cases`: each call in a forked child
of a fresh interpreter, after a warm-up call on a small image of the same case, with the peak reset to the
child's current size first (`/proc/self/clear_refs`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = """
import ctypes, importlib, json, os, resource, sys
from tests.gateway.media.image.test_decode import peak_cases

module, name, side = sys.argv[1], sys.argv[2], int(sys.argv[3])
work = getattr(importlib.import_module(module), name)
cases = peak_cases(side)
small = peak_cases(64)
libc = ctypes.CDLL("libc.so.6")

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

results = {}
for case, (data, _) in cases.items():
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        libc.malloc_trim(0)  # free heap pages stop being resident: the call reusing them is counted
        work(small[case][0], "warm-up")  # what any call touches first
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # the peak restarts from the current size
        before = resident()
        said = work(data, case)
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        os.write(writer, json.dumps([grown, said]).encode())
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as pipe:
        results[case] = json.loads(pipe.read())
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


def resident_peaks(work: str, side: int) -> dict[str, tuple[int, Any]]:
    """Per case, (peak growth in bytes, what the call returned): `work` is "module:function", a function of
    (data, locator) returning something JSON can carry."""
    if not sys.platform.startswith("linux"):
        pytest.skip("measures resident memory through /proc and fork")
    module, name = work.split(":")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, module, name, str(side)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    measured: dict[str, list[Any]] = json.loads(done.stdout)
    return {case: (int(grown), said) for case, (grown, said) in measured.items()}
