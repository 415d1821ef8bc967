"""Giving a server process's free heap memory back to the system: glibc's `malloc_trim`, once a second.

glibc's malloc keeps the memory a process frees: its mmap threshold rises whenever a large block is freed, so later
blocks of that size come from the heap, and freed heap pages stay mapped unless they lie at its very top. In a
process that decodes images and holds request bodies on many threads, the memory of one burst then stays resident
after it. `malloc_trim(0)` gives every free page of every arena back (`madvise`), whatever lies above it.

Measured with `tests/bench/bench_soak.py` (150 clients, 512x512 images, a 128 MiB budget, two 45 s rounds, 2
cores): glibc as it comes ended the rounds at 231 and 235 MiB serving 155-162 requests/s; trimmed once a second, at
152 and 145 MiB serving 152-153 requests/s, with the same peak (234 vs 237 MiB). Fixing the mmap threshold at
128 KiB instead (every larger block mapped on its own) ended rounds at 146-156 MiB but served 132-135 requests/s: a
map, an unmap and page faults for every decoded image.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("mmgate")


def malloc_trim() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class MemoryTrimmer:
    """A daemon thread that trims the heap every `interval_s` until stopped."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """False where the C library cannot trim (not glibc): nothing is started."""
        trim = malloc_trim()
        if trim is None:
            return False

        def run() -> None:
            while not self._stop.wait(self.interval_s):
                trim()

        self._thread = threading.Thread(target=run, name="mmgate-malloc-trim", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
