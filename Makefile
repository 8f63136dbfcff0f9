# Every target installs what it needs first. Override e.g. `make test PYTHON=python3.12`.
PYTHON ?= python3
VENV ?= .venv
# Pinned here, not in setup.cfg: an unpinned torch pulls several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
OUT ?= out
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core, at most 4 (a test spawns up to 4 ranks itself).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)

# What `make install` installs: the versions last tested (setup.cfg keeps ranges for users).
CONSTRAINTS ?= constraints.txt
LATEST ?= .venv-latest

.PHONY: install bytecode test test-all test-latest constraints lint format demo bench gpu-check gpu-wheels audit clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

# Our modules' bytecode, as a pip install (not an editable one) compiles it: where Python may
# not write it (PYTHONDONTWRITEBYTECODE, set on some machines), every command, test worker and
# rank compiled ~180 modules from source again (~0.4 s each time). Up-to-date files are skipped.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 ftpipe_compiler runtime benchmarks tools

test: bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Everything, the exhaustive parametrizations included (every schedule resumed: ~1 minute more on 2 cores).
test-all: bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "exhaustive or not exhaustive" $(PYTEST_ARGS)

# The tests against the newest releases of everything but torch (its own venv), so that a new
# transformers is met on purpose; when green, `make constraints` records them for install.
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|ftpipe|pip|setuptools|wheel)=='
	$(LATEST)/bin/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Write constraints.txt from the latest venv (after `make test-latest` passed).
constraints:
	{ sed -n '1,3p' $(CONSTRAINTS); $(LATEST)/bin/python -m pip freeze --exclude-editable \
		| grep -v -i -E '^(torch|ftpipe|pip|setuptools|wheel)=='; } > $(CONSTRAINTS).tmp
	mv $(CONSTRAINTS).tmp $(CONSTRAINTS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The main job: compile T5-3B for 8 GPUs (analytic costs, nothing downloaded) and simulate
# the plan; then fine-tune a tiny Llama on chat conversations, packed into rows that keep
# documents apart, with torchrun on 2 CPU processes, evaluating as it goes; write it out as a
# HuggingFace folder and ask it questions through transformers and its chat template.
demo: bytecode
	$(BIN)/ftpipe compile --model t5-3b --gpus 8 -o $(OUT)/t5-3b --force
	$(BIN)/ftpipe simulate $(OUT)/t5-3b/plan.json --report $(OUT)/t5-3b/report.html
	$(BIN)/python tools/demo_text.py $(OUT)/demo-text
	$(BIN)/ftpipe compile --model $(OUT)/demo-text/tiny-llama --gpus 2 --seq-len 32 --pack \
		--micro-batch 4 --batch 16 -o $(OUT)/tiny-llama --force
	cd $(OUT)/tiny-llama && OMP_NUM_THREADS=1 $(abspath $(BIN))/torchrun --nproc_per_node 2 \
		-m tiny_llama_pipeline --device cpu --data ../demo-text/train.jsonl \
		--eval-data ../demo-text/val.jsonl --chat-field messages --pack \
		--steps 40 --eval-every 10 --lr 1e-2 --log-every 10 --save-hf ../demo-text/fine-tuned
	$(BIN)/python tools/demo_text.py --generate $(OUT)/demo-text/fine-tuned

bench: bytecode
	$(BIN)/python -m benchmarks --out BENCHMARKS.md

# One command on a lent GPU (docs/gpu-check.md): GPU_CHECK.md and .json, in under 8 minutes
# on one H100 or H200; on a CPU the small version, into out/. It installs nothing: the venv's
# python where there is one, else the machine's python3 with the checkout as it is (the GPU
# machine's; benchmarks/gpu_check/bootstrap.py maps ftpipe_runtime to runtime/ and installs
# the wheels carried in .whl/, offline).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The wheels the GPU machine lacks (Python 3.12, x86-64), into .whl/ for the device call to
# carry (the device tool's README: `carry: [".whl"]`).
GPU_WHEELS ?= pymetis==2025.2.2
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)

# Bad inputs and faults, each run as a user meets them; writes docs/reliability.md.
audit: install
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.audit

clean:
	rm -rf $(OUT) build *.egg-info .pytest_cache .ruff_cache
