"""One local Ray for the in-process integration tests, and a Ray of its own for those that need one.

    def test_x(shared_ray): ...   # the suite's Ray on 127.0.0.1 (started by the first test that asks, up until the last of this directory):
                                  # `train(cfg)` joins it and leaves it up; the test's actors must be gone after it
    def test_y(own_ray): ...      # no Ray up when it starts: `train(cfg)` starts its own and must shut it down
                                  # with the collector frozen (moerl/ray_gc.py); the shared one comes back later

Starting and stopping a private Ray costs each in-process run seconds (and `ray.shutdown()` waits its 1 s per process
of a run's Ray, which holds SIGTERM: moerl/startup.py). The shared Ray is started as `train` starts its own (same
CPUs, loopback, worker environment), so a run behaves the same in it. Tests that run `moerl train` as a subprocess
(kills of the driver's process group, Ray's start-up, its listeners) start their own Ray there, as before.

After each test on the shared Ray, its actors must be gone (their names free, their CPUs back) within a bounded
wait: a run that joins a Ray must not leave actors behind. Past it the shared Ray is restarted for the next test and
the test errs (unless it failed already).
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from moerl.local_ray import inherited_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
NUM_CPUS = 2  # configs/demo.toml's ray.num_cpus: the Ray `train` would start for the demo config
RELEASE_S = 60.0  # how long a test's actors may take to go after it


def _worker_env() -> dict[str, str]:
    """What `train` gives a local Ray's workers (moerl/run.py, `_init_ray`)."""
    env = {"OMP_NUM_THREADS": "1"}
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "")
    if loopback:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


class SuiteRay:
    """The shared Ray: up on demand, down for a test that needs Ray to itself, and after the last test of this
    directory (the unit tests after it expect no Ray in this process)."""

    def __init__(self) -> None:
        self.temp_dir: str | None = None
        self.env: pytest.MonkeyPatch | None = None

    def environ(self) -> None:
        """Ray workers inherit the environment of the process that starts Ray: this repo (and `tests`) importable in
        them, no token (the runs of these tests are this process's own)."""
        if self.env is None:
            self.env = pytest.MonkeyPatch()
            self.env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", ""))
                                                          if p))
            self.env.setenv("RAY_AUTH_MODE", "disabled")

    def start(self) -> None:
        import ray

        self.environ()
        if ray.is_initialized():
            return
        self.temp_dir = tempfile.mkdtemp(prefix="mrs", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
        with inherited_env(_worker_env()):  # as `train` starts a local Ray
            ray.init(num_cpus=NUM_CPUS, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                     _temp_dir=self.temp_dir)

    def stop(self) -> None:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            from moerl.ray_gc import gc_frozen

            with gc_frozen():  # no collection of a Ray object while Ray shuts down (moerl/ray_gc.py)
                sys.modules["ray"].shutdown()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

    def close(self) -> None:
        self.stop()
        if self.env is not None:
            self.env.undo()
            self.env = None

    @staticmethod
    def leftovers() -> list[str]:
        """What the last test left in the shared Ray: named actors, CPUs still held."""
        import ray

        gc.collect()  # handles in reference cycles (exceptions' tracebacks hold a run's frames)
        left = [f"actor {name}" for name in ray.util.list_named_actors()]
        free, total = ray.available_resources().get("CPU", 0.0), ray.cluster_resources().get("CPU", 0.0)
        if free < total:
            left.append(f"{total - free:g} of {total:g} CPUs held")
        return left


SUITE = SuiteRay()


@pytest.fixture
def shared_ray(request) -> Iterator[object]:
    import ray

    SUITE.start()
    yield ray
    deadline, left = time.monotonic() + RELEASE_S, SuiteRay.leftovers()
    while left and time.monotonic() < deadline:  # a run's actors go within a second or two (a starting one: ~15 s)
        time.sleep(0.2)
        left = SuiteRay.leftovers()
    if left:
        SUITE.stop()  # the next test gets a fresh one
        report = getattr(request.node, "rep_call", None)
        if report is None or report.passed:
            pytest.fail(f"the test left {left} in the shared Ray after {RELEASE_S:.0f} s")


@pytest.fixture
def no_ray() -> Iterator[None]:
    """No Ray up when the test starts: the shared one is stopped (it comes back for the next test that asks); for a
    test that starts Ray its own way (a multi-node cluster, a bench)."""
    SUITE.stop()
    yield


@pytest.fixture
def own_ray(monkeypatch) -> Iterator[None]:
    """No Ray up; every `ray.shutdown()` the test makes (train's own) runs with the run's Ray objects out of the
    collector's reach (moerl/ray_gc.py), and Ray is down after the test."""
    import ray

    SUITE.stop()
    SUITE.environ()
    real_shutdown, frozen = ray.shutdown, []

    def checked_shutdown(*args, **kwargs):  # train() shuts Ray down with the collector frozen (moerl/ray_gc.py)
        frozen.append(gc.get_freeze_count())
        real_shutdown(*args, **kwargs)

    monkeypatch.setattr(ray, "shutdown", checked_shutdown)
    yield
    if ray.is_initialized():  # train() stops the Ray it started; this is only for a failed test
        real_shutdown()
    assert all(frozen), "ray.shutdown() ran with the run's Ray objects in the collector's reach"


def _on_shared_ray(item) -> bool:
    return "shared_ray" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(session, config, items) -> None:
    """This directory's tests on the shared Ray first, one after another, so that it starts once (a test with a
    Ray of its own stops it, and the next shared test would start it again: ~4 s each time); the rest keep their
    order after them."""
    inside = [i for i, item in enumerate(items) if HERE in Path(item.path).parents]
    if not inside or inside != list(range(inside[0], inside[-1] + 1)):
        return  # not one contiguous run of this directory's tests (a selection by hand): leave it
    ours = items[inside[0]:inside[-1] + 1]
    items[inside[0]:inside[-1] + 1] = ([i for i in ours if _on_shared_ray(i)]
                                       + [i for i in ours if not _on_shared_ray(i)])


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    """After the fixtures' teardown: the last test of this directory takes the shared Ray and its environment down;
    the last test on it, the shared Ray (the tests after it run Rays of their own, which it would only slow)."""
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        SUITE.close()
    elif _on_shared_ray(item) and not _on_shared_ray(nextitem):
        SUITE.stop()


def pytest_unconfigure(config) -> None:
    SUITE.close()  # an interrupted session


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """The call's report on the item (`rep_call`), for fixtures' teardown to know whether the test passed."""
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report
