from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import encoder_scheduler.packing as packing_module
from encoder_scheduler import (
    EncoderInputField,
    EncoderInputs,
    ItemRange,
    MissingInputError,
    RequestInputs,
    batch_encoder_inputs,
    batch_qwen3_vl_inputs,
)

PIXELS = EncoderInputField("pixel_values", ("pixel_values", "pixel_values_videos"))


def rows(start: int, count: int, width: int = 3) -> torch.Tensor:
    return torch.arange(start * width, (start + count) * width, dtype=torch.float32).reshape(count, width)


def storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def qwen_like_request(base: int) -> RequestInputs:
    """Four items: image (2 rows), video (3 rows), image (1 row), video (2 rows)."""
    return RequestInputs.from_item_rows(
        {
            "pixel_values": rows(base, 3),
            "pixel_values_videos": rows(base + 100, 5),
            "image_grid_thw": torch.tensor([[1, 2, 1], [1, 1, 1]]),
            "video_grid_thw": torch.tensor([[3, 1, 1], [2, 1, 1]]),
        },
        {
            "pixel_values": (2, 0, 1, 0),
            "pixel_values_videos": (0, 3, 0, 2),
            "image_grid_thw": (1, 0, 1, 0),
            "video_grid_thw": (0, 1, 0, 1),
        },
    )


# ------------------------------------------------------------------------------------------- declarations


def test_field_is_frozen_and_defaults_its_source_to_its_name() -> None:
    field = EncoderInputField("pixel_values")
    assert field.sources == ("pixel_values",)
    assert (field.concat_axis, field.pad_axes, field.fill_value, field.required) == (0, (), 0.0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        field.name = "other"  # type: ignore[misc]
    assert hash(field) == hash(EncoderInputField("pixel_values", ("pixel_values",)))


def test_field_validation() -> None:
    with pytest.raises(ValueError, match="concat axis"):
        EncoderInputField("mask", concat_axis=0, pad_axes=(0,))
    with pytest.raises(ValueError, match="duplicate"):
        EncoderInputField("mask", pad_axes=(1, 1))
    with pytest.raises(TypeError, match="sources"):
        EncoderInputField("x", sources="x")  # type: ignore[arg-type]


def test_request_inputs_validation() -> None:
    with pytest.raises(ValueError, match="num_items"):
        RequestInputs({"a": rows(0, 2)}, {"a": (0, 1, 2), "b": (0, 2)})
    with pytest.raises(ValueError, match="never decrease"):
        RequestInputs({"a": rows(0, 2)}, {"a": (0, 2, 1)})
    request = RequestInputs.from_item_rows({"a": rows(0, 3)}, {"a": (1, 2)})
    assert request.item_offsets["a"] == (0, 1, 3)
    assert request.num_items == 2
    with pytest.raises(IndexError):
        request.items(1, 3)
    with pytest.raises(IndexError):
        request.items(1, 1)


# ------------------------------------------------------------------------------------------------ packing


def test_plain_items_concatenate_in_order_with_one_cat(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = rows(0, 2), rows(10, 1), rows(20, 3)
    calls = []
    real_cat = torch.cat

    def counting_cat(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_cat(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "cat", counting_cat)
    packed = batch_encoder_inputs([PIXELS], [{"pixel_values": a}, {"pixel_values": b}, {"pixel_values": c}])
    monkeypatch.undo()
    assert list(packed) == ["pixel_values"]
    assert torch.equal(packed["pixel_values"], real_cat([a, b, c]))
    assert len(calls) == 1


def test_aliases_prefer_the_first_key_and_skip_explicit_none() -> None:
    image, video, other = rows(0, 2), rows(10, 3), rows(50, 1)
    packed = batch_encoder_inputs(
        [PIXELS],
        [
            {"pixel_values": image, "pixel_values_videos": other},  # preferred alias wins
            {"pixel_values": None, "pixel_values_videos": video},  # explicit None falls through
            {"pixel_values_videos": video},
        ],
    )
    assert torch.equal(packed["pixel_values"], torch.cat([image, video, video]))


def test_declared_padding_uses_the_fill_value_and_only_declared_axes() -> None:
    field = EncoderInputField("features", concat_axis=0, pad_axes=(1,), fill_value=-1.0)
    a = torch.ones(2, 3)
    b = 2 * torch.ones(1, 5)
    packed = batch_encoder_inputs([field], [{"features": a}, {"features": b}])["features"]
    expected = torch.tensor(
        [[1, 1, 1, -1, -1], [1, 1, 1, -1, -1], [2, 2, 2, 2, 2]],
        dtype=torch.float32,
    )
    assert torch.equal(packed, expected)
    with pytest.raises(ValueError, match="not a pad axis"):
        batch_encoder_inputs([EncoderInputField("features")], [{"features": a}, {"features": b}])


def test_padding_on_several_axes_and_concat_on_a_negative_axis() -> None:
    field = EncoderInputField("x", concat_axis=-1, pad_axes=(0, 1), fill_value=7)
    a = torch.zeros(1, 2, 2, dtype=torch.int64)
    b = torch.ones(2, 1, 3, dtype=torch.int64)
    packed = batch_encoder_inputs([field], [{"x": a}, {"x": b}])["x"]
    assert packed.shape == (2, 2, 5)
    assert torch.equal(packed[:1, :2, :2], a)
    assert torch.equal(packed[:2, :1, 2:], b)
    assert (packed[1, :, :2] == 7).all()
    assert (packed[:, 1, 2:] == 7).all()


def test_boolean_masks_pad_with_false() -> None:
    field = EncoderInputField("mask", pad_axes=(1,), fill_value=False)
    a = torch.ones(1, 2, dtype=torch.bool)
    b = torch.ones(2, 4, dtype=torch.bool)
    mask = batch_encoder_inputs([field], [{"mask": a}, {"mask": b}])["mask"]
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True] * 4]


def test_equal_shapes_under_a_pad_declaration_need_no_padding() -> None:
    field = EncoderInputField("x", pad_axes=(1,), fill_value=5.0)
    packed = batch_encoder_inputs([field], [{"x": rows(0, 1)}, {"x": rows(1, 2)}])["x"]
    assert torch.equal(packed, rows(0, 3))


def test_outputs_own_their_storage_and_inputs_are_untouched() -> None:
    single = rows(0, 4)
    request = qwen_like_request(0)
    inputs_before = {key: t.clone() for key, t in request.tensors.items() if t is not None}
    versions = {key: t._version for key, t in request.tensors.items() if t is not None}
    grid = EncoderInputField("grid", ("image_grid_thw", "video_grid_thw"))
    cases: list[tuple[list[EncoderInputField], list[EncoderInputs]]] = [
        ([PIXELS], [{"pixel_values": single}]),  # one whole input: still copied
        ([PIXELS, grid], [request.items(0, 1)]),  # one slice
        ([PIXELS, grid], [request.items(1, 2), request.items(3, 4)]),  # the whole video tensors, one run
    ]
    for fields, entries in cases:
        packed = batch_encoder_inputs(fields, entries)
        sources = {storage_ptr(single)} | {storage_ptr(t) for t in request.tensors.values() if t is not None}
        for tensor in packed.values():
            assert storage_ptr(tensor) not in sources
            tensor.fill_(-5)
    assert torch.equal(single, rows(0, 4))
    for key, tensor in request.tensors.items():
        assert tensor is not None
        assert torch.equal(tensor, inputs_before[key])
        assert tensor._version == versions[key]


def test_required_field_missing_raises_and_optional_fields_are_skipped() -> None:
    required = EncoderInputField("pixel_values")
    optional = EncoderInputField("second_per_grid", required=False)
    with pytest.raises(MissingInputError, match=r"pixel_values.*input 1"):
        batch_encoder_inputs([required], [{"pixel_values": rows(0, 1)}, {"other": rows(0, 1)}])
    packed = batch_encoder_inputs(
        [required, optional],
        [{"pixel_values": rows(0, 1)}, {"pixel_values": rows(1, 1), "second_per_grid": torch.tensor([0.5])}],
    )
    assert torch.equal(packed["second_per_grid"], torch.tensor([0.5]))
    packed = batch_encoder_inputs([required, optional], [{"pixel_values": rows(0, 1)}])
    assert "second_per_grid" not in packed
    assert batch_encoder_inputs([required], []) == {}


def test_request_ranges_pack_mixed_and_reordered_items() -> None:
    r0, r1 = qwen_like_request(0), qwen_like_request(1000)
    grid = EncoderInputField("grid_thw", ("image_grid_thw", "video_grid_thw"))
    packed = batch_encoder_inputs(
        [PIXELS, grid],
        # Reordered within r0 (item 3 before item 1), then mixed image and video from r1.
        [r0.items(3, 4), r0.items(1, 2), r1.items(0, 1), r1.items(1, 2), r1.items(2, 3)],
    )
    r0_videos = r0.tensors["pixel_values_videos"]
    r1_images = r1.tensors["pixel_values"]
    r1_videos = r1.tensors["pixel_values_videos"]
    assert r0_videos is not None and r1_images is not None and r1_videos is not None  # noqa: PT018
    expected = torch.cat([r0_videos[3:5], r0_videos[0:3], r1_images[0:2], r1_videos[0:3], r1_images[2:3]])
    assert torch.equal(packed["pixel_values"], expected)
    assert packed["grid_thw"].tolist() == [[2, 1, 1], [3, 1, 1], [1, 2, 1], [3, 1, 1], [1, 1, 1]]


def test_adjacent_items_of_one_request_are_one_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [
        RequestInputs.from_item_rows({"pixel_values": rows(100 * n, 10)}, {"pixel_values": (2, 3, 1, 4)})
        for n in range(3)
    ]
    slices = []
    real_rows = packing_module._rows

    def counting_rows(tensor: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
        slices.append((start, stop))
        view = real_rows(tensor, axis, start, stop)
        assert storage_ptr(view) == storage_ptr(tensor)  # a view, not a copy
        return view

    monkeypatch.setattr(packing_module, "_rows", counting_rows)
    entries: list[ItemRange] = []
    for request in requests:  # one entry per item: items 0, 1, 2 of every request
        entries.extend(request.items(i, i + 1) for i in range(3))
    packed = batch_encoder_inputs([EncoderInputField("pixel_values")], entries)
    assert slices == [(0, 6)] * 3
    expected = torch.cat([r.tensors["pixel_values"][0:6] for r in requests])  # type: ignore[index]
    assert torch.equal(packed["pixel_values"], expected)


def test_an_item_range_spanning_sources_is_resolved_item_by_item() -> None:
    request = qwen_like_request(0)
    images, videos = request.tensors["pixel_values"], request.tensors["pixel_values_videos"]
    assert images is not None
    assert videos is not None
    packed = batch_encoder_inputs([PIXELS], [request.items(0, 4)])["pixel_values"]
    assert torch.equal(packed, torch.cat([images[0:2], videos[0:3], images[2:3], videos[3:5]]))
    # A single-source field over the same range takes only that source's items.
    images_only = EncoderInputField("pixel_values", required=False)
    assert torch.equal(batch_encoder_inputs([images_only], [request.items(0, 4)])["pixel_values"], images)


def test_a_required_field_missing_from_one_item_of_a_range_raises() -> None:
    request = RequestInputs.from_item_rows({"pixel_values": rows(0, 3)}, {"pixel_values": (2, 0, 1)})
    with pytest.raises(MissingInputError, match="item 1"):
        batch_encoder_inputs([EncoderInputField("pixel_values")], [request.items(0, 3)])
    mixed = qwen_like_request(0)
    with pytest.raises(MissingInputError, match="item 1"):
        batch_encoder_inputs([EncoderInputField("pixel_values")], [mixed.items(0, 2)])
    optional = EncoderInputField("pixel_values", required=False)
    assert torch.equal(batch_encoder_inputs([optional], [request.items(0, 3)])["pixel_values"], rows(0, 3))


def test_offsets_beyond_the_tensor_raise_instead_of_clamping() -> None:
    request = RequestInputs.from_item_rows({"pixel_values": rows(0, 3)}, {"pixel_values": (2, 2)})
    with pytest.raises(ValueError, match="end at 4 but the tensor has 3"):
        batch_encoder_inputs([EncoderInputField("pixel_values")], [request.items(0, 1)])


def test_range_key_without_offsets_and_dtype_mismatch_raise() -> None:
    request = RequestInputs({"pixel_values": rows(0, 2), "extra": rows(0, 2)}, {"extra": (0, 1, 2)})
    with pytest.raises(KeyError, match="no item offsets"):
        batch_encoder_inputs([EncoderInputField("pixel_values")], [request.items(0, 1)])
    with pytest.raises(TypeError, match="different dtypes"):
        batch_encoder_inputs([EncoderInputField("x")], [{"x": rows(0, 1)}, {"x": rows(0, 1).to(torch.float64)}])


# ------------------------------------------------------------------------------------------ property test


@st.composite
def packing_cases(draw: st.DrawFn) -> tuple[list[RequestInputs], list[tuple[int, int, bool]]]:
    """Random requests (items of random modality and row count) and a random selection of their items."""
    requests = []
    for n in range(draw(st.integers(1, 4))):
        modalities = draw(st.lists(st.sampled_from(["image", "video"]), min_size=1, max_size=5))
        counts = [draw(st.integers(1, 4)) for _ in modalities]
        image_rows = [c if m == "image" else 0 for m, c in zip(modalities, counts, strict=True)]
        video_rows = [c if m == "video" else 0 for m, c in zip(modalities, counts, strict=True)]
        tensors = {
            "pixel_values": rows(1000 * n, sum(image_rows)) if sum(image_rows) else None,
            "pixel_values_videos": rows(1000 * n + 500, sum(video_rows)) if sum(video_rows) else None,
        }
        requests.append(
            RequestInputs.from_item_rows(tensors, {"pixel_values": image_rows, "pixel_values_videos": video_rows})
        )
    all_items = [(r, i) for r, request in enumerate(requests) for i in range(request.num_items)]
    chosen = draw(st.lists(st.sampled_from(all_items), min_size=1, max_size=12, unique=True))
    if draw(st.booleans()):
        chosen.sort()  # the scheduler's usual case: runs of adjacent items
    as_mapping = [draw(st.booleans()) for _ in chosen]
    return requests, [(r, i, m) for (r, i), m in zip(chosen, as_mapping, strict=True)]


def item_rows(request: RequestInputs, index: int) -> tuple[str, torch.Tensor]:
    """The source key and rows of one item, sliced on its own (the naive way)."""
    for key in ("pixel_values", "pixel_values_videos"):
        offsets = request.item_offsets[key]
        if offsets[index + 1] > offsets[index]:
            tensor = request.tensors[key]
            assert tensor is not None
            return key, tensor[offsets[index] : offsets[index + 1]]
    raise AssertionError("item without rows")


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(packing_cases())
def test_packing_matches_a_per_item_reference(
    case: tuple[list[RequestInputs], list[tuple[int, int, bool]]],
) -> None:
    requests, chosen = case
    entries: list[EncoderInputs] = []
    for r, i, as_mapping in chosen:
        previous = entries[-1] if entries else None
        if as_mapping:
            key, tensor = item_rows(requests[r], i)
            entries.append({key: tensor.clone()})
        elif isinstance(previous, ItemRange) and previous.request is requests[r] and previous.stop == i:
            entries[-1] = requests[r].items(previous.start, i + 1)  # a run of adjacent items, as plan.runs
        else:
            entries.append(requests[r].items(i, i + 1))
    packed = batch_encoder_inputs([PIXELS], entries)["pixel_values"]
    reference = torch.cat([item_rows(requests[r], i)[1] for r, i, _ in chosen])
    assert torch.equal(packed, reference)
    for request in requests:
        for tensor in request.tensors.values():
            if tensor is not None:
                assert storage_ptr(packed) != storage_ptr(tensor)


@SETTINGS
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(1, 3)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([0.0, -1.0, 3.5]),
)
def test_padding_matches_a_per_item_reference(shapes: list[tuple[int, int, int]], fill: float) -> None:
    field = EncoderInputField("x", concat_axis=0, pad_axes=(1, 2), fill_value=fill)
    pieces = [torch.rand(shape) for shape in shapes]
    packed = batch_encoder_inputs([field], [{"x": piece} for piece in pieces])["x"]
    height = max(shape[1] for shape in shapes)
    width = max(shape[2] for shape in shapes)
    reference = torch.cat(
        [
            torch.nn.functional.pad(piece, (0, width - piece.shape[2], 0, height - piece.shape[1]), value=fill)
            for piece in pieces
        ]
    )
    assert torch.equal(packed, reference)


# ------------------------------------------------------------------------------------------ Qwen3-VL layout


def test_qwen3_vl_layout_puts_images_before_videos_each_in_selection_order() -> None:
    first, second = qwen_like_request(0), qwen_like_request(1000)
    # Selected: r0 items 1 (video), 0 (image); r1 items 0..3 (image, video, image, video) as one range.
    batch = batch_qwen3_vl_inputs([first.items(1, 2), first.items(0, 1), second.items(0, 4)])
    pixels, grids = batch.tensors["pixel_values"], batch.tensors["grid_thw"]
    images = [rows(0, 2), rows(1000, 2), rows(1002, 1)]  # r0 image 0, r1 images 0 and 2
    videos = [rows(100, 3), rows(1100, 3), rows(1103, 2)]  # r0 video 1, r1 videos 1 and 3
    assert torch.equal(pixels, torch.cat(images + videos))
    assert grids.tolist() == [[1, 2, 1], [1, 2, 1], [1, 1, 1], [3, 1, 1], [3, 1, 1], [2, 1, 1]]
    assert (batch.num_images, batch.image_rows) == (3, 5)
    # Selected items in order: r0/1, r0/0, r1/0, r1/1, r1/2, r1/3; images were 1, 2, 4; videos 0, 3, 5.
    assert batch.order == (1, 2, 4, 0, 3, 5)
    assert set(batch.tensors) == {"pixel_values", "grid_thw"}


def test_qwen3_vl_layout_takes_processor_output_mappings_too() -> None:
    video = {"pixel_values_videos": rows(50, 4), "video_grid_thw": torch.tensor([[2, 2, 1]])}
    image = {"pixel_values": rows(0, 1), "image_grid_thw": torch.tensor([[1, 1, 1]]), "pixel_values_videos": None}
    batch = batch_qwen3_vl_inputs([video, image])
    assert torch.equal(batch.tensors["pixel_values"], torch.cat([rows(0, 1), rows(50, 4)]))
    assert batch.tensors["grid_thw"].tolist() == [[1, 1, 1], [2, 2, 1]]
    assert batch.order == (1, 0)
    with pytest.raises(MissingInputError, match="input 1 has neither"):
        batch_qwen3_vl_inputs([video, {"image_grid_thw": torch.tensor([[1, 1, 1]])}])


def test_qwen3_vl_layout_gathers_pixels_and_grids_together_and_checks_they_agree() -> None:
    short = {"pixel_values": rows(0, 2), "image_grid_thw": torch.tensor([[1, 3, 1]])}  # grid says 3 rows
    with pytest.raises(ValueError, match="grid_thw accounts for 3 pixel rows, pixel_values has 2"):
        batch_qwen3_vl_inputs([short])
    no_grid = {"pixel_values": rows(0, 2)}
    with pytest.raises(MissingInputError, match="grid_thw"):
        batch_qwen3_vl_inputs([no_grid])


def test_qwen3_vl_layout_packs_adjacent_rows_as_one_slice_and_one_cat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default field (axis 0, no pad axes) is one torch.cat of one slice per run of adjacent rows: the images
    of an alternating request are adjacent in its image tensor, so each request gives one image slice."""
    requests = [qwen_like_request(base) for base in (0, 1000, 2000)]
    pieces: dict[str, list[int]] = {}
    real_pack = packing_module._pack

    def recording_pack(spec: EncoderInputField, parts: list[torch.Tensor]) -> torch.Tensor:
        pieces[spec.name] = [part.shape[0] for part in parts]
        return real_pack(spec, parts)

    calls = []
    real_cat = torch.cat

    def counting_cat(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real_cat(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(packing_module, "_pack", recording_pack)
    monkeypatch.setattr(torch, "cat", counting_cat)
    entries = [request.items(i, i + 1) for request in requests for i in range(4)]
    batch = batch_qwen3_vl_inputs(entries)
    assert pieces["pixel_values"] == [3, 3, 3, 5, 5, 5]  # per request: its images, then (later) its videos
    assert pieces["grid_thw"] == [2, 2, 2, 2, 2, 2]
    assert len(calls) == 2  # one concatenation per field
    assert batch.tensors["pixel_values"].shape == (24, 3)


def test_qwen3_vl_layout_pads_declared_axes_of_extra_fields_in_the_same_order() -> None:
    mask = EncoderInputField("mask", ("image_mask", "video_mask"), pad_axes=(1,), fill_value=-1.0)
    video = {"pixel_values_videos": rows(0, 2), "video_grid_thw": torch.tensor([[2, 1, 1]]), "video_mask": rows(7, 1)}
    image = {"pixel_values": rows(5, 1), "image_grid_thw": torch.tensor([[1, 1, 1]]), "image_mask": rows(9, 1, 2)}
    batch = batch_qwen3_vl_inputs([video, image], extra_fields=[mask])
    assert batch.tensors["mask"].tolist() == [[18.0, 19.0, -1.0], [21.0, 22.0, 23.0]]  # the image first, padded
    with pytest.raises(ValueError, match="field mask: pieces differ on an axis that is not a pad axis"):
        batch_qwen3_vl_inputs([video, image], extra_fields=[dataclasses.replace(mask, pad_axes=())])


def test_qwen3_vl_layout_of_a_single_input_owns_its_storage() -> None:
    request = qwen_like_request(0)
    whole = request.tensors["pixel_values"]
    assert whole is not None
    single: list[list[EncoderInputs]] = [
        [request.items(0, 1)],
        [{"pixel_values": whole, "image_grid_thw": torch.tensor([[1, 3, 1]])}],
    ]
    for entries in single:
        batch = batch_qwen3_vl_inputs(entries)
        pixels = batch.tensors["pixel_values"]
        assert storage_ptr(pixels) != storage_ptr(whole)
        before = whole.clone()
        pixels.fill_(-7.0)
        assert torch.equal(whole, before)
    grids = request.tensors["image_grid_thw"]
    assert grids is not None
    batch = batch_qwen3_vl_inputs([request.items(0, 1)])
    assert storage_ptr(batch.tensors["grid_thw"]) != storage_ptr(grids)


def test_qwen3_vl_layout_of_nothing_is_empty() -> None:
    assert batch_qwen3_vl_inputs([]) == ({}, 0, 0, ())
