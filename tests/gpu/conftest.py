"""The GPU suite: `make test-gpu` on a CUDA host (one device call). Every test here is marked `gpu` and skipped
without CUDA, so `make test` on a CPU machine collects and skips it.

    make test-gpu                                    # on the GPU machine: every test, one summary
    MOERL_GPU_SUITE_ON_CPU=1 python -m pytest tests/gpu   # a CPU smoke of the tests' own code (tiny shapes)

Fixtures: `device` (cuda, or cpu under the smoke switch), `dtype` (bf16 on CUDA, float32 on the CPU smoke), and
the marker `cuda_only` for tests that mean nothing off a GPU (CUDA IPC, graphs, Triton kernels, device memory):
those are skipped in the smoke run too.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CPU = os.environ.get("MOERL_GPU_SUITE_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.gpu)
        if not HAS_CUDA and not ON_CPU:
            item.add_marker(pytest.mark.skip(reason="needs CUDA (make test-gpu on a GPU machine)"))
        elif not HAS_CUDA and item.get_closest_marker("cuda_only"):
            item.add_marker(pytest.mark.skip(reason="CUDA only: skipped in the CPU smoke run"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(scope="session")
def dtype() -> torch.dtype:
    return torch.bfloat16 if HAS_CUDA else torch.float32



_REPORT: list[str] = []


@pytest.fixture(scope="session")
def report():
    """report(line): a measured figure printed in the run's summary (the closing table of `make test-gpu`),
    passed or not, so one device call gives the numbers as well as the verdicts."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _REPORT:
        terminalreporter.section("GPU suite: measured")
        for line in _REPORT:
            terminalreporter.write_line(line)
