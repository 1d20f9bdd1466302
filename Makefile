# The two commands: `make quickstart` (main job on the built-in simulated default) and `make test`.
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export MUJOCO_GL ?= egl

.PHONY: install quickstart test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/robopolicy quickstart --config configs/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/oracles.py
	$(BIN)/python bench/env_throughput.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
