"""moerl.wire: the compact pickling of the routed-expert tensors that travel with every sample."""

from __future__ import annotations

import pickle

import pytest
import torch

from moerl.rollout.types import Completion
from moerl.train.trainer import Sample
from moerl.wire import pack, unpack


@pytest.mark.parametrize("t", [torch.randint(0, 64, (7, 3, 2), dtype=torch.int16), torch.zeros(0, 2, 2, dtype=torch.int16),
                               torch.arange(6, dtype=torch.int64).view(2, 3)[:, 1:], torch.rand(3, dtype=torch.bfloat16)])
def test_round_trip_keeps_dtype_shape_and_values(t):
    got = unpack(pickle.loads(pickle.dumps(pack(t))))
    assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    if got.numel():
        got.view(-1)[0] = 1  # a writable tensor of its own, not a view of the pickle's bytes


def test_values_it_does_not_pack_pass_through():
    grad = torch.ones(2, requires_grad=True)
    assert pack(None) is None and pack(grad) is grad and unpack([1, 2]) == [1, 2]


def test_completion_and_sample_pickle_compactly_and_equal():
    routed = torch.randint(0, 8, (30, 2, 2), dtype=torch.int16)
    c = Completion("r", [1, 2], [3, 4], [-0.5, -0.25], [0, 1], routed, "stop", seed=7)
    data = pickle.dumps(c)
    assert b"torch._utils" not in data  # not the tensor's own (slow) reduction
    back = pickle.loads(data)
    assert torch.equal(back.routed_experts, routed)
    assert (back.token_ids, back.logprobs, back.versions, back.finish_reason, back.seed) == ([3, 4], [-0.5, -0.25], [0, 1], "stop", 7)
    s = pickle.loads(pickle.dumps(Sample([1], [2, 3], [-0.1, -0.2], 0.5, routed)))
    assert torch.equal(s.routed_experts, routed) and s.advantage == 0.5
    assert pickle.loads(pickle.dumps(Completion("x", [1]))).routed_experts is None
