#!/usr/bin/env bash
# GPU engine benchmark, unattended, in under 5 minutes on a fresh GPU box that has this repository:
# a Qwen2-VL-2B-size vision tower with random bfloat16 weights, items/s, encoder iteration latency and peak CUDA
# memory per scheduling policy (DEFAULT / EAGER / DISABLED) at 1 / 4 / 7 images per request, 32 concurrent requests.
# Prints what it finds (torch, CUDA, GPU) and one markdown table (tests/bench/bench_engine.py does the measuring).
#
#   tests/bench/gpu_engine.sh              # creates .venv-gpu (reusing a CUDA torch already installed system-wide)
#   VENV=.venv tests/bench/gpu_engine.sh --dry-run   # the same pipeline on the CPU with the tiny tower
set -euo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=0
[[ "${1:-}" == "--dry-run" ]] && DRY_RUN=1
VENV=${VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}

if [[ ! -x "$VENV/bin/python" ]]; then
  # System site-packages: a CUDA build of torch the box already has satisfies the engine extra's torch pin
  # (a local version such as 2.13.0+cu128 matches ==2.13.0), so nothing multi-GB is downloaded.
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
if ! "$VENV/bin/pip" install --quiet --disable-pip-version-check -e '.[engine]'; then
  echo "gpu_engine.sh: could not install .[engine] (offline, or no matching torch); installing mmgate alone" \
       "and using the packages already here" >&2
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
fi

"$VENV/bin/python" - "$DRY_RUN" <<'EOF'
import sys

import torch

dry_run = sys.argv[1] == "1"
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, CUDA available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    print(
        f"GPU {index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability "
        f"{props.major}.{props.minor}, bf16 {torch.cuda.is_bf16_supported()}"
    )
elif not dry_run:
    sys.exit("gpu_engine.sh: this torch cannot see a CUDA device; install a CUDA build of torch 2.13 (or run --dry-run)")
EOF

if [[ "$DRY_RUN" == 1 ]]; then
  ARGS=(--preset tiny --device cpu --dtype float32 --image 112 --images 1,4 --requests 8)
else
  # 448x448 images: 1,024 encoder tokens, 256 embedding rows of 1,536 each per image.
  ARGS=(--preset qwen2-vl-2b --device cuda --dtype bfloat16 --image 448 --images 1,4,7 --requests 32
        --max-num-items 16 --max-num-tokens 16384 --max-resident-bytes 256MiB --max-concurrency 8)
fi
# Nine rows, each in a fresh process; the timeout keeps the whole script inside its 5 minutes.
timeout 270 "$VENV/bin/python" tests/bench/bench_engine.py "${ARGS[@]}"

# ---------------------------------------------------------------------------------------------------------------
# End to end against a real vLLM (only with E2E_VLLM=1 and vLLM installed; `pip install 'vllm>=0.13.0'`):
# vLLM serves $VLLM_MODEL with --enable-mm-embeds and no vision tower of its own; the engine encodes with the same
# checkpoint's tower on the GPU and hands the embeddings off; one portrait and one landscape image through the engine
# must be answered 200 (the [1, 3] grid mmgate used to send got a 400 for every request).
#   E2E_VLLM=1 VLLM_MODEL=Qwen/Qwen2-VL-2B-Instruct ENGINE_PRESET=qwen2-vl-2b tests/bench/gpu_engine.sh
if [[ "${E2E_VLLM:-0}" == 1 && "$DRY_RUN" == 0 ]]; then
  VLLM_MODEL=${VLLM_MODEL:-Qwen/Qwen2-VL-2B-Instruct}
  ENGINE_PRESET=${ENGINE_PRESET:-qwen2-vl-2b}
  CHECKPOINT=$("$VENV/bin/python" -c "from huggingface_hub import snapshot_download as s; print(s('$VLLM_MODEL'))")
  LOGS=$(mktemp -d)
  VLLM_BIN=${VLLM_BIN:-$(command -v vllm || echo "$VENV/bin/vllm")}
  "$VLLM_BIN" serve "$CHECKPOINT" --host 127.0.0.1 --port 8001 --enable-mm-embeds \
    --limit-mm-per-prompt '{"image": 0, "video": 0}' --max-model-len 8192 --gpu-memory-utilization 0.6 >"$LOGS/vllm.log" 2>&1 &
  VLLM_PID=$!
  MMGATE_ENGINE_MODEL__PRESET=$ENGINE_PRESET MMGATE_ENGINE_MODEL__CHECKPOINT=$CHECKPOINT \
  MMGATE_ENGINE_MODEL__DEVICE=cuda MMGATE_ENGINE_MODEL__DTYPE=bfloat16 MMGATE_ENGINE_HANDOFF__BACKEND=openai \
  MMGATE_ENGINE_HANDOFF__URL=http://127.0.0.1:8001 MMGATE_ENGINE_HANDOFF__FORMAT=vllm \
  MMGATE_ENGINE_HANDOFF__MODEL=$CHECKPOINT MMGATE_ENGINE_HANDOFF__EXPECTED_DTYPE=bfloat16 \
    "$VENV/bin/python" -m engine_adapter --port 8100 >"$LOGS/engine.log" 2>&1 &
  ENGINE_PID=$!
  trap 'kill $VLLM_PID $ENGINE_PID 2>/dev/null || true' EXIT
  timeout 420 "$VENV/bin/python" - <<'PY' || { tail -n 30 "$LOGS"/*.log; exit 1; }
import time

import httpx
import numpy as np

from engine_adapter.client.wire import SUBMIT_CONTENT_TYPE, WireItem, encode_submit, item_part

for url in ("http://127.0.0.1:8001/health", "http://127.0.0.1:8100/healthz"):
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(2)
rng = np.random.default_rng(0)
images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((448, 280), (280, 448))]  # portrait, landscape
content = [{"type": "text", "text": "Describe both images in one sentence."}, item_part(0), item_part(1)]
document = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": content}]}
items = [WireItem("image", f"image-{i}", "", image) for i, image in enumerate(images)]
body = encode_submit("gpu-e2e", document, items)
base = "http://127.0.0.1:8100/internal/v1/requests"
job = httpx.post(base, content=body, headers={"content-type": SUBMIT_CONTENT_TYPE}, timeout=60)
assert job.status_code == 202, job.text
answer = httpx.get(f"{base}/{job.json()['id']}/response", timeout=300)
print("vLLM answered", answer.status_code, answer.text[:300])
assert answer.status_code == 200, "vLLM refused the engine's image_embeds parts"
status = httpx.get("http://127.0.0.1:8100/internal/v1/status", timeout=10).json()
print("hand-off", status["handoff"], "processor", status["processor"])
PY
fi
