# Set-up and everyday commands. Every target creates or updates .venv as needed,
# with the versions pinned in constraints.txt (torch 2.13.0 CPU lies on disk).
PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
export OMP_NUM_THREADS := 1
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu

.PHONY: demo test test-fast bench install install-all clean

demo: $(VENV)/.core
	$(PY) -m examples.demo

test: $(VENV)/.all
	$(PY) -m pytest -q

# the quick lane for the development loop: everything not marked slow
test-fast: $(VENV)/.all
	$(PY) -m pytest -q -m "not slow"

# bench/suite.py: monitor and dump overhead on models we did not write, next to the predecessor;
# `make bench BENCH_ARGS=--quick` for a short correctness run
bench: $(VENV)/.all
	$(PY) bench/suite.py $(BENCH_ARGS)
	@for b in bench/dump.py bench/compare.py bench/deepspeed_overhead.py bench/megatron_overhead.py \
		bench/mindspore_overhead.py bench/mindspore_dump.py bench/precheck.py bench/tasks.py bench/graph.py \
		bench/replica_drift.py bench/trainer_callbacks.py bench/tensorboard_charts.py; do \
		if [ -f $$b ]; then echo "== $$b"; $(PY) $$b || exit 1; fi; done

install: $(VENV)/.core
install-all: $(VENV)/.all

$(PY):
	$(PYTHON3) -m venv $(VENV)

# The core (torch + TensorBoard): enough for the demo. The editable install also compiles the CPU
# kernel into the package (setup.py): it is rebuilt when its source changes.
$(VENV)/.core: pyproject.toml setup.py msprobe_engine/frameworks/torch/cpu_reduce.c constraints.txt | $(PY)
	$(PIP) -e ".[torch,test]"
	touch $@

# Everything the tests need: the real DeepSpeed, Megatron-core, MindSpore, the predecessor
# (mindstudio-probe), transformers, Lightning, wandb, MLflow, tb-graph-ascend; Chromium from apt.
$(VENV)/.all: $(VENV)/.core
	$(PIP) -e ".[torch,test,deepspeed,megatron,mindspore,predecessor,hf,lightning,wandb,mlflow,graph,triton]"
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)
	touch $@

clean:
	rm -rf $(VENV) demo_output .pytest_cache
