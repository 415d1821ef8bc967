"""The engine's internal API through a real server on loopback: statuses, bodies, auth, draining, metrics."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
import safetensors.numpy
import torch

from engine_adapter.app import body_cap
from engine_adapter.client.wire import SUBMIT_CONTENT_TYPE, WireItem, encode_submit, item_part
from engine_adapter.errors import BadRequest, TooLarge
from engine_adapter.jobs import Job
from tests.conftest import (
    EngineFactory,
)
from tests.engine_adapter.conftest import (
    REQUESTS,
    admitted,
    metric_samples,
    pixels,
    status,
    submit,
    submit_body,
    wait_idle,
)
from tests.engine_adapter.stub_llm import StubLLM
from tests.observe import wait_until
from tests.servers import served_process

ROOT = Path(__file__).resolve().parents[2]


def error_of(response: httpx.Response) -> dict[str, object]:
    assert response.headers["x-mmgate-engine-error"] == "1"
    error = response.json()["error"]
    assert error["code"] == response.status_code
    assert isinstance(error, dict)
    return error


def test_submit_202_then_response_then_gone(make_engine: EngineFactory) -> None:
    with make_engine() as (_, url):
        response = submit(url, submit_body("wire-1", [pixels(56, 84), pixels(56, 56, seed=1)]))
        assert response.status_code == 202
        assert response.headers["x-request-id"] == "wire-1"
        job_id = response.json()["id"]
        answer = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert answer.status_code == 200
        assert answer.headers["x-request-id"] == "wire-1"
        content = answer.json()["choices"][0]["message"]["content"]
        assert content.startswith("image 0: 6 rows x 128, sha256 ")
        assert "image 1: 4 rows x 128, sha256 " in content
        # Relayed: the request is finished, its id is remembered as gone.
        again = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=10)
        assert again.status_code == 410
        assert "completed" in str(error_of(again)["message"])
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/embeddings", timeout=10).status_code == 410
        idle = wait_idle(url)
        assert idle["pending_input_bytes"] == 0


def test_unknown_ids_and_routes_are_404(make_engine: EngineFactory) -> None:
    with make_engine() as (_, url):
        for method, path in [
            ("GET", f"{REQUESTS}/nope/response"),
            ("GET", f"{REQUESTS}/nope/embeddings"),
            ("DELETE", f"{REQUESTS}/nope"),
            ("GET", "/internal/v1/elsewhere"),
            ("PUT", REQUESTS),
        ]:
            response = httpx.request(method, url + path, timeout=10)
            assert response.status_code == 404, (method, path)
            assert error_of(response)["reason"] == "not_found"


def test_second_claim_is_409(make_engine: EngineFactory) -> None:
    # max_concurrency 1: the first request's answer, unclaimed, holds the only consumer slot, so the second
    # waits unstarted and its first claimant waits with it.
    with make_engine(handoff={"max_concurrency": 1}) as (_, url):
        first = admitted(url, submit_body("first", [pixels(56, 56)]))
        second = admitted(url, submit_body("second", [pixels(56, 84)]))
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.get, f"{url}{REQUESTS}/{second}/response", timeout=30)
            wait_until(lambda: status(url)["queue"]["waiting"] == 1 and not waiting.done(), what="a queued claim")
            time.sleep(0.2)  # the waiting claim has reached the engine
            response = httpx.get(f"{url}{REQUESTS}/{second}/response", timeout=10)
            assert response.status_code == 409
            assert "already claimed" in str(error_of(response)["message"])
            assert httpx.get(f"{url}{REQUESTS}/{first}/response", timeout=30).status_code == 200
            assert waiting.result().status_code == 200
        wait_idle(url)


def test_never_fits_is_413_naming_the_knob_and_both_numbers(make_engine: EngineFactory) -> None:
    # Two 56x84 images: 6 + 6 rows x 128 x float32 = 6,144 bytes; the budget holds one image's worth.
    with make_engine(encoder={"max_resident_bytes": 4096}) as (_, url):
        response = submit(url, submit_body("too-big", [pixels(56, 84), pixels(56, 84, seed=1)]))
        assert response.status_code == 413
        error = error_of(response)
        assert error["reason"] == "max_resident_bytes"
        assert "encoder.max_resident_bytes=4,096" in str(error["message"])
        assert "6,144 bytes" in str(error["message"])
        assert "too-big" in str(error["message"])
        assert metric_samples(url)['mmgate_engine_admission_rejections_total{reason="max_resident_bytes"}'] == 1
        # A request that fits is still served.
        job_id = admitted(url, submit_body("fits", [pixels(56, 84)]))
        assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200


def test_auth_token_is_required_everywhere_but_healthz(make_engine: EngineFactory) -> None:
    with make_engine(server={"auth_token": "s3cret"}) as (_, url):
        body = submit_body("auth", [pixels(56, 56)])
        assert httpx.get(url + "/healthz", timeout=10).status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            for response in (
                submit(url, body, **headers),
                httpx.get(url + "/metrics", headers=headers, timeout=10),
                httpx.get(url + "/internal/v1/status", headers=headers, timeout=10),
                httpx.get(f"{url}{REQUESTS}/x/response", headers=headers, timeout=10),
                httpx.delete(f"{url}{REQUESTS}/x", headers=headers, timeout=10),
            ):
                assert response.status_code == 401, headers
                assert response.headers["www-authenticate"] == "Bearer"
                assert "server.auth_token" in str(error_of(response)["message"])
        good = {"authorization": "Bearer s3cret"}
        job_id = admitted(url, body, **good)
        answer = httpx.get(f"{url}{REQUESTS}/{job_id}/response", headers=good, timeout=30)
        assert answer.status_code == 200
        assert status(url, **good)["requests"] == 0


def test_draining_refuses_submits_with_503(make_engine: EngineFactory) -> None:
    with make_engine() as (app, url):
        app.start_draining()
        response = submit(url, submit_body("late", [pixels(56, 56)]))
        assert response.status_code == 503
        assert error_of(response)["reason"] == "draining"
        assert status(url)["draining"] is True


def test_malformed_submits_are_400(make_engine: EngineFactory) -> None:
    image = pixels(56, 56)
    document = {"messages": [{"role": "user", "content": [item_part(0), item_part(0)]}]}
    twice = encode_submit("twice", document, [WireItem("image", "a", "h", image)])
    no_items = encode_submit("none", {"messages": []}, [])
    no_metadata = bytes(safetensors.numpy.save({"item.0": image}))
    # A hand-written header whose metadata values are not strings (the safetensors writer would refuse them).
    header = orjson.dumps(
        {
            "__metadata__": {
                "mmgate.version": "1",
                "mmgate.request_id": 5,
                "mmgate.request": orjson.dumps({"messages": [{"role": "user", "content": [item_part(0)]}]}).decode(),
                "mmgate.items": '[{"modality": "image", "locator": "a", "content_hash": "h"}]',
            },
            "item.0": {"dtype": "U8", "shape": [56, 56, 3], "data_offsets": [0, image.nbytes]},
        }
    )
    odd_metadata = len(header).to_bytes(8, "little") + header + image.tobytes()
    with make_engine() as (_, url):
        for body, expected in [
            (b"not a safetensors file", "malformed submit file"),
            (no_metadata, "mmgate.version"),
            (twice, "each index 0..0 must appear exactly once"),
            (no_items, "carries no media items"),
            (odd_metadata, "expected a string"),
        ]:
            response = submit(url, body)
            assert response.status_code == 400, body[:40]
            error = error_of(response)
            assert error["reason"] == "malformed"
            assert expected in str(error["message"])
        assert status(url)["requests"] == 0


def test_items_off_the_engine_geometry_are_400_naming_the_item(make_engine: EngineFactory) -> None:
    with make_engine(model={"max_pixels": 56 * 112}) as (_, url):
        cases = [
            (pixels(56, 60), "patch_size*merge_size=28"),  # not a multiple of 28
            (pixels(28, 56), "under model.min_pixels=3,136"),
            (pixels(112, 112), "over model.max_pixels=6,272"),
        ]
        for image, expected in cases:
            body = submit_body("geometry", [pixels(56, 56), image])
            response = submit(url, body)
            assert response.status_code == 400
            error = error_of(response)
            assert error["reason"] == "geometry"
            assert "item 1 (image-1)" in str(error["message"])
            assert expected in str(error["message"])


def test_body_over_the_cap_is_413_before_it_is_read(make_engine: EngineFactory) -> None:
    with make_engine(server={"max_request_body_bytes": 1000}) as (_, url):
        response = submit(url, submit_body("big", [pixels(56, 56)]))
        assert response.status_code == 413
        assert "server.max_request_body_bytes=1,000" in str(error_of(response)["message"])

        def chunked() -> object:
            yield b"x" * 800
            yield b"x" * 800

        response = httpx.post(
            url + REQUESTS, content=chunked(), headers={"content-type": SUBMIT_CONTENT_TYPE}, timeout=10
        )  # type: ignore[arg-type]
        assert response.status_code == 413


def test_pending_inputs_are_capped(make_engine: EngineFactory) -> None:
    # A 56x56 image is 16 patch rows of 1,176 uint8 values: 18,816 bytes held until it is encoded.
    sections = {"encoder": {"max_pending_input_bytes": 40_000}, "handoff": {"max_concurrency": 1}}
    with make_engine(**sections) as (_, url):
        admitted(url, submit_body("holds-the-slot", [pixels(56, 56)]))  # answered, unclaimed: the one slot
        wait_until(lambda: status(url)["handoff"]["in_flight"] == 1, what="the first hand-off")
        admitted(url, submit_body("queued", [pixels(56, 56, seed=1)]))  # waits for the slot, inputs held
        assert status(url)["pending_input_bytes"] == 18_816
        response = submit(url, submit_body("one-too-many", [pixels(56, 56), pixels(56, 56, seed=2)]))
        assert response.status_code == 429
        assert response.headers["retry-after"] == "1"
        error = error_of(response)
        assert error["reason"] == "max_pending_input_bytes"
        assert "hold 18,816 bytes" in str(error["message"])
        assert "encoder.max_pending_input_bytes=40,000" in str(error["message"])
        response = submit(url, submit_body("never", [pixels(56, 56, seed=i) for i in range(3)]))
        assert response.status_code == 413
        assert "56,448 bytes, over encoder.max_pending_input_bytes=40,000" in str(error_of(response)["message"])


def test_a_caller_that_leaves_while_its_embeddings_are_not_ready_ends_its_wait(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True
    handoff = {"backend": "openai", "url": stub_url, "max_concurrency": 1}
    with make_engine(handoff=handoff) as (app, url):
        ended = threading.Event()
        wait_for_buffer = app.engine.embeddings

        async def watched(job: Job) -> tuple[torch.Tensor, tuple[int, ...]]:
            try:
                return await wait_for_buffer(job)
            finally:
                ended.set()

        monkeypatch.setattr(app.engine, "embeddings", watched)
        first = admitted(url, submit_body("held", [pixels(56, 56)]))
        assert stub.state.arrived.wait(10)  # the one hand-off slot is taken: the next request waits unencoded
        second = admitted(url, submit_body("waiting", [pixels(56, 56, seed=1)]))
        with pytest.raises(httpx.ReadTimeout):  # the caller gives up and closes its connection
            httpx.get(f"{url}{REQUESTS}/{second}/embeddings", timeout=0.5)
        assert ended.wait(5), "the wait for the buffer went on after its caller left"
        assert status(url)["queue"]["waiting"] == 1  # it ended because the caller left, not because it was ready
        for job_id in (first, second):
            assert httpx.delete(f"{url}{REQUESTS}/{job_id}", timeout=10).json()["cancelled"] is True
        wait_idle(url)


def test_cancel_is_idempotent(make_engine: EngineFactory) -> None:
    with make_engine() as (_, url):
        job_id = admitted(url, submit_body("cancel-me", [pixels(56, 56)]))
        first = httpx.delete(f"{url}{REQUESTS}/{job_id}", timeout=10)
        assert first.status_code == 200
        assert first.json()["cancelled"] is True
        second = httpx.delete(f"{url}{REQUESTS}/{job_id}", timeout=10)
        assert second.status_code == 200
        assert second.json() == {"id": job_id, "cancelled": False, "freed_bytes": 0}
        gone = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=10)
        assert gone.status_code == 410
        assert "DELETE" in str(error_of(gone)["message"])
        wait_idle(url)


def test_status_describes_budgets_model_and_handoff(make_engine: EngineFactory) -> None:
    with make_engine(encoder={"max_resident_bytes": "1MiB", "scheduling_policy": "eager"}) as (_, url):
        data = status(url)
        assert data["policy"] == "EAGER"
        assert data["budgets"]["max_resident_bytes"] == 1 << 20
        assert data["budgets"]["effective_max_num_tokens"] == 16384
        assert data["resident_bytes"] == 0
        assert data["queue"]["waiting"] == 0
        assert data["model"] == {
            "preset": "tiny",
            "arch": "qwen2_vl",
            "device": "cpu",
            "dtype": "float32",
            "weights": "random (seed=0)",
            "from_checkpoint": False,
            "embedding_width": 128,
            "deepstack_visual_indexes": [],
        }
        assert data["processor"]["geometry"] == "qwen2_vl"
        assert data["handoff"]["backend"] == "reference"
        assert data["handoff"]["in_flight"] == 0
        assert data["cache"] is None


METRIC_NAMES = [
    "mmgate_engine_iterations_total",
    "mmgate_engine_items_encoded_total",
    "mmgate_engine_iteration_seconds_bucket",
    "mmgate_engine_iteration_tokens_bucket",
    "mmgate_engine_resident_bytes",
    "mmgate_engine_resident_budget_bytes",
    "mmgate_engine_queued_requests",
    "mmgate_engine_admission_rejections_total",
    "mmgate_engine_cache_hits_total",
    "mmgate_engine_cache_misses_total",
]


def test_metrics_on_a_live_engine(make_engine: EngineFactory) -> None:
    with make_engine(encoder={"cache_max_bytes": "1MiB"}) as (_, url):
        image = pixels(56, 56)
        for request_id in ("m1", "m2"):  # the same image twice: one miss, then one hit
            job_id = admitted(url, submit_body(request_id, [image]))
            assert httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30).status_code == 200
        text = httpx.get(url + "/metrics", timeout=10).text
        samples = metric_samples(url)
        for name in METRIC_NAMES:
            assert any(sample.startswith(name) for sample in samples), name
        assert samples["mmgate_engine_items_encoded_total"] == 1
        assert samples["mmgate_engine_cache_hits_total"] == 1
        assert samples["mmgate_engine_cache_misses_total"] == 1
        assert samples["mmgate_engine_resident_budget_bytes"] == 256 << 20
        assert "request" not in "".join(line for line in text.splitlines() if "{" in line and "reason" not in line)


@pytest.mark.slow
def test_engine_process_serves_then_exits_on_sigterm(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("model:\n  device: cpu\nserver:\n  drain_timeout_s: 5\n  log_level: warning\n")
    with served_process("engine_adapter", config) as served:
        url = served.url
        job_id = admitted(url, submit_body("e2e", [pixels(56, 56)], stream=True))
        answer = httpx.get(f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert answer.headers["content-type"] == "text/event-stream"
        assert answer.text.endswith("data: [DONE]\n\n")
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(timeout=20) in (0, -signal.SIGTERM)


def test_a_response_still_waited_for_at_the_drain_deadline_gets_a_503(
    make_engine: EngineFactory, stub_llm: tuple[StubLLM, str]
) -> None:
    stub, stub_url = stub_llm
    stub.state.hold = True  # the LLM never answers
    handoff = {"backend": "openai", "url": stub_url}
    with make_engine(handoff=handoff, server={"drain_timeout_s": 0.5}) as (app, url), ThreadPoolExecutor(1) as pool:
        job_id = admitted(url, submit_body("cut", [pixels(56, 56)]))
        answer = pool.submit(httpx.get, f"{url}{REQUESTS}/{job_id}/response", timeout=30)
        assert stub.state.arrived.wait(10)
        app.start_draining()
        response = answer.result(timeout=30)
    assert response.status_code == 503
    assert response.headers["x-mmgate-engine-error"] == "1"
    assert response.json()["error"] == {
        "message": f"the engine shut down before GET {REQUESTS}/{job_id}/response finished "
        "(server.drain_timeout_s=0.5)",
        "code": 503,
        "reason": "drain_timeout",
    }


def test_error_body_shape() -> None:
    body = orjson.loads(TooLarge("over encoder.max_resident_bytes=1", reason="max_resident_bytes").body())
    assert body == {
        "error": {"message": "over encoder.max_resident_bytes=1", "code": 413, "reason": "max_resident_bytes"}
    }


def test_reference_engine_answers_text_only_chat_itself(make_engine: EngineFactory) -> None:
    body = {"model": "demo", "messages": [{"role": "user", "content": "say three words"}]}
    with make_engine() as (_, url):
        plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        streamed = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30)
        malformed = httpx.post(url + "/v1/chat/completions", content=b"{", timeout=30)
    assert plain.status_code == 200
    data = plain.json()
    assert data["object"] == "chat.completion"
    assert data["model"] == "demo"
    assert data["choices"][0]["message"]["content"] == (
        "reference reply: 0 item(s), 0 embedding row(s), 3 text token(s)."
    )
    assert data["usage"]["prompt_tokens"] == 3
    assert streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text.rstrip().endswith("data: [DONE]")
    assert malformed.status_code == 400


def test_openai_backend_engine_is_no_llm(make_engine: EngineFactory) -> None:
    handoff = {"backend": "openai", "url": "http://127.0.0.1:9"}
    with make_engine(handoff=handoff) as (_, url):
        response = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert response.status_code == 404


async def test_a_malformed_content_length_is_a_400_before_the_body_is_read() -> None:
    # uvicorn's parser refuses such a head itself; the engine's reader does not rely on it.
    async def receive() -> dict[str, object]:
        raise AssertionError("the body must not be read")

    scope = {"type": "http", "headers": [(b"content-length", b"12abc")]}
    with pytest.raises(BadRequest, match="invalid Content-Length header '12abc'") as refused:
        await body_cap(1 << 20).read(scope, receive)
    assert refused.value.status_code == 400
    assert orjson.loads(refused.value.body())["error"]["reason"] == "malformed"


def test_routes_take_any_single_segment_id_and_refuse_other_methods_in_the_envelope(make_engine: EngineFactory) -> None:
    with make_engine(server={"auth_token": "s3cret"}) as (_, url):
        good = {"authorization": "Bearer s3cret"}
        # Odd ids are path parameters like any other: unknown, so 404 naming the decoded id.
        for raw, decoded in [("a%20b", "a b"), ("%C3%A9t%C3%A9", "été"), ("x.y~z", "x.y~z")]:
            response = httpx.delete(f"{url}{REQUESTS}/{raw}", headers=good, timeout=10)
            assert response.status_code == 404, raw
            assert f"no request {decoded} on this engine" in str(error_of(response)["message"])
            for action in ("response", "embeddings"):
                response = httpx.get(f"{url}{REQUESTS}/{raw}/{action}", headers=good, timeout=10)
                assert response.status_code == 404, (raw, action)
                assert error_of(response)["reason"] == "not_found"
        for method, path in [
            # A path the engine serves, with a method it does not: 404 in the engine's envelope, no Allow header.
            ("POST", f"{REQUESTS}/x/response"),
            ("PUT", f"{REQUESTS}/x"),
            ("DELETE", "/internal/v1/status"),
            ("POST", "/healthz"),
            # HEAD is answered only on /healthz and /metrics: a HEAD never claims a response.
            ("HEAD", f"{REQUESTS}/x/response"),
            ("HEAD", "/internal/v1/status"),
            # An empty id, a trailing slash or an id with a slash is no route (never a redirect).
            ("DELETE", f"{REQUESTS}/"),
            ("GET", f"{REQUESTS}/x/response/"),
            ("GET", f"{REQUESTS}/x%2Fy/response"),
            ("GET", "/internal/v1/status/"),
        ]:
            response = httpx.request(method, url + path, headers=good, timeout=10)
            assert response.status_code == 404, (method, path)
            assert "allow" not in response.headers
            if method != "HEAD":
                error = error_of(response)
                assert error["reason"] == "not_found"
                assert str(error["message"]).startswith(f"no route {method} "), (method, path)
            else:
                assert response.headers["x-mmgate-engine-error"] == "1"
        assert httpx.head(url + "/healthz", timeout=10).status_code == 200
        assert httpx.head(url + "/metrics", headers=good, timeout=10).status_code == 200
        # The bearer token is checked before routing: an unknown path without it is 401, not 404.
        response = httpx.get(url + "/internal/v1/elsewhere", timeout=10)
        assert response.status_code == 401
        assert error_of(response)["reason"] == "unauthorized"
