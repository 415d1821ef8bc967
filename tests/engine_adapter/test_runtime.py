"""The runtime loop: budgets hold at every iteration under load, policies agree on embeddings, batching does not
change them, partial requests resume, failures and cancels free buffers, and an idle loop sleeps."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest
import torch

from engine_adapter.client.wire import WireItem, encode_submit, item_part
from engine_adapter.encoder import VisionEncoder
from engine_adapter.engine import Engine
from engine_adapter.handoff import BackendResponse, Handoff
from engine_adapter.models import build_vision_tower
from engine_adapter.processor import process_image, process_video
from engine_adapter.runtime import IterationReport
from processor_geometry import QWEN2_VL
from tests.conftest import (
    EngineFactory,
    engine_settings,
)
from tests.engine_adapter.conftest import (
    REQUESTS,
    admitted,
    metric_samples,
    pixels,
    status,
    submit_body,
    wait_idle,
)
from tests.engine_adapter.stub_llm import StubLLM
from tests.observe import wait_until

SIZES = [(56, 56), (56, 84), (84, 84)]  # 4, 6 and 9 embedding rows


def request_images(seed: int, count: int = 3) -> list[npt.NDArray[Any]]:
    return [pixels(*SIZES[(seed + i) % len(SIZES)], seed=seed * 10 + i) for i in range(count)]


def alone(image: npt.NDArray[Any]) -> torch.Tensor:
    """One image through the tiny tower by itself, without the engine."""
    model = build_vision_tower("tiny", seed=0).model
    visual = process_image(image, QWEN2_VL)
    with torch.inference_mode():
        return model(visual.pixel_values, visual.grid_thw)  # type: ignore[no-any-return]


class Recorder:
    """The invariant hook: checks the resident budget inside the runtime after every iteration."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.reports: list[IterationReport] = []
        self.violations: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, report: IterationReport) -> None:
        stats = report.stats
        with self.lock:
            self.reports.append(report)
            if self.budget is not None and stats.resident_bytes > self.budget:
                self.violations.append(f"iteration {stats.iterations}: {stats.resident_bytes:,} > {self.budget:,}")

    def encoding(self) -> list[IterationReport]:
        with self.lock:
            return [report for report in self.reports if report.plan.work]


@pytest.mark.parametrize("policy", ["DEFAULT", "EAGER"])
async def test_32_concurrent_requests_all_finish_within_the_resident_budget(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str], policy: str
) -> None:
    # Each request: 3 images, 19 rows x 128 x float32 = 9,728 bytes; the budget holds two requests at a time.
    budget = 20_000
    stub, stub_url = stub_llm
    stub.state.hold = True  # buffers stay resident until the stub answers: the budget has to hold the line
    recorder = Recorder(budget)
    sections = {
        "encoder": {"max_resident_bytes": budget, "max_num_items": 4, "scheduling_policy": policy},
        "handoff": {"backend": "openai", "url": stub_url, "max_concurrency": 8},
    }
    with make_engine(on_iteration=recorder, **sections) as (_, url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def one(index: int) -> str:
                body = submit_body(f"load-{index}", request_images(index))
                accepted = await client.post(REQUESTS, content=body)
                assert accepted.status_code == 202, accepted.text
                answer = await client.get(f"{REQUESTS}/{accepted.json()['id']}/response")
                assert answer.status_code == 200, answer.text
                content: str = answer.json()["choices"][0]["message"]["content"]
                return content

            async def release_when_full() -> dict[str, Any]:
                while True:
                    now: dict[str, Any] = (await client.get("/internal/v1/status")).json()
                    if now["resident_bytes"] > budget // 2 and now["queue"]["waiting"] > 0:
                        stub.release()
                        return now
                    await asyncio.sleep(0.01)

            full = asyncio.ensure_future(release_when_full())
            contents = await asyncio.wait_for(asyncio.gather(*(one(index) for index in range(32))), 60)
            at_the_line = await full
        idle = wait_idle(url)
    assert contents == ["stub saw 3 image embed(s)"] * 32
    assert recorder.violations == []
    # The line held: the budget was full with requests still waiting behind it.
    assert budget // 2 < at_the_line["resident_bytes"] <= budget
    reports = recorder.encoding()
    assert sum(len(report.plan) for report in reports) == 32 * 3
    assert all(len(report.plan) <= 4 for report in reports)
    assert idle["pending_input_bytes"] == 0


def test_disabled_policy_is_the_legacy_path_without_budgets(make_engine: EngineFactory) -> None:
    recorder = Recorder(None)
    encoder = {"max_resident_bytes": 4096, "scheduling_policy": "DISABLED"}
    with make_engine(on_iteration=recorder, encoder=encoder) as (_, url):
        job_id = admitted(url, submit_body("legacy", request_images(0)))  # 9,728 bytes > 4,096: no 413
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
        assert status(url)["budgets"]["max_resident_bytes_enforced"] is False
        assert metric_samples(url)["mmgate_engine_resident_budget_bytes"] == float("inf")
    assert [len(report.plan) for report in recorder.encoding()] == [3]  # the whole request at once


def test_embeddings_agree_across_policies(make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]) -> None:
    stub, stub_url = stub_llm
    handoff = {"backend": "openai", "url": stub_url, "format": "vllm"}
    batches: dict[str, list[list[int]]] = {}
    for policy in ("DEFAULT", "EAGER", "DISABLED"):
        recorder = Recorder(None)
        encoder = {"scheduling_policy": policy, "max_num_items": 2, "max_resident_bytes": 40_000}
        with make_engine(on_iteration=recorder, encoder=encoder, handoff=handoff) as (_, url):
            # Multi-image requests in flight together: batch composition differs by policy.
            ids = [admitted(url, submit_body(f"{policy}-multi-{i}", request_images(i))) for i in range(4)]
            for job_id in ids:
                assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
            # One single-image request at a time: every policy encodes each item alone.
            for i in range(3):
                job_id = admitted(url, submit_body(f"{policy}-single-{i}", [pixels(*SIZES[i], seed=100 + i)]))
                assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
        batches[policy] = [[len(report.plan)] for report in recorder.encoding()]
    assert batches["DEFAULT"] != batches["DISABLED"]  # the comparison below spans different batchings
    for i in range(4):
        reference = stub.state.by_request_id(f"DEFAULT-multi-{i}").embeds
        for policy in ("EAGER", "DISABLED"):
            other = stub.state.by_request_id(f"{policy}-multi-{i}").embeds
            assert len(other) == len(reference) == 3
            for got, expected in zip(other, reference, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for i in range(3):
        reference = stub.state.by_request_id(f"DEFAULT-single-{i}").embeds[0]
        for policy in ("EAGER", "DISABLED"):
            assert torch.equal(stub.state.by_request_id(f"{policy}-single-{i}").embeds[0], reference)


async def encode_together(engine: Engine, bodies: list[bytes]) -> list[str]:
    """Submit every request before the engine's loop starts, let each finish, then close the engine; the jobs'
    ids."""
    try:
        jobs = [await engine.submit(body) for body in bodies]
        await engine.start()
        for job in jobs:
            assert await asyncio.wait_for(_drain(job.outcome), 30)
            engine.finish(job, "completed")
    finally:
        await engine.aclose()
    return [job.id for job in jobs]


async def _drain(job_outcome: asyncio.Future[Any]) -> bytes:
    result = await job_outcome
    assert isinstance(result, BackendResponse), result
    try:
        return b"".join([chunk async for chunk in result.chunks()])
    finally:
        await result.aclose()


async def test_batched_encoding_of_several_requests_equals_each_item_alone(stub_llm: tuple[StubLLM, str]) -> None:
    stub, stub_url = stub_llm
    recorder = Recorder(None)
    settings = engine_settings(
        handoff={"backend": "openai", "url": stub_url, "format": "trtllm"},
        encoder={"scheduling_policy": "EAGER", "max_num_items": 16},
    )
    engine = Engine(settings, on_iteration=recorder)
    images = {f"batch-{i}": request_images(i, count=2 + i % 2) for i in range(3)}
    # Admitted before the loop runs, so its first iteration packs all three requests into one pass.
    await encode_together(engine, [submit_body(request_id, imgs) for request_id, imgs in images.items()])
    first = recorder.encoding()[0]
    assert len(first.encoded_requests) == 3
    assert len(first.plan.runs) == 3  # each request's items as one run: one slice of its pixel tensor
    for request_id, imgs in images.items():
        received = stub.state.by_request_id(request_id).embeds
        for got, image in zip(received, imgs, strict=True):
            torch.testing.assert_close(got, alone(image), atol=1e-5, rtol=0)


def media_submit(request_id: str, modality: str, media: npt.NDArray[np.uint8]) -> bytes:
    """A submit file of one item: an image `[h, w, 3]` or a clip `[t, h, w, 3]`."""
    document = {"model": "test-model", "messages": [{"role": "user", "content": [item_part(0)]}]}
    digest = hashlib.sha256(media.tobytes()).hexdigest()
    return encode_submit(request_id, document, [WireItem(modality, f"{modality}-0", digest, media)])


async def test_an_image_and_a_video_encoded_in_one_pass_equal_each_encoded_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the Qwen3-VL tower (`tiny-3`, DeepStack features from blocks 1 and 2), an image request and a video request
    admitted before the loop runs are packed into one forward pass (grids 1x16x20 and 3x4x6: 5 frames padded to 3
    temporal patches); each item's rows, 128 visual + 2 x 128 DeepStack wide, are those of the item encoded alone."""
    settings = engine_settings(model={"preset": "tiny-3"}, encoder={"scheduling_policy": "EAGER", "max_num_items": 16})
    recorder = Recorder(None)
    engine = Engine(settings, on_iteration=recorder)
    received: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {}
    reference_start = engine.backend.start

    async def capture(handoff: Handoff) -> BackendResponse:
        received[handoff.request_id] = (handoff.embeddings.clone(), handoff.offsets)
        return await reference_start(handoff)

    monkeypatch.setattr(engine.backend, "start", capture)
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (256, 320, 3), dtype=np.uint8)  # the image bounds' minimum is 65,536 pixels
    clip = rng.integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)
    job_ids = await encode_together(
        engine, [media_submit("image", "image", image), media_submit("video", "video", clip)]
    )
    encoder = engine.encoder
    [first] = recorder.encoding()  # one forward pass encoded both
    assert len(first.plan) == 2
    assert set(first.encoded_requests) == set(job_ids)
    width = encoder.config.out_hidden_size * (1 + len(encoder.config.deepstack_visual_indexes))
    assert width == encoder.width == 128 * 3
    geometry = encoder.geometry
    for request_id, visual, rows in (
        ("image", process_image(image, geometry), 16 * 20 // 4),
        ("video", process_video(clip, geometry), 3 * 4 * 6 // 4),
    ):
        expected = encoder.forward(visual.pixel_values, visual.grid_thw)
        got, offsets = received[request_id]
        assert offsets == (0, rows)
        assert tuple(got.shape) == tuple(expected.shape) == (rows, width)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_a_partial_request_resumes_in_the_next_iteration(make_engine: EngineFactory) -> None:
    recorder = Recorder(None)
    images = request_images(1)
    with make_engine(on_iteration=recorder, encoder={"max_num_items": 1}) as (_, url):
        job_id = admitted(url, submit_body("partial", images))
        content = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).json()["choices"][0]["message"]
    reports = recorder.encoding()
    assert [report.plan.work for report in reports] == [((job_id, i),) for i in range(3)]
    # The whole buffer was charged at the first item and stayed charged until the request was done.
    footprint = sum(int(alone(image).shape[0]) for image in images) * 128 * 4
    assert [report.stats.resident_bytes for report in reports[:2]] == [footprint, footprint]
    # Each item ran alone in its iteration: bitwise what the tower gives for it alone.
    for index, image in enumerate(images):
        digest = hashlib.sha256(alone(image).numpy().tobytes()).hexdigest()
        assert f"image {index}: " in content["content"]
        assert f"sha256 {digest}" in content["content"].splitlines()[index]


def test_an_encoder_failure_fails_its_batch_and_the_loop_goes_on(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_forward = VisionEncoder.forward
    calls = {"n": 0}

    def failing_once(self: VisionEncoder, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real_forward(self, pixel_values, grid_thw)

    # Fault injection at the device boundary: the first forward pass raises like a device error would.
    monkeypatch.setattr(VisionEncoder, "forward", failing_once)
    with make_engine() as (_, url):
        failed = admitted(url, submit_body("unlucky", request_images(2)))
        response = httpx.get(f"{url}{REQUESTS}/{failed}/response", timeout=30)
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["reason"] == "encoder_error"
        assert "injected" in error["message"]
        assert status(url)["resident_bytes"] == 0
        served = admitted(url, submit_body("next", request_images(3)))
        assert httpx.get(f"{url}{REQUESTS}/{served}/response", timeout=30).status_code == 200
        wait_idle(url)


def test_cancel_while_its_items_encode_drops_their_outputs(
    make_engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_forward = VisionEncoder.forward
    entered, proceed = threading.Event(), threading.Event()

    def gated(self: VisionEncoder, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        entered.set()
        assert proceed.wait(20)
        return real_forward(self, pixel_values, grid_thw)

    monkeypatch.setattr(VisionEncoder, "forward", gated)
    with make_engine() as (_, url):
        job_id = admitted(url, submit_body("doomed", request_images(0)))
        assert entered.wait(10)
        response = httpx.delete(f"{url}{REQUESTS}/{job_id}", timeout=10)
        assert response.json() == {"id": job_id, "cancelled": True, "freed_bytes": 19 * 128 * 4}
        assert status(url)["resident_bytes"] == 0
        proceed.set()
        wait_until(lambda: status(url)["iterations"] >= 2, what="the loop to run past the dropped batch")
        assert status(url)["items_recorded"] == 0
        served = admitted(url, submit_body("survivor", request_images(1)))
        assert httpx.get(f"{url}{REQUESTS}/{served}/response", timeout=30).status_code == 200
        assert wait_idle(url)["items_recorded"] == 3


def test_an_idle_loop_sleeps(make_engine: EngineFactory) -> None:
    recorder = Recorder(None)
    with make_engine(on_iteration=recorder) as (_, url):
        job_id = admitted(url, submit_body("one", [pixels(56, 56)]))
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
        wait_idle(url)
        before = len(recorder.reports)
        threading.Event().wait(0.5)
        assert len(recorder.reports) - before <= 1  # at most the wake-up of the request's own finish
