"""`moerl bench ray-fleet`: the Ray side of a rollout fleet at 8, 16 and 32 workers on one machine, no model.

    moerl bench ray-fleet                                # 8, 16, 32 workers
    moerl bench ray-fleet --workers 4 --seconds 5        # a quick look

Real `RolloutWorker` actors (moerl/actors/rollout_worker.py: threads, heartbeats, preemption, weight receive)
driven by the real `RayRolloutPool` and `WorkQueue`, each over a stub engine (`StubEngine`: the engine's contract,
no model) whose requests finish after a simulated decode time with tokens of lengths drawn from --lengths. Placed
with num_cpus=0, so every worker starts on a 2-core machine. For each fleet size, three phases:

- start: all workers asked for at once, each caught up to the newest weights (an object-store bucket of
  --weight-mb) before its first lease;
- steady: --seconds of leases and heartbeats, with a new weight version delivered to every worker every
  --publish-s (the loop the controller runs, less training);
- storm: --storm of the workers SIGTERMed at once (a spot reclaim): they hand back their partial groups, exit,
  and are replaced; the phase ends when the fleet is whole again and every replacement holds the newest version.

Costs are process CPU time (utime + stime from /proc), not wall time: the driver (this process: the pool, the
queue and Ray's core worker threads in it), the workers, and Ray's own processes (GCS, raylet, agents). Memory is
each worker's proportional set size (Pss: shared library pages split between the processes that map them) and the
driver's RSS. Every group is checked: none lost, none completed twice.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from moerl.actors.rollout_worker import RolloutWorker
from moerl.actors.worker_spec import WorkerSpec
from moerl.bench import options

TICK_S = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------ the stub engine
@dataclass
class StubShape:
    """What a stub engine does: every request finishes at a length drawn from `lengths` (by its task and sample,
    so a continuation elsewhere has the same one) at `tokens_per_s` per request, stepping every `step_s`."""

    lengths: tuple[int, ...] = (64, 128, 256, 512)
    tokens_per_s: float = 400.0
    step_s: float = 0.02
    weight_mb: float = 4.0
    token_id: int = 52  # a digit in the arithmetic task's vocabulary: rewards decode it


class _StubWeights(torch.nn.Module):
    """The engine's model as weight sync sees it (moerl/actors/weight_sync/receiver.py `apply_weights`): one flat
    tensor of weight_mb, no MoE blocks."""

    def __init__(self, weight_mb: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(max(1, int(weight_mb * 2**20 / 4))), requires_grad=False)
        self.moe_blocks: list = []
        self.config = SimpleNamespace(num_experts=0)


class StubEngine:
    """The rollout engine's contract (moerl/rollout/engine.py: submit, abort, step, has_unfinished,
    update_weights, version, device, stats) with a simulated decode and no model."""

    def __init__(self, shape: StubShape) -> None:
        from moerl.rollout.types import Completion

        self._completion = Completion
        self.shape, self.version, self.device = shape, -1, torch.device("cpu")
        self.model = _StubWeights(shape.weight_mb)
        self.stats = {"decode_tokens": 0, "decode_steps": 0}
        self.running: dict[str, tuple[object, int, float]] = {}  # request id -> (Completion, length, tokens owed)

    def _length(self, request_id: str) -> int:
        task, sample = request_id.split("/")[:2]  # "<task id>/<sample>/<ns>" (rollout_worker.py)
        digest = hashlib.blake2b(f"{task}/{sample}".encode(), digest_size=4).digest()
        return self.shape.lengths[int.from_bytes(digest, "little") % len(self.shape.lengths)]

    def submit(self, prompt, params, *, request_id: str, prefix=None) -> str:
        done = prefix.token_ids if prefix is not None else []
        c = self._completion(request_id, list(prompt), list(done), list(prefix.logprobs) if prefix else [],
                             list(prefix.versions) if prefix else [])
        self.running[request_id] = (c, self._length(request_id), 0.0)
        return request_id

    def abort(self, request_id: str):
        c, _, _ = self.running.pop(request_id)
        c.finish_reason = "abort"
        return c

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def update_weights(self, named_tensors, version: int) -> None:
        state = self.model.state_dict()
        for name, tensor in named_tensors:
            state[name].copy_(tensor)
        self.version = version

    def step(self) -> list:
        from moerl.rollout.types import StepOutput

        time.sleep(self.shape.step_s)  # the decode forward this stands for
        self.stats["decode_steps"] += 1
        out = []
        for rid, (c, length, owed) in list(self.running.items()):
            owed += self.shape.tokens_per_s * self.shape.step_s
            n = min(int(owed), length - len(c.token_ids))
            c.token_ids += [self.shape.token_id] * n
            c.logprobs += [-1.0] * n
            c.versions += [self.version] * n
            self.stats["decode_tokens"] += n
            self.running[rid] = (c, length, owed - n)
            if len(c.token_ids) >= length:
                c.finish_reason = "length"
                del self.running[rid]
                out.append(StepOutput(rid, [], [], completion=c))
        return out


class StubRolloutWorker(RolloutWorker):
    """A real rollout worker (threads, heartbeats, preemption, weight receive) whose engine is a StubEngine."""

    def build_engine(self, spec, arch, dtype) -> StubEngine:  # type: ignore[override]
        return StubEngine(spec.stub)


@dataclass
class StubWorkerSpec(WorkerSpec):
    stub: StubShape = field(default_factory=StubShape)


def worker_spec(shape: StubShape) -> StubWorkerSpec:
    from moerl.model import tiny_config
    from moerl.rollout import EngineConfig, SamplingParams

    return StubWorkerSpec(arch=tiny_config().to_hf_dict(), model_path="", dtype="float32", device="cpu",
                          engine=EngineConfig(), sampling=SamplingParams(max_new_tokens=max(shape.lengths)),
                          task_name="moerl.tasks.arithmetic:ArithmeticTask", task_options={}, seed=0, grace_s=10.0,
                          group_timeout_s=120.0, stub=shape)


# ------------------------------------------------------------------------------------------ weights
class StoreWeights:
    """Weight versions through the object store, as `RayWeightSync` sends them to workers on other nodes: one
    bucket per version, to every started worker (`deliver`) and to each one that comes up (`catch_up`, the hook
    RayRolloutPool calls)."""

    def __init__(self, weight_mb: float) -> None:
        self.nbytes = max(4, int(weight_mb * 2**20) // 4 * 4)
        self.version, self.shards, self.refs = -1, [], []
        self.publish()

    def publish(self) -> None:
        import numpy as np
        import ray

        from moerl.actors.weight_sync import Bucket, plan

        self.version += 1
        (layout,) = plan([("w", torch.float32, (self.nbytes // 4,), None)], bucket_bytes=1 << 62)
        self.shards = [ray.put(Bucket(layout, np.full(self.nbytes, self.version % 251, dtype=np.uint8)))]

    def catch_up(self, handle, version: int, where) -> object | None:
        return None if version >= self.version else handle.update_weights.remote(self.version, self.shards)

    def deliver(self, pool) -> None:
        self.refs = [h.update_weights.remote(self.version, self.shards) for _, h, _ in pool.started_workers()]


# ------------------------------------------------------------------------------------------ measuring
def cpu_s(pid: int) -> float:
    """Process CPU time (user + system) of `pid`, 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK_S
    except (OSError, IndexError, ValueError):
        return 0.0


def pss_mb(pid: int) -> float:
    """Proportional set size (shared pages split between their processes); RSS where Pss cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def ray_system_pids(session_dir: str) -> list[int]:
    """Ray's own processes of this session (GCS, raylet, agents, log monitor): their command lines name it."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if session_dir in cmd and "RolloutWorker" not in cmd and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
    return pids


@dataclass
class Phase:
    wall_s: float = 0.0
    driver_cpu_s: float = 0.0
    workers_cpu_s: float = 0.0
    ray_cpu_s: float = 0.0
    groups: int = 0


# ------------------------------------------------------------------------------------------ the driver
class Fleet:
    """The controller's Ray-facing loop without training: lease groups to ready workers, collect them, ping,
    replace the lost, publish weights; every group completed exactly once (`done`)."""

    def __init__(self, n: int, shape: StubShape, inflight: int, group_size: int, heartbeat_s: float) -> None:
        from moerl.actors.pools import RayRolloutPool
        from moerl.loop.work_queue import WorkQueue
        from moerl.tasks.arithmetic import ArithmeticTask

        self.task, self.group_size, self.inflight_cap = ArithmeticTask(), group_size, inflight
        self.queue = WorkQueue(lease_timeout=600.0, max_attempts=3)
        self.weights = StoreWeights(shape.weight_mb)
        self.pool = RayRolloutPool(worker_spec(shape), n, 0.0, 0.0, self.queue, heartbeat_s=heartbeat_s,
                                   heartbeat_timeout_s=60.0, max_inflight_groups=inflight, start_timeout_s=300.0,
                                   min_workers=n, worker_class=StubRolloutWorker)
        self.pool.weights = self.weights
        self.inflight: dict = {}
        self.done: Counter = Counter()
        self.next_prompt = 0
        self.handed_back = self.pings = 0
        self.pids: dict[str, int] = {}  # worker id -> pid, from its pings (CPU time and memory by pid)

    def step(self, new_work: bool = True) -> None:
        """One pass of the loop; without `new_work` only what is pending is leased (a drain)."""
        from moerl.loop.types import GroupTask

        now = time.monotonic()
        for wid in self.pool.ready_ids():
            while self.pool.inflight(wid) < self.inflight_cap:
                if self.queue.pending() == 0 and new_work:
                    prompt = self.task.prompt_at(self.next_prompt)
                    self.queue.add(GroupTask(prompt.task_id, self.next_prompt, prompt.prompt_token_ids,
                                             self.group_size, [None] * self.group_size))
                    self.next_prompt += 1
                task = self.queue.lease(wid, now)
                if task is None:
                    break
                self.inflight[self.pool.dispatch(wid, task)] = (wid, task.task_id)
        for ref, result, error in self.pool.wait(self.inflight, 0.05):
            wid, task_id = self.inflight.pop(ref, (None, None))
            if wid is None:
                continue
            if error is not None:
                self._lost(wid, now, f"died ({type(error).__name__})")
            elif result.status == "preempted":
                self.queue.hand_back(task_id, wid, result.completions, now)
                self.handed_back += 1
                self.pool.mark_leaving(wid)
            elif result.status == "ok" and self.queue.complete(task_id, wid, now):
                self.done[task_id] += 1
            elif result.status == "error":
                raise RuntimeError(f"group {task_id} failed on {wid}: {result.error}")
        for wid in self.pool.unresponsive(now):
            self._lost(wid, now, "stopped answering")
        self.queue.expire(now)
        for wid in self.pool.replace_missing(self.weights.version):
            self.queue.worker_lost(wid, now)
            self.pids.pop(wid, None)

    def _lost(self, wid: str, now: float, cause: str) -> None:
        if self.pool.remove(wid):
            self.queue.worker_died(wid, now, cause)
            self.inflight = {r: e for r, e in self.inflight.items() if e[0] != wid}
            self.pids.pop(wid, None)

    def learn_pids(self) -> None:
        import ray

        started = [(wid, h) for wid, h, _ in self.pool.started_workers() if wid not in self.pids]
        for (wid, _), answer in zip(started, ray.get([h.ping.remote() for _, h in started], timeout=60)):
            self.pids[wid] = answer["pid"]

    def whole(self) -> bool:
        """Every worker up, holding the newest weights, none leaving."""
        return len(self.pool.ready_ids()) == self.pool.target and not any(
            w.leaving for w in self.pool.workers.values())


def measure(fleet: Fleet, session_dir: str, until, publish_s: float = 0.0, new_work: bool = True) -> Phase:
    """Run the fleet's loop until `until()`; the CPU each part spent meanwhile."""
    ray_pids = ray_system_pids(session_dir)
    fleet.learn_pids()
    workers0 = {p: cpu_s(p) for p in fleet.pids.values()}
    ray0 = sum(cpu_s(p) for p in ray_pids)
    done0 = sum(fleet.done.values())
    t0, cpu0 = time.monotonic(), time.process_time()
    last_publish = t0
    while not until():
        fleet.step(new_work)
        if publish_s and time.monotonic() - last_publish >= publish_s:
            fleet.weights.publish()
            fleet.weights.deliver(fleet.pool)
            last_publish = time.monotonic()
    phase = Phase(wall_s=time.monotonic() - t0, driver_cpu_s=time.process_time() - cpu0,
                  ray_cpu_s=sum(cpu_s(p) for p in ray_pids) - ray0, groups=sum(fleet.done.values()) - done0)
    fleet.learn_pids()  # a worker that came up meanwhile: its CPU counted from its start
    phase.workers_cpu_s = sum(cpu_s(p) - workers0.get(p, 0.0) for p in fleet.pids.values())
    return phase


# ------------------------------------------------------------------------------------------ one fleet size
def run_size(n: int, args: argparse.Namespace, session_dir: str) -> dict:
    """Start, steady and storm phases for a fleet of n; raises if a group is lost or completed twice."""
    import ray

    shape = StubShape(tuple(int(x) for x in args.lengths.split(",")), args.tokens_per_s, args.step_s, args.weight_mb)
    fleet = Fleet(n, shape, args.inflight, args.group_size, args.heartbeat_s)
    deadline = time.monotonic() + args.start_timeout_s

    def up() -> bool:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{fleet.pool.fleet_line()} after {args.start_timeout_s:g} s (--start-timeout-s)")
        return fleet.whole()

    start = measure(fleet, session_dir, up)
    pss = [pss_mb(pid) for pid in fleet.pids.values()]
    end = time.monotonic() + args.seconds
    steady = measure(fleet, session_dir, lambda: time.monotonic() >= end, publish_s=args.publish_s)
    victims = sorted(fleet.pids)[: max(1, round(args.storm * n))]
    for wid in victims:  # a spot reclaim: SIGTERM, as the rollout pod's entrypoint forwards it
        os.kill(fleet.pids[wid], signal.SIGTERM)
    handed0, version = fleet.handed_back, fleet.weights.version
    storm = measure(fleet, session_dir, lambda: up() and not set(victims) & set(fleet.pool.workers))
    answers = ray.get([h.ping.remote() for _, h, _ in fleet.pool.started_workers()], timeout=60)
    caught_up = all(a["version"] >= version for a in answers)  # replacements hold the version of the storm
    drain_end = time.monotonic() + 120
    measure(fleet, session_dir, lambda: (fleet.queue.pending() == 0 and not fleet.inflight)
            or time.monotonic() > drain_end, new_work=False)
    twice = [t for t, k in fleet.done.items() if k > 1]
    lost = fleet.queue.pending() + len(fleet.inflight) + fleet.queue.stats().get("failed", 0)
    if twice or lost:
        raise RuntimeError(f"{n} workers: {len(twice)} groups completed twice, {lost} not completed")
    for _, handle, _ in fleet.pool.started_workers():
        ray.kill(handle, no_restart=True)
    return {"workers": n, "start": start, "steady": steady, "storm": storm, "victims": len(victims),
            "handed_back": fleet.handed_back - handed0, "caught_up": caught_up, "worker_pss_mb": sum(pss) / len(pss),
            "groups_done": sum(fleet.done.values()), "driver_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def extrapolate(rows: list[dict], to: int = 256) -> tuple[float, float]:
    """Steady driver cores = a + b x workers (least squares over the sizes run), at `to` workers."""
    xs = [r["workers"] for r in rows]
    ys = [r["steady"].driver_cpu_s / r["steady"].wall_s for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return b, my + b * (to - mx)


def report(rows: list[dict]) -> str:
    lines = ["workers | start s | steady groups/s | driver cores | driver ms/group | worker cores each | Ray procs "
             "cores | worker Pss MB | storm: SIGTERMed, handed back, back whole s, driver CPU s, workers CPU s"]
    for r in rows:
        st, sd, sm = r["start"], r["steady"], r["storm"]
        lines.append(
            f"{r['workers']:7d} | {st.wall_s:7.1f} | {sd.groups / sd.wall_s:15.1f} | {sd.driver_cpu_s / sd.wall_s:12.3f} | "
            f"{1e3 * sd.driver_cpu_s / max(sd.groups, 1):15.2f} | {sd.workers_cpu_s / sd.wall_s / r['workers']:17.4f} | "
            f"{sd.ray_cpu_s / sd.wall_s:15.3f} | {r['worker_pss_mb']:12.0f} | {r['victims']}, {r['handed_back']}, "
            f"{sm.wall_s:.1f}, {sm.driver_cpu_s:.2f}, {sm.workers_cpu_s:.1f}")
    b, at256 = extrapolate(rows) if len(rows) > 1 else (0.0, float("nan"))
    last = rows[-1]
    per_group = last["steady"].driver_cpu_s / max(last["steady"].groups, 1)
    lines.append(f"driver cores = a + {b:.4f} x workers (steady, fit over {len(rows)} sizes): {at256:.2f} cores at 256 "
                 f"workers at this bench's group rate per worker; driver CPU per group at {last['workers']}: "
                 f"{1e3 * per_group:.2f} ms, so 256 workers finishing R groups/s each cost {256 * per_group:.3f} x R "
                 f"cores. Driver peak RSS {last['driver_rss_mb']:.0f} MB. No group lost or completed twice; "
                 f"replacements caught up: {all(r['caught_up'] for r in rows)}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = options.parser("ray-fleet").parse_args(argv)
    from moerl import local_ray

    local_ray.loopback_env(True)  # a private local Ray on 127.0.0.1, behind its own token (moerl/local_ray.py)
    import ray

    token = local_ray.RunToken()
    token.open()
    rows = []
    try:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 _temp_dir=token.ray_temp_dir, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
        for n in (int(x) for x in args.workers.split(",")):
            rows.append(run_size(n, args, token.ray_temp_dir))
            print(f"{n} workers: done ({rows[-1]['groups_done']} groups)", flush=True)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        token.close()
    print(report(rows))
    return 0
