"""The `openai` hand-off backend against a stub LLM server on loopback: the embeddings it decodes equal the
engine's buffer exactly, in both part formats; the buffer lives until the backend's first byte and is freed on
every other path (caller disconnect, unclaimed response, backend unreachable)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine_adapter.embeddings_file import read_embeddings_file
from tests.conftest import (
    EngineFactory,
)
from tests.engine_adapter.conftest import (
    REQUESTS,
    admitted,
    pixels,
    status,
    submit,
    submit_body,
    wait_idle,
)
from tests.engine_adapter.stub_llm import StubLLM
from tests.observe import wait_until


def openai_handoff(stub_url: str, fmt: str = "vllm", **extra: object) -> dict[str, object]:
    return {"backend": "openai", "url": stub_url, "format": fmt, **extra}


def held_by_the_backend(url: str, stub: StubLLM, body: bytes) -> str:
    """Admit this submit and wait until its request reached the stub (which holds its first byte); its job id."""
    job_id = admitted(url, body)
    assert stub.state.arrived.wait(10)
    return job_id


def assert_dropped(url: str, stub: StubLLM, job_id: str, said: str) -> None:
    """The engine dropped its request to the stub, and a claim of the job's response is a 410 saying `said`."""
    assert stub.state.disconnected.wait(10)
    gone = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=10)
    assert gone.status_code == 410
    assert said in gone.json()["error"]["message"]


@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
def test_backend_receives_exactly_the_engines_buffer(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str], fmt: str
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    stub.state.server = fmt
    # Landscape and square: trtllm-serve infers their grids right, so both forms carry embeddings (a portrait
    # image goes to trtllm-serve as pixels: tests/engine_adapter/test_handoff_contract.py).
    images = [pixels(56, 84), pixels(84, 112, seed=1), pixels(56, 56, seed=2)]
    with make_engine(handoff=openai_handoff(stub_url, fmt)) as (_, url), ThreadPoolExecutor(1) as pool:
        job_id = admitted(url, submit_body("embeds-1", images))
        answer = pool.submit(httpx.get, f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert stub.state.arrived.wait(10)
        # The stub holds its first byte: the buffer is still the engine's, charged and readable.
        fetched = httpx.get(f"{url}{REQUESTS}/{job_id}/embeddings", timeout=10)
        assert fetched.status_code == 200
        assert fetched.headers["content-type"] == "application/vnd.mmgate.embeddings+safetensors"
        buffer, offsets = read_embeddings_file(fetched.content)
        assert offsets == [0, 6, 18, 22]
        assert tuple(buffer.shape) == (22, 128)
        assert status(url)["resident_bytes"] == 22 * 128 * 4
        stub.release()
        response = answer.result()
        assert response.status_code == 200
        assert response.json() == {"choices": [{"message": {"content": "stub saw 3 image embed(s)"}}]}
        assert response.headers["x-stub"] == "yes"
        # At the backend's first byte the buffer went away.
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/embeddings", timeout=10).status_code == 410
        wait_idle(url)
    seen = stub.state.by_request_id("embeds-1")
    assert seen.formats == [fmt] * 3
    for index, received in enumerate(seen.embeds):
        expected = buffer[offsets[index] : offsets[index + 1]]
        assert received.dtype == expected.dtype
        assert torch.equal(received, expected)
    for index, sent in enumerate(seen.sent):
        expected = buffer[offsets[index] : offsets[index + 1]]
        # Each part carries its own rows, not the whole buffer's storage.
        assert sent.untyped_storage().nbytes() == expected.numel() * expected.element_size()
    # The grid each item is placed with: sent by vLLM's form, inferred from the row count by trtllm-serve.
    assert [grid.tolist() for grid in seen.grids if grid is not None] == [[1, 4, 6], [1, 6, 8], [1, 4, 4]]
    if fmt == "vllm":
        assert all(grid is not None and grid.dtype == torch.int64 for grid in seen.grids)
    content = seen.document["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "describe these images"}
    assert [part["type"] for part in content[1:]] == ["image_embeds"] * 3


def test_streamed_answer_is_relayed_untouched(make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]) -> None:
    _, stub_url = stub_llm
    with make_engine(handoff=openai_handoff(stub_url)) as (_, url):
        job_id = admitted(url, submit_body("sse", [pixels(56, 56)], stream=True))
        with httpx.stream("GET", f"{url}{REQUESTS}/{job_id}/response", timeout=30) as response:
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["x-request-id"] == "sse"
            assert b"".join(response.iter_raw()) == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
        wait_idle(url)


def test_backend_error_status_passes_through(make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]) -> None:
    _, stub_url = stub_llm
    with make_engine(handoff=openai_handoff(stub_url)) as (_, url):
        job_id = admitted(url, submit_body("refused", [pixels(56, 56)], model="status-400"))
        response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert response.status_code == 400
        assert response.content == b'{"detail":"the stub refuses"}'
        assert "x-mmgate-engine-error" not in response.headers
        wait_idle(url)


def test_model_override_and_api_key(make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]) -> None:
    stub, stub_url = stub_llm
    handoff = openai_handoff(stub_url, "trtllm", model="served-model", api_key="llm-key")
    with make_engine(handoff=handoff) as (_, url):
        job_id = admitted(url, submit_body("override", [pixels(56, 56)]))
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
    seen = stub.state.by_request_id("override")
    assert seen.document["model"] == "served-model"
    assert seen.headers["authorization"] == "Bearer llm-key"


def test_unreachable_backend_is_502_and_frees_the_buffer(make_engine: EngineFactory) -> None:
    with make_engine(handoff=openai_handoff("http://127.0.0.1:9")) as (_, url):
        job_id = admitted(url, submit_body("nowhere", [pixels(56, 56)]))
        response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert response.status_code == 502
        assert response.headers["x-mmgate-engine-error"] == "1"
        error = response.json()["error"]
        assert error["reason"] == "handoff_unreachable"
        assert "http://127.0.0.1:9/v1/chat/completions unreachable" in error["message"]
        wait_idle(url)


def test_backend_silent_past_read_timeout_is_504(make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    with make_engine(handoff=openai_handoff(stub_url, read_timeout_s=0.5)) as (_, url):
        job_id = admitted(url, submit_body("slow", [pixels(56, 56)]))
        response = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert response.status_code == 504
        assert "handoff.read_timeout_s=0.5" in response.json()["error"]["message"]
        wait_idle(url)


def test_caller_that_disconnects_from_response_frees_the_buffer(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    with make_engine(handoff=openai_handoff(stub_url)) as (_, url):
        job_id = held_by_the_backend(url, stub, submit_body("leaver", [pixels(56, 84), pixels(56, 56, seed=1)]))
        assert status(url)["resident_bytes"] == 10 * 128 * 4
        with pytest.raises(httpx.ReadTimeout):  # the caller gives up and closes its connection
            httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=0.5)
        idle = wait_idle(url)
        assert idle["handoff"]["in_flight"] == 0
        # The engine dropped its request to the LLM server too.
        assert_dropped(url, stub, job_id, "disconnected")


def test_unclaimed_response_is_cancelled_after_the_claim_timeout(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    sections = {"handoff": openai_handoff(stub_url), "server": {"response_claim_timeout_s": 0.5}}
    with make_engine(**sections) as (_, url):
        job_id = held_by_the_backend(url, stub, submit_body("orphan", [pixels(56, 56)]))
        assert status(url)["resident_bytes"] == 4 * 128 * 4
        wait_idle(url)
        assert_dropped(url, stub, job_id, "server.response_claim_timeout_s=0.5")


def test_delete_while_the_backend_holds_the_request_frees_it(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    with make_engine(handoff=openai_handoff(stub_url)) as (_, url), ThreadPoolExecutor(1) as pool:
        job_id = admitted(url, submit_body("deleted", [pixels(56, 56)]))
        waiting = pool.submit(httpx.get, f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert stub.state.arrived.wait(10)
        response = httpx.delete(f"{url}{REQUESTS}/{job_id}", timeout=10)
        assert response.json() == {"id": job_id, "cancelled": True, "freed_bytes": 4 * 128 * 4}
        answer = waiting.result()
        assert answer.status_code == 410
        assert answer.json()["error"]["reason"] == "cancelled"
        wait_idle(url)
        assert stub.state.disconnected.wait(10)


def test_default_policy_starts_no_more_than_the_consumer_takes(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    """DEFAULT schedules against `handoff.max_concurrency`; EAGER encodes ahead of it within the budgets."""
    stub, stub_url = stub_llm
    stub.state.hold = True
    for policy, started_second in (("DEFAULT", False), ("EAGER", True)):
        stub.state.gate.clear()
        sections = {"handoff": openai_handoff(stub_url, max_concurrency=1), "encoder": {"scheduling_policy": policy}}
        with make_engine(**sections) as (_, url), ThreadPoolExecutor(2) as pool:
            first = admitted(url, submit_body(f"{policy}-1", [pixels(56, 56)]))
            second = admitted(url, submit_body(f"{policy}-2", [pixels(56, 56, seed=1)]))
            answers = [pool.submit(httpx.get, f"{url}{REQUESTS}/{i}/response", timeout=30) for i in (first, second)]
            wait_until(lambda: status(url)["handoff"]["in_flight"] == 1, what="the first hand-off")
            if started_second:
                wait_until(lambda: status(url)["queue"]["ready"] == 1, what="the second, encoded ahead")
                assert status(url)["resident_bytes"] == 2 * 4 * 128 * 4
            else:
                assert status(url)["queue"]["waiting"] == 1
                assert status(url)["resident_bytes"] == 4 * 128 * 4
            stub.release()
            assert [answer.result().status_code for answer in answers] == [200, 200]
            wait_idle(url)


def test_submit_of_a_video_to_the_openai_backend_is_400(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    from engine_adapter.client.wire import WireItem, encode_submit, item_part

    _, stub_url = stub_llm
    clip = pixels(56, 56)[None].repeat(2, axis=0)
    body = encode_submit(
        "video", {"messages": [{"role": "user", "content": [item_part(0)]}]}, [WireItem("video", "clip", "h", clip)]
    )
    with make_engine(handoff=openai_handoff(stub_url)) as (_, url):
        response = submit(url, body)
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "handoff.backend=openai with handoff.format=vllm forwards image embeddings only" in message
        assert "no video embeddings part" in message
