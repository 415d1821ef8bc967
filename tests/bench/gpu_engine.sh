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
