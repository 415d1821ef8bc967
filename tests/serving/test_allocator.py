"""`serving.allocator`: memory freed after a burst of large blocks leaves the process once the heap is trimmed, and
stays without it; the trimmer trims on its interval and stops.

glibc's dynamic mmap threshold is what keeps it otherwise: once a 1 MiB block has been freed, 512 KiB blocks come
from the heap, and one of them still held at the top of the heap keeps every freed one below it resident.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from serving.allocator import MemoryTrimmer, malloc_trim
from tests.observe import wait_until
from tests.servers import ROOT

_BURST = """
import ctypes, sys, time
from serving.allocator import MemoryTrimmer
from tests.observe import process_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.free(libc.malloc(1 << 20))  # raises glibc's dynamic mmap threshold to 1 MiB
blocks = [libc.malloc(512 << 10) for _ in range(400)]  # 200 MiB
for block in blocks:
    ctypes.memset(block, 1, 512 << 10)
before = process_memory("self")
for block in blocks[:-1]:  # the last one stays: the top of the heap
    libc.free(block)
if sys.argv[1] == "trimmed":
    trimmer = MemoryTrimmer(0.05)
    assert trimmer.start()
    time.sleep(0.5)
    trimmer.stop()
else:
    time.sleep(0.5)
print((before - process_memory("self")) >> 20)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the C library is not glibc")


def freed_mib(mode: str) -> int:
    """MiB of RSS given back after freeing 199.5 MiB of 200, in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-c", _BURST, mode], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return int(result.stdout)


def test_trimming_gives_freed_memory_back_and_glibc_alone_keeps_it() -> None:
    assert freed_mib("trimmed") >= 190
    assert freed_mib("kept") < 20


def test_the_trimmer_trims_on_its_interval_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    trim = malloc_trim()
    assert trim is not None
    monkeypatch.setattr("serving.allocator.malloc_trim", lambda: lambda: trims.append(1))
    trimmer = MemoryTrimmer(0.01)
    assert trimmer.start()
    wait_until(lambda: len(trims) >= 3, 10, "three trims")
    trimmer.stop()
    stopped_at = len(trims)
    assert not trimmer._thread.is_alive()  # type: ignore[union-attr]
    assert len(trims) == stopped_at
