"""Export the policy of a committed checkpoint as a Hugging Face directory that serves.

    config.json + model.safetensors     the policy (save_pretrained)
    tokenizer files, generation_config.json    of the source model, so `AutoTokenizer`, `AutoModelForCausalLM`
                                        and a server (vLLM, SGLang) load the directory as it is

Runs in one process with no process group: DCP reads every rank's files, and the expert shards
(`model/<name>@ep{r}of{P}`) are concatenated back into the full stacked [E, ...] tensors. The tokenizer
files and generation_config.json travel with every checkpoint (`hf/` under the step, written by the
Checkpointer from the run's tokenizer directory and `model.path`), so a checkpoint on S3 exports on a
machine that has neither; `source` (`moerl export --source DIR`) takes them from a directory instead.

Everything read from the checkpoint is untrusted (a forger who can write the bucket recomputes the manifest): of
`hf/`, only the tokenizer and generation files named in SERVING_FILES are copied, at the top of the output, never a
name export writes itself (config.json, the safetensors) and never code (`*.py`; an `auto_map` entry, which makes a
consumer with trust_remote_code=True fetch and run code, is dropped from the JSON files, with a warning). The tensor
shapes of the trainer's `.metadata` are compared with arch.json before anything is allocated. The directory is
written under a temporary name beside `out_dir` and renamed into place: a failure leaves no half-written output.
Each storage call has a deadline (`timeout_s`), and `progress` hears what has been read and written so far.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.checkpoint.serving import (  # noqa: F401 - SERVING_DIR, serving_files: re-exported by moerl.checkpoint
    SERVING_DIR, TOKENIZER_FILES, checkpoint_serving_files, serving_files, used_byte_tokenizer, without_code,
)
from moerl.checkpoint.storage import CheckpointStore
from moerl.checkpoint.trainer_state import EP_KEY, load_into, read_metadata
from moerl.model import CheckpointError, MoEModelConfig, build_model, save_pretrained

ARCH_FILE = "arch.json"
_WEIGHT_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")  # what save_pretrained writes
EXPORT_DTYPES = ("float32", "bfloat16")
TRAINER_DIR = "trainer"
log = logging.getLogger(__name__)


def write_arch(store: CheckpointStore, step: int, model_config: MoEModelConfig, dtype: str | None = None) -> None:
    """Save the architecture with the step, so export (and resume checks) need nothing but the checkpoint.
    dtype: the run's compute dtype (model.dtype), what an export writes by default; the checkpoint itself holds
    the master weights (float32)."""
    store.write_bytes(step, ARCH_FILE, arch_bytes(model_config, dtype))


def arch_bytes(model_config: MoEModelConfig, dtype: str | None = None) -> bytes:
    """The contents of arch.json (see write_arch)."""
    return json.dumps(model_config.to_hf_dict() | ({"dtype": dtype} if dtype else {}), indent=1).encode()


def read_arch_dtype(store: CheckpointStore, step: int) -> str | None:
    """The compute dtype the run trained with, when its checkpoint recorded one."""
    try:
        dtype = json.loads(store.read_bytes(step, ARCH_FILE)).get("dtype")
    except (json.JSONDecodeError, AttributeError):
        return None
    return dtype if dtype in EXPORT_DTYPES else None


def read_arch(store: CheckpointStore, step: int) -> MoEModelConfig:
    raw = store.read_bytes(step, ARCH_FILE)
    try:
        return MoEModelConfig.from_hf_dict(json.loads(raw), source=f"{store.step_path(step)}/{ARCH_FILE}")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{store.step_path(step)}/{ARCH_FILE}: not valid JSON ({e})") from None


def gather_model_state(trainer_path: str, timeout_s: float = STORAGE_TIMEOUT_S,
                       expected: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    """The full model state dict (plain names) from a trainer checkpoint, expert shards stacked back.
    expected: name -> full shape (from arch.json); every tensor's shape in the metadata is checked against it
    before anything is allocated (a forged `[2**40]` would otherwise reach the allocator)."""
    meta = read_metadata(trainer_path, timeout_s)
    wanted = {k: m for k, m in meta.items() if k.startswith("model/")}
    if not wanted:
        raise CheckpointError(f"{trainer_path}: no model tensors in this checkpoint")
    if expected is not None:
        _check_shapes(trainer_path, wanted, expected)
    loaded = load_into(trainer_path, wanted, timeout_s)
    out: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    for key, t in loaded.items():
        name = key[len("model/"):]
        m = EP_KEY.match(name)
        if m:
            shards.setdefault(m.group(1), {})[int(m.group(2))] = t
            sizes[m.group(1)] = int(m.group(3))
        else:
            out[name] = t
    for name, parts in shards.items():
        missing = sorted(set(range(sizes[name])) - set(parts))
        if missing:
            raise CheckpointError(f"{trainer_path}: {name!r} lacks the expert shard(s) of EP rank(s) {missing}")
        out[name] = torch.cat([parts[r] for r in range(sizes[name])], dim=0)  # rank r holds [r*E/P, (r+1)*E/P)
    return out


def _check_shapes(trainer_path: str, meta: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """Each `model/` entry of the metadata has the shape `expected` holds for it (an expert shard `@ep{r}of{P}`
    its 1/P share of dim 0), and every expected tensor is there: else CheckpointError naming the first that is not."""
    where = f"{trainer_path}: "
    for key, m in meta.items():
        name = key[len("model/"):]
        ep = EP_KEY.match(name)
        base = ep.group(1) if ep else name
        full = expected.get(base)
        if full is None:
            raise CheckpointError(f"{where}{key!r} is not a tensor of the model its {ARCH_FILE} describes")
        want = full
        if ep:
            parts = int(ep.group(3))
            if parts < 1 or not full or full[0] % parts or int(ep.group(2)) >= parts:
                raise CheckpointError(f"{where}{key!r}: {parts} expert shards do not split {list(full)}")
            want = (full[0] // parts, *full[1:])
        if tuple(m.size) != tuple(want):
            raise CheckpointError(f"{where}{key!r} is {list(m.size)} in the checkpoint, {list(want)} per its "
                                  f"{ARCH_FILE}")
    names = {EP_KEY.match(k[6:]).group(1) if EP_KEY.match(k[6:]) else k[6:] for k in meta}
    missing = sorted(set(expected) - names)
    if missing:
        raise CheckpointError(f"{where}{missing[0]!r} is absent from the checkpoint, {list(expected[missing[0]])} per "
                              f"its {ARCH_FILE}")


def export_step(store: CheckpointStore, step: int | None = None) -> int:
    """The step an export writes: `step` when it is committed, else the newest committed one. A newest step that
    is torn is refused, naming the intact one to pass as `step`, rather than exporting an older policy unasked.
    A root without steps whose `checkpoints/` has some (a run directory given for its checkpoint.dir) says so."""
    if step is not None:
        committed = store.committed_steps()
        if step not in committed:
            raise CheckpointError(f"{store.root}: step {step} is not a committed checkpoint (committed: "
                                  f"{', '.join(map(str, committed)) or 'none'}{_run_dir_hint(store)})")
        return step
    step = store.latest_step()
    torn = store.torn_steps(step)
    if torn:
        raise CheckpointError(f"{store.root}: checkpoint step {torn[0][0]} is torn ({torn[0][1]}); "
                              + (f"the newest intact step is {step}: export it with --step {step}"
                                 if step is not None else "no older step is committed"))
    if step is None:
        raise CheckpointError(f"{store.root}: no committed checkpoint to export{_run_dir_hint(store)}")
    return step


def _run_dir_hint(store: CheckpointStore) -> str:
    """"; ... is a run directory: its checkpoints are in ROOT/checkpoints" when that holds steps and ROOT none."""
    if store.step_dirs():
        return ""
    try:
        inner = CheckpointStore(f"{store.root}/checkpoints", store.timeout_s)
        steps = inner.step_dirs()
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if not steps:
        return ""
    return (f"; {store.root} looks like a run directory: its checkpoints are under {inner.root} (steps up to "
            f"{steps[-1]}), so export {inner.root}")


def export_policy(checkpoint_root: str, out_dir: str, step: int | None = None, dtype: str | None = None,
                  source: str | None = None, timeout_s: float = STORAGE_TIMEOUT_S,
                  progress: Callable[[str], None] = lambda text: None,
                  warn: Callable[[str], None] | None = None) -> Path:
    """Write the policy of `step` (default: the latest committed) under `out_dir`; returns out_dir.
    dtype: of the written tensors, float32 or bfloat16 (default: the run's model.dtype, else the checkpoint's).
    source: a model or tokenizer directory whose tokenizer files and generation_config.json to write (default:
    those saved with the checkpoint). timeout_s: the deadline of each storage call. progress: hears a line per
    stage (files and bytes read, what was written); warn: what the export lacks or left out (default: logged).
    A newest step that is torn is refused, naming the intact one to pass as `step`, rather than exporting an older
    policy unasked. `out_dir` appears whole or not at all (an existing directory: its files of the same names are
    replaced, each whole, and weight files of an earlier export removed)."""
    if source is not None and not Path(source).is_dir():
        raise CheckpointError(f"export source {source!r} is not a directory")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export dtype must be one of {list(EXPORT_DTYPES)}, got {dtype!r}")
    warn = warn or log.warning
    store = CheckpointStore(checkpoint_root, timeout_s)
    step = export_step(store, step)
    progress(f"verifying {store.step_path(step)}")
    manifest = store.verify(step, progress)  # a partial or corrupted step names its files here, not exporting garbage
    files = manifest["files"]
    progress(f"verified {len(files)} files, {_mib(sum(files.values()))} (sizes and checksums)")
    config = read_arch(store, step)
    dtype = dtype or read_arch_dtype(store, step)
    # the shapes arch.json implies (built on the meta device: nothing allocated), checked against the metadata first
    shapes = {n: tuple(t.shape) for n, t in build_model(config, init=False, device="meta").state_dict().items()}
    shards = {k: n for k, n in files.items() if k.startswith(f"{TRAINER_DIR}/")}
    progress(f"reading the policy's tensors from {len(shards)} trainer files ({_mib(sum(shards.values()))} in all)")
    state = gather_model_state(f"{store.step_path(step)}/{TRAINER_DIR}", timeout_s, expected=shapes)
    torch_dtype = getattr(torch, dtype) if dtype else next(iter(state.values())).dtype
    model = build_model(config, dtype=torch_dtype, init=False)
    expected = model.state_dict()
    for name, t in expected.items():
        if name not in state or tuple(state[name].shape) != tuple(t.shape):
            got = list(state[name].shape) if name in state else "absent"
            raise CheckpointError(f"{store.step_path(step)}: {name!r} is {got} in the checkpoint, "
                                  f"{list(t.shape)} per its {ARCH_FILE}")
    model.load_state_dict({n: state[n] for n in expected}, strict=True)
    if any(state[n].any() for n in expected if n.endswith("expert_bias")):  # save_pretrained drops it
        warn("the policy routes with an aux-loss-free expert bias, which the Hugging Face format has no place for: "
             "the exported model routes without it")
    model.tie_weights()
    extra = serving_files(source, source) if source is not None else checkpoint_serving_files(store, step, files, warn)
    extra = {name: without_code(name, data, warn) for name, data in extra.items()}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"  # same filesystem: the rename is atomic
    try:
        save_pretrained(model, staging)
        for name, data in extra.items():
            (staging / name).write_bytes(data)
        mode = 0o666 & ~_umask()  # as config.json: safetensors writes its files 0600
        for path in staging.iterdir():
            path.chmod(mode)
        staging.chmod(0o777 & ~_umask())
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    progress(f"wrote {out_dir}: config.json and {_mib(weights)} of safetensors")
    if extra:
        progress(f"copied {len(extra)} serving files, {_mib(sum(map(len, extra.values())))}: {', '.join(extra)}")
    if not any(n in extra for n in TOKENIZER_FILES):
        byte = used_byte_tokenizer(manifest) and source is None
        warn(f"{out_dir} has no tokenizer: "
             + ("the run used the byte tokenizer (task.options.tokenizer = \"byte\"), which has no files, "
                if byte else f"no tokenizer files {'in ' + repr(source) if source else 'in the checkpoint'}, ")
             + "so AutoTokenizer loads an empty one (a single token) from it; `moerl export --source "
             "MODEL_OR_TOKENIZER_DIR` adds a tokenizer's files")
    return Path(out_dir)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _move_into_place(staging: Path, out: Path) -> None:
    """`staging` becomes `out`: renamed when `out` is absent or empty; else (--force) each file replaced whole, and
    weight files of an earlier export that this one did not write removed (a stale index would name old shards)."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.rename(staging, out)
        return
    if not out.is_dir():
        raise CheckpointError(f"{out} is a file, not a directory: choose another output directory")
    written = {p.name for p in staging.iterdir()}
    for old in out.iterdir():
        if old.name not in written and (old.name in _WEIGHT_FILES or
                                        (old.name.startswith("model-") and old.name.endswith(".safetensors"))):
            old.unlink()
    for path in staging.iterdir():
        os.replace(path, out / path.name)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
