# Set-up from nothing: a virtual environment with the CPU torch wheel (no CUDA download on a
# machine without a GPU), nixl 1.5.1 and kvpush in editable mode with its test extras.
VENV ?= .venv
PYTHON ?= python3
# On a GPU machine pass TORCH=torch (or a CUDA build spec) to keep the CUDA torch.
TORCH ?= torch==2.13.0

.PHONY: setup demo test test-vllm lint bench bench-gate bench-baseline bench-names clean

setup: $(VENV)/.kvpush-installed

$(VENV)/.kvpush-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q "$(TORCH)"
	$(VENV)/bin/pip install --disable-pip-version-check -q -e '.[test]'
	touch $@

demo: setup
	$(VENV)/bin/kvpush demo

test: setup
	$(VENV)/bin/python -m pytest

# The vLLM connector suite (tests_vllm/) in its own venv: vLLM 0.33.0 is ~4.5 GB of wheels and
# ~12 min to install, so it stays out of `make test`. The suite is its own pytest root.
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.kvpush-installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q "vllm==0.33.0" "nixl==1.5.1" pytest pytest-timeout msgpack hypothesis pytest-benchmark
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q -e .
	touch $@

# tests_vllm/, then the probes in tests/ that drive vLLM's real scheduler in-process (they skip
# under .venv, which has no vLLM).
VLLM_PROBES ?= tests/test_probe_block_translation.py

test-vllm: $(VLLM_VENV)/.kvpush-installed
	cd tests_vllm && $(abspath $(VLLM_VENV))/bin/python -m pytest
	$(VLLM_VENV)/bin/python -m pytest $(VLLM_PROBES)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: setup
	$(VENV)/bin/kvpush bench

# The CPU benchmark regression gate (not part of CI; docs/performance.md "Regression gate"):
# a fresh run of BENCH_FILES compared by name with the saved baseline BENCH_BASELINE, failing
# when any median is over BENCH_FAIL of the baseline's. `bench-names` first checks that every
# benchmark has a baseline entry (a renamed benchmark would otherwise go ungated); the machine
# info warning (CPU frequency differs run to run on a VM) must not become an error. They use the
# venv as it is (run `make setup` first): a newer pyproject.toml must not reinstall a shared venv
# in the middle of a measurement.
BENCH_FILES ?= benchmarks/bench_planning.py benchmarks/bench_completion.py \
	benchmarks/bench_core_tick.py benchmarks/bench_handshake.py benchmarks/bench_push.py \
	benchmarks/bench_serve.py
BENCH_STORAGE ?= benchmarks/baseline
BENCH_BASELINE ?= 0003
BENCH_FAIL ?= median:150%
BENCH_PYTEST = $(VENV)/bin/python -m pytest $(BENCH_FILES) --benchmark-enable -p no:cacheprovider \
	-W ignore::pytest_benchmark.logger.PytestBenchmarkWarning --benchmark-storage=file://$(BENCH_STORAGE)

bench-names:
	@test -x $(VENV)/bin/python || { echo "no $(VENV): run make setup first"; exit 1; }
	$(VENV)/bin/python benchmarks/_helpers.py $(BENCH_STORAGE) $(BENCH_BASELINE) $(BENCH_FILES)

bench-gate: bench-names
	$(BENCH_PYTEST) --benchmark-compare=$(BENCH_BASELINE) --benchmark-compare-fail=$(BENCH_FAIL)

# Save a new baseline (the next number in BENCH_STORAGE); then point BENCH_BASELINE at it.
bench-baseline:
	@test -x $(VENV)/bin/python || { echo "no $(VENV): run make setup first"; exit 1; }
	$(BENCH_PYTEST) --benchmark-save=cpu-2vcpu

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .benchmarks

# The full multi-host matrix (docs/deployment.md): P and D in two network namespaces with delay,
# loss, 60 s link-down and silent partition, SIGKILL and restart. Needs root, iproute2, iptables.
.PHONY: test-multihost-full
test-multihost-full: setup
	$(VENV)/bin/python -m pytest -m "multihost or multihost_full" -rxXs tests/test_multihost_netns.py
