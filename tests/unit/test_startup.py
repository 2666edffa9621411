"""Start-up waits have deadlines naming what they wait for, and a stop ends them in order (issue 37 items 1-2);
a local Ray's processes start with SIGTERM blocked, so a process group's SIGTERM is left to the driver."""

from __future__ import annotations

import signal
import threading

import pytest

from moerl.startup import StartupStopped, StartupTimeout, run_within


def _jumping_clock(*readings: float):
    it = iter(readings)
    last = [0.0]

    def clock() -> float:
        last[0] = next(it, last[0])
        return last[0]
    return clock


def test_a_call_past_its_deadline_names_what_it_waited_for():
    never = threading.Event()
    with pytest.raises(StartupTimeout, match=r"^starting a local Ray did not finish within 300 s "
                                             r"\(ray.start_timeout_s\): the run stops$"):
        run_within(never.wait, deadline_s=300, what="starting a local Ray", key="ray.start_timeout_s",
                   stop=lambda: False, clock=_jumping_clock(0.0, 301.0))
    never.set()
    assert run_within(lambda: 7, deadline_s=300, what="x", key="k", stop=lambda: False) == 7
    with pytest.raises(ValueError, match="its own"):
        run_within(lambda: (_ for _ in ()).throw(ValueError("its own")), deadline_s=300, what="x", key="k",
                   stop=lambda: False)


def test_a_stop_meanwhile_ends_the_wait_once_the_call_returned():
    release, asked = threading.Event(), []

    def stop() -> bool:
        asked.append(1)
        release.set()  # the call returns only after the stop was seen: it is waited for, not abandoned
        return True
    with pytest.raises(StartupStopped):
        run_within(release.wait, deadline_s=300, what="x", key="k", stop=stop)
    assert asked


def test_the_call_holds_sigterm_for_what_it_starts_and_its_thread_outlives_it_until_released():
    """Processes inherit the starting thread's signal mask, and a parent-death signal fires when the thread that
    started them exits: a local Ray started from a thread that ended had its GCS killed at once."""
    seen, keep = {}, threading.Event()

    def start() -> str:
        seen["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        seen["thread"] = threading.current_thread()
        return "up"
    assert run_within(start, deadline_s=300, what="x", key="k", stop=lambda: False, hold_sigterm=True,
                      keep_until=keep) == "up"
    assert signal.SIGTERM in seen["mask"] and signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert seen["thread"].is_alive()
    keep.set()
    seen["thread"].join(timeout=30)
    assert not seen["thread"].is_alive()


def test_init_ray_starts_a_local_ray_from_a_kept_thread_that_holds_sigterm(monkeypatch, tmp_path):
    import ray

    from moerl import local_ray, run
    from moerl.config import load_config

    seen = {}

    def init(**kwargs):
        seen["mask"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        seen["thread"] = threading.current_thread()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    keep, token = threading.Event(), local_ray.RunToken(base=str(tmp_path))
    try:
        assert run._init_ray(load_config(None, []), token, lambda: False, keep)
        assert signal.SIGTERM in seen["mask"] and seen["thread"] is not threading.main_thread()
        assert seen["thread"].is_alive()  # until the run has shut its Ray down
    finally:
        keep.set()
        token.close()
    with pytest.raises(StartupTimeout, match=r"ray.start_timeout_s"):
        monkeypatch.setattr(ray, "init", lambda **kw: threading.Event().wait(30))
        run._init_ray(load_config(None, ["--ray.start_timeout_s=0.2"]), local_ray.RunToken(base=str(tmp_path)))


def test_placing_trainer_ranks_has_a_deadline_naming_them_and_a_stop_ends_it():
    from moerl.actors.pools import wait_up

    refs = ["r0", "r1", "r2"]

    def wait(refs, num_returns, timeout):
        return ["r0"], ["r1", "r2"]  # ranks 1 and 2 never placed: the cluster lacks room
    with pytest.raises(StartupTimeout) as e:
        wait_up(refs, 600.0, lambda: False, "the 3 trainer ranks placed, built and joined (each asks for 1 CPU)",
                600.0, wait=wait, clock=_jumping_clock(0.0, 601.0))
    assert str(e.value).startswith("the 3 trainer ranks placed, built and joined (each asks for 1 CPU) did not finish "
                                   "within 600 s (train.start_timeout_s): 2 of 3 not up (rank 1, rank 2); Ray has ")
    with pytest.raises(StartupStopped):
        wait_up(refs, 600.0, lambda: True, "x", 600.0, wait=wait, clock=_jumping_clock(0.0))
    wait_up(refs, 600.0, lambda: True, "x", 600.0, wait=lambda refs, num_returns, timeout: (refs, []))


def test_a_held_ray_is_killed_at_once_and_so_are_its_raylets_children(monkeypatch):
    """local_ray.shutdown_held: Ray's own shutdown runs without its graceful SIGTERM (which Ray's processes hold, so
    each cost a 1 s wait), and what the raylet started (agents, workers: they outlived a raylet killed at once)
    is killed after it. A stand-in node: a shell as the raylet, with a child of its own."""
    import os
    import subprocess
    import time

    import ray

    from moerl import local_ray
    from moerl.launch.node import _running as running  # alive and not a zombie (an orphan init has yet to reap)

    raylet = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    child = int(raylet.stdout.readline())
    calls = []

    class Node:
        all_processes = {"raylet": [type("Info", (), {"process": raylet})()]}

        def kill_all_processes(self, check_alive=True, allow_graceful=False, wait=False):
            calls.append(allow_graceful)
            raylet.kill()
            raylet.wait()

    node = Node()
    monkeypatch.setattr(ray._private.worker, "_global_node", node)
    # as ray.shutdown() does: kill_all_processes(check_alive=False, allow_graceful=True, ...)
    monkeypatch.setattr(ray, "shutdown", lambda: node.kill_all_processes(check_alive=False, allow_graceful=True))
    try:
        local_ray.shutdown_held()
        assert calls == [False]  # SIGKILL at once: no SIGTERM that Ray's processes would hold
        deadline = time.monotonic() + 30  # the SIGKILL is sent before shutdown_held returns; its effect is seen
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(child), "the raylet's child outlived it"
    finally:
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_shutdown_held_falls_back_to_a_plain_shutdown_where_rays_node_is_not_found(monkeypatch):
    import ray

    from moerl import local_ray

    calls = []
    monkeypatch.setattr(ray._private.worker, "_global_node", None)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    local_ray.shutdown_held()
    assert calls == ["shutdown"]
