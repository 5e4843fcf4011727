# Everything installs from nothing: a machine with Python >= 3.10 and pip is enough.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# DeepSpeed's CPU accelerator only where no NVIDIA GPU is present: a CUDA job must not inherit it
# (framework/strategies/deepspeed also replaces an inherited `cpu` on CUDA, and sets it per CPU job).
ifeq ($(wildcard /dev/nvidia0),)
export DS_ACCELERATOR ?= cpu
endif
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install bytecode run test test-fast lint format bench bench-gpu docs docs-serve clean

install: $(STAMP)

# torch is installed first and pinned through constraints.txt for every later step, so no
# CUDA wheels are ever pulled on a CPU machine.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -c constraints.txt -e ".[recipes,wandb,tensorboard,mlflow,dev,bench,data,ray,docs,sweep,hf,torchft,float8]"
	$(BIN)/pip install -q -c constraints.txt --no-deps "litdata>=0.2.76"
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c constraints.txt --no-build-isolation "deepspeed>=0.15"
	@$(BIN)/python -c "import torch; v = torch.__version__; assert v.startswith('2.13.0'), v; print('torch', v)"
	touch $(STAMP)

run: install
	$(BIN)/fw train task=gpt

# Two pytest workers (pytest-xdist), each given whole files: one worker's tests leave a core
# idle much of the time (a job's launcher validating, a rank waiting on another, in-process
# tests on one core).
TEST_WORKERS ?= 2
test: install bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=40

test-fast: install bytecode
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

# The project's own modules compiled once: where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) no import writes them, and every process of the suite would compile them again
# (0.36 s for framework/ alone on one core). Up-to-date files are skipped.
bytecode: install
	$(BIN)/python -m compileall -q -j 0 framework recipes tests benchmarks

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.startup
	$(BIN)/python -m benchmarks.memory
	$(BIN)/python -m benchmarks.strategies
	$(BIN)/python -m benchmarks.muon
	$(BIN)/python -m benchmarks.tensor
	$(BIN)/python -m benchmarks.hf
	$(BIN)/python -m benchmarks.pipeline
	$(BIN)/python -m benchmarks.moe
	$(BIN)/python -m benchmarks.checkpoint_stall
	$(BIN)/python -m benchmarks.data
	$(BIN)/python -m benchmarks.async
	$(BIN)/python -m benchmarks.plan_vs_published
	$(BIN)/python -m benchmarks.plan_accuracy --rounds 3
	$(BIN)/python -m benchmarks.context
	$(BIN)/python -m benchmarks.scale_memory
	$(BIN)/python -m benchmarks.plot

# One CUDA GPU: GPT-2 small (124M) in bf16, fw train against a hand-written loop (about 15 min;
# see docs/benchmarks.md). On the CPU, `python -m benchmarks.gpu --smoke` checks that the two
# sides compute the same losses.
bench-gpu: install
	$(BIN)/python -m benchmarks.gpu

# The documentation site, strict: a broken link or anchor fails it (mkdocs.yml). Never add -q:
# mkdocs counts strict mode's warnings only when it logs them, so a quiet build passes anyway.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache *.egg-info
