"""Export the policy of a committed checkpoint as a Hugging Face directory that serves.

    config.json + model.safetensors     the policy (save_pretrained)
    tokenizer files, generation_config.json    of the source model, so `AutoTokenizer`, `AutoModelForCausalLM`
                                        and a server (vLLM, SGLang) load the directory as it is

Runs in one process with no process group: DCP reads every rank's files, and the expert shards
(`model/<name>@ep{r}of{P}`) are concatenated back into the full stacked [E, ...] tensors. The tokenizer
files and generation_config.json travel with every checkpoint (`hf/` under the step, written by the
Checkpointer from the run's tokenizer directory and `model.path`), so a checkpoint on S3 exports on a
machine that has neither; `source` (`moerl export --source DIR`) takes them from a directory instead.

Everything read from the checkpoint is untrusted: a serving file's key must be a plain relative path and is
written only inside the output directory (a forged `hf//abs/path` or `hf/../../x` is refused, naming it). Each
storage call has a deadline (`timeout_s`), and `progress` hears what has been read and written so far.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch

from moerl.checkpoint.deadline import STORAGE_TIMEOUT_S
from moerl.checkpoint.storage import CheckpointStore
from moerl.checkpoint.trainer_state import EP_KEY, load_into, read_metadata
from moerl.checkpoint.untrusted import inside
from moerl.model import CheckpointError, MoEModelConfig, build_model, save_pretrained

ARCH_FILE = "arch.json"
SERVING_DIR = "hf"  # under a step: the source model's tokenizer files and generation_config.json
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
GENERATION_CONFIG = "generation_config.json"
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


def serving_files(model_path: str = "", tokenizer_dir: str | None = None) -> dict[str, bytes]:
    """The files a served export needs besides the weights: the tokenizer's (from the run's tokenizer directory,
    else the model's) and generation_config.json (the model's, else the tokenizer directory's). Absent ones are
    skipped: a random-init model with the byte tokenizer has none."""
    def read(directory: str | None, names: tuple[str, ...]) -> dict[str, bytes]:
        if not directory or not Path(directory).is_dir():
            return {}
        return {n: (Path(directory) / n).read_bytes() for n in names if (Path(directory) / n).is_file()}
    files = read(tokenizer_dir, TOKENIZER_FILES) or read(model_path, TOKENIZER_FILES)
    generation = read(model_path, (GENERATION_CONFIG,)) or read(tokenizer_dir, (GENERATION_CONFIG,))
    return files | generation


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


def gather_model_state(trainer_path: str, timeout_s: float = STORAGE_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """The full model state dict (plain names) from a trainer checkpoint, expert shards stacked back."""
    meta = read_metadata(trainer_path, timeout_s)
    wanted = {k: m for k, m in meta.items() if k.startswith("model/")}
    if not wanted:
        raise CheckpointError(f"{trainer_path}: no model tensors in this checkpoint")
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


def export_step(store: CheckpointStore, step: int | None = None) -> int:
    """The step an export writes: `step`, else the newest committed one. A newest step that is torn is refused,
    naming the intact one to pass as `step`, rather than exporting an older policy unasked."""
    if step is not None:
        return step
    step = store.latest_step()
    torn = store.torn_steps(step)
    if torn:
        raise CheckpointError(f"{store.root}: checkpoint step {torn[0][0]} is torn ({torn[0][1]}); "
                              + (f"the newest intact step is {step}: export it with --step {step}"
                                 if step is not None else "no older step is committed"))
    if step is None:
        raise CheckpointError(f"{store.root}: no committed checkpoint to export")
    return step


def export_policy(checkpoint_root: str, out_dir: str, step: int | None = None, dtype: str | None = None,
                  source: str | None = None, timeout_s: float = STORAGE_TIMEOUT_S,
                  progress: Callable[[str], None] = lambda text: None,
                  warn: Callable[[str], None] | None = None) -> Path:
    """Write the policy of `step` (default: the latest committed) under `out_dir`; returns out_dir.
    dtype: of the written tensors, float32 or bfloat16 (default: the run's model.dtype, else the checkpoint's).
    source: a model or tokenizer directory whose tokenizer files and generation_config.json to write (default:
    those saved with the checkpoint). timeout_s: the deadline of each storage call. progress: hears a line per
    stage (files and bytes read, what was written); warn: what the export lacks (default: logged). A newest step that is torn is refused, naming the intact
    one to pass as `step`, rather than exporting an older policy unasked."""
    if source is not None and not Path(source).is_dir():
        raise CheckpointError(f"export source {source!r} is not a directory")
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise CheckpointError(f"export dtype must be one of {list(EXPORT_DTYPES)}, got {dtype!r}")
    store = CheckpointStore(checkpoint_root, timeout_s)
    step = export_step(store, step)
    progress(f"verifying {store.step_path(step)}")
    manifest = store.verify(step, progress)  # a partial or corrupted step names its files here, not exporting garbage
    files = manifest["files"]
    progress(f"verified {len(files)} files, {_mib(sum(files.values()))} (sizes and checksums)")
    config = read_arch(store, step)
    shards = {k: n for k, n in files.items() if k.startswith(f"{TRAINER_DIR}/")}
    progress(f"reading the policy's tensors from {len(shards)} trainer files ({_mib(sum(shards.values()))} in all)")
    state = gather_model_state(f"{store.step_path(step)}/{TRAINER_DIR}", timeout_s)
    dtype = dtype or read_arch_dtype(store, step)
    torch_dtype = getattr(torch, dtype) if dtype else next(iter(state.values())).dtype
    model = build_model(config, dtype=torch_dtype, init=False)
    expected = model.state_dict()
    for name, t in expected.items():
        if name not in state or tuple(state[name].shape) != tuple(t.shape):
            got = list(state[name].shape) if name in state else "absent"
            raise CheckpointError(f"{store.step_path(step)}: {name!r} is {got} in the checkpoint, "
                                  f"{list(t.shape)} per its {ARCH_FILE}")
    model.load_state_dict({n: state[n] for n in expected}, strict=True)
    warn = warn or log.warning
    if any(state[n].any() for n in expected if n.endswith("expert_bias")):  # save_pretrained drops it
        warn("the policy routes with an aux-loss-free expert bias, which the Hugging Face format has no place for: "
             "the exported model routes without it")
    model.tie_weights()
    out = Path(out_dir)
    if source is not None:
        extra = serving_files(source, source)
    else:
        prefix = SERVING_DIR + "/"
        where = store.step_path(step)  # every key is checked (again) before anything is written
        targets = {n[len(prefix):]: inside(out, n[len(prefix):], where) for n in sorted(files) if n.startswith(prefix)}
        extra = {name: store.read_bytes(step, f"{prefix}{name}") for name in targets}
    save_pretrained(model, out_dir)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    progress(f"wrote {out_dir}: config.json and {_mib(weights)} of safetensors")
    for name, data in extra.items():
        path = inside(out, name, str(out))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if extra:
        progress(f"copied {len(extra)} serving files, {_mib(sum(map(len, extra.values())))}: {', '.join(extra)}")
    if not any(n in extra for n in TOKENIZER_FILES):
        warn(f"{out_dir}: no tokenizer files {'given' if source else 'in the checkpoint'} (the run used no tokenizer "
             "directory): AutoTokenizer cannot load it; `moerl export --source MODEL_DIR` adds them")
    return Path(out_dir)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
