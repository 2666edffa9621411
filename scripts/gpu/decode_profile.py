"""Where one decode step's time goes, at a `moerl bench rollout` preset's shape (default Qwen3-30B-A3B, random
init drawn on the GPU, bf16), with every request decoding at temperature 1 (what RL decodes).

    python scripts/gpu/decode_profile.py --preset qwen3-30b-a3b --requests 256
    python scripts/gpu/decode_profile.py --preset qwen3-30b-a3b --requests 64 --steps 30 --trace /tmp/decode.json
    python scripts/gpu/decode_profile.py --device cpu --preset tiny --requests 4 --steps 3    # smoke test

It builds the engine, prefills `--requests` prompts of `--prompt-len` tokens, decodes `--warmup` steps (graph
capture), then prints:
  (a) the per-step time split: from one eager decode step with each part of the model in a labelled profiler
      range (attention projections, attention core, router/top-k, dispatch permute/combine, expert grouped GEMMs,
      lm_head, sampling, ...), the device time of each part; the graph-mode kernel time split by the same labels
      (each kernel name shared out as in the eager step); and in graph mode the wall time per step against the
      device's busy time: the difference is host time the device waits (bookkeeping between steps);
  (b) the top 25 CUDA kernels by total time over the profiled graph-mode steps;
  (c) the bytes one step must read (weights touched + KV) over the step's wall time and over the device-busy
      time: achieved bandwidth against the measured copy bandwidth and the 4.8 TB/s H200 datasheet peak;
  (d) the host side of a graph-mode step: the captured graph replayed alone (no host work between replays)
      against the whole step, and a cProfile of the steps (host ms per step by function; time inside a
      device-to-host copy is time the host waits for the device).
Self-contained: torch and this source tree (moerl need not be installed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a source tree, moerl not installed

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import moerl.rollout.engine as engine_module  # noqa: E402
from moerl.bench.common import measure_copy_bandwidth, synchronize  # noqa: E402
from moerl.bench.rollout import decode_step_bytes, random_model  # noqa: E402
from moerl.bench.rollout_workload import PRESETS, parameter_count  # noqa: E402
from moerl.model.layers import Attention, RMSNorm  # noqa: E402
from moerl.model.moe import GroupedExperts, SparseMoEBlock, TopKRouter  # noqa: E402
from moerl.rollout import Engine, EngineConfig, SamplingParams  # noqa: E402

TAG = "part::"  # prefix of our profiler ranges


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed and profiled")
    p.add_argument("--warmup", type=int, default=5, help="decode steps before timing (graph capture)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-graphs", action="store_true", help="profile eager decode only")
    p.add_argument("--trace", default="", help="also write the graph-mode profile as a Chrome trace here")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ labelled ranges
class Labels:
    """Profiler ranges around the model's parts (forward hooks) and the engine's sampling, for the eager step."""

    def __init__(self, model, engine: Engine) -> None:
        self.handles, self.patched = [], []
        dispatchers = {}  # one dispatcher may serve every MoE block: wrap it once
        for name, module in model.named_modules():
            label = self._label(name, module)
            if label:
                self._wrap_module(module, label)
            if isinstance(module, SparseMoEBlock):
                dispatchers[id(module.dispatcher)] = module.dispatcher
        for dispatcher in dispatchers.values():
            for method in ("dispatch", "combine"):
                self._wrap_attr(dispatcher, method, "dispatch permute/combine")
        self._wrap_attr(engine_module, "sample", "sampling")

    @staticmethod
    def _label(name: str, module) -> str | None:
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, RMSNorm):
            return "norms"
        if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return "attention projections"
        if isinstance(module, Attention):
            return "attention core (rope, KV write, SDPA)"
        if isinstance(module, TopKRouter):
            return "router/top-k"
        if isinstance(module, GroupedExperts):
            return "experts (grouped GEMMs, SwiGLU)"
        if isinstance(module, SparseMoEBlock):
            return "MoE block other (sort, counts)"
        if leaf == "lm_head":
            return "lm_head"
        if leaf == "embed_tokens":
            return "embedding"
        if leaf == "rotary":
            return "attention core (rope, KV write, SDPA)"
        if leaf == "mlp":
            return "dense MLP"
        return None

    def _wrap_module(self, module, label: str) -> None:
        stack: list = []

        def pre(*_):
            rf = record_function(TAG + label)
            rf.__enter__()
            stack.append(rf)

        def post(*_):
            stack.pop().__exit__(None, None, None)

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def _wrap_attr(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def wrapped(*a, **k):
            with record_function(TAG + label):
                return inner(*a, **k)

        had = attr in vars(owner)
        setattr(owner, attr, wrapped)
        self.patched.append((owner, attr, inner, had))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for owner, attr, inner, had in reversed(self.patched):
            if had:
                setattr(owner, attr, inner)
            else:
                delattr(owner, attr)  # the instance attribute that shadowed the class's method


def split_by_label(events, on_cuda: bool) -> tuple[dict[str, float], dict[str, collections.Counter]]:
    """Device time (CPU self time on a CPU run) per label, in us, attributing each op to its innermost labelled
    range; and per kernel name, its time per label (to share graph-mode kernels out the same way)."""
    per_label: dict[str, float] = collections.defaultdict(float)
    per_kernel: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CPU or evt.name.startswith(TAG):
            continue
        label, parent = "engine other (inputs, mask, copies)", evt.cpu_parent
        while parent is not None:
            if parent.name.startswith(TAG):
                label = parent.name[len(TAG):]
                break
            parent = parent.cpu_parent
        if on_cuda:
            for k in evt.kernels:
                per_label[label] += k.duration
                per_kernel[k.name][label] += k.duration
        else:
            per_label[label] += evt.self_cpu_time_total
    return per_label, per_kernel


# ------------------------------------------------------------------------------------------ graph-mode timeline
def device_kernels(events) -> list:
    """Kernels, copies and memsets on the device (not the device-side spans of our labelled ranges)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(TAG)]


def busy_and_gaps(kernels) -> tuple[float, float, list[float]]:
    """(union of kernel intervals, span first start to last end, idle gaps), in us."""
    spans = sorted((k.time_range.start, k.time_range.end) for k in kernels)
    busy, gaps = 0.0, []
    cur_s, cur_e = spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy, spans[-1][1] - spans[0][0], gaps


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("decode_profile: no CUDA device (use --device cpu --preset tiny for a smoke test)", file=sys.stderr)
        return 2
    preset = PRESETS[args.preset]
    config = preset.config()
    dtype = preset.dtype if on_cuda else torch.float32
    R, P = args.requests, args.prompt_len
    max_seq = P + args.warmup + 3 * args.steps + 16  # no request finishes while profiled
    n = parameter_count(config)
    log(f"preset {args.preset}: {n / 1e9:.2f}B ({n:,}) parameters, {config.num_hidden_layers} layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, vocabulary {config.vocab_size}, {dtype}; "
        f"{R} requests x {P}-token prompts, temperature {args.temperature}, max_seq_len {max_seq}")
    try:
        t0 = time.perf_counter()
        model = random_model(config, dtype, device, seed=0)
        synchronize(device)
        mem = f", {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated" if on_cuda else ""
        log(f"model built on {device} in {time.perf_counter() - t0:.1f} s{mem}")
        engine = Engine(model, EngineConfig(max_batch_size=R, max_seq_len=max_seq, prefill_chunk=P,
                                            max_prefill_tokens=1 << 20, cuda_graphs=on_cuda and not args.no_graphs))
        log(f"engine: KV cache {engine.cache.nbytes / 2**30:.2f} GiB")
        prompts = torch.randint(0, config.vocab_size, (R, P), generator=torch.Generator().manual_seed(0)).tolist()
        for i, prompt in enumerate(prompts):
            engine.submit(prompt, SamplingParams(max_new_tokens=max_seq - P, temperature=args.temperature, seed=i))
        t0 = time.perf_counter()
        while any(r.num_computed < len(r.tokens) - 1 or r.num_computed == 0 for r in engine.by_id.values()):
            engine.step()  # prefill (the step that finishes it also decodes)
        synchronize(device)
        capture = f" (captures the {R}-row CUDA graph)" if engine.graphs is not None else ""
        log(f"prefilled {R} x {P} tokens in {time.perf_counter() - t0:.2f} s; {args.warmup} warm-up decode steps"
            + capture)
        for _ in range(args.warmup):
            engine.step()
        synchronize(device)
        if engine.graphs is not None and engine.graphs.disabled_reason:
            log(f"CUDA graph capture FAILED, decoding eagerly: {engine.graphs.disabled_reason}")
        report(args, engine, model, config, dtype, device, R, P)
    except torch.OutOfMemoryError as e:
        free, total = torch.cuda.mem_get_info(device) if on_cuda else (0, 0)
        print(f"\ndecode_profile: OUT OF DEVICE MEMORY at preset {args.preset} with {R} requests x {max_seq} positions "
              f"(free {free / 2**30:.1f} of {total / 2**30:.1f} GiB): {str(e).splitlines()[0][:300]}\n"
              f"try fewer --requests", file=sys.stderr)
        return 1
    return 0


def _timed_steps(engine: Engine, device, n: int) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    synchronize(device)
    return (time.perf_counter() - t0) / n


def _profiled_steps(engine: Engine, device, acts, n: int):
    """(profile of n engine steps, wall seconds per step with the profiler on)."""
    synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n):
            engine.step()
        synchronize(device)
    return prof, (time.perf_counter() - t0) / n


def report(args, engine: Engine, model, config, dtype, device, R: int, P: int) -> None:
    on_cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    graphs = engine.graphs
    graph_mode = graphs is not None and graphs.disabled_reason is None
    N = args.steps

    # Wall time per step, profiler off.
    wall_s = _timed_steps(engine, device, N)
    log(f"{'graph' if graph_mode else 'eager'} decode: {wall_s * 1e3:.2f} ms/step wall = {R / wall_s:,.0f} tok/s "
        f"at {R} requests (profiler off, {N} steps)")

    # Eager steps with labelled parts: the split by part.
    engine.graphs = None
    labels = Labels(model, engine)
    eager_steps = 2
    try:
        engine.step()  # warm the eager path
        prof, eager_wall = _profiled_steps(engine, device, acts, eager_steps)
    finally:
        labels.remove()
        engine.graphs = graphs
    per_label, per_kernel = split_by_label(prof.events(), on_cuda)
    per_label = {k: v / eager_steps for k, v in per_label.items()}
    eager_total = sum(per_label.values())

    # The engine's own decode under the profiler (graph mode; else the eager steps above): kernels, busy, gaps.
    if graph_mode:
        tprof, prof_wall = _profiled_steps(engine, device, acts, N)
        n_prof = N
    else:
        tprof, prof_wall, n_prof = prof, eager_wall, eager_steps
    if args.trace:
        tprof.export_chrome_trace(args.trace)
        log(f"chrome trace written to {args.trace}")
    graph_split: dict[str, float] = collections.defaultdict(float)
    kernel_rows, busy_us, gaps = [], 0.0, []
    kernels = device_kernels(tprof.events()) if on_cuda else []
    if kernels:
        busy_us, _, gaps = busy_and_gaps(kernels)
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for k in kernels:
        t = k.time_range.end - k.time_range.start
        totals[k.name][0] += t
        totals[k.name][1] += 1
        if graph_mode:
            shares = per_kernel.get(k.name)
            if shares:
                whole = sum(shares.values())
                for label, v in shares.items():
                    graph_split[label] += t * v / whole / N
            else:
                graph_split["(kernel not seen in the eager step)"] += t / N
    kernel_rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:25]

    # (a) split
    context = round(sum(len(r.tokens) for r in engine.by_id.values()) / max(len(engine.by_id), 1))
    print(f"\n(a) per-step time split, {len(engine.by_id)} requests decoding, mean context {context}:")
    unit = "device" if on_cuda else "CPU"
    head = f"  {'part':42} {'eager ' + unit + ' ms':>16} {'share':>7}"
    if graph_split:
        head += f" {'graph ' + unit + ' ms':>16} {'share':>7}"
    print(head)
    graph_total = sum(graph_split.values())
    for label in sorted(set(per_label) | set(graph_split), key=lambda k: -max(per_label.get(k, 0), graph_split.get(k, 0))):
        e = per_label.get(label, 0.0)
        line = f"  {label:42} {e / 1e3:16.3f} {100 * e / max(eager_total, 1e-9):6.1f}%"
        if graph_split:
            g = graph_split.get(label, 0.0)
            line += f" {g / 1e3:16.3f} {100 * g / max(graph_total, 1e-9):6.1f}%"
        print(line)
    total_line = f"  {'total':42} {eager_total / 1e3:16.3f} {'':7}"
    if graph_split:
        total_line += f" {graph_total / 1e3:16.3f}"
    print(total_line)
    if busy_us:
        busy_ms = busy_us / 1e3 / n_prof
        host_ms = prof_wall * 1e3 - busy_ms
        big = sorted(gaps, reverse=True)[:5]
        print(f"  {'graph' if graph_mode else 'eager'} mode, profiler on: {prof_wall * 1e3:.2f} ms/step wall; device busy {busy_ms:.2f} ms/step; "
              f"device idle {host_ms:.2f} ms/step ({100 * host_ms / (prof_wall * 1e3):.0f}%: host time between steps "
              f"the device waits on: bookkeeping, input copies, the token read-back); {len(gaps) / n_prof:.0f} gaps per "
              f"step, largest {', '.join(f'{g / 1e3:.2f}' for g in big)} ms")
        print(f"  profiler off: {wall_s * 1e3:.2f} ms/step wall")

    # (b) kernels
    if graph_mode and not kernel_rows:
        print("\n(b) the profiler recorded no CUDA kernels inside the graph replays: rerun with --no-graphs")
    if kernel_rows:
        mode = "graph-mode" if graph_mode else "eager"
        print(f"\n(b) top {len(kernel_rows)} CUDA kernels over {n_prof} {mode} steps (per step; share of busy time):")
        print(f"  {'ms/step':>8} {'share':>6} {'calls/step':>10}  kernel")
        for name, (t, n) in kernel_rows:
            print(f"  {t / 1e3 / n_prof:8.3f} {100 * t / max(busy_us, 1e-9):5.1f}% {n / n_prof:10.1f}  {name[:110]}")
    elif not on_cuda:
        print("\n(b) top CPU ops (no CUDA on this run):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))

    # (c) bandwidth
    w_bytes, kv_bytes = decode_step_bytes(config, R, context, torch.finfo(dtype).bits // 8)
    step_bytes = w_bytes + kv_bytes
    copy_bw = measure_copy_bandwidth(device)
    print(f"\n(c) bytes one step must read: {w_bytes / 1e9:.3g} GB of weights touched + {kv_bytes / 1e9:.3g} GB of KV "
          f"at context {context} = {step_bytes / 1e9:.3g} GB")
    print(f"  measured copy bandwidth {copy_bw / 1e9:.0f} GB/s: floor {step_bytes / copy_bw * 1e3:.3f} ms/step = "
          f"{R * copy_bw / step_bytes:,.0f} tok/s")
    if on_cuda:
        print(f"  H200 datasheet 4.8 TB/s: floor {step_bytes / 4.8e12 * 1e3:.3f} ms/step = "
              f"{R * 4.8e12 / step_bytes:,.0f} tok/s")
    achieved = step_bytes / wall_s
    print(f"  achieved over the wall step ({wall_s * 1e3:.2f} ms): {achieved / 1e9:,.0f} GB/s = "
          f"{100 * achieved / copy_bw:.1f}% of the copy bandwidth" + (f", {100 * achieved / 4.8e12:.1f}% of 4.8 TB/s"
                                                                       if on_cuda else ""))
    if busy_us:
        dev_s = busy_us / 1e6 / n_prof
        print(f"  over the device-busy time ({dev_s * 1e3:.2f} ms): {step_bytes / dev_s / 1e9:,.0f} GB/s = "
              f"{100 * step_bytes / dev_s / copy_bw:.1f}% of the copy bandwidth (what the kernels alone reach)")
    if graph_mode:
        host_split(engine, device, N)


def host_split(engine: Engine, device, n: int) -> None:
    """(d): replay-only time of the decode graph vs the whole step, and where the step's host time goes."""
    import cProfile
    import pstats

    key = max(engine.graphs.captured, key=lambda k: k[0])
    graph = engine.graphs.captured[key][0]
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    synchronize(device)
    replay_s = (time.perf_counter() - t0) / n
    prof = cProfile.Profile()
    synchronize(device)
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(n):
        engine.step()
    synchronize(device)
    prof.disable()
    step_s = (time.perf_counter() - t0) / n
    print(f"\n(d) host side, graph mode: the {key[0]}-row graph replayed alone {replay_s * 1e3:.2f} ms; a whole step "
          f"{step_s * 1e3:.2f} ms under cProfile: {max(step_s - replay_s, 0) * 1e3:.2f} ms/step of host work the "
          f"device waits on. Host time by function (ms/step, self and cumulative):")
    stats = pstats.Stats(prof).stats
    for (file, line, fn), (_, calls, tottime, cumtime, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:22]:
        print(f"  {tottime / n * 1e3:8.3f} {cumtime / n * 1e3:8.3f} {calls / n:9.1f}/step  {Path(file).name}:{line} {fn}")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
