# kvscope — two set-up commands: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv and install what they need on first use (pip: it takes the local torch wheel).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint pytest install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

## The main job: agent + alerts + dashboard + the engine replaying the bundled real trace.
demo: $(STAMP)
	$(BIN)/kvscope up

## The whole suite: lint, types, then pytest (CPU only; Triton kernels run interpreted).
test: $(STAMP)
	$(MAKE) lint
	$(MAKE) pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
