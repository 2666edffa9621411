"""Where a decode step's time goes in the engine's own mode (CUDA graphs where they run), for
`moerl bench rollout --profile`; the step split beside it (step_split.py) profiles eager steps by model part.

After the timed run the same engine decodes the same prompts again (graphs already captured) and prints:
  (a) wall ms per step with the profiler off; the same number of steps under torch.profiler: the device's busy
      time (the union of its kernel intervals) and its idle gaps. Wall minus busy is host time the device waits
      on: bookkeeping between steps, input copies, the token read-back;
  (b) the top kernels by total time per step (a graph replay's kernels are recorded as its own);
  (c) graph mode: the captured graph of the widest batch replayed alone (no host work between replays) against
      a whole step under cProfile, and the host's time by function (time inside a device-to-host copy is time
      the host waits for the device). On a CPU: the top ops by self time, and the same cProfile of the steps.
--trace PATH writes (a)'s profile as a Chrome trace. Formerly scripts/gpu/decode_profile.py.
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import time
from pathlib import Path

import torch

from moerl.rollout import Engine, SamplingParams

Span = tuple[str, float, float]  # a kernel's name, start and end, us


def busy_and_gaps(spans: list[Span]) -> tuple[float, list[float]]:
    """(the union of the spans' intervals, the idle gaps between them), us."""
    if not spans:
        return 0.0, []
    ordered = sorted((s, e) for _, s, e in spans)
    busy, gaps = 0.0, []
    cur_s, cur_e = ordered[0]
    for s, e in ordered[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + cur_e - cur_s, gaps


def top_kernels(spans: list[Span], n: int) -> list[tuple[str, float, int]]:
    """The n names with the most total time: (name, total us, launches), most first."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, s, e in spans:
        totals[name][0] += e - s
        totals[name][1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [(name, t, int(count)) for name, (t, count) in ranked]


def device_spans(prof) -> list[Span]:
    """Kernels, copies and memsets on the device, without the device-side spans of annotations."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == cuda and not e.is_user_annotation]


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _steps_seconds(engine: Engine, n: int) -> float:
    _sync(engine)
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    _sync(engine)
    return (time.perf_counter() - t0) / n


def profile_decode(engine: Engine, prompts: list[list[int]], temperature: float, new_tokens: int, steps: int = 20,
                   trace: str = "") -> None:
    """Print (a)-(c) over `steps` decode steps of `prompts` (fewer where new_tokens leaves no room for three
    rounds of them); the engine is left empty."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    steps = max(1, min(steps, (new_tokens - 4) // 3))
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens, temperature=temperature, seed=i))
    started: set[str] = set()
    try:
        while engine.has_unfinished() and len(started) < len(prompts):  # prefill: every request's first token
            started.update(out.request_id for out in engine.step() if out.new_token_ids)
        for _ in range(2):
            engine.step()
        graphs = engine.graphs
        graph_mode = graphs is not None and graphs.disabled_reason is None and bool(graphs.captured)
        wall_s = _steps_seconds(engine, steps)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            prof_wall_s = _steps_seconds(engine, steps)
        if trace:
            prof.export_chrome_trace(trace)
        mode = "graph" if graph_mode else "eager"
        print(f"\n--- decode profile, {mode} mode, {len(engine.running)} rows, {steps} steps "
              "(moerl/bench/decode_profile.py)")
        print(f"(a) {wall_s * 1e3:.2f} ms/step wall, profiler off; {prof_wall_s * 1e3:.2f} ms/step with it"
              + (f"; Chrome trace written to {trace}" if trace else ""))
        if cuda:
            _print_device(device_spans(prof), prof_wall_s, steps)
        else:
            print("(b) top ops by self CPU time (a CPU run: no device timeline)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
        _print_host(engine, steps, graph_mode)
    finally:
        while engine.has_unfinished():
            engine.step()


def _print_device(spans: list[Span], prof_wall_s: float, steps: int) -> None:
    if not spans:
        print("    the profiler recorded no kernels: rerun with --no-graphs")
        return
    busy_us, gaps = busy_and_gaps(spans)
    busy_ms, wall_ms = busy_us / 1e3 / steps, prof_wall_s * 1e3
    idle_ms = wall_ms - busy_ms
    largest = ", ".join(f"{g / 1e3:.2f}" for g in sorted(gaps, reverse=True)[:5])
    print(f"    device busy {busy_ms:.2f} ms/step, idle {idle_ms:.2f} ms/step ({100 * idle_ms / wall_ms:.0f}% of the "
          f"wall: host time the device waits on); {len(gaps) / steps:.0f} gaps a step, largest {largest} ms")
    print("(b) top kernels per step (share of the busy time):")
    print(f"    {'ms/step':>8} {'share':>6} {'calls/step':>10}  kernel")
    for name, t, count in top_kernels(spans, 25):
        print(f"    {t / 1e3 / steps:8.3f} {100 * t / busy_us:5.1f}% {count / steps:10.1f}  {name[:110]}")


def _print_host(engine: Engine, steps: int, graph_mode: bool) -> None:
    replay = ""
    if graph_mode:
        captured = engine.graphs.captured
        key = max(captured, key=lambda k: k[0])  # the widest batch's graph: the one these steps replay
        graph = captured[key][0]
        _sync(engine)
        t0 = time.perf_counter()
        for _ in range(steps):
            # The last inputs again, in stream order after any step launched ahead and its read-back: it rewrites
            # the same positions' keys and values with the same numbers.
            graph.replay()
        _sync(engine)
        replay_s = (time.perf_counter() - t0) / steps
        replay = f"the {key[0]}-row graph replayed alone {replay_s * 1e3:.2f} ms; "
    prof = cProfile.Profile()
    prof.enable()
    step_s = _steps_seconds(engine, steps)
    prof.disable()
    if graph_mode:
        replay += f"{max(step_s - replay_s, 0.0) * 1e3:.2f} ms/step of host work the device waits on. "
    print(f"(c) {replay}A whole step under cProfile {step_s * 1e3:.2f} ms; the host's time by function "
          "(ms/step, self and cumulative):")
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (file, line, fn), (_, calls, self_s, cum_s, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:22]:
        print(f"    {self_s / steps * 1e3:8.3f} {cum_s / steps * 1e3:8.3f} {calls / steps:9.1f}/step  "
              f"{Path(file).name}:{line} {fn}")
