"""Every benchmark's command line, kept apart from its code: `moerl bench NAME --help` answers from here, before
torch loads (importing a benchmark module imports torch and the model: 1.5 s on an idle machine, 4-8 s on a busy
one). Each benchmark parses its arguments with `parser(NAME)`; the description is its module's docstring, read
from its source without importing it. Standard library only.

    parser("moe-layer").parse_args(argv)     # in moerl/bench/moe_layer.py
    describe("loop")                         # the docstring of moerl/bench/loop.py

A benchmark whose options are not here still answers --help, by importing its module (slowly): add its parser.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
from collections.abc import Callable

# Choices that name a benchmark's tables (the modules build their torch values from these names; a test checks).
DISPATCH_DTYPES = ("bf16", "fp16", "fp32")
ROLLOUT_PRESETS = ("0.9b", "qwen3-30b-a3b", "tiny")
MOE_DECODE_SHAPES = ("30b", "0.9b")
KERNEL_GROUPS = ("decode", "train", "sampler")
DEVICES = ("auto", "cpu", "cuda")


def describe(module: str) -> str:
    """The docstring of `module` (a dotted name), from its source: the module is not imported."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read()), clean=False) or ""


def _new(name: str, module: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"moerl bench {name}", description=describe(module),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def _moe_layer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (GPU default 16384, CPU 512)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (GPU default 2048, CPU 256)")
    p.add_argument("--experts", type=int, default=None, help="experts (GPU default 128, CPU 16)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=None, help="expert intermediate (GPU 768, CPU 128)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="GPU default bf16, CPU fp32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peer", default="all", help="comma list of transformers experts implementations, or 'none'")
    p.add_argument("--profile", action="store_true", help="print the top kernels of one step of each")


def _dispatch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("all_to_all", "symm_mem", "all"), default="all",
                   help="all: every backend that can run here (default)")
    p.add_argument("--tokens", default=None, help="tokens per rank, comma-separated (default 4096,128; CPU 512,128)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168; CPU 1024)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--dtype", choices=sorted(DISPATCH_DTYPES), default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to spawn (default: CPU 2, CUDA every GPU); under torchrun its world size")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before spawned ranks are stopped")


def _rollout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--preset", default=None, choices=sorted(ROLLOUT_PRESETS), help="GPU: 0.9b, CPU: tiny")
    p.add_argument("--requests", type=int, default=None, help="default: the preset's")
    p.add_argument("--prompt-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--new-tokens", type=int, default=None, help="default: the preset's")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the preset's")
    p.add_argument("--peer", default=None, help="transformers cache implementations ('dynamic,static'), or "
                   "'none'; default: both, none for qwen3-30b-a3b")
    p.add_argument("--peak-bw", type=float, default=None, help="HBM datasheet bandwidth in GB/s for a second "
                   "floor (default 4800 on an H200, else none); the first is over the measured copy bandwidth")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    p.add_argument("--profile", action="store_true", help="then profile decode steps in the engine's own mode: "
                   "device busy vs idle, top kernels, the graph replayed alone vs a step, the host's time by function "
                   "(moerl/bench/decode_profile.py)")
    p.add_argument("--trace", default="", metavar="PATH", help="with --profile: write its steps as a Chrome trace")
    p.add_argument("--overlap-ablation", action="store_true", help="then time the same engine with overlapped "
                   "decode off (EngineConfig.overlap_decode) on the same prompts: a row of the table")
    p.add_argument("--no-split", action="store_true", help="skip the decode step split (a few profiled eager steps)")
    p.add_argument("--ep-size", type=int, default=1, help="ranks of an expert-parallel engine group (spawned, or "
                   "torchrun's); > 1 compares it with one engine: see moerl/bench/rollout_ep.py")


def _async(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills; 0 = skip the kill run")
    p.add_argument("--workers", type=int, default=1, help="rollout workers (1 CPU each)")
    p.add_argument("--out", default="", help="keep the run directories here")
    p.add_argument("--preset", default="", help="model preset override (e.g. small); default: the config's")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per mode, alternating sync and async; the median is reported (a shared or "
                        "throttled machine drifts by 10-20%% between runs)")


def _checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="", help="S3 endpoint URL (default: AWS_ENDPOINT_URL, else a local moto)")
    p.add_argument("--bucket", default="moerl-bench", help="created if missing")
    p.add_argument("--size-mb", type=float, default=200.0, help="trainer state size (weights + AdamW moments)")
    p.add_argument("--iters", type=int, default=3, help="repetitions per measurement (median)")
    p.add_argument("--threads", type=int, default=4, help="DCP writer threads = files per rank (moerl's default: 4)")


def _moe_decode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default=None, choices=[*MOE_DECODE_SHAPES, "all"], help="default 30b; --tune: all")
    p.add_argument("--tokens", default="1,16,64,128,256,512", help="comma list of tokens per call")
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peer", default="all", help="comma list of transformers experts implementations, or 'none'")
    p.add_argument("--tune", action="store_true", help="sweep block configs per M bucket instead")


def _train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--samples", type=int, default=None, help="samples per step (GPU 128, CPU 8)")
    p.add_argument("--seq", type=int, default=None, help="positions per sample (GPU 2048, CPU 128)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens of each sample (GPU 256, CPU 16)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (GPU 151936, CPU 4096)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="ours (GPU 65536, CPU 512)")
    p.add_argument("--checkpointing", default="full", choices=["full", "selective", "none"],
                   help="ours: activation checkpointing of each decoder layer (moerl/model/checkpointing.py)")
    p.add_argument("--no-checkpointing", action="store_const", const="none", dest="checkpointing",
                   help="the same as --checkpointing none")
    p.add_argument("--equal-batch-checkpointing", default="none", choices=["full", "selective", "none"],
                   help="ours at the largest batch the peer fits (the peer keeps every activation too)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step; the median is reported "
                   "(of 2 it would be the slower one: the 16 x 2,048 step varied 0.36-0.44 s between runs)")
    p.add_argument("--peer", default="transformers", choices=["transformers", "none"])
    p.add_argument("--no-split", action="store_true",
                   help="skip the optimizer step split (one extra step of ours under torch.profiler)")
    p.add_argument("--split-top", type=int, default=0, help="also print the top N kernels of each large split row")


def _loop(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--shape", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (GPU 30, CPU 200)")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating; medians reported")
    p.add_argument("--out", default="", help="keep the run directories here")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. --set weights.transport=object_store")


def _logprobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=32_768, help="N (CUDA; the CPU runs a tiny shape)")
    p.add_argument("--hidden", type=int, default=1024, help="D")
    p.add_argument("--vocab", type=int, default=151_936, help="V")
    p.add_argument("--entropy", action="store_true", help="also the entropy and its gradient")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)


def _kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--group", default="all", choices=["all", *KERNEL_GROUPS])
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer (CUDA; slow to compile)")
    p.add_argument("--calls", type=int, default=50, help="calls per CUDA graph (no-grad cases)")
    p.add_argument("--reps", type=int, default=10, help="graph replays; eager steps for the rest")


def _varlen(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=3, help="timed steps after one warm-up step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mask", action="store_true", help="skip timing the O(T^2) block-mask path")


def _paged_decode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=DEVICES)
    p.add_argument("--no-gather", dest="gather", action="store_false", help="skip the gather + SDPA row")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--contexts", default="128,1024,3072", help="positions each request holds, comma-separated")


def _fleet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", default="256", help="comma list of engine counts, one simulation each (e.g. 256,1024)")
    p.add_argument("--groups", type=int, default=100_000, help="groups trained per simulation")
    p.add_argument("--batch-groups", type=int, default=256, help="train.batch_groups (configs/eks-p5en.toml: 256)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--inflight-per-engine", type=int, default=32, help="groups leased to one engine at most")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--lengths", default="config", choices=["config", "long-tail", "fixed"],
                   help="completion lengths (moerl/bench/fleet_engines.py length_table)")
    p.add_argument("--step-base-ms", type=float, default=18.98, help="decode step at 0 rows (30B on an H200)")
    p.add_argument("--step-row-us", type=float, default=19.5, help="decode step time per row")
    p.add_argument("--max-batch", type=int, default=256, help="rows an engine decodes at once")
    p.add_argument("--respawn-s", type=float, default=300.0, help="a preempted engine's replacement comes up after")
    p.add_argument("--train-tok-s", type=float, default=1.4e6, help="the trainer group's tokens/s (moerl bench plan)")
    p.add_argument("--step-fixed-s", type=float, default=0.5, help="a trainer step's time beside its tokens")
    p.add_argument("--publish-s", type=float, default=1.0, help="the trainer's publish of a version")
    p.add_argument("--transfer-s", type=float, default=2.0, help="publish -> the engines hold the version")
    p.add_argument("--preempt-per-hour", type=float, default=0.0, help="spot notices per engine-hour")
    p.add_argument("--no-trajectories", action="store_true", help="skip encoding the trajectory rows")
    p.add_argument("--seed", type=int, default=0)


def _plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-30b-a3b", help="a model shape (moerl/bench/plan.py MODELS)")
    p.add_argument("--node", default="p5en.48xlarge", help="a node kind (moerl/bench/plan.py NODES)")
    p.add_argument("--trainer-nodes", type=int, default=16)
    p.add_argument("--rollout-nodes", type=int, default=32)
    p.add_argument("--config", default="", help="take the workload (batch, group, staleness, lengths, node counts) "
                   "from this moerl config, e.g. configs/eks-p5en.toml")
    p.add_argument("--batch-groups", type=int, default=256)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--inflight-per-engine", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=4096)
    p.add_argument("--lengths", default="config", choices=["config", "long-tail", "fixed"])
    p.add_argument("--decode-tok-s", type=float, default=10_680.0, help="one engine's decode tok/s at --decode-rows "
                   "(your `moerl bench rollout` figure; default the 30B shape on an H200, BENCHMARKS.md)")
    p.add_argument("--decode-rows", type=int, default=256)
    p.add_argument("--decode-tok-s-small", type=float, default=3_163.0, help="... and at --decode-rows-small")
    p.add_argument("--decode-rows-small", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--train-tok-s-per-gpu", type=float, default=0.0, help="trainer tokens/s per GPU (0 = the "
                   "estimate from `moerl bench train`'s measured MFU, see the output)")
    p.add_argument("--publish-s", type=float, default=-1.0, help="the trainer's publish per version "
                   "(default: the chosen transport's computed time)")
    p.add_argument("--transport", default="node-broadcast-ipc",
                   choices=["object-store", "nccl-broadcast", "node-broadcast-ipc", "node-sharded-ipc"])
    p.add_argument("--efficiency", type=float, default=0.8, help="achieved share of a link's bandwidth")
    p.add_argument("--tcp-gbps", type=float, default=100.0, help="what one node's TCP path gives Ray's object store")
def _ray_fleet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,16,32", help="fleet sizes, comma-separated")
    p.add_argument("--seconds", type=float, default=20.0, help="the steady phase of each size")
    p.add_argument("--storm", type=float, default=0.25, help="share of the workers SIGTERMed at once")
    p.add_argument("--lengths", default="64,128,256,512", help="completion lengths drawn per sample (tokens)")
    p.add_argument("--tokens-per-s", type=float, default=400.0, help="simulated decode rate per request")
    p.add_argument("--step-s", type=float, default=0.02, help="simulated decode step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--inflight", type=int, default=4, help="groups a worker holds at once")
    p.add_argument("--weight-mb", type=float, default=4.0, help="one weight version's size")
    p.add_argument("--publish-s", type=float, default=2.0, help="a new weight version to every worker this often")
    p.add_argument("--heartbeat-s", type=float, default=2.0, help="rollout.heartbeat_s")
    p.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs (the workers ask for 0)")
    p.add_argument("--start-timeout-s", type=float, default=600.0, help="a fleet not whole by then fails the run")


# name -> (module, what adds its arguments)
OPTIONS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "moe-layer": ("moerl.bench.moe_layer", _moe_layer), "dispatch": ("moerl.bench.dispatch", _dispatch),
    "rollout": ("moerl.bench.rollout", _rollout), "async": ("moerl.bench.async_loop", _async),
    "checkpoint": ("moerl.bench.checkpoint", _checkpoint), "moe-decode": ("moerl.bench.moe_decode", _moe_decode),
    "train": ("moerl.bench.train", _train), "loop": ("moerl.bench.loop", _loop),
    "logprobs": ("moerl.bench.logprobs", _logprobs), "kernels": ("moerl.bench.kernels", _kernels),
    "varlen": ("moerl.bench.varlen", _varlen), "paged-decode": ("moerl.bench.paged_decode", _paged_decode),
    "fleet": ("moerl.bench.fleet", _fleet), "plan": ("moerl.bench.plan_report", _plan),
    "ray-fleet": ("moerl.bench.ray_fleet", _ray_fleet),
}


def parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of `moerl bench NAME` (KeyError for a benchmark without one here)."""
    module, add = OPTIONS[name]
    p = _new(name, module)
    add(p)
    return p
