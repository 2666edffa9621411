"""An engine group driven from rank 0 as if it were one Engine: what a rollout worker runs when ep_size > 1.

    rank 0:   leader = GroupLeader(EngineGroup(model, config, group=g))   # Engine's interface: submit, step, ...
    rank > 0: follow(EngineGroup(model, config, group=g))                 # until the leader closes the group

The leader places each request on the rank with the fewest of its requests (rank 0 included); its `step()` is
one round: broadcast the command (new requests per rank, aborts), every rank runs `EngineGroup.step`, the
followers' step outputs come back in one gather. `abort` of a request on another rank is a round without a
step, answered with its partial completion; `on_every_rank(fn, *args)` runs fn(engine, *args) on every rank
(a weight update: each rank keeps its expert slice). Commands travel as pickled objects over the group
(small, except weights, see docs/rollout.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch.distributed as dist

from moerl.rollout.engine_group import EngineGroup
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion, StepOutput


class GroupLeader:
    """Rank 0's handle on the whole group, with the Engine interface that EngineThread and the worker use."""

    def __init__(self, group: EngineGroup) -> None:
        if group.rank != 0:
            raise ValueError(f"the leader is rank 0 of the engine group, this is rank {group.rank}")
        self.group = group
        self.engine = group.engine  # rank 0's Engine: its version, device, model and stats stand for the group's
        self.owner: dict[str, int] = {}  # request id -> the rank that runs it
        self._submits: list[list[tuple]] = [[] for _ in range(group.size)]  # queued for the next step, per rank
        self.processes: list = []  # the follower processes, where whoever started them keeps them here

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def device(self):
        return self.engine.device

    @property
    def stats(self) -> dict:
        return self.engine.stats

    @property
    def model(self):
        return self.engine.model

    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               prefix: Completion | None = None) -> str:
        """Check the request here (every rank would refuse it alike), then queue it for its rank."""
        if request_id is None or request_id in self.owner:
            raise ValueError(f"the engine group needs a new request id, got {request_id!r}")
        prompt = self.engine.check_request(prompt, params, prefix)
        load = [0] * self.group.size
        for rank in self.owner.values():
            load[rank] += 1
        rank = load.index(min(load))
        self.owner[request_id] = rank
        self._submits[rank].append((prompt, params, request_id, prefix))
        return request_id

    def abort(self, request_id: str) -> Completion:
        rank = self.owner.get(request_id)
        if rank is None:
            raise KeyError(f"no request {request_id!r} in the engine group")
        del self.owner[request_id]
        queued = [s for s in self._submits[rank] if s[2] == request_id]
        if queued:  # never reached its rank: nothing generated
            self._submits[rank].remove(queued[0])
            prompt, params, _, prefix = queued[0]
            if prefix is not None:
                return dataclasses.replace(prefix, request_id=request_id, finish_reason="abort")
            return Completion(request_id, prompt, finish_reason="abort", seed=params.seed)
        return self._round(("abort", rank, request_id))[rank]

    def has_unfinished(self) -> bool:
        return bool(self.owner)

    def step(self) -> list[StepOutput]:
        submits, self._submits = self._submits, [[] for _ in range(self.group.size)]
        outputs = [out for rank_outputs in self._round(("step", submits)) for out in rank_outputs]
        for out in outputs:
            if out.completion is not None:
                self.owner.pop(out.request_id, None)
        return outputs

    def on_every_rank(self, fn: Callable[..., Any], *args) -> Any:
        """fn(engine, *args) on every rank (fn a module-level function: it travels pickled); rank 0's result."""
        return self._round(("call", fn, args))[0]

    def close(self) -> None:
        """Tell the followers to return from `follow`."""
        self._round(("close",))

    def _round(self, command: tuple) -> list[Any]:
        dist.broadcast_object_list([command], src=0, group=self.group.group)
        return _execute(self.group, command)


def follow(group: EngineGroup) -> None:
    """A follower rank: run the leader's commands until it closes the group."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=group.group)
        _execute(group, box[0])
        if box[0][0] == "close":
            return


def _execute(group: EngineGroup, command: tuple) -> list[Any] | None:
    """Run one command on this rank; the leader gets every rank's answer (a gather), the followers None.

    A command that fails on a rank (a weight update naming an unknown parameter) is still answered, so no rank
    is left waiting in the gather and the followers stay in the group; the leader raises it afterwards."""
    answer: Any = None
    error: Exception | None = None
    try:
        answer = _run(group, command)
    except Exception as e:  # noqa: BLE001 - raised on the leader once every rank has answered
        error = e
    gathered = [None] * group.size if group.rank == 0 else None
    dist.gather_object((answer, None if error is None else f"{type(error).__name__}: {error}"), gathered, dst=0,
                       group=group.group)
    if error is not None and group.rank == 0:
        raise error
    if gathered is None:
        return None
    for rank, (_, failed) in enumerate(gathered):
        if failed is not None:
            raise RuntimeError(f"engine group rank {rank}: {failed}")
    return [a for a, _ in gathered]


def _run(group: EngineGroup, command: tuple) -> Any:
    kind = command[0]
    if kind == "step":
        for prompt, params, request_id, prefix in command[1][group.rank]:
            group.submit(prompt, params, request_id=request_id, prefix=prefix)
        return group.step()
    if kind == "abort":
        return group.abort(command[2]) if command[1] == group.rank else None
    if kind == "call":
        return command[1](group.engine, *command[2])
    return None
