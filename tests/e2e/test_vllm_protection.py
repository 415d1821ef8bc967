"""The protection, measured on a real vLLM: a burst of requests with many large images, refused by the gateway
before vLLM sees a byte, and sent to vLLM directly, which decodes and processes them."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.support import MIB, PeakRSS, VLLMServer, image_chat, noise_jpegs

pytestmark = pytest.mark.timeout(600)

REQUESTS = 8
IMAGES = 48  # each request: 48 distinct 1024 x 1024 noise JPEGs (about 30 MB; 40 MB of base64)
SIDE = 1024
# vLLM's resident memory when nothing reaches it may still move by a few pages.
FLAT_BYTES = 64 * MIB
# What the direct burst must add at least, for the refusal to mean something: one such request's pixel tensors
# alone are 48 x 5476 patches x 1176 x 4 bytes = 1.2 GB.
GROWTH_BYTES = 512 * MIB


@pytest.fixture(scope="module")
def burst() -> list[bytes]:
    began = time.monotonic()
    bodies = [
        json.dumps(image_chat(*noise_jpegs(IMAGES, SIDE, seed=100 + n), max_tokens=4, temperature=0)).encode()
        for n in range(REQUESTS)
    ]
    size = sum(map(len, bodies)) / MIB
    print(f"\n{REQUESTS} bodies of {IMAGES} JPEGs, {size:,.0f} MiB in all, built in {time.monotonic() - began:.1f} s")
    return bodies


def send_at_once(base_url: str, bodies: list[bytes]) -> list[httpx.Response]:
    with (
        httpx.Client(timeout=300, limits=httpx.Limits(max_connections=len(bodies))) as client,
        ThreadPoolExecutor(len(bodies)) as pool,
    ):
        return list(
            pool.map(
                lambda body: client.post(
                    base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
                ),
                bodies,
            )
        )


def test_the_gateway_refuses_the_burst_and_vllms_memory_stays_flat(
    vllm: VLLMServer, gateway_url: str, burst: list[bytes]
) -> None:
    with PeakRSS(vllm) as rss:
        began = time.monotonic()
        responses = send_at_once(gateway_url, burst)
        took = time.monotonic() - began
    print(f"\nthrough the gateway: {[r.status_code for r in responses]} in {took:.1f} s; {rss.summary()}")
    for response in responses:
        assert response.status_code == 413, response.text
        assert "limits.max_multimodal_cpu_bytes_per_request" in response.json()["message"]
    assert rss.peak - rss.before < FLAT_BYTES, rss.summary()
    assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200


@pytest.mark.e2e_last
def test_the_same_burst_sent_directly_grows_vllms_memory(vllm: VLLMServer, burst: list[bytes]) -> None:
    with PeakRSS(vllm) as rss:
        began = time.monotonic()
        responses = send_at_once(vllm.url, burst)
        took = time.monotonic() - began
    print(f"\nsent to vLLM directly: {[r.status_code for r in responses]} in {took:.1f} s; {rss.summary()}")
    print(f"vLLM's answer to the first: {responses[0].text[:300]}")
    assert rss.peak - rss.before > GROWTH_BYTES, rss.summary()
