"""Hugging Face checkpoint I/O: config.json + safetensors in the Hub's per-expert key layout.

On disk each expert is three matrices (`mlp.experts.{e}.gate_proj.weight` [I, D], `up_proj` [I, D],
`down_proj` [D, I]); in memory they are stacked and fused as transformers 5 keeps them
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]). Checkpoints already in the
fused layout load too. With expert parallelism a rank reads only its own experts' tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from moerl.ep import make_dispatcher
from moerl.model.build import build_model
from moerl.model.config import CheckpointError, MoEModelConfig
from moerl.model.transformer import MoECausalLM

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_INDEX_FILE = "model.safetensors.index.json"


def read_config(path: str | Path) -> MoEModelConfig:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_file}: not valid JSON ({e})") from e
    return MoEModelConfig.from_hf_dict(raw, source=str(config_file))


def read_stop_token_ids(path: str | Path) -> tuple[int, ...]:
    """The ids that end generation for a checkpoint: `eos_token_id` of its generation_config.json (an int or a
    list: chat models list `<|im_end|>` and `<|endoftext|>`), else of its config.json; () when neither has one."""
    directory = Path(path)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from e
        eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise CheckpointError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
        return tuple(dict.fromkeys(ids))
    return ()


def _open(f: Path):
    """safe_open, with an unreadable file reported as a CheckpointError naming it."""
    try:
        return safe_open(str(f), framework="pt")
    except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
        raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e


def _file_keys(f: Path) -> list[str]:
    with _open(f) as handle:
        return list(handle.keys())


def _key_to_file(path: Path) -> dict[str, Path]:
    """Map every tensor key to the safetensors file that holds it (sharded or not)."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (JSON object with a weight_map)") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        missing_files = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing_files:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing_files}")
        for f in sorted(set(weight_map.values())):
            absent = sorted(set(k for k, v in weight_map.items() if v == f) - set(_file_keys(path / f)))
            if absent:
                raise CheckpointError(f"{index} places {_describe(absent)} in {f}, which does not hold them")
        return {k: path / f for k, f in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    key_to_file: dict[str, Path] = {}
    for f in files:
        key_to_file.update({k: f for k in _file_keys(f)})
    return key_to_file


def _describe(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return f"{shown} (+{len(keys) - limit} more)" if len(keys) > limit else shown


def load_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    expert_parallel_group: dist.ProcessGroup | None = None,
    dispatcher: str = "auto",
    capacity_factor: float = 0.0,
) -> MoECausalLM:
    """Load a `qwen3_moe` checkpoint directory into a moerl model (this rank's experts only under EP)."""
    path = Path(path)
    config = read_config(path)
    model = build_model(
        config, dtype=dtype, device=device, expert_parallel_group=expert_parallel_group,
        dispatcher=dispatcher, capacity_factor=capacity_factor, init=False,
    )
    key_to_file = _key_to_file(path)
    state = model.state_dict()
    expected = _expected_keys(state, config)
    per_expert = _match_keys(path, config, expected, key_to_file)
    handles = {f: _open(f) for f in set(key_to_file.values())}
    with torch.no_grad():
        for name, param in state.items():
            if name not in expected:
                continue
            if name.endswith(".experts.gate_up_proj") or name.endswith(".experts.down_proj"):
                tensor = _read_experts(name, model, key_to_file, handles, per_expert, path)
            else:
                tensor = handles[key_to_file[name]].get_tensor(name)
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {list(tensor.shape)}, the config.json implies {list(param.shape)}"
                )
            param.copy_(tensor.to(param.dtype))
    model.tie_weights()
    return model


def _expected_keys(state: dict[str, torch.Tensor], config: MoEModelConfig) -> set[str]:
    """The tensors a checkpoint must provide (the expert bias is moerl's own; a tied lm_head is the embedding)."""
    expected = {k for k in state if not k.endswith("expert_bias")}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    return expected


def _match_keys(path: Path, config: MoEModelConfig, expected: set[str], disk_keys) -> set[str]:
    """Raise CheckpointError naming missing and unexpected tensors; returns the expert prefixes stored per
    expert on disk (`model.layers.{i}.mlp.experts`), the others being fused on disk."""
    per_expert = {m.group(1) for k in disk_keys if (m := _EXPERT_KEY.match(k))}
    provided, unexpected_expert_keys = set(), []
    for key in disk_keys:
        m = _EXPERT_KEY.match(key)
        if m and int(m.group(2)) >= config.num_experts:  # an expert id past num_experts in config.json
            unexpected_expert_keys.append(key)
            continue
        provided.add(f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}" if m else key)
    if config.tie_word_embeddings:
        provided.discard("lm_head.weight")
    missing, unexpected = sorted(expected - provided), sorted(provided - expected) + sorted(unexpected_expert_keys)
    if missing or unexpected:
        parts = [f"missing keys: {_describe(missing)}" if missing else "",
                 f"unexpected keys: {_describe(unexpected)}" if unexpected else ""]
        raise CheckpointError(f"{path}: checkpoint does not match the qwen3_moe architecture in its config.json; "
                              + "; ".join(p for p in parts if p))
    return per_expert


def check_pretrained(path: str | Path) -> MoEModelConfig:
    """What `load_pretrained` checks, without reading a tensor: config.json, the index, every safetensors
    header (and that each file is as long as its header says), and every tensor's name and shape against
    config.json's architecture (a model built on the meta device: no memory). Returns the architecture."""
    path = Path(path)
    config = read_config(path)
    with torch.device("meta"):
        model = MoECausalLM(config, dispatcher=make_dispatcher("local", config.num_experts))
    state = model.state_dict()
    key_to_file = _key_to_file(path)
    _match_keys(path, config, _expected_keys(state, config), key_to_file)
    shapes = {}
    for f in sorted(set(key_to_file.values())):
        with _open(f) as handle:
            shapes.update((k, list(handle.get_slice(k).get_shape())) for k, v in key_to_file.items() if v == f)
    D, I = config.hidden_size, config.moe_intermediate_size
    order = {name: i for i, name in enumerate(state)}

    def load_order(key: str) -> tuple[int, int, int]:  # load_pretrained's: the first bad tensor is the same one
        m = _EXPERT_KEY.match(key)
        if not m:
            return order[key], 0, 0
        fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"
        return order[fused], int(m.group(2)), ("gate_proj", "up_proj", "down_proj").index(m.group(3))

    for key in sorted(shapes, key=load_order):
        m = _EXPERT_KEY.match(key)
        want = ([D, I] if m.group(3) == "down_proj" else [I, D]) if m else list(state[key].shape)
        if shapes[key] != want:
            raise CheckpointError(f"{path}: tensor {key!r} has shape {shapes[key]}, the config.json implies {want}")
    return config


def _read_experts(
    name: str, model: MoECausalLM, key_to_file, handles, per_expert_prefixes: set[str], path: Path
) -> torch.Tensor:
    prefix, which = name.rsplit(".", 1)
    block = model.get_submodule(prefix.rsplit(".", 1)[0])
    local = range(block.dispatcher.num_experts)[block.dispatcher.local_expert_slice]
    if prefix not in per_expert_prefixes:  # already fused on disk: slice this rank's experts
        return handles[key_to_file[name]].get_slice(name)[local.start : local.stop]
    D, I = model.config.hidden_size, model.config.moe_intermediate_size
    parts = []
    for e in local:
        names = [f"{prefix}.{e}.down_proj.weight"] if which == "down_proj" else [
            f"{prefix}.{e}.gate_proj.weight", f"{prefix}.{e}.up_proj.weight"
        ]
        absent = [n for n in names if n not in key_to_file]
        if absent:
            raise CheckpointError(f"{path}: checkpoint is missing expert tensor(s): {_describe(absent)}")
        tensors = []
        for n in names:
            tensor = handles[key_to_file[n]].get_tensor(n)
            want = [D, I] if which == "down_proj" else [I, D]
            if list(tensor.shape) != want:
                raise CheckpointError(
                    f"{path}: tensor {n!r} has shape {list(tensor.shape)}, the config.json implies {want}"
                )
            tensors.append(tensor)
        parts.append(torch.cat(tensors, dim=0))
    return torch.stack(parts)


def save_pretrained(model: MoECausalLM, path: str | Path, *, max_shard_bytes: int = 4 << 30) -> None:
    """Write config.json and safetensors (Hub per-expert layout, sharded past `max_shard_bytes`).

    Under expert parallelism every rank must call this: rank 0 gathers all experts and writes.
    """
    path = Path(path)
    tensors = _hf_state_dict(model)
    if dist.is_initialized() and any(b.dispatcher.world_size > 1 for b in model.moe_blocks):
        raise NotImplementedError("save_pretrained of an expert-parallel model: gather to one rank first")
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf_dict()
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / _INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _hf_state_dict(model: MoECausalLM) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    I = model.config.moe_intermediate_size
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        if key.endswith("expert_bias") or (key == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        if key.endswith(".experts.gate_up_proj"):
            prefix = key.rsplit(".", 1)[0]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :I].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, I:].clone()
        elif key.endswith(".experts.down_proj"):
            prefix = key.rsplit(".", 1)[0]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[key] = tensor
    return out
