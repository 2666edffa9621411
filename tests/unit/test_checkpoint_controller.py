"""The controller's state codec: a round trip of the work queue (leased + partial tasks), finished groups and
counters, and refusal of anything but the allow-listed dataclasses, on both sides."""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass

import pytest
import torch

from moerl.checkpoint import decode_controller_state, encode_controller_state
from moerl.loop.types import STATE_CLASSES, GroupResult, GroupTask
from moerl.loop.work_queue import WorkQueue
from moerl.rollout.types import Completion


def completion(i: int, finished: bool) -> Completion:
    prompt, tokens = [1, 2, 3], list(range(10, 10 + i + 1))
    routed = torch.randint(0, 8, (len(prompt) + len(tokens) - 1, 2, 2), dtype=torch.int16)
    return Completion(f"req-{i}", prompt, tokens, [-0.5 * j for j in range(len(tokens))], [3] * len(tokens),
                      routed, "stop" if finished else None, None, 1234 + i)


def controller_state() -> dict:
    q = WorkQueue(lease_timeout=30.0, max_attempts=3)
    for i in range(4):
        q.add(GroupTask(f"t{i}", i, [5, 6, i], group_size=2))
    q.lease("w0", now=0.0)
    q.lease("w1", now=0.0)
    q.hand_back("t1", "w1", [completion(1, False), None], now=1.0)  # preempted: partials kept
    q.lease("w1", now=2.0)
    ready = [GroupResult("t9", 9, "w0", "ok", [completion(2, True), completion(3, True)], [1.0, None], [None, "boom"],
                         None, 0.25)]
    return {"version": 7, "step": 12, "next_prompt_index": 4, "queue": q.state_dict(), "ready": ready,
            "counters": {"groups_done": 3, "preempted": 1}, "seen": {"a", "b"}, "pair": (1, 2.5)}


def assert_equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y)
    elif hasattr(a, "__dataclass_fields__"):
        assert_equal(vars(a), vars(b))
    else:
        assert a == b


def test_round_trip_keeps_queue_partials_and_results():
    state = controller_state()
    back = decode_controller_state(encode_controller_state(state, classes=STATE_CLASSES), classes=STATE_CLASSES)
    assert_equal(back, state)
    leased = back["queue"]["leased"]
    assert [t["task_id"] for t in leased] == ["t0", "t1"]
    assert isinstance(leased[1]["partials"][0], Completion) and leased[1]["partials"][1] is None
    assert leased[1]["partials"][0].routed_experts.dtype == torch.int16
    q = WorkQueue(lease_timeout=30.0, max_attempts=3)
    q.load_state_dict(back["queue"])  # the restored queue takes it: leases back at the front, partials kept
    assert q.pending_ids() == ["t0", "t1", "t2", "t3"]


def test_unknown_dataclass_is_refused_on_encode_unless_allowed():
    @dataclass
    class Loop:
        version: int
        ready: list

    with pytest.raises(TypeError, match=r"root\['loop'\]: .*Loop is not allowed"):
        encode_controller_state({"loop": Loop(1, [])}, classes=STATE_CLASSES)
    with pytest.raises(TypeError, match=r"root\[0\]: builtins.object is not allowed"):
        encode_controller_state([object()], classes=STATE_CLASSES)
    state = Loop(3, [controller_state()["ready"][0]])
    with_loop = (*STATE_CLASSES, Loop)
    assert_equal(decode_controller_state(encode_controller_state(state, classes=with_loop), classes=with_loop), state)
    with pytest.raises(ValueError, match="'Loop', which is not in the allow-list"):
        decode_controller_state(encode_controller_state(state, classes=with_loop), classes=STATE_CLASSES)
    with pytest.raises(TypeError, match="must be dataclasses"):
        encode_controller_state({}, classes=(object,))


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_forged_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save({"version": 1, "x": _Evil(str(marker))}, buf)
    with pytest.raises(pickle.UnpicklingError):
        decode_controller_state(buf.getvalue(), classes=STATE_CLASSES)
    buf = io.BytesIO()
    torch.save({"x": Completion("r", [1])}, buf)  # even an allow-listed class, pickled as itself, is refused
    with pytest.raises(pickle.UnpicklingError):
        decode_controller_state(buf.getvalue(), classes=STATE_CLASSES)
    assert not marker.exists()
