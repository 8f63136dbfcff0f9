# Every target installs what it needs first. Override e.g. `make test PYTHON=python3.12`.
PYTHON ?= python3
VENV ?= .venv
# Pinned here, not in setup.cfg: an unpinned torch pulls several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
OUT ?= out
PYTEST_ARGS ?=

.PHONY: install test lint format demo bench clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The main job: compile T5-3B for 8 GPUs (analytic costs) and simulate the plan.
demo: install
	$(BIN)/ftpipe profile --model t5-3b --task rte -o $(OUT)/t5-3b-graph.json
	$(BIN)/ftpipe partition $(OUT)/t5-3b-graph.json --gpus 8 -o $(OUT)/t5-3b-plan.json
	$(BIN)/ftpipe simulate $(OUT)/t5-3b-plan.json --report $(OUT)/t5-3b-report.html

bench: install
	$(BIN)/python tools/bench.py --out BENCHMARKS.md

clean:
	rm -rf $(OUT) build *.egg-info .pytest_cache .ruff_cache
