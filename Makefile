# alignflow: `make demo` runs the pipeline on the tiny offline model; `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
# the torch the lock was tested with (PyPI's is a CUDA build; the CPU machines' index serves a CPU one); another:
# TORCH_SPEC="torch==X" make setup (the lock's other pins stay; a changed TORCH_SPEC installs again)
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup demo test test-fast lock vllm-env bench clean FORCE

setup: $(STAMP)

# the torch spec the venv holds, rewritten only when it changes (so it reinstalls then)
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV) && echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@

$(STAMP): pyproject.toml requirements/cpu-lock.txt $(VENV)/.torch-spec
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	grep -v '^torch==' requirements/cpu-lock.txt > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check -c $(VENV)/constraints.txt "$(TORCH_SPEC)" -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch, transformers, prefect, mlflow, duckdb, polars, pipeline_lib, flows, tasks"
	touch $(STAMP)

demo: setup
	$(BIN)/alignflow demo

# the whole suite: slow learning tests and the vLLM test included (CI runs this)
test: setup vllm-env
	$(BIN)/pytest -q --durations=15

# inner loop, a few minutes
test-fast: setup
	$(BIN)/pytest -q -m "not slow and not vllm"

lock: setup
	$(BIN)/pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu/torch==\1/' > requirements/cpu-lock.txt.new
	{ head -1 requirements/cpu-lock.txt; cat requirements/cpu-lock.txt.new; } > requirements/cpu-lock.tmp && mv requirements/cpu-lock.tmp requirements/cpu-lock.txt && rm requirements/cpu-lock.txt.new

vllm-env: setup
	$(BIN)/alignflow vllm-env --venv $(VLLM_VENV)

# every benchmark on its README settings (sampling adds vLLM where `make vllm-env` has built it)
bench: setup
	$(BIN)/python benchmarks/ingest.py --n 1000000
	$(BIN)/python benchmarks/evaluation.py
	$(BIN)/python benchmarks/logprobs.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/sampling.py
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/sampling.py --no-vllm --data gsm8k --prompts 8 --n 8 --max-new-tokens 240
	$(BIN)/python benchmarks/cache_rerun.py
	$(BIN)/python benchmarks/rm_packing.py
	$(BIN)/python benchmarks/dpo_setup.py
	$(BIN)/python benchmarks/vs_trl.py --model demo --algo dpo grpo --threads 1
	$(BIN)/python benchmarks/vs_trl.py --model large --algo dpo grpo --threads 1

clean:
	rm -rf .alignflow
