"""Where a decode step's time goes, for `moerl bench rollout`: experts, attention, dense GEMMs, norms, router,
dispatch, sampling, other device work, unclassified, and the host.

Method. A few decode steps run eagerly (CUDA graphs off on the same engine, at the batch and mean context of
the timed run) under torch.profiler. Each kernel (each CPU op on a CPU run) is put in a category:
  1. by its name, where the name says what it is (`RULES` with specific=True: fused MoE, paged decode, RMSNorm,
     router and dispatch kernels, whoever launches them);
  2. else by the model module it ran in (`SCOPES`: the innermost labelled module or engine method, from
     profiler ranges that forward hooks open for the profiled steps only);
  3. else by a generic name rule (specific=False: a GEMM, a sort, an elementwise kernel outside any module);
  4. else "unclassified", whose top names the table prints: the next rule to write.
Device rows are kernel time per step; host = the timed run's decode step wall (under CUDA graphs when they
ran) minus the device busy time per step. On a CPU the ops run on the host: the rows are op self time and
there is no host row.
"""

from __future__ import annotations

import collections
import contextlib
import re
import time
from dataclasses import dataclass
from typing import Iterator

import torch

CATEGORIES = ("experts", "attention", "dense GEMMs", "norms", "router", "dispatch", "sampling", "other",
              "unclassified")
CAPTIONS = {
    "experts": "expert GEMMs, SwiGLU, fused MoE",
    "attention": "paged decode/flash, q/k/v/o, rope, KV write",
    "dense GEMMs": "lm_head, dense MLPs, GEMMs outside modules",
    "norms": "RMSNorm (q/k norms included)",
    "router": "router GEMM, softmax, top-k",
    "dispatch": "sort, permute, gather/scatter, combine",
    "sampling": "logits to tokens",
    "other": "inputs, residual adds, embedding, copies",
    "unclassified": "no rule, no module",
}


@dataclass(frozen=True)
class Rule:
    category: str
    pattern: str  # a regular expression searched in the kernel (or CPU op) name
    specific: bool  # the name alone decides, even inside another category's module


# First match wins within each tier; case is ignored. Names are CUDA kernels as the profiler shows them
# (torch's, cuBLAS', CUTLASS', our Triton kernels' function names) and aten ops on a CPU run.
RULES: tuple[Rule, ...] = (
    # moerl/kernels/triton_fused_moe.py's kernels: _gate_up_swiglu_kernel, _down_kernel, _align_{count,scatter}_kernel
    Rule("experts", r"fused_moe|grouped_mm|GroupProblemShape|grouped_gemm|moe_gemm|swiglu|^_down_kernel$", True),
    Rule("attention", r"paged_decode|flash|fmha|attention|sdpa", True),
    Rule("norms", r"rms_?norm|layer_?norm|triton_\w*fused\w*rsqrt", True),  # Inductor names its fused ops
    Rule("router", r"router", True),
    Rule("dispatch", r"moe_align|_align_(count|scatter)_kernel|gather_weighted_sum|moe_permute|moe_unpermute|moe_sum|ExpandTokens|combine", True),
    Rule("sampling", r"gumbel|multinomial", True),
    Rule("router", r"topk", False),  # before "gather": torch's top-k kernel is sbtopk::gatherTopK
    Rule("sampling", r"log_?softmax|argmax", False),  # the vocabulary log-softmax; the router's is a softmax
    Rule("router", r"softmax", False),
    Rule("dense GEMMs", r"gemm|xmma|nvjet|cublas|aten::(mm|addmm|bmm|linear|matmul)$", False),
    Rule("experts", r"cutlass", False),  # a CUTLASS kernel without GEMM in its name: torch's grouped GEMM
    Rule("dispatch", r"sort|index_select|indexselect|gather|scatter|index_put|index_add|cumsum|devicescan|bincount|"
                     r"histc|permute", False),
    Rule("other", r"elementwise|reduce_kernel|copy|memcpy|memset|fill|catarray|embedding|triton_(poi|red|per)_|"
                  r"aten::(add|sub|mul|div|where|cat|to|_to_copy|empty\w*|zeros|ones|arange|view|reshape|slice|select|"
                  r"as_strided|unsqueeze|squeeze|transpose|expand|contiguous|clone|item|_local_scalar_dense|"
                  r"resolve_conj|resolve_neg|lift_fresh|detach|alias)_?$", False),
)


def compile_rules(rules: tuple[Rule, ...]) -> tuple[tuple[Rule, re.Pattern], ...]:
    """A rule table ready for `classify` (bench train's split has its own table: moerl/bench/train_split.py)."""
    return tuple((r, re.compile(r.pattern, re.IGNORECASE)) for r in rules)


_COMPILED = compile_rules(RULES)

# Module class names (or a module's attribute name) -> category; names, not imports, so a renamed class
# degrades to the name rules instead of breaking the bench.
SCOPES: dict[str, str] = {
    "RMSNorm": "norms", "TopKRouter": "router", "GroupedExperts": "experts", "Attention": "attention",
    "RotaryEmbedding": "attention", "SparseMoEBlock": "dispatch", "DenseMLP": "dense GEMMs",
    "Embedding": "other", "lm_head": "dense GEMMs",
}
# Methods called directly (not through the module's __call__, so no hook sees them) that run in their module's
# category: the decoder layer calls the residual add + norm this way.
SCOPE_METHODS: dict[str, tuple[str, ...]] = {"RMSNorm": ("add_and_norm",)}
# Engine methods around the forward: decode_forward = plan + forward + sampling, so what it runs outside the
# plan and the forward is sampling; the forward itself is neutral (its modules label their own ops).
ENGINE_SCOPES: dict[str, str | None] = {"decode_inputs": "other", "decode_forward": "sampling", "forward": None}
TAG = "moerl.split::"
NEUTRAL = "-"


def classify(name: str, scope: str | None = None, rules: tuple[tuple[Rule, re.Pattern], ...] = _COMPILED) -> str:
    """The category of a kernel or op called `name` that ran inside a module of category `scope` (None: none):
    a specific name rule, else the scope, else a generic name rule, else "unclassified"."""
    generic = None
    for rule, pattern in rules:
        if pattern.search(name):
            if rule.specific:
                return rule.category
            generic = generic or rule.category
    return scope or generic or "unclassified"


@dataclass
class Split:
    """Time per decode step by category (ms), from `steps` profiled eager steps."""

    ms: dict[str, float]
    launches: dict[str, float]  # kernels (ops) per step
    unclassified: list[tuple[str, float]]  # the top names no rule or module claimed, ms per step
    steps: int
    rows: int
    context: int
    on_cuda: bool
    eager_wall_ms: float  # per step, profiler on
    phases_s: dict[str, float]  # seconds measuring took: reaching the mean context, profiling (start/stop in), reading

    @property
    def busy_ms(self) -> float:
        return sum(self.ms.values())


@contextlib.contextmanager
def labelled(engine) -> Iterator[None]:
    """Profiler ranges around the model's labelled modules and the engine's decode methods, removed after."""
    with label_modules(engine.model, SCOPES, SCOPE_METHODS):
        patched = []
        try:
            for attr, category in ENGINE_SCOPES.items():
                patched.append(wrap(engine, attr, category))
            yield
        finally:
            for owner, attr in patched:
                delattr(owner, attr)


@contextlib.contextmanager
def label_modules(model: torch.nn.Module, scopes: dict[str, str],
                  methods: dict[str, tuple[str, ...]]) -> Iterator[None]:
    """A profiler range `TAG + category` around each call of a module whose class name (or attribute name) is in
    `scopes`, opened and closed by forward hooks, and around its `methods`; all removed after."""
    handles, patched = [], []  # patched: (object, attribute) shadowed by an instance attribute, deleted after

    def open_close(category: str | None):
        stack: list = []
        name = TAG + (category or NEUTRAL)

        def pre(*_):
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            stack.append(rf)

        def post(*_):
            if stack:
                stack.pop().__exit__(None, None, None)
        return pre, post

    try:
        for path, module in model.named_modules():
            category = scopes.get(type(module).__name__) or scopes.get(path.rsplit(".", 1)[-1])
            if category:
                pre, post = open_close(category)
                handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
                for attr in methods.get(type(module).__name__, ()):
                    if hasattr(module, attr):
                        patched.append(wrap(module, attr, category))
        yield
    finally:
        for h in handles:
            h.remove()
        for owner, attr in patched:
            delattr(owner, attr)


def wrap(owner, attr: str, category: str | None) -> tuple[object, str]:
    """Shadow owner's method `attr` with an instance attribute that runs it inside a labelled range."""
    inner = getattr(owner, attr)
    name = TAG + (category or NEUTRAL)

    def wrapped(*a, **k):
        with torch.autograd.profiler.record_function(name):
            return inner(*a, **k)
    object.__setattr__(owner, attr, wrapped)  # not nn.Module's __setattr__: a plain instance attribute
    return owner, attr


def _scope_of(evt) -> str | None:
    """The category of the innermost labelled range around (or equal to) a profiler event."""
    node = evt
    while node is not None:
        if node.name.startswith(TAG):
            category = node.name[len(TAG):]
            return None if category == NEUTRAL else category
        node = node.cpu_parent
    return None


def split_from_events(events, steps: int, on_cuda: bool) -> tuple[dict, dict, dict]:
    """(ms per category, launches per category, ms per unclassified name), per step, from profiler events.

    CUDA: every device event (kernels, copies, memsets) counts; a kernel name's time is shared among the
    modules that launched it in the proportions the CPU-side links show (a kernel the profiler linked to no
    op goes by its name alone). CPU: each op's self time, in the module it ran in."""
    ms: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, float] = collections.defaultdict(float)
    unclassified: dict[str, float] = collections.defaultdict(float)
    cpu = torch.autograd.DeviceType.CPU

    def add(name: str, scope: str | None, us: float, count: float) -> None:
        category = classify(name, scope)
        ms[category] += us / 1e3 / steps
        launches[category] += count / steps
        if category == "unclassified":
            unclassified[name] += us / 1e3 / steps

    if not on_cuda:
        for evt in events:
            if evt.device_type == cpu and not evt.name.startswith(TAG) and not evt.is_user_annotation:
                add(evt.name, _scope_of(evt.cpu_parent), evt.self_cpu_time_total, 1)
        return ms, launches, unclassified
    shares: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for evt in events:
        if evt.device_type == cpu:
            for k in evt.kernels:
                shares[k.name][_scope_of(evt)] += max(k.duration, 1e-3)
    for evt in events:
        if evt.device_type == cpu or evt.name.startswith(TAG) or evt.is_user_annotation:
            continue
        us = evt.time_range.end - evt.time_range.start
        by_scope = shares.get(evt.name) or {None: 1.0}
        whole = sum(by_scope.values())
        for scope, part in by_scope.items():
            add(evt.name, scope, us * part / whole, part / whole)
    return ms, launches, unclassified


def measure(engine, prompts: list[list[int]], new_tokens: int, temperature: float, steps: int = 3) -> Split:
    """Profile `steps` eager decode steps of `prompts` at about prompt + new_tokens / 2 positions (the timed
    run's mean context); decode up to there with the engine's own (graph) path. The engine is left empty."""
    from torch.profiler import ProfilerActivity, profile

    from moerl.rollout import SamplingParams

    device = engine.device
    on_cuda = device.type == "cuda"
    reach = max(1, min(new_tokens // 2, new_tokens - steps - 2))  # tokens before the profiled steps
    params = [SamplingParams(max_new_tokens=min(new_tokens, reach + steps + 2), temperature=temperature, seed=i)
              for i in range(len(prompts))]
    start = time.perf_counter()
    ids = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
    graphs = engine.graphs
    try:
        done = collections.Counter()
        while engine.has_unfinished() and min(done[i] for i in ids) < reach:
            for out in engine.step():
                done[out.request_id] += len(out.new_token_ids)
        phases = {"decode to the mean context": time.perf_counter() - start}
        engine.graphs = None  # eager: every kernel launched (and visible) on its own
        engine.step()  # warm the eager path at this batch (allocator, Triton's launch cache)
        rows = len(engine.running)
        context = round(sum(len(engine.by_id[i].tokens) for i in ids if i in engine.by_id) / max(rows, 1))
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
        before = engine.stats["decode_steps"]
        with labelled(engine), profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                if engine.has_unfinished():
                    engine.step()
            if on_cuda:
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
        n = engine.stats["decode_steps"] - before
        if n == 0:
            raise RuntimeError(f"no decode step left to profile at {new_tokens} new tokens")
    finally:
        engine.graphs = graphs
        while engine.has_unfinished():
            engine.step()
    phases["profiling"] = time.perf_counter() - start - sum(phases.values())
    ms, launches, unclassified = split_from_events(prof.events(), n, on_cuda)
    phases["reading the profile"] = time.perf_counter() - start - sum(phases.values())
    top = sorted(unclassified.items(), key=lambda kv: -kv[1])[:3]
    return Split(dict(ms), dict(launches), top, n, rows, context, on_cuda, wall / n * 1e3, phases)


def format_split(split: Split, step_ms: float, graphs: bool) -> str:
    """The table: ms per step and share of the step for each category, then the host row and the step."""
    cost = (f"measured in {sum(split.phases_s.values()):.1f} s ("
            + ", ".join(f"{v:.1f} {k}" for k, v in split.phases_s.items()) + ")")
    where = (f"{split.steps} eager steps profiled at {split.rows} rows, mean context {split.context}; each "
             f"{'kernel' if split.on_cuda else 'op'} by its name or the module that ran it (moerl/bench/step_split.py)")
    if split.on_cuda:
        host_ms, total_ms, unit = step_ms - split.busy_ms, step_ms, "kernels"
        mode = "CUDA-graph" if graphs else "eager"
        head = (f"\ndecode step split: device kernel time per step over {where}\n"
                f"host = the timed run's {mode} step wall {step_ms:.2f} ms - device busy {split.busy_ms:.2f} ms per "
                f"step (an eager step took {split.eager_wall_ms:.1f} ms with the profiler); {cost}")
    else:
        host_ms, total_ms, unit = None, split.busy_ms, "ops"
        head = (f"\ndecode step split (CPU): op self time per step over {where}\n"
                f"ops run on the host, so no host row; shares of the op time {split.busy_ms:.2f} ms (timed step "
                f"{step_ms:.2f} ms); {cost}")
    lines = [head] + table_rows(CATEGORIES, CAPTIONS, split.ms, split.launches, split.unclassified, total_ms, unit,
                                14, 9, 3)
    if host_ms is None:
        lines.append(f"  {'host':14} {'n/a':>9}")
        return "\n".join(lines)
    why = "the device waits on the host" if host_ms >= 0 else "negative: the eager kernels took longer than the step"
    lines.append(f"  {'host':14} {host_ms:9.3f} {100 * host_ms / total_ms:7.1f}% {'':13}  {why}")
    lines.append(f"  {'step':14} {step_ms:9.3f} {100.0:7.1f}%")
    return "\n".join(lines)


def table_rows(rows: tuple[str, ...], captions: dict[str, str], ms: dict[str, float], launches: dict[str, float],
               unclassified: list[tuple[str, float]], total_ms: float, unit: str, name_w: int, ms_w: int,
               digits: int) -> list[str]:
    """The header and one line per row (ms per step, share of total_ms, launches per step, caption), then the top
    unclassified names: the body both splits (this one and train_split's) print."""
    lines = [f"  {'part':{name_w}} {'ms/step':>{ms_w}} {'of step':>8} {unit + '/step':>13}  what"]
    for row in rows:
        v = ms.get(row, 0.0)
        lines.append(f"  {row:{name_w}} {v:{ms_w}.{digits}f} {100 * v / total_ms:7.1f}% {launches.get(row, 0):13.0f}  "
                     f"{captions[row]}")
    for name, v in unclassified:
        lines.append(f"  {'':{name_w}} {v:{ms_w}.{digits}f}  unclassified: {name[:90]}")
    return lines
