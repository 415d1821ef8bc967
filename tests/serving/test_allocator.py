"""`serving.allocator`: with the policy set, memory freed after a burst of large blocks leaves the process.

glibc's dynamic mmap threshold is what keeps it otherwise: once a 1 MiB block has been freed, 512 KiB blocks come
from the heap, and one of them still held at the top of the heap keeps every freed one below it resident.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from tests.servers import ROOT

_BURST = """
import ctypes, sys
from serving.allocator import tune_allocator
from tests.observe import process_memory
if sys.argv[1] == "tuned":
    assert tune_allocator() is not None
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
print((before - process_memory("self")) >> 20)
"""


def freed_mib(mode: str) -> int:
    """MiB of RSS given back after freeing 199.5 MiB of 200, in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-c", _BURST, mode], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    )
    return int(result.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the C library is not glibc")
def test_the_tuned_allocator_gives_freed_memory_back_and_the_default_keeps_it() -> None:
    assert freed_mib("tuned") >= 190
    assert freed_mib("default") < 20
