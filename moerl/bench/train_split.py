"""Where an optimizer step's time goes, for `moerl bench train`: attention and expert GEMMs forward and backward,
router/dispatch, log-probs, norms and elementwise, recompute, optimizer, communication, other, idle.

Method. One extra optimizer step of ours (after the timed ones, same samples) runs under torch.profiler (CUDA
activity on a GPU, CPU ops on a CPU). Each kernel (each CPU op on a CPU run) gets a phase and a part from the
CPU op that launched it, walking up its profiler parents:
  - forward: inside a module's range (forward hooks open `TAG + part`, moerl/bench/step_split.py's
    `label_modules`) or a named range (the chunked log-prob Function, the optimizer step);
  - backward: inside an autograd node (`MmBackward0`, ...): the part is that of the forward op that created the
    node (the profiler gives both the same sequence number and thread), so a GEMM's backward lands in attention
    or experts as its forward did;
  - recompute: a module range opened INSIDE an autograd node: activation checkpointing re-runs each decoder
    layer's forward during backward, and the forward hooks fire again there. Every decoder layer's `_forward`
    is labelled too, so its residual adds count as recompute as well.
Then `classify` (step_split's: a specific name rule, else the part, else a generic name rule) with this file's
`RULES`; attention and expert GEMMs are split by phase; recompute is one row, whatever its kernels.
Device rows are kernel time; idle = the timed step's wall - device busy time. On a CPU the rows are op self time
and idle = the profiled step's wall - op time (the host's Python between ops).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from moerl.bench.step_split import NEUTRAL, TAG, Rule, classify, compile_rules, label_modules, table_rows, wrap

ROWS = ("attention fwd", "attention bwd", "expert GEMMs fwd", "expert GEMMs bwd", "router/dispatch", "log-probs",
        "norms/elementwise", "recompute", "optimizer", "communication", "other", "unclassified")
CAPTIONS = {
    "attention fwd": "flash/SDPA, q/k/v/o GEMMs, rope, q/k norms",
    "attention bwd": "their backward",
    "expert GEMMs fwd": "grouped GEMMs, SwiGLU",
    "expert GEMMs bwd": "their backward",
    "router/dispatch": "router GEMM, softmax/top-k, sort, permute/combine (fwd+bwd)",
    "log-probs": "chunked lm_head + log-softmax (fwd+bwd)",
    "norms/elementwise": "RMSNorm, residual adds, loss, casts outside modules",
    "recompute": "checkpointed layers' forward re-run in backward",
    "optimizer": "AdamW, grad clip, master-weight casts, fp32 grad accumulation",
    "communication": "nccl/gloo collectives",
    "other": "embedding, copies, memsets, GEMMs outside modules",
    "unclassified": "no rule, no part",
}
# Parts: what a module range, a named CPU range or the trainer's level says. Names, not imports (as step_split).
SCOPES: dict[str, str] = {
    "RMSNorm": "norms/elementwise", "TopKRouter": "router/dispatch", "GroupedExperts": "expert GEMMs",
    "Attention": "attention", "RotaryEmbedding": "attention", "SparseMoEBlock": "router/dispatch",
    "DenseMLP": "expert GEMMs", "Embedding": "other",
}
SCOPE_METHODS: dict[str, tuple[str, ...]] = {"RMSNorm": ("add_and_norm",)}
NAMED: tuple[tuple[str, str], ...] = (  # CPU range name pattern -> part
    (r"^_ChunkedLogprobs(Backward)?$", "log-probs"),  # the custom Function's forward and its autograd node
    (r"^Optimizer\.", "optimizer"), (r"AccumulateGrad", "optimizer"),  # into the float32 master grads
)
TRAINER = "trainer"  # ops of the step outside the model (casts, loss): a copy there is a master-weight cast
TRAINER_COPY = re.compile(r"copy", re.IGNORECASE)
PHASED = ("attention", "expert GEMMs")

# First match wins within each tier (step_split.classify); case is ignored. CUDA kernel names and aten ops.
RULES: tuple[Rule, ...] = (
    Rule("communication", r"nccl|gloo|c10d::|all_?reduce|reduce_?scatter|all_?gather|all_?to_?all", True),
    Rule("optimizer", r"multi_tensor_apply|adamw?|_foreach_|linalg_vector_norm", True),
    Rule("expert GEMMs", r"grouped_mm|GroupProblemShape|grouped_gemm|moe_gemm|fused_moe|swiglu|^_down_kernel$|"
                         r"_gate_up", True),
    Rule("attention", r"flash|fmha|attention|sdpa|paged_decode", True),
    Rule("norms/elementwise", r"rms_?norm|layer_?norm|triton_\w*fused\w*rsqrt", True),
    Rule("router/dispatch", r"router|combine|ExpandTokens|moe_align|_align_(count|scatter)|gather_weighted_sum|"
                            r"moe_(permute|unpermute|sum)", True),
    Rule("router/dispatch", r"topk|softmax|sort|index_select|indexselect|gather|scatter|index_put|index_add|cumsum|"
                            r"devicescan|bincount|histc|permute|aten::index$", False),
    # autograd's own host ranges (a CPU run) and GEMMs, copies, memsets outside any part
    Rule("other", r"autograd::engine|Backward\d*$|^detach_?$|gemm|xmma|nvjet|cublas|"
                  r"aten::(mm|addmm|bmm|linear|matmul)$|memcpy|memset|embedding", False),
    Rule("expert GEMMs", r"cutlass", False),  # a CUTLASS kernel without GEMM in its name: torch's grouped GEMM
    Rule("norms/elementwise", r"elementwise|reduce_kernel|copy|fill|catarray|triton_(poi|red|per)_|"
                              r"aten::(add|sub|mul|div|neg|pow|rsqrt|mean|sum|exp|log|where|clamp|minimum|maximum|"
                              r"silu|sigmoid|cat|stack|to|_to_copy|empty\w*|zeros|ones|new_zeros|arange|view|"
                              r"reshape|slice|select|narrow|as_strided|unsqueeze|squeeze|transpose|t|expand|"
                              r"contiguous|clone|item|_local_scalar_dense|detach|alias|ne|eq|lt|ge|gt|bitwise_and|"
                              r"__and__|diff|repeat_interleave|flatten|_unsafe_view|_reshape_alias|resolve_\w+)_?$",
         False),
)
_COMPILED = compile_rules(RULES)
_NAMED = tuple((re.compile(p), part) for p, part in NAMED)


def row_of(name: str, phase: str, part: str | None) -> str:
    """The table row of a kernel (or op) `name` launched in `phase` (fwd, bwd, recompute) inside `part`."""
    if phase == "recompute" and classify(name, None, _COMPILED) != "communication":
        return "recompute"
    if part == TRAINER:
        part = "optimizer" if TRAINER_COPY.search(name) else None
    category = classify(name, part, _COMPILED)
    if category in PHASED:
        backward = phase == "bwd" or re.search(r"bwd|backward", name, re.IGNORECASE)
        return f"{category} {'bwd' if backward else 'fwd'}"
    return category


def _is_autograd_node(evt) -> bool:
    # backward nodes carry the forward op's sequence number and thread; AccumulateGrad has neither
    return evt.name.startswith("autograd::engine::evaluate_function") or (
        evt.fwd_thread > 0 and evt.sequence_nr >= 0)


def context(evt, forward_parts: dict | None) -> tuple[str, str | None]:
    """(phase, part) of a CPU op, from its parents; forward_parts: (thread, sequence number) -> part of the
    forward ops (None while building it: then backward parts are left None)."""
    part, labelled = None, False
    node = evt
    while node is not None:
        name = node.name
        if name.startswith(TAG):
            labelled = True
            part = part or (None if name[len(TAG):] == NEUTRAL else name[len(TAG):])
        elif part is None:
            part = next((p for pattern, p in _NAMED if pattern.search(name)), None)
        if _is_autograd_node(node):
            if labelled:
                return "recompute", part
            if part is None and forward_parts is not None and node.sequence_nr >= 0:
                part = forward_parts.get((node.fwd_thread, node.sequence_nr))
            return "bwd", part
        node = node.cpu_parent
    return "fwd", part or TRAINER


@dataclass
class TrainSplit:
    """Time per optimizer step by row (ms) from one profiled step."""

    ms: dict[str, float]
    launches: dict[str, float]  # kernels (ops) per step
    unclassified: list[tuple[str, float]]  # the top names no rule or part claimed, ms
    on_cuda: bool
    profiled_wall_ms: float  # the profiled step's wall, profiler on
    phases_s: dict[str, float]  # seconds measuring took: profiling, reading
    top_names: dict[str, list[tuple[str, float]]] = dataclasses.field(default_factory=dict)  # row -> (name, ms)

    @property
    def busy_ms(self) -> float:
        return sum(self.ms.values())


@contextlib.contextmanager
def labelled(trainer) -> Iterator[None]:
    """Module ranges (forward hooks) and a neutral range around each decoder layer's `_forward` (what the
    checkpoint re-runs: its residual adds are recompute too) and the model's forward; removed after."""
    model = trainer.model
    with label_modules(model, SCOPES, SCOPE_METHODS):
        patched = []
        try:
            patched.append(wrap(model, "forward_logprobs", None))
            for layer in model.model.layers:
                patched.append(wrap(layer, "_forward", None))
            yield
        finally:
            for owner, attr in patched:
                delattr(owner, attr)


def split_from_events(events, on_cuda: bool, by_name: dict | None = None) -> tuple[dict, dict, dict]:
    """(ms per row, launches per row, ms per unclassified name) of one step, from profiler events; `by_name`
    (row -> Counter of ms per kernel name) is filled when given.

    CUDA: every device event counts; a kernel name's time is shared among the rows of the ops that launched it
    in the proportions the CPU-side links show (a kernel linked to no op goes by its name alone, as forward).
    CPU: each op's self time in its row."""
    ms: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, float] = collections.defaultdict(float)
    unclassified: dict[str, float] = collections.defaultdict(float)
    cpu = torch.autograd.DeviceType.CPU
    cpu_ops = [e for e in events if e.device_type == cpu and not e.name.startswith(TAG) and not e.is_user_annotation]
    forward_parts: dict[tuple[int, int], str | None] = {}
    for evt in events:  # in start order: an outer op before the ops it calls
        if evt.device_type == cpu and evt.sequence_nr >= 0 and evt.fwd_thread <= 0:
            phase, part = context(evt, None)
            if phase == "fwd":
                forward_parts.setdefault((evt.thread, evt.sequence_nr), part)

    def add(name: str, row: str, us: float, count: float) -> None:
        ms[row] += us / 1e3
        launches[row] += count
        if by_name is not None:
            by_name.setdefault(row, collections.Counter())[name] += us / 1e3
        if row == "unclassified":
            unclassified[name] += us / 1e3

    if not on_cuda:
        for evt in cpu_ops:
            add(evt.name, row_of(evt.name, *context(evt, forward_parts)), evt.self_cpu_time_total, 1)
        return ms, launches, unclassified
    shares: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for evt in cpu_ops:
        if evt.kernels:
            phase, part = context(evt, forward_parts)
            for k in evt.kernels:
                shares[k.name][row_of(k.name, phase, part)] += max(k.duration, 1e-3)
    for evt in events:
        if evt.device_type == cpu or evt.name.startswith(TAG) or evt.is_user_annotation:
            continue
        us = evt.time_range.end - evt.time_range.start
        by_row = shares.get(evt.name) or {row_of(evt.name, "fwd", None): 1.0}
        whole = sum(by_row.values())
        for row, part in by_row.items():
            add(evt.name, row, us * part / whole, part / whole)
    return ms, launches, unclassified


def measure(trainer, samples: list, device: torch.device, top: int = 0) -> TrainSplit:
    """Profile one optimizer step of `trainer` on `samples` (a step is taken: call it after the timed ones);
    `top` kernel names per row are kept for the table."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    start = time.perf_counter()
    with labelled(trainer), profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.rl_step(samples)
        if on_cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    phases = {"profiling": time.perf_counter() - start}
    by_name: dict[str, collections.Counter] = {}
    ms, launches, unclassified = split_from_events(prof.events(), on_cuda, by_name)
    phases["reading the profile"] = time.perf_counter() - start - phases["profiling"]
    worst = sorted(unclassified.items(), key=lambda kv: -kv[1])[:3]
    names = {row: c.most_common(top) for row, c in by_name.items() if row != "unclassified"} if top else {}
    return TrainSplit(dict(ms), dict(launches), worst, on_cuda, wall * 1e3, phases, names)


def format_split(split: TrainSplit, step_ms: float) -> str:
    """The table: ms per step, share of the step and kernels per step for each row, then idle and the step."""
    cost = (f"measured in {sum(split.phases_s.values()):.1f} s ("
            + ", ".join(f"{v:.1f} {k}" for k, v in split.phases_s.items()) + ")")
    if split.on_cuda:
        unit, what = "kernels", "device kernel time"
        idle_why = f"the timed step's wall {step_ms:.1f} ms - device busy {split.busy_ms:.1f} ms"
    else:
        step_ms, unit, what = split.profiled_wall_ms, "ops", "op self time (CPU)"
        idle_why = f"the profiled step's wall {step_ms:.1f} ms - op time {split.busy_ms:.1f} ms (the host's Python)"
    head = (f"\noptimizer step split: {what} of one profiled step; each {unit[:-1]} by its name, its module and "
            f"its phase (moerl/bench/train_split.py; the profiled step took {split.profiled_wall_ms:.1f} ms); {cost}")
    lines = [head] + table_rows(ROWS, CAPTIONS, split.ms, split.launches, split.unclassified, step_ms, unit, 18, 10, 2)
    idle_ms = step_ms - split.busy_ms
    lines.append(f"  {'idle':18} {idle_ms:10.2f} {100 * idle_ms / step_ms:7.1f}% {'':13}  {idle_why}")
    lines.append(f"  {'step':18} {step_ms:10.2f} {100.0:7.1f}%")
    if split.top_names:
        lines.append(f"\ntop {unit} of each row over 3% of the step (ms/step):")
        for row in ROWS:
            if split.ms.get(row, 0.0) > 0.03 * step_ms:
                lines.append(f"  {row}: " + "; ".join(f"{v:.1f} {n[:70]}" for n, v in split.top_names.get(row, [])))
    return "\n".join(lines)
