# Two entry points: `make demo` and `make test`. Each builds its own virtual environment.
# torch is pinned to the CPU wheel that this machine class ships (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
TORCH_PIN ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moerl-installed

.PHONY: demo test test-gpu venv clean

# uv installs the ~150 wheels in 31 s where pip takes 70-80 s on the 2-core box (the suite's 10-minute budget
# includes the venv). --compile-bytecode as pip does: with PYTHONDONTWRITEBYTECODE set (as on this box) a venv
# without .pyc files compiles torch in every process it starts, and the suite ran 2x slower. pip fetches uv into
# the venv; uv is given the wheel directories pip is configured with (`pip config get global.find-links`: where
# the CPU torch lies). Should uv be missing or fail (USE_UV=0 to skip it), pip installs it all.
USE_UV ?= 1
UV := $(VENV)/bin/uv
UV_FIND := $(foreach d,$(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)),--find-links $(d))
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if [ "$(USE_UV)" = 1 ] && $(PY) -m pip install -q uv 2>/dev/null && \
		$(UV) pip install -q --compile-bytecode --python $(PY) $(UV_FIND) "$(TORCH_PIN)" -e ".[test]"; then :; else \
		echo "installing with pip"; \
		$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q "$(TORCH_PIN)" && \
		$(PY) -m pip install -q -e ".[test]" "$(TORCH_PIN)"; fi
	touch $(STAMP)

venv: $(STAMP)

# The demo starts afresh each time: `moerl train` never overwrites a run, so the last demo's directory goes first.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/moerl train configs/demo.toml

# Two passes: the unit tests (no Ray, no processes of their own) on both cores at once, then the distributed and
# integration tests one at a time (each runs a Ray or a gloo group that wants the whole machine; run side by side
# they slowed each other 2-4x). If pytest dies inside a test (no summary), tests/postmortem.py names the test from
# the progress record.
PROGRESS := $(VENV)/test-progress
PYTEST := RAY_AUTH_MODE=disabled MOERL_TEST_PROGRESS=$(PROGRESS) $(PY) -m pytest -q -ra
test: $(STAMP)
	rm -f $(PROGRESS)
	$(PYTEST) -n 2 tests/unit || { rc=$$?; $(PY) tests/postmortem.py $(PROGRESS); exit $$rc; }
	$(PYTEST) --durations=10 tests/distributed tests/integration tests/gpu \
		|| { rc=$$?; $(PY) tests/postmortem.py $(PROGRESS); exit $$rc; }

# The GPU suite (tests/gpu), on a CUDA machine: no venv there, the image's python3 and torch; Ray and the other
# wheels that image lacks come from .whl/ when present (../shared/tools/device-wheels.sh builds it). It takes ~9
# minutes on one H100/H200: past a 10-minute call with the machine's start, so split it with GPU_TEST_ARGS
# (e.g. --ignore=tests/gpu/test_fused_moe_gpu.py ...; BENCHMARKS.md names the two halves of the last run).
GPU_PY ?= python3
GPU_SITE ?= /tmp/moerl-site
test-gpu:
	@if [ -d .whl ]; then $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1 \
		$(GPU_PY) -m pytest tests/gpu -m gpu -q -ra -p no:cacheprovider --durations=20 $(GPU_TEST_ARGS)

clean:
	rm -rf $(VENV) runs
