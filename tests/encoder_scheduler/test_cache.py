from __future__ import annotations

import pytest
import torch

from encoder_scheduler import EncoderCache, EncoderCacheKey, processor_kwargs_key


def key(name: str, rows: int = 2) -> EncoderCacheKey:
    return EncoderCacheKey("image", name, rows, "")


def tensor(rows: int = 2, width: int = 4, value: float = 1.0) -> torch.Tensor:
    return torch.full((rows, width), value)


def test_put_stores_a_private_copy_and_get_counts() -> None:
    cache = EncoderCache(1 << 10)
    source = tensor(value=3.0)
    assert cache.put(key("a"), source)
    source.fill_(-1)  # the caller reusing its tensor must not change the cached output
    cached = cache.get(key("a"))
    assert cached is not None
    assert torch.equal(cached, tensor(value=3.0))
    assert cached.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert cache.get(key("missing")) is None
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.bytes_used == 2 * 4 * 4
    assert len(cache) == 1


def test_put_of_a_view_stores_only_the_view() -> None:
    cache = EncoderCache(1 << 20)
    big = torch.zeros(1000, 4)
    cache.put(key("a"), big[10:12])
    assert cache.bytes_used == 2 * 4 * 4
    cached = cache.get(key("a"))
    assert cached is not None
    assert cached.untyped_storage().nbytes() == 2 * 4 * 4


def test_lru_eviction_is_byte_bounded() -> None:
    entry = 2 * 4 * 4
    cache = EncoderCache(3 * entry)
    for name in "abc":
        cache.put(key(name), tensor())
    assert cache.get(key("a")) is not None  # a becomes most recent; b is now the oldest
    cache.put(key("d"), tensor())
    assert key("b") not in cache
    assert all(key(name) in cache for name in "acd")
    assert cache.bytes_used == 3 * entry
    assert cache.evictions == 1
    cache.put(key("big", rows=4), tensor(rows=4))  # needs two entries' room: evicts c, then a
    assert key("c") not in cache
    assert key("a") not in cache
    assert cache.bytes_used == 3 * entry


def test_contains_does_not_touch_recency_or_counters() -> None:
    entry = 2 * 4 * 4
    cache = EncoderCache(2 * entry)
    cache.put(key("a"), tensor())
    cache.put(key("b"), tensor())
    assert key("a") in cache
    cache.put(key("c"), tensor())
    assert key("a") not in cache
    assert (cache.hits, cache.misses) == (0, 0)


def test_oversized_entry_is_refused_and_replacing_a_key_keeps_accounting_exact() -> None:
    cache = EncoderCache(100)
    assert not cache.put(key("huge", rows=100), tensor(rows=100))
    assert len(cache) == 0
    assert cache.bytes_used == 0
    cache.put(key("a"), tensor(value=1.0))
    cache.put(key("a"), tensor(value=2.0))
    assert cache.bytes_used == 32
    assert len(cache) == 1
    cached = cache.get(key("a"))
    assert cached is not None
    assert cached[0, 0].item() == 2.0
    cache.clear()
    assert cache.bytes_used == 0
    assert len(cache) == 0


def test_invalid_max_bytes() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        EncoderCache(-1)


def test_processor_kwargs_key_is_stable() -> None:
    assert processor_kwargs_key(None) == processor_kwargs_key({}) == ""
    assert processor_kwargs_key({"b": 1, "a": [2, 3]}) == processor_kwargs_key({"a": [2, 3], "b": 1})
    assert processor_kwargs_key({"max_pixels": 1}) != processor_kwargs_key({"max_pixels": 2})
