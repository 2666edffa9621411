"""What crosses the loop's seams: the work (`GroupTask`), its outcome (`GroupResult`), one training step in
flight (`StepInFlight`), and the Protocols of the parts the controller drives.

The controller is typed against the Protocols only; `moerl/actors/` implements them on Ray, and the unit
tests implement them in-process (tests/unit/test_controller.py). Handles (`Ref`, a step's handle) are opaque
to the loop: it only passes them back to the part that made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from moerl.rollout.types import Completion

Ref = Any  # an in-flight call of a rollout worker (a Ray ObjectRef in moerl.actors)


@dataclass
class GroupTask:
    """One prompt x `group_size` samples. `partials[i]` is None or an opaque partial completion."""

    task_id: str
    prompt_index: int  # the task's prompt (Task.prompt_at); never parsed from task_id
    prompt_token_ids: list[int]
    group_size: int
    partials: list[Any | None] = field(default_factory=list)
    attempts: int = 0
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"task {self.task_id!r}: group_size must be >= 1, got {self.group_size}")
        if not self.partials:
            self.partials = [None] * self.group_size
        if len(self.partials) != self.group_size:
            raise ValueError(f"task {self.task_id!r}: {len(self.partials)} partials for group_size {self.group_size}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able except the partials, which are kept as given (the checkpoint layer handles them)."""
        return {"task_id": self.task_id, "prompt_index": self.prompt_index,
                "prompt_token_ids": list(self.prompt_token_ids), "group_size": self.group_size,
                "partials": list(self.partials), "attempts": self.attempts, "errors": list(self.errors)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupTask:
        return cls(d["task_id"], int(d["prompt_index"]), list(d["prompt_token_ids"]), int(d["group_size"]),
                   list(d["partials"]), int(d["attempts"]), list(d["errors"]))


@dataclass
class GroupResult:
    """What a rollout worker returns for one leased GroupTask."""

    task_id: str
    prompt_index: int  # carried from the GroupTask: a stale group is regenerated from this prompt
    worker_id: str
    status: Literal["ok", "preempted", "error"]
    completions: list[Completion] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    reward_errors: list[str | None] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0  # generating and scoring the group, on the worker
    apply_s: float = 0.0  # the worker's engine paused to apply new weights since its previous result
    episodes: list[dict] = field(default_factory=list)  # multi-turn tasks: Episode.stats() per sample


@dataclass
class StepInFlight:
    """One optimizer step the trainer group is running, and what the controller logs when it ends."""

    handle: Any  # from TrainerGroup.start_rl_step
    batch: list[GroupResult]
    samples: list  # moerl.train.trainer.Sample, one per trained completion
    rows: list[dict]  # trajectory rows
    stats: dict  # the batch's reward/length/staleness statistics
    started_at: float  # time.monotonic()


# The dataclasses the controller's checkpointed state may hold (moerl/checkpoint/controller_state.py rebuilds
# these and nothing else).
STATE_CLASSES: tuple[type, ...] = (Completion, GroupTask, GroupResult)


class RolloutPool(Protocol):
    """M rollout workers that run GroupTasks; lost ones are replaced while capacity allows."""

    target: int  # how many workers the pool keeps

    def ready_ids(self) -> list[str]:
        """Workers up, holding the newest weights, not leaving: the ones that may take leases."""

    def inflight(self, worker_id: str) -> int:
        """Groups dispatched to the worker whose results have not come back."""

    def alive(self) -> int:
        """Workers started (answered a ping)."""

    def dispatch(self, worker_id: str, task: GroupTask) -> Ref:
        """Start the worker on the task; the result arrives through `wait`."""

    def wait(self, inflight: dict[Ref, tuple[str, str]], timeout: float,
             also: list = ()) -> list[tuple[Ref, GroupResult | None, Exception | None]]:
        """Results that came within `timeout` (an error when the worker died); `inflight` maps each ref to
        (worker_id, task_id). Returns early, maybe empty, when one of the handles in `also` is done."""

    def mark_leaving(self, worker_id: str) -> None:
        """The worker hands back its work (preempted): it takes no more."""

    def remove(self, worker_id: str) -> bool:
        """Kill and forget the worker; False when it was already gone."""

    def unresponsive(self, now: float) -> list[str]:
        """Ping the workers; the ones silent past the heartbeat timeout (renews the live ones' leases)."""

    def replace_missing(self, version: int) -> list[str]:
        """Retire idle leaving workers and top the pool up; returns the retired ids."""

    def preempt_all(self) -> None:
        """Ask every worker to hand back its in-flight work (graceful stop of the run)."""


class TrainerGroup(Protocol):
    """N trainer ranks stepping together; a step runs in the background and is awaited by handle."""

    def start_rl_step(self, samples: list) -> Any:
        """Queue one RL optimizer step on every rank; returns its handle."""

    def pending(self, handle: Any) -> list:
        """The parts of the step not finished yet (what `RolloutPool.wait` may also wake on)."""

    def done(self, handle: Any) -> bool:
        """The step finished on every rank."""

    def result(self, handle: Any, step: int | str) -> dict:
        """The step's metrics; raises when a rank does not answer within the collective timeout."""


class WeightSync(Protocol):
    """Publish -> transfer -> apply: brings the trainer's newest weights to every rollout worker."""

    def publish(self, version: int) -> None:
        """Queue the trainer's publish of `version` behind its current step (it may not be done yet)."""

    def published(self) -> None:
        """Wait until the trainer has published the version of the last `publish`."""

    def deliver(self, wait: bool) -> None:
        """Send the published version to every started worker; wait=True returns once they hold it."""


class Checkpoints(Protocol):
    """Checkpoint scheduling: the trainer's state and the controller's state, committed together."""

    def save(self, step: int, trainer: TrainerGroup, controller_state: dict) -> None: ...

    def poll(self) -> int | None:
        """Commit a finished save; returns its step."""

    def wait(self) -> int | None:
        """Wait for the pending save and commit it."""
