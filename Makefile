# Set-up and everyday commands. Every target creates or updates .venv as needed,
# with the versions pinned in constraints.txt (torch 2.13.0 CPU lies on disk).
PYTHON3 ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
# The Python 3.12 lane: megatron-core 0.19.2 (which needs 3.12) and numpy 2, beside 0.16.1 and
# numpy 1 in .venv; pyenv's 3.12.1 (plain `python3.12` is a pyenv shim that refuses)
PYTHON312 ?= $(shell pyenv root 2>/dev/null || echo $(HOME)/.pyenv)/versions/3.12.1/bin/python3.12
VENV312   := .venv-py312
PY312     := $(VENV312)/bin/python
PIP312    := $(PY312) -m pip install --quiet --disable-pip-version-check -c constraints-py312.txt
# what runs there: every Megatron test, and core tests that need no predecessor (numpy 2)
PY312_TESTS := tests/test_megatron.py tests/test_megatron_moe.py tests/test_megatron_bridge.py \
	tests/test_megatron_tp_split.py tests/test_megatron_router_losses.py \
	"tests/test_lifecycle_order.py::test_lifecycle_calls_arrive_in_order[megatron]" \
	tests/test_stats.py tests/test_monitor_torch.py tests/test_config.py
export OMP_NUM_THREADS := 1
# pytest-xdist: one test file per worker process (module fixtures stay shared); two workers for this
# machine kind's two cores (TEST_WORKERS=0: every test in one process)
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile
export DS_BUILD_OPS := 0
export DS_ACCELERATOR := cpu

.PHONY: demo test test-fast test-py312 bench install install-all clean

demo: $(VENV)/.core
	$(PY) -m examples.demo

test: $(VENV)/.all $(VENV312)/.ready
	$(PY) $(PYTEST)
	$(PY312) -m pytest -q $(PY312_TESTS)

# the Python 3.12 lane alone (megatron-core 0.19.2, numpy 2)
test-py312: $(VENV312)/.ready
	$(PY312) -m pytest -q $(PY312_TESTS)

# the quick lane for the development loop: everything not marked slow
test-fast: $(VENV)/.all
	$(PY) $(PYTEST) -m "not slow"

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
$(VENV)/.core: pyproject.toml setup.py msprobe_engine/cpu_kernel/cpu_reduce.c constraints.txt | $(PY)
	$(PIP) -e ".[torch,test]"
	touch $@

# Everything the tests need: the real DeepSpeed, Megatron-core, MindSpore, the predecessor
# (mindstudio-probe), transformers, Lightning, wandb, MLflow, tb-graph-ascend; Chromium from apt.
$(VENV)/.all: $(VENV)/.core
	$(PIP) -e ".[torch,test,deepspeed,megatron,mindspore,predecessor,hf,lightning,wandb,mlflow,graph,triton]"
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)
	touch $@

# The 3.12 lane runs the repository from its checkout (tests/conftest.py puts it on sys.path):
# the 3.11 environment keeps numpy 1 (MindSpore 2.10 and the predecessor need it).
# megatron-bridge without its dependencies (they need CUDA builds): its callback module, for
# tests/test_megatron_bridge.py.
$(VENV312)/.ready: constraints-py312.txt
	test -x $(PY312) || $(PYTHON312) -m venv $(VENV312)
	$(PIP312) torch megatron-core numpy pyyaml tensorboard google-crc32c orjson pytest
	$(PIP312) --no-deps megatron-bridge
	touch $@

clean:
	rm -rf $(VENV) $(VENV312) demo_output .pytest_cache
