# The two commands a newcomer needs: `make run` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test lint typecheck unit config-reference clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@ $(RUN_STAMP)

# The embedded default stack: the engine (CPU, tiny tower, reference responder) on 127.0.0.1:8100 and the gateway
# in engine mode in front of it on 127.0.0.1:8000. Ctrl-C stops both; so does either one exiting.
run: $(RUN_STAMP)
	@echo "mmgate: engine on 127.0.0.1:8100 (configs/engine.yaml), gateway on 127.0.0.1:8000 (configs/demo.yaml); Ctrl-C stops both"
	@bash -c 'trap "kill \$$(jobs -p) 2>/dev/null; wait" EXIT; \
		$(BIN)/mmgate engine --config configs/engine.yaml & \
		$(BIN)/mmgate gateway --config configs/demo.yaml & \
		wait -n'

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

unit: $(TEST_STAMP)
	$(BIN)/pytest -q

test: lint typecheck unit

# docs/configuration.md from the settings models and the annotated configs (a test fails when it is stale).
config-reference: $(TEST_STAMP)
	$(BIN)/python -m tests.config_reference > docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
