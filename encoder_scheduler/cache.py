"""Byte-bounded LRU cache of per-item encoder outputs."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

import torch


class EncoderCacheKey(NamedTuple):
    """Identity of one item's encoder output.

    Two items with equal keys produce the same rows, so one may be served from the other's output.
    """

    modality: str
    content_hash: str
    num_embeddings: int
    processor_key: str


def processor_kwargs_key(kwargs: Mapping[str, object] | None) -> str:
    """A stable string for the processor kwargs that shape an item's output (min/max pixels, fps, ...)."""
    if not kwargs:
        return ""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), default=repr)


class EncoderCache:
    """LRU cache of encoder outputs, bounded by the bytes of the tensors it holds.

    The cache owns its storage: `put` stores a private copy, and `get` returns the cache-owned tensor, which
    callers must only read (the scheduler copies it into the request's buffer). So the cache never shares
    storage with a request buffer in either direction, and evicting an entry really frees its bytes.
    """

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"encoder cache max_bytes must be a non-negative integer, got {max_bytes!r}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[EncoderCacheKey, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Membership without touching recency or the hit/miss counters."""
        return key in self._entries

    def get(self, key: EncoderCacheKey) -> torch.Tensor | None:
        """The cached output (cache-owned; read only) and mark it most recently used, or None."""
        tensor = self._entries.get(key)
        if tensor is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return tensor

    def put(self, key: EncoderCacheKey, output: torch.Tensor) -> bool:
        """Store a private copy of `output` under `key`, evicting least recently used entries to make room.

        Returns False (and stores nothing) when the output alone is larger than the cache.
        """
        nbytes = output.numel() * output.element_size()
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old.numel() * old.element_size()
        if nbytes > self._max_bytes:
            return False
        while self._bytes + nbytes > self._max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.numel() * evicted.element_size()
            self.evictions += 1
        self._entries[key] = output.detach().clone(memory_format=torch.contiguous_format)
        self._bytes += nbytes
        return True

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0
