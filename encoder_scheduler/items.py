"""Atomic encoder items and the requests that carry them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from encoder_scheduler.cache import EncoderCacheKey


@dataclass(frozen=True, slots=True)
class EncoderItem:
    """One atomic encoder input: one image or one video.

    modality: e.g. ``"image"`` or ``"video"``.
    num_tokens: encoder cost, in pre-merger attention tokens (Qwen2-VL family: ``prod(grid_thw)``).
    num_embeddings: rows the item contributes to the request's output buffer.
    content_hash: identity of the media, for the encoder cache; None makes the item uncacheable.
    """

    modality: str
    num_tokens: int
    num_embeddings: int
    content_hash: str | None = None

    def __post_init__(self) -> None:
        if not self.modality:
            raise ValueError("EncoderItem.modality must be a non-empty string")
        for name in ("num_tokens", "num_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EncoderItem.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_grid_thw(
        cls,
        modality: str,
        grid_thw: Sequence[int],
        *,
        spatial_merge_size: int = 2,
        content_hash: str | None = None,
    ) -> EncoderItem:
        """A Qwen2-VL-family item: ``prod(grid_thw)`` patches, merged ``spatial_merge_size**2`` to one row."""
        if len(grid_thw) != 3:
            raise ValueError(f"grid_thw must have 3 entries (t, h, w), got {list(grid_thw)}")
        t, h, w = (int(v) for v in grid_thw)
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"grid_thw {[t, h, w]} is not divisible by spatial_merge_size={spatial_merge_size}")
        tokens = t * h * w
        return cls(modality, tokens, tokens // (spatial_merge_size * spatial_merge_size), content_hash)


@dataclass(frozen=True, slots=True)
class EncoderRequest:
    """A request's encoder work: its items in prompt order and the shape of its output buffer.

    The derived fields are computed once here, at construction, and never per iteration:
    `offsets` (row offsets of each item in the buffer, ``len(items) + 1`` entries, the last one the total
    rows), `item_tokens`, `total_tokens`, `footprint_bytes` (the buffer's size) and `cache_keys` (per item,
    None where the item has no content hash; None as a whole when no item is cacheable).
    `processor_key` distinguishes outputs of the same media under different processor kwargs
    (see `processor_kwargs_key`).
    """

    request_id: str
    embedding_width: int
    dtype: torch.dtype
    items: Sequence[EncoderItem]
    processor_key: str = ""
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    item_tokens: tuple[int, ...] = field(init=False, repr=False, compare=False)
    total_tokens: int = field(init=False, repr=False, compare=False)
    footprint_bytes: int = field(init=False, repr=False, compare=False)
    cache_keys: tuple[EncoderCacheKey | None, ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        items = tuple(self.items)
        if not self.request_id:
            raise ValueError("EncoderRequest.request_id must be a non-empty string")
        if not items:
            raise ValueError(f"request {self.request_id}: an encoder request needs at least one item")
        for item in items:
            if not isinstance(item, EncoderItem):
                raise TypeError(f"request {self.request_id}: items must be EncoderItem, got {type(item).__name__}")
        width = self.embedding_width
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"request {self.request_id}: embedding_width must be a positive integer, got {width!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"request {self.request_id}: dtype must be a torch.dtype, got {self.dtype!r}")
        offsets = (0, *accumulate(item.num_embeddings for item in items))
        keys = tuple(
            None
            if item.content_hash is None
            else EncoderCacheKey(item.modality, item.content_hash, item.num_embeddings, self.processor_key)
            for item in items
        )
        setattr_ = object.__setattr__
        setattr_(self, "items", items)
        setattr_(self, "offsets", offsets)
        item_tokens = tuple(item.num_tokens for item in items)
        setattr_(self, "item_tokens", item_tokens)
        setattr_(self, "total_tokens", sum(item_tokens))
        setattr_(self, "footprint_bytes", offsets[-1] * width * self.dtype.itemsize)
        setattr_(self, "cache_keys", keys if any(key is not None for key in keys) else None)

    @property
    def num_items(self) -> int:
        return len(self.items)

    @property
    def total_rows(self) -> int:
        return self.offsets[-1]
