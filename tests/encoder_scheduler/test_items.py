from __future__ import annotations

import pytest
import torch

import encoder_scheduler.items as items_module
from encoder_scheduler import (
    EncoderBudget,
    EncoderCache,
    EncoderCacheKey,
    EncoderItem,
    EncoderRequest,
    EncoderScheduler,
)
from tests.encoder_scheduler.helpers import encode_plan, item, request


def test_item_rejects_nonpositive_costs() -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        EncoderItem("image", 0, 1)
    with pytest.raises(ValueError, match="num_embeddings"):
        EncoderItem("image", 4, 0)
    with pytest.raises(ValueError, match="modality"):
        EncoderItem("", 4, 1)


def test_item_from_grid_thw_uses_prod_and_merge() -> None:
    it = EncoderItem.from_grid_thw("video", (2, 8, 12), content_hash="h")
    assert it.num_tokens == 2 * 8 * 12
    assert it.num_embeddings == 2 * 8 * 12 // 4
    assert it.content_hash == "h"
    with pytest.raises(ValueError, match="divisible"):
        EncoderItem.from_grid_thw("image", (1, 7, 8))


def test_request_derives_offsets_footprint_and_keys_once() -> None:
    req = request(
        "r",
        [item(10, 3, "a"), item(20, 5), item(30, 2, "c", modality="video")],
        width=8,
        dtype=torch.bfloat16,
        processor_key="max_pixels=100",
    )
    assert isinstance(req.items, tuple)
    assert req.offsets == (0, 3, 8, 10)
    assert req.total_rows == 10
    assert req.item_tokens == (10, 20, 30)
    assert req.total_tokens == 60
    assert req.footprint_bytes == 10 * 8 * 2
    assert req.cache_keys == (
        EncoderCacheKey("image", "a", 3, "max_pixels=100"),
        None,
        EncoderCacheKey("video", "c", 2, "max_pixels=100"),
    )


def test_request_without_any_hash_is_unkeyable() -> None:
    assert request("r", [item(1), item(2)]).cache_keys is None


def test_request_validation() -> None:
    with pytest.raises(ValueError, match="at least one item"):
        request("r", [])
    with pytest.raises(ValueError, match="embedding_width"):
        request("r", [item(1)], width=0)
    with pytest.raises(TypeError, match="EncoderItem"):
        EncoderRequest("r", 4, torch.float32, [("image", 1, 1)])  # type: ignore[list-item]


def test_metadata_is_not_recomputed_per_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """After submit, scheduling, recording and taking never rebuild offsets or cache keys."""
    sched = EncoderScheduler(EncoderBudget(1, 100, None), cache=EncoderCache(1 << 20))
    reqs = [request(f"r{n}", [item(5, 2, f"h{n}{k}") for k in range(4)]) for n in range(3)]
    for req in reqs:
        sched.submit(req)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("per-request metadata recomputed after submit")

    monkeypatch.setattr(items_module, "accumulate", boom)
    monkeypatch.setattr(items_module, "EncoderCacheKey", boom)
    done = 0
    for _ in range(20):
        done += len(encode_plan(sched, sched.schedule()))
    assert done == 3
