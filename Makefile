# Two entry points: `make demo` and `make test`. Each builds its own virtual environment.
# torch is pinned to the CPU wheel that this machine class ships (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moerl-installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test]" "$(TORCH_PIN)"
	touch $(STAMP)

venv: $(STAMP)

# The demo starts afresh each time: `moerl train` never overwrites a run, so the last demo's directory goes first.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/moerl train configs/demo.toml

test: $(STAMP)
	RAY_AUTH_MODE=disabled $(PY) -m pytest -q -ra

clean:
	rm -rf $(VENV) runs
