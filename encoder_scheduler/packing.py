"""Declared encoder input fields and packing of selected items' inputs across requests.

`batch_encoder_inputs(fields, inputs)` takes one entry per selected piece of work, in encode order. An entry
is either

* a ``Mapping[str, Tensor | None]``: one item's own tensors, taken whole; the field's first source key that is
  present and not None supplies it; or
* an `ItemRange`: items ``[start, stop)`` of one request whose inputs are request-level tensors (every item's
  rows concatenated along the field's concat axis) described by a `RequestInputs`; the field's first source
  with rows for those items supplies them. A range whose items come from different sources (an image next to
  a video) is resolved item by item, in item order.

Consecutive `ItemRange` entries of the same `RequestInputs` whose rows are adjacent under the same source key
are merged, so a run of adjacent items becomes one slice (a view) of the request-level tensor, however the
caller splits it (one entry per item is fine). The packed tensors are fresh allocations: they never alias the
inputs, and the inputs are never modified.

Engine recipe (Qwen2-VL family), once per request when it arrives::

    inputs = RequestInputs.from_item_rows(
        {"pixel_values": image_patches, "image_grid_thw": image_grids,
         "pixel_values_videos": video_patches, "video_grid_thw": video_grids},
        {"pixel_values": [prod(thw) if image else 0 for each item],
         "image_grid_thw": [1 if image else 0 for each item],
         "pixel_values_videos": [prod(thw) if video else 0 for each item],
         "video_grid_thw": [1 if video else 0 for each item]},
    )

and every iteration, with ``fields = [EncoderInputField("pixel_values", ("pixel_values",
"pixel_values_videos")), EncoderInputField("grid_thw", ("image_grid_thw", "video_grid_thw"))]``::

    packed = batch_encoder_inputs(fields, [inputs_of[rid].items(i, i + 1) for rid, i in plan])

Qwen3-VL layout (`batch_qwen3_vl_inputs`): the processor output keys (``pixel_values`` / ``image_grid_thw`` for
images, ``pixel_values_videos`` / ``video_grid_thw`` for videos), packed as the canonical ``pixel_values`` and
``grid_thw`` columns with every selected image first and every selected video after, each in selection order, the
two columns gathered from the same entry order so row ``k`` of ``grid_thw`` describes the ``k``-th block of
``pixel_values``. It reorders the entries and packs them with `batch_encoder_inputs`, so the same rules hold: one
``torch.cat`` per field without pad axes, declared padding for the others, fresh output storage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from typing import Literal, NamedTuple

import torch

from encoder_scheduler.errors import MissingInputError


@dataclass(frozen=True, slots=True)
class EncoderInputField:
    """One encoder input field and how to pack it.

    name: the key in the packed output.
    sources: input keys to read it from, in order of preference (aliases, e.g. ``("pixel_values",
        "pixel_values_videos")``); the first key present and not None wins. Empty means ``(name,)``.
    concat_axis: the axis pieces are concatenated along.
    pad_axes: axes along which shorter pieces are right-padded to the longest, with `fill_value`. Every other
        axis must match exactly.
    required: when True, an item without the field raises MissingInputError; when False, such items contribute
        nothing to it, and a field no item has is left out of the output.
    """

    name: str
    sources: tuple[str, ...] = ()
    concat_axis: int = 0
    pad_axes: tuple[int, ...] = ()
    fill_value: float | int | bool = 0.0
    required: bool = True

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("EncoderInputField.name must be a non-empty string")
        sources = (self.name,) if not self.sources else tuple(self.sources)
        if isinstance(self.sources, str) or not all(isinstance(key, str) and key for key in sources):
            raise TypeError(f"field {self.name}: sources must be a tuple of non-empty strings, got {self.sources!r}")
        pad_axes = tuple(self.pad_axes)
        if len(set(pad_axes)) != len(pad_axes):
            raise ValueError(f"field {self.name}: duplicate pad axes {pad_axes}")
        if self.concat_axis in pad_axes:
            raise ValueError(f"field {self.name}: the concat axis {self.concat_axis} cannot be a pad axis")
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "pad_axes", pad_axes)


@dataclass(frozen=True, slots=True, eq=False)
class RequestInputs:
    """One request's encoder inputs: request-level tensors plus, per source key, the item offsets along the
    concat axis (``num_items + 1`` entries; an item with no rows under a key has an empty range there).

    Build it once per request (e.g. with `from_item_rows`) and select items with `items`.
    """

    tensors: Mapping[str, torch.Tensor | None]
    item_offsets: Mapping[str, Sequence[int]]
    num_items: int = field(init=False)
    _resolved: dict[tuple[tuple[str, ...], int], tuple[tuple[torch.Tensor, tuple[int, ...]], ...]] = field(
        init=False, repr=False
    )

    def __post_init__(self) -> None:
        offsets = {key: tuple(values) for key, values in self.item_offsets.items()}
        lengths = {len(values) for values in offsets.values()}
        if len(lengths) != 1:
            raise ValueError(f"item offsets must all have num_items + 1 entries, got lengths {sorted(lengths)}")
        for key, values in offsets.items():
            if values[0] != 0 or any(b < a for a, b in pairwise(values)):
                raise ValueError(f"item offsets of {key!r} must start at 0 and never decrease: {list(values)}")
        object.__setattr__(self, "tensors", dict(self.tensors))
        object.__setattr__(self, "item_offsets", offsets)
        object.__setattr__(self, "num_items", lengths.pop() - 1)
        object.__setattr__(self, "_resolved", {})

    @classmethod
    def from_item_rows(
        cls, tensors: Mapping[str, torch.Tensor | None], item_rows: Mapping[str, Sequence[int]]
    ) -> RequestInputs:
        """From per-item row counts per source key (0 for items that have no rows under a key)."""
        return cls(tensors, {key: (0, *accumulate(rows)) for key, rows in item_rows.items()})

    def items(self, start: int, stop: int) -> ItemRange:
        """Items ``[start, stop)`` of this request."""
        _check_range(self, start, stop)
        return ItemRange(self, start, stop)

    def _candidates(self, spec: EncoderInputField) -> tuple[tuple[torch.Tensor, tuple[int, ...]], ...]:
        """The (tensor, item offsets) of each of the field's sources present here, in preference order.

        Resolved once per request and source tuple, not once per selected item.
        """
        memo_key = (spec.sources, spec.concat_axis)
        resolved = self._resolved.get(memo_key)
        if resolved is None:
            found = []
            for key in spec.sources:
                tensor = self.tensors.get(key)
                if tensor is None:
                    continue
                offsets = self.item_offsets.get(key)
                if offsets is None:
                    raise KeyError(f"field {spec.name}: request inputs have {key!r} but no item offsets for it")
                axis = _axis(spec, spec.concat_axis, tensor.dim())
                if offsets[-1] > tensor.shape[axis]:
                    # Slicing would silently clamp; the offsets describe rows the tensor does not have.
                    raise ValueError(
                        f"field {spec.name}: item offsets of {key!r} end at {offsets[-1]} but the tensor has "
                        f"{tensor.shape[axis]} along axis {axis}"
                    )
                found.append((tensor, tuple(offsets)))
            resolved = self._resolved[memo_key] = tuple(found)
        return resolved


class ItemRange(NamedTuple):
    """Adjacent items ``[start, stop)`` of one request, packed as one slice per field (per source, when the
    items come from different sources). Build it with `RequestInputs.items`; packing validates the range."""

    request: RequestInputs
    start: int
    stop: int


EncoderInputs = Mapping[str, torch.Tensor | None] | ItemRange


def batch_encoder_inputs(
    fields: Sequence[EncoderInputField], inputs: Sequence[EncoderInputs]
) -> dict[str, torch.Tensor]:
    """Gather each declared field from the selected `inputs` in order, pad only the declared axes and
    concatenate. Returns ``{field.name: tensor}``; every tensor owns fresh storage. See the module docstring
    for the entry types.
    """
    packed: dict[str, torch.Tensor] = {}
    if not inputs:
        return packed
    for spec in fields:
        pieces = _gather(spec, inputs)
        if pieces:
            packed[spec.name] = _pack(spec, pieces)
    return packed


def _rows(tensor: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    if start == 0 and stop == tensor.shape[axis]:
        return tensor
    if axis == 0:
        return tensor[start:stop]
    return tensor.narrow(axis, start, stop - start)


def _gather(spec: EncoderInputField, inputs: Sequence[EncoderInputs]) -> list[torch.Tensor]:
    sources = spec.sources
    axis = spec.concat_axis
    required = spec.required
    pieces: list[torch.Tensor] = []
    # A pending slice of a request-level tensor, extended while the next entries continue it.
    run: torch.Tensor | None = None
    run_start = run_stop = 0
    request: RequestInputs | None = None
    candidates: tuple[tuple[torch.Tensor, tuple[int, ...]], ...] = ()
    for position, entry in enumerate(inputs):
        if isinstance(entry, ItemRange):
            entry_request, first, stop_item = entry
            if entry_request is not request:
                request = entry_request
                candidates = request._candidates(spec)
            if not 0 <= first < stop_item <= request.num_items:
                _check_range(request, first, stop_item)
            found: torch.Tensor | None = None
            found_offsets: tuple[int, ...] = ()
            mixed = False
            for tensor, offsets in candidates:
                if offsets[first] != offsets[stop_item]:
                    if found is not None:
                        mixed = True
                        break
                    found, found_offsets = tensor, offsets
            if mixed:
                # Items of different sources (an image run next to a video run): resolve item by item.
                for tensor, start, stop in _item_segments(spec, entry, position):
                    if tensor is run and start == run_stop:
                        run_stop = stop
                        continue
                    if run is not None:
                        pieces.append(_rows(run, axis, run_start, run_stop))
                    run, run_start, run_stop = tensor, start, stop
                continue
            if found is None:
                if required:
                    raise MissingInputError(
                        f"required field {spec.name} (sources {sources}) missing from input {position} "
                        f"(items [{first}, {stop_item}))"
                    )
                continue
            if required and stop_item - first > 1:
                _check_every_item_has_rows(spec, entry, found_offsets, position)
            start = found_offsets[first]
            if found is run and start == run_stop:
                run_stop = found_offsets[stop_item]
                continue
            if run is not None:
                pieces.append(_rows(run, axis, run_start, run_stop))
            run, run_start, run_stop = found, start, found_offsets[stop_item]
        else:
            value: torch.Tensor | None = None
            for key in sources:
                value = entry.get(key)
                if value is not None:
                    break
            if value is None:
                if required:
                    raise MissingInputError(
                        f"required field {spec.name} (sources {sources}) missing from input {position}"
                    )
                continue
            if run is not None:
                pieces.append(_rows(run, axis, run_start, run_stop))
                run = None
            pieces.append(value)
    if run is not None:
        pieces.append(_rows(run, axis, run_start, run_stop))
    return pieces


def _check_range(request: RequestInputs, start: int, stop: int) -> None:
    if not 0 <= start < stop <= request.num_items:
        raise IndexError(f"item range [{start}, {stop}) is empty or outside a request of {request.num_items} items")


def _item_segments(spec: EncoderInputField, entry: ItemRange, position: int) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, start, stop) per item of a range whose items come from different sources."""
    candidates = entry.request._candidates(spec)
    segments = []
    for index in range(entry.start, entry.stop):
        for tensor, offsets in candidates:
            if offsets[index] != offsets[index + 1]:
                segments.append((tensor, offsets[index], offsets[index + 1]))
                break
        else:
            if spec.required:
                raise MissingInputError(
                    f"required field {spec.name} (sources {spec.sources}) missing from input {position} (item {index})"
                )
    return segments


def _check_every_item_has_rows(
    spec: EncoderInputField, entry: ItemRange, offsets: tuple[int, ...], position: int
) -> None:
    for index in range(entry.start, entry.stop):
        if offsets[index] == offsets[index + 1]:
            raise MissingInputError(
                f"required field {spec.name} (sources {spec.sources}) missing from input {position} (item {index})"
            )


def _pack(spec: EncoderInputField, pieces: list[torch.Tensor]) -> torch.Tensor:
    first = pieces[0]
    ndim = first.dim()
    dtype = first.dtype
    # torch.cat would promote mixed dtypes silently; a mixed batch is a caller bug.
    dtypes = {piece.dtype for piece in pieces}
    if len(dtypes) > 1:
        raise TypeError(f"field {spec.name}: pieces have different dtypes {sorted(map(str, dtypes))}")
    axis = _axis(spec, spec.concat_axis, ndim)
    if not spec.pad_axes:
        # torch.cat always allocates, even for one piece, so the result never aliases an input. Its own shape
        # check is free on the success path; only its message lacks the field's name.
        try:
            return torch.cat(pieces, dim=axis)
        except RuntimeError as exc:
            raise ValueError(f"field {spec.name}: pieces differ on an axis that is not a pad axis: {exc}") from exc
    pad_axes = tuple(_axis(spec, pad_axis, ndim) for pad_axis in spec.pad_axes)
    if axis in pad_axes:
        raise ValueError(f"field {spec.name}: the concat axis {axis} cannot be a pad axis")
    shape = list(first.shape)
    shape[axis] = sum(piece.shape[axis] for piece in pieces)
    for pad_axis in pad_axes:
        shape[pad_axis] = max(piece.shape[pad_axis] for piece in pieces)
    needs_padding = False
    for piece in pieces:
        if piece.dim() != ndim:
            raise ValueError(f"field {spec.name}: pieces of {piece.dim()} and {ndim} dimensions")
        for dim in range(ndim):
            if dim == axis:
                continue
            if piece.shape[dim] != shape[dim]:
                if dim not in pad_axes:
                    raise ValueError(
                        f"field {spec.name}: axis {dim} is not a pad axis but sizes differ: "
                        f"{tuple(piece.shape)} vs {tuple(shape)}"
                    )
                needs_padding = True
    if not needs_padding:
        return torch.cat(pieces, dim=axis)
    out = torch.full(shape, spec.fill_value, dtype=dtype, device=first.device)
    offset = 0
    for piece in pieces:
        length = piece.shape[axis]
        region = out.narrow(axis, offset, length)
        for pad_axis in pad_axes:
            region = region.narrow(pad_axis, 0, piece.shape[pad_axis])
        region.copy_(piece)
        offset += length
    return out


def _axis(spec: EncoderInputField, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"field {spec.name}: axis {axis} out of range for {ndim}-d inputs")
    return axis % ndim


# --- Qwen3-VL layout -------------------------------------------------------------------------------------------

QWEN3_VL_IMAGE_KEYS = ("pixel_values", "image_grid_thw")
QWEN3_VL_VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")
QWEN3_VL_FIELDS = (
    EncoderInputField("pixel_values", (QWEN3_VL_IMAGE_KEYS[0], QWEN3_VL_VIDEO_KEYS[0])),
    EncoderInputField("grid_thw", (QWEN3_VL_IMAGE_KEYS[1], QWEN3_VL_VIDEO_KEYS[1])),
)

_Modality = Literal["image", "video"]


class Qwen3VLBatch(NamedTuple):
    """Packed Qwen3-VL encoder inputs."""

    tensors: dict[str, torch.Tensor]
    """``pixel_values`` (image rows, then video rows), ``grid_thw`` ``[items, 3]`` in the same order, and each
    extra field in that order."""
    num_images: int
    """The first `num_images` rows of ``grid_thw`` are images, the rest videos."""
    image_rows: int
    """The first `image_rows` rows of ``pixel_values`` are the images'."""
    order: tuple[int, ...]
    """For each packed item, its position among the selected items (the items of `inputs` in order, an `ItemRange`
    counting each of its items), so that outputs can be put back in selection order."""


def batch_qwen3_vl_inputs(
    inputs: Sequence[EncoderInputs], extra_fields: Sequence[EncoderInputField] = ()
) -> Qwen3VLBatch:
    """Pack `inputs` (as `batch_encoder_inputs` takes them, with Qwen3-VL's processor keys) in the Qwen3-VL layout:
    images before videos, each in selection order, ``pixel_values`` and ``grid_thw`` gathered together.

    An item is an image when it has ``pixel_values`` rows and a video when it has ``pixel_values_videos`` rows;
    one with neither raises MissingInputError. `extra_fields` are packed in the same item order (declare their
    pad axes). Raises ValueError when the grids do not account for the pixel rows.
    """
    images: list[EncoderInputs] = []
    videos: list[EncoderInputs] = []
    image_order: list[int] = []
    video_order: list[int] = []
    position = 0
    for index, entry in enumerate(inputs):
        if isinstance(entry, ItemRange):
            request, start, stop = entry
            _check_range(request, start, stop)
            run_start = start
            run_modality: _Modality | None = None
            for item in range(start, stop):
                modality = _item_modality(request, item, index)
                if run_modality is not None and modality != run_modality:
                    (images if run_modality == "image" else videos).append(ItemRange(request, run_start, item))
                    run_start = item
                run_modality = modality
                (image_order if modality == "image" else video_order).append(position)
                position += 1
            assert run_modality is not None
            (images if run_modality == "image" else videos).append(ItemRange(request, run_start, stop))
        else:
            if entry.get(QWEN3_VL_IMAGE_KEYS[0]) is not None:
                images.append(entry)
                image_order.append(position)
            elif entry.get(QWEN3_VL_VIDEO_KEYS[0]) is not None:
                videos.append(entry)
                video_order.append(position)
            else:
                raise MissingInputError(f"input {index} has neither pixel_values nor pixel_values_videos")
            position += 1
    packed = batch_encoder_inputs((*QWEN3_VL_FIELDS, *extra_fields), images + videos)
    if not packed:
        return Qwen3VLBatch(packed, 0, 0, ())
    pixels, grids = packed["pixel_values"], packed["grid_thw"]
    if grids.shape[0] != position:
        raise ValueError(f"grid_thw has {grids.shape[0]} rows for {position} selected items")
    rows = grids.prod(dim=1).tolist()
    if sum(rows) != pixels.shape[0]:
        raise ValueError(f"grid_thw accounts for {sum(rows)} pixel rows, pixel_values has {pixels.shape[0]}")
    num_images = len(image_order)
    return Qwen3VLBatch(packed, num_images, sum(rows[:num_images]), (*image_order, *video_order))


def _item_modality(request: RequestInputs, item: int, position: int) -> _Modality:
    keys: tuple[tuple[str, _Modality], ...] = ((QWEN3_VL_IMAGE_KEYS[0], "image"), (QWEN3_VL_VIDEO_KEYS[0], "video"))
    for key, modality in keys:
        offsets = request.item_offsets.get(key)
        if request.tensors.get(key) is not None and offsets is not None and offsets[item] != offsets[item + 1]:
            return modality
    raise MissingInputError(f"input {position} (item {item}) has neither pixel_values nor pixel_values_videos rows")
