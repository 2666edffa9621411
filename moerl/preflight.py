"""What `moerl train` checks before Ray starts: every input the run needs, each failure one line.

    run.dir          writable
    checkpoint.dir   a test write (S3: credentials, endpoint, bucket)
    no run there     unless --resume, run.dir holds no logged step and checkpoint.dir no step: never overwritten
    model.path       a directory; config.json of a supported model_type; safetensors whose headers are whole and
                     whose tensors match config.json by name and shape (no tensor is read)
    task             imports; its options fit its config_class; its data and tokenizer load; prompt 0 builds
                     (and its SFT example when train.sft_steps > 0); the tokenizer's ids fit the model
    capacity         a group fits one engine (batch, KV cache) and a step's batch half the driver's free memory
    --resume         a committed checkpoint that verifies (sizes and checksums), written with this config;
                     a torn one (a file lost or damaged, or a newer step whose COMMIT was) names the newest intact
                     step and stops the run before anything is written

`run.prepare` calls these in that order; `train_cli.main` prints a failure as `error: <message>` and exits 2 before
anything has started. Errors the parts already raise (TaskError, CheckpointError) pass through; the new
checks raise PreflightError. Nothing here imports Ray.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moerl.checkpoint.storage import CheckpointStore
    from moerl.config import MoerlConfig
    from moerl.model.config import MoEModelConfig
    from moerl.tasks.base import Task

RUN_FILES = ("metrics.jsonl", "trajectories.jsonl")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class PreflightError(ValueError):
    """An input that cannot work, found before the run starts; the message is the line printed."""


def one_line(error: BaseException) -> str:
    """The line `moerl train` prints for `error`: the first line of its text, colour codes stripped, with the
    type's name in front unless the type is moerl's own (its messages are written to be read as they are)."""
    lines = [line.strip() for line in _ANSI.sub("", str(error)).splitlines() if line.strip()]
    text = lines[0] if lines else repr(error)
    return text if type(error).__module__.split(".")[0] == "moerl" else f"{type(error).__name__}: {text}"


# ------------------------------------------------------------------------------------------ run.dir
def check_run_dir(run_dir: Path) -> None:
    """`run_dir` exists (made if need be) and takes a file."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".moerl-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PreflightError(f"run.dir {str(run_dir)!r} is not writable: {type(e).__name__}: "
                             f"{e.strerror or e}") from None


def check_no_run(run_dir: Path, store: CheckpointStore) -> None:
    """A new run (no --resume) starts where no run is: no logged RL step in `run_dir` and no checkpoint under
    `store` (also a `checkpoint.dir` elsewhere, whose old steps a later --resume would pick up)."""
    held = []
    last = last_logged_step(run_dir)
    if last:
        held.append(f"metrics.jsonl up to step {last}")
    steps = store.step_dirs()
    if steps:
        held.append(f"checkpoints under {store.root} up to step {steps[-1]}")
    if held:
        # --resume must be able to do what this says (a save cut short by a crash or a second Ctrl-C has a step
        # directory but no COMMIT: --resume refuses it, so this may not send the user there)
        committed = store.committed_steps() if steps else []
        how = ("continue it with --resume, or" if committed else
               f"it has no committed checkpoint to continue from (step {steps[-1]}'s save did not finish), so"
               if steps else "it has no checkpoint to continue from, so")
        raise PreflightError(f"run.dir {str(run_dir)!r} holds a run ({', '.join(held)}) and a run is never "
                             f"overwritten: {how} start a new one with --run.dir=<another directory> "
                             "(or delete that one)")


def last_logged_step(run_dir: Path) -> int:
    """The highest RL step (>= 1) in `run_dir`'s metrics.jsonl, 0 if none (warm-start rows are steps <= 0)."""
    last = 0
    try:
        with open(run_dir / RUN_FILES[0], "rb") as f:
            for line in f:
                try:
                    step = json.loads(line).get("step", 0)
                except (ValueError, AttributeError):
                    continue  # a line cut short by a crash
                if isinstance(step, int) and step > last:
                    last = step
    except FileNotFoundError:
        pass
    if not last and (run_dir / RUN_FILES[1]).is_file() and (run_dir / RUN_FILES[1]).stat().st_size:
        last = 1  # trained samples without a metrics row: a step was under way
    return last


# ------------------------------------------------------------------------------------------ model
def check_model(path: str) -> MoEModelConfig:
    """The architecture of the HF checkpoint at `path`, after `check_pretrained`'s header-only checks."""
    from moerl.model.config import CheckpointError
    from moerl.model.hf import check_pretrained

    where = Path(path)
    if not where.exists():
        raise PreflightError(f"model.path {path!r} does not exist (a Hugging Face checkpoint directory: "
                             "config.json and *.safetensors; empty = a random model of model.preset)")
    if not where.is_dir():
        raise PreflightError(f"model.path {path!r} is not a directory")
    try:
        return check_pretrained(where)
    except CheckpointError as e:
        raise PreflightError(f"model.path: {one_line(e)}") from e


# ------------------------------------------------------------------------------------------ task
def check_task(cfg: MoerlConfig) -> Task:
    """The task built as the workers will build it, and its first prompt (and SFT example) made."""
    from moerl.tasks.base import TaskError, load_task

    name = cfg.task.name
    try:
        task = load_task(name, dict(cfg.task.options), seed=cfg.run.seed)
    except TaskError:
        raise
    except Exception as e:  # the task's own constructor (data, tokenizer): named in one line
        raise PreflightError(f"task {name!r} could not be built: {one_line(e)}") from e
    try:
        prompt = task.prompt_at(0)
    except Exception as e:
        raise PreflightError(f"task {name!r}: its first prompt fails: {one_line(e)}") from e
    r = cfg.rollout
    n = len(prompt.prompt_token_ids)
    if n == 0:
        raise PreflightError(f"task {name!r}: prompt 0 is no tokens: the tokenizer (task.options.tokenizer) turns its "
                             "text into nothing, so the model would see no prompt")
    if n >= r.max_seq_len:
        raise PreflightError(f"task {name!r}: prompt 0 has {n} tokens, rollout.max_seq_len={r.max_seq_len} leaves no "
                             "room for a completion: raise rollout.max_seq_len")
    if n + r.max_new_tokens > r.max_seq_len:
        logging.getLogger(__name__).warning(
            "rollout.max_new_tokens=%d: prompt 0 has %d tokens, so rollout.max_seq_len=%d cuts its completion at %d "
            "tokens (raise rollout.max_seq_len to %d)", r.max_new_tokens, n, r.max_seq_len, r.max_seq_len - n,
            n + r.max_new_tokens)
    if cfg.train.sft_steps > 0:
        if not hasattr(task, "sft_example"):
            raise PreflightError(f"config key 'train.sft_steps' is {cfg.train.sft_steps} but task {name!r} has no "
                                 "sft_example() for a warm start: set train.sft_steps = 0")
        try:
            task.sft_example(0)
        except Exception as e:
            raise PreflightError(f"task {name!r}: its first SFT example fails: {one_line(e)}") from e
    return task


def check_tokenizer(task: Task, arch: MoEModelConfig) -> None:
    """Every id the tokenizer makes (EOS included) is a row of the model's embedding."""
    tok = task.tokenizer
    if tok.vocab_size > arch.vocab_size or tok.eos_token_id >= arch.vocab_size:
        raise PreflightError(f"the task's tokenizer has {tok.vocab_size} ids (EOS {tok.eos_token_id}) but the model's "
                             f"vocabulary has {arch.vocab_size}: its ids would index past the embedding; use the "
                             "model's own tokenizer (task.options.tokenizer = the model directory)")


def check_expert_split(cfg: MoerlConfig, arch: MoEModelConfig) -> None:
    """The trainer's and the rollout engine's expert-parallel sizes each divide the model's experts."""
    for key, size in (("ep.size", cfg.ep.size), ("rollout.ep_size", cfg.rollout.ep_size)):
        if arch.num_experts % size:
            raise PreflightError(f"config key {key!r} is {size}, which does not divide the model's {arch.num_experts} "
                                 "experts: every rank must hold the same number of experts")
    if cfg.rollout.ep_size > 1 and cfg.run.deterministic:
        raise PreflightError("config key 'run.deterministic' is not supported with rollout.ep_size > 1 yet (the "
                             "engine group does not match its rescoring forwards across ranks): set one of them off")
    gpus = cfg.rollout.gpus_per_worker
    if cfg.rollout.ep_size > 1 and gpus and gpus != cfg.rollout.ep_size:
        raise PreflightError(f"config key 'rollout.gpus_per_worker' is {gpus}, but an engine of rollout.ep_size = "
                             f"{cfg.rollout.ep_size} ranks takes one GPU per rank: set it to {cfg.rollout.ep_size}")


def check_capacity(cfg: MoerlConfig, arch: MoEModelConfig, available: int | None = None) -> None:
    """A group fits one engine, and a step's batch the driver's memory (`available` bytes; default: what this
    machine and its cgroup have free). The worker takes a group's completions into its engine at once and the
    controller holds a step's samples: a group of 10**8 held the driver at 7.5 GB while workers were called stuck."""
    r, t = cfg.rollout, cfg.train
    if r.group_size > r.max_batch_size:
        raise PreflightError(f"config key 'rollout.group_size' is {r.group_size}, more than one engine's batch "
                             f"(rollout.max_batch_size={r.max_batch_size}): a worker samples a group in one engine; "
                             "lower the group size or raise the batch")
    kv = r.kv_cache_tokens or (r.max_batch_size * r.max_seq_len if resolve_device_type(cfg) == "cpu" else 0)
    if kv and r.group_size * r.max_seq_len > kv:  # 0 on a GPU without kv_cache_tokens: sized from its memory later
        raise PreflightError(f"config key 'rollout.group_size' is {r.group_size}: a group of {r.group_size} x "
                             f"rollout.max_seq_len={r.max_seq_len} tokens needs {r.group_size * r.max_seq_len} tokens "
                             f"of KV cache, one engine holds {kv} (rollout.kv_cache_tokens): lower the group size or "
                             "max_seq_len, or raise rollout.kv_cache_tokens")
    tokens = t.batch_groups * r.group_size * r.max_seq_len
    need = tokens * driver_bytes_per_token(arch)
    free = memory_available() if available is None else available
    if free and need > free // 2:  # half: the next step's batch arrives while this one trains
        raise PreflightError(f"config keys 'train.batch_groups' x 'rollout.group_size' x 'rollout.max_seq_len' "
                             f"({t.batch_groups} x {r.group_size} x {r.max_seq_len} = {tokens} tokens) make a step's "
                             f"batch of up to {need / 2**30:.1f} GiB in the driver, over half of the "
                             f"{free / 2**30:.1f} GiB of memory free here: lower train.batch_groups or "
                             "rollout.group_size")


def driver_bytes_per_token(arch: MoEModelConfig) -> int:
    """What one token of a step's batch costs the driver, about: its id, log-prob and version as Python list
    items (in the completion and again in the trained sample) and its routing (int16, layers x top-k, twice)."""
    routing = 2 * len(arch.moe_layer_indices) * arch.num_experts_per_tok
    return 2 * (36 + 32) + 8 + 2 * routing


def memory_available() -> int:
    """Bytes of memory this process could still take: MemAvailable, capped by its cgroup's limit less its use;
    0 when unknown (not Linux)."""
    free = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit.isdigit() and int(limit) < 1 << 60:
                free = min(free, max(0, int(limit) - int(Path(usage_file).read_text().strip())))
            break
        except (OSError, ValueError):
            continue
    return free


def resolve_device_type(cfg: MoerlConfig) -> str:
    """"cuda" or "cpu": where the engines run (run.device, auto = cuda when this machine has one)."""
    if cfg.run.device != "auto":
        return cfg.run.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_deterministic(cfg: MoerlConfig, device: str) -> None:
    """run.deterministic is honoured on the CPU (torch's deterministic algorithms in every trainer and rollout
    process, sync mode, batches in task order, log-probs from the full forward); refused where it cannot be."""
    if cfg.run.deterministic and device.startswith("cuda"):
        raise PreflightError("config key 'run.deterministic' is CPU-only: on a GPU the grouped GEMMs, the Triton "
                             "kernels and flash attention's backward are not bitwise reproducible here; set "
                             "run.device = \"cpu\" or run.deterministic = false")


def check_eval_task(cfg: MoerlConfig, task: Any) -> None:
    """`[eval]` scores completions with the task's reward; a multi-turn task's episodes are scored by their
    environment, which the eval runner does not play yet (docs/environments.md)."""
    from moerl.tasks.episodic import is_episodic

    if cfg.eval.enabled and is_episodic(task):
        raise PreflightError(f"config key 'eval.every': task {cfg.task.name!r} plays multi-turn episodes, which "
                             "[eval] cannot score yet; set eval.every = 0 and eval.before_train = false")


def check_device(cfg: MoerlConfig) -> None:
    """`run.device = "cuda"` needs a GPU where the run starts its local Ray (a cluster's GPUs are its own)."""
    if cfg.run.device != "cuda" or cfg.ray.address or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device visible"
        raise PreflightError(f"config key 'run.device' is 'cuda' but this machine has no CUDA GPU (torch "
                             f"{torch.__version__}, {build}): set --run.device=cpu (or auto)")


def check_ray_address(address: str, timeout_s: float, say: Callable[[str], None] = lambda text: None) -> None:
    """A Ray address to join accepts a TCP connection within `timeout_s` (a head that is still starting gets
    that long; `say` hears once that it is being waited for). "auto" and "local" are Ray's own lookups."""
    if address in ("", "auto", "local"):
        return
    target = address.split("://", 1)[-1].split("/", 1)[0].rsplit("@", 1)[-1]
    host, _, port = target.rpartition(":") if target.rpartition(":")[2].isdigit() else (target, "", "6379")
    host = host.strip("[]") or "127.0.0.1"
    deadline = time.monotonic() + timeout_s
    said, cause = False, ""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(left, 2.0))):
                return
        except OSError as e:
            cause = f"{type(e).__name__}: {e.strerror or e}"
        if time.monotonic() + 0.25 >= deadline:
            break
        if not said:
            say(f"waiting for Ray at {host}:{port} (up to {timeout_s:g} s, ray.connect_timeout_s)")
            said = True
        time.sleep(0.25)
    raise PreflightError(f"ray.address {address!r}: nothing answers there within {timeout_s:g} s ({cause}); start "
                         "the cluster's head first, or leave ray.address empty for a local Ray")


# ------------------------------------------------------------------------------------------ resume
def check_resume(store: CheckpointStore, fingerprint: dict[str, Any], *, every: int,
                 step: int | None = None, run_dir: Path | None = None) -> int:
    """The step to resume from: `step`, else the newest committed one; it must verify (sizes, checksums) and
    have been written with this `fingerprint`. A torn one names the newest older step that verifies. Without
    `step`, a newer step whose COMMIT was lost or damaged is torn too: falling back to an older step unasked
    would drop the log rows after it and later overwrite the newer step."""
    from moerl.model.config import CheckpointError

    committed = store.committed_steps()
    if step is None:
        latest = store.latest_step()
        torn = store.torn_steps(latest)
        if torn:
            intact = next((s for s in reversed(committed) if _verifies(store, s)), None)
            raise PreflightError(f"--resume: checkpoint step {torn[0][0]} is torn ({torn[0][1]}); "
                                 + (f"the newest intact step is {intact}: resume from it with --resume-step={intact}"
                                    if intact is not None else "no older committed step is intact"))
    if step is not None and step not in committed:
        raise PreflightError(f"--resume-step {step}: no committed checkpoint of that step under {store.root} "
                             f"(committed: {', '.join(map(str, committed)) or 'none'})")
    if not committed:
        uncommitted = store.step_dirs()
        raise PreflightError(
            f"--resume: no committed checkpoint under {store.root}"
            + (f" (step {uncommitted[-1]} was never committed: its save did not finish)" if uncommitted else "")
            + ("; checkpoint.every is 0, so a run saves only at its last step or when it is stopped (SIGTERM or "
               "Ctrl-C)" if every == 0 else "")
            # the plain command refuses a run directory that holds a run: say what works (check_no_run agrees)
            + (": nothing to resume; start a new run with --run.dir=<another directory> (or delete that one)"
               if uncommitted or (run_dir is not None and last_logged_step(run_dir)) else ": start without --resume"))
    chosen = step if step is not None else store.latest_step()
    assert chosen is not None
    try:
        manifest = store.verify(chosen)
    except CheckpointError as e:
        intact = next((s for s in reversed(committed) if s < chosen and _verifies(store, s)), None)
        raise PreflightError(f"--resume: checkpoint step {chosen} is torn ({one_line(e)}); "
                             + (f"the newest intact step is {intact}: resume from it with --resume-step={intact}"
                                if intact is not None else "no older committed step is intact")) from e
    saved = manifest.get("fingerprint", {})
    mismatched = []
    for key, ours in fingerprint.items():
        theirs = saved.get(key)
        if isinstance(ours, dict) and isinstance(theirs, dict):  # the architecture: only the fields that differ
            mismatched += [f"{key}.{k}: checkpoint {theirs.get(k)!r} vs config {ours.get(k)!r}"
                           for k in sorted(set(ours) | set(theirs)) if theirs.get(k) != ours.get(k)]
        elif theirs != ours:
            mismatched.append(f"{key}: checkpoint {theirs!r} vs config {ours!r}")
    if mismatched:
        raise PreflightError(f"--resume: checkpoint step {chosen} was written with another configuration: "
                             + "; ".join(mismatched))
    return chosen


def _verifies(store: CheckpointStore, step: int) -> bool:
    from moerl.model.config import CheckpointError

    try:
        store.verify(step)
        return True
    except CheckpointError:
        return False
