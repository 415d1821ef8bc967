"""Shared helpers for the engine tests: submit files, real engine servers on loopback, the stub LLM."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from engine_adapter.client.wire import SUBMIT_CONTENT_TYPE, WireItem, encode_submit, item_part
from tests.observe import wait_until

REQUESTS = "/internal/v1/requests"


def pixels(height: int, width: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """Random uint8 RGB pixels (both sides should be multiples of 28 for the Qwen2-VL geometry)."""
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def submit_body(
    request_id: str,
    images: list[npt.NDArray[np.uint8]],
    *,
    text: str = "describe these images",
    stream: bool = False,
    model: str = "test-model",
    extra: dict[str, Any] | None = None,
) -> bytes:
    content: list[Any] = [{"type": "text", "text": text}, *(item_part(i) for i in range(len(images)))]
    document: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    document.update(extra or {})
    items = [
        WireItem("image", f"image-{i}", hashlib.sha256(image.tobytes()).hexdigest(), image)
        for i, image in enumerate(images)
    ]
    return encode_submit(request_id, document, items)


def submit(url: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(
        url + REQUESTS, content=body, headers={"content-type": SUBMIT_CONTENT_TYPE, **headers}, timeout=30
    )


def admitted(url: str, body: bytes, **headers: str) -> str:
    response = submit(url, body, **headers)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert isinstance(job_id, str)
    return job_id


def status(url: str, **headers: str) -> dict[str, Any]:
    response = httpx.get(url + "/internal/v1/status", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def metric_samples(url: str, **headers: str) -> dict[str, float]:
    """`/metrics` as {sample with labels: value}."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def wait_idle(url: str) -> dict[str, Any]:
    """Wait until the engine holds no request and no buffer; returns its status."""
    seen: dict[str, Any] = {}

    def idle() -> bool:
        seen.update(status(url))
        return bool(seen["requests"] == 0 and seen["resident_bytes"] == 0 and seen["queue"]["live"] == 0)

    wait_until(idle, what="the engine to hold no request")
    return seen
