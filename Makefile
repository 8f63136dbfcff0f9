# Every target installs what it needs first. Override e.g. `make test PYTHON=python3.12`.
PYTHON ?= python3
VENV ?= .venv
# Pinned here, not in setup.cfg: an unpinned torch pulls several GB of CUDA wheels.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
OUT ?= out
PYTEST_ARGS ?=

# What `make install` installs: the versions last tested (setup.cfg keeps ranges for users).
CONSTRAINTS ?= constraints.txt
LATEST ?= .venv-latest

.PHONY: install test test-latest constraints lint format demo bench audit clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The tests against the newest releases of everything but torch (its own venv), so that a new
# transformers is met on purpose; when green, `make constraints` records them for install.
test-latest:
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LATEST)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[test]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|ftpipe|pip|setuptools|wheel)=='
	$(LATEST)/bin/python -m pytest -q $(PYTEST_ARGS)

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
# the plan; then fine-tune a tiny Llama on question/answer text with torchrun on 2 CPU
# processes, evaluating as it goes, and write it out as a HuggingFace folder.
demo: install
	$(BIN)/ftpipe compile --model t5-3b --gpus 8 -o $(OUT)/t5-3b --force
	$(BIN)/ftpipe simulate $(OUT)/t5-3b/plan.json --report $(OUT)/t5-3b/report.html
	$(BIN)/python tools/demo_text.py $(OUT)/demo-text
	$(BIN)/ftpipe compile --model $(OUT)/demo-text/tiny-llama --gpus 2 --seq-len 16 \
		--micro-batch 4 --batch 16 -o $(OUT)/tiny-llama --force
	cd $(OUT)/tiny-llama && OMP_NUM_THREADS=1 $(abspath $(BIN))/torchrun --nproc_per_node 2 \
		-m tiny_llama_pipeline --device cpu --data ../demo-text/train.jsonl \
		--eval-data ../demo-text/val.jsonl --prompt-field question --target-field answer \
		--steps 40 --eval-every 10 --lr 3e-3 --log-every 10 --save-hf ../demo-text/fine-tuned

bench: install
	$(BIN)/python -m benchmarks --out BENCHMARKS.md

# Bad inputs and faults, each run as a user meets them; writes docs/reliability.md.
audit: install
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.audit

clean:
	rm -rf $(OUT) build *.egg-info .pytest_cache .ruff_cache
